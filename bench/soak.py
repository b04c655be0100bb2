"""Soak: submit noop jobs with idempotency keys while the service is killed with SIGKILL at
random moments and restarted; then check that nothing acknowledged was lost or doubled.

Each service death costs the running jobs one attempt (docs/topics.md, "Attempts and failures"); a job whose last
attempt (``max_attempts``, 3) is interrupted fails with ``worker_lost``, so a job that takes
the service down cannot loop forever. With kills milliseconds after restarts, a few jobs end
that way; they are terminal, as the checks require, and the summary counts them.

    .venv/bin/python bench/soak.py [--jobs 1000] [--kills 100]
    .venv/bin/python bench/soak.py --jobs 1000 --kills 100 --burst 10000 --bursts 3 --broker-restarts 3

Traffic, all on 127.0.0.1:

- one by one (``--jobs``): a client submits ``noop`` jobs (``sleep_s`` 0.05), each with its
  own ``idempotency_key``, and resends a submit every second until it is answered, as our CLI
  does. ``--kills`` kill -9 cycles of the service are spread over these submissions (after a
  random number of new answers, or a random pause of 0.05-3 s).
- bursts (``--burst N``, ``--bursts M``): M times, a second client publishes N QoS 1 ``noop``
  submits (no sleep, each with its own ``idempotency_key``) as fast as it can, without waiting
  for answers; during each burst the service is kill -9'd and restarted ``--burst-kills``
  times. Then the soak waits, without kills, until every submit of the burst is answered.
- broker restarts (``--broker-restarts K``): the soak's private mosquitto is stopped (SIGTERM,
  so it writes its persistence file) and started again on the same port; the first restarts
  fall during bursts (one per burst), the others among the kill -9 cycles.
- a liveness probe: a third client publishes a ``list`` request every second. Each must be
  answered within ``--probe-bound`` seconds; the longest wait is reported. The wait includes
  service and broker restarts and the requests queued ahead of the probe: the default, 10 s,
  is a burst of 10,000 at the P1 target of 2,000 jobs/s (5 s), plus a restart (under 2 s,
  P6), plus margin. When no probe has been answered for ``--hang-after`` seconds (default
  60), the service hung: the soak stops there with FAIL (HANG), dumps the service's Python
  stacks into its log (faulthandler, SIGABRT) and prints the log's tail. Requests that stay
  unanswered 10 s longer while the probes are answered end the run the same way (STALLED):
  they were lost on the way.

The broker is a private mosquitto on a free loopback port with the delivery settings of
broker/mosquitto.conf (``max_queued_messages 0``, ``set_tcp_nodelay``) and its persistence
(``persistence true``, ``autosave_interval 60``); ``--broker system`` uses the broker at
``--host``/``--port`` instead (no broker restarts then). The clients have persistent sessions
(MQTT 5, session expiry 1 h), so responses published while they are disconnected wait for them.

Checks at the end: every submit acknowledged by a PUBACK has its job in the store, with one
job per idempotency key (none lost, none twice, no job succeeded twice), every job terminal,
database integrity ok; every request got a response (per transaction, at least as many
responses as PUBACKed publishes; all ``ok``); every liveness probe answered within the bound;
the service never exited by itself and never hung; a clean stop exits 0. Every wait is bounded
(``--hang-after`` without progress, ``--max-time`` in all).

Prints one summary line and writes it, with the details, to bench/results/soak-<date>.json
(``soak-<date>-bursts.json`` with bursts or broker restarts; or ``--out``). Exit code 0 only
when every check holds.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import harness
import provenance
from soak_rig import HOST, Broker, Hang, Peer, Probe, Service, Stalled, log, submit_body

ROOT = Path(__file__).resolve().parent.parent
TERMINAL = ("succeeded", "failed", "cancelled")


# Run on the way out whatever happens: no broker or service outlives the soak.
_cleanup: list[Callable[[], None]] = []


def main() -> int:
    try:
        return soak()
    finally:
        for f in reversed(_cleanup):
            try:
                f()
            except Exception as e:  # noqa: BLE001 - cleanup goes on
                log(f"cleanup: {e!r}")


def soak() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=1000, help="jobs submitted one by one (default 1000)")
    ap.add_argument("--kills", type=int, default=100, help="kill -9 cycles among them (default 100)")
    ap.add_argument("--burst", type=int, default=0, help="submits per burst (e.g. 10000; default 0: no bursts)")
    ap.add_argument("--bursts", type=int, default=None, help="number of bursts (default 3 with --burst)")
    ap.add_argument("--burst-kills", type=int, default=3, help="kill -9 cycles during each burst (default 3)")
    ap.add_argument("--broker-restarts", type=int, default=0, help="stops and starts of the private broker")
    ap.add_argument("--probe-bound", type=float, default=10.0, help="max seconds to answer a probe (default 10)")
    ap.add_argument("--hang-after", type=float, default=60.0, help="seconds without an answer = hung (default 60)")
    ap.add_argument("--max-time", type=float, default=7200.0, help="seconds for the whole run (default 7200)")
    ap.add_argument("--broker", choices=["private", "system"], default="private")
    ap.add_argument("--host", default=HOST, help="with --broker system")
    ap.add_argument("--port", type=int, default=1883, help="with --broker system")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="results file (default bench/results/soak-<date>...)")
    args = ap.parse_args()
    bursts = (args.bursts if args.bursts is not None else 3) if args.burst else 0
    if args.burst < 0 or args.burst > 50_000:
        ap.error("--burst must be 0..50000 (paho's 16-bit message ids bound the publishes awaiting PUBACK)")
    if args.broker == "system" and args.broker_restarts:
        ap.error("--broker-restarts needs the private broker: the system broker is never stopped")
    if min(args.jobs, args.kills, args.burst_kills, args.broker_restarts, bursts) < 0:
        ap.error("counts must not be negative")
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    code = provenance.code_state()  # the tree soaked: others may edit it during the run
    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix="edge-queue-soak-"))
    base = "soak" + uuid.uuid4().hex[:8]
    broker: Broker | None = None
    host, port = args.host, args.port
    if args.broker == "private":
        broker = Broker(tmp)
        _cleanup.append(broker.stop)
        broker.start()
        host, port = HOST, broker.port
    log(f"soak in {tmp}; broker {args.broker} {host}:{port}; seed {seed}")
    svc = Service(tmp / "data", base, host, port)
    _cleanup.append(svc.ensure_dead)
    svc.start()
    svc.wait_online()
    seq = Peer("seq", host, port, base)
    burster = Peer("burst", host, port, base, max_inflight=0)  # 0: no limit, as fast as it goes
    probe = Probe(Peer("probe", host, port, base))
    acked: dict[str, str] = {}  # one-by-one key -> job id of its first response
    done = threading.Event()
    stop = threading.Event()
    started = time.monotonic()
    hard_end = started + args.max_time
    # Requests without progress for this long while the probe is answered: stalled. Longer
    # than --hang-after, so that a service that stopped answering is reported as hung.
    stall_s = args.hang_after + 10
    kills = burst_kills_done = 0
    hang: str | None = None
    burst_keys: list[str] = []
    burst_stats: list[dict[str, Any]] = []

    def submitter() -> None:
        for i in range(args.jobs):
            key = f"soak-{i}"
            while not stop.is_set():
                seq.publish("submit", submit_body(key, 0.05))
                with seq.cond:
                    if seq.cond.wait_for(lambda k=key: k in seq.responses, 1.0):
                        break
            if stop.is_set():
                return
            r = seq.first_response(key)
            assert r is not None
            if r[1] == "ok" and r[2]:
                acked[key] = r[2]
        done.set()

    def guard() -> None:
        """Raise Hang when the service stopped answering or the run is out of time; restart a
        service that exited by itself (counted)."""
        now = time.monotonic()
        if now > hard_end:
            raise Hang(f"the run exceeded --max-time {args.max_time:.0f} s")
        silent = probe.silent_s(now)
        if silent > args.hang_after:
            raise Hang(
                f"the service answered no liveness probe for {silent:.0f} s (--hang-after {args.hang_after:.0f} s)"
            )
        svc.check_exited()

    def until_done(
        measure: Callable[[], int], done: Callable[[int], bool], stalled: Callable[[int], str], poll_s: float
    ) -> None:
        """Poll ``measure`` until ``done`` holds; :class:`Stalled` (with ``stalled(value)``) when
        the value stops changing for ``stall_s`` seconds, :class:`Hang` via ``guard``."""
        last, last_progress = -1, time.monotonic()
        while True:
            guard()
            value = measure()
            if done(value):
                return
            if value != last:
                last, last_progress = value, time.monotonic()
            elif time.monotonic() - last_progress > stall_s:
                raise Stalled(stalled(value))
            time.sleep(poll_s)

    def wait_until(pred: Callable[[], bool], until: float, poll_s: float = 0.005) -> None:
        while not pred() and time.monotonic() < until:
            guard()
            time.sleep(poll_s)

    def kill_cycle() -> None:
        nonlocal kills
        svc.kill()
        kills += 1
        svc.start()

    def broker_restart() -> None:
        assert broker is not None
        down = rng.uniform(0.2, 2.0)
        log(f"broker restart {broker.restarts + 1}/{args.broker_restarts} (down {down:.1f} s)")
        broker.restart(down)

    def run_burst(b: int, with_broker_restart: bool) -> None:
        nonlocal burst_kills_done
        keys = [f"burst{b}-{i}" for i in range(args.burst)]
        burst_keys.extend(keys)
        t0 = time.monotonic()
        log(f"burst {b + 1}/{bursts}: {args.burst} submits")

        published = [t0]

        def publish_all() -> None:
            for k in keys:
                if stop.is_set():
                    return
                burster.publish("submit", submit_body(k, None))
            published[0] = time.monotonic()

        answered_before = burster.distinct  # every earlier burst is fully answered
        th = threading.Thread(target=publish_all, daemon=True)
        th.start()
        chaos = ["kill"] * args.burst_kills + (["broker"] if with_broker_restart else [])
        rng.shuffle(chaos)
        for ev in chaos:
            # After a random share of the burst is answered, or a random pause.
            target = rng.randint(0, args.burst)
            wait_until(
                lambda t=target: burster.distinct - answered_before >= t,
                time.monotonic() + rng.uniform(0.05, 3.0),
                0.01,
            )
            if ev == "kill":
                kill_cycle()
                burst_kills_done += 1
            else:
                broker_restart()
        wait_until(lambda: not th.is_alive(), hard_end)
        # No more chaos: every submit of the burst must be PUBACKed and answered.
        until_done(
            lambda: burster.distinct - answered_before,
            lambda n: n >= len(keys) and all(burster.acked(k) for k in keys),
            lambda n: (
                f"burst {b + 1}: {len(keys) - n} of {len(keys)} submits unanswered, no new answer for "
                f"{stall_s:.0f} s while the service answers the probe"
            ),
            0.2,
        )
        t1 = time.monotonic()
        stat = {"publish_s": round(published[0] - t0, 2), "answered_s": round(t1 - t0, 2)}
        burst_stats.append(stat)
        log(f"burst {b + 1}/{bursts}: all {len(keys)} answered after {t1 - t0:.1f} s")

    # The schedule: the one-by-one kill cycles, the bursts evenly among them, and the broker
    # restarts: one during each of the first bursts, the rest at random among the kill cycles.
    in_bursts = min(args.broker_restarts, bursts)
    events: list[str] = ["kill"] * args.kills
    for _ in range(args.broker_restarts - in_bursts):
        events.insert(rng.randint(0, len(events)), "broker")
    n_ev = len(events)
    for b in reversed(range(bursts)):
        events.insert(round((b + 1) * n_ev / (bursts + 1)), f"burst{b}")
    thread = threading.Thread(target=submitter, daemon=True)
    thread.start()
    exit_code: int | None = None
    try:
        # Spread the kills over the submissions: kill after a random number of new acks (0-2x
        # the even share) or a random pause, whichever comes first.
        share = max(1, args.jobs // max(args.kills, 1))
        for ev in events:
            if ev.startswith("burst"):
                b = int(ev[5:])
                run_burst(b, b < in_bursts)
                continue
            target = len(acked) + rng.randint(0, 2 * share)
            pause_end = time.monotonic() + rng.uniform(0.05, 3.0)
            wait_until(lambda t=target: len(acked) >= t or done.is_set(), pause_end)
            if ev == "kill":
                kill_cycle()
            else:
                broker_restart()
        wait_until(done.is_set, hard_end, 0.05)
        thread.join(5)
        # Every request answered (duplicates included), then every job finished.
        until_done(
            lambda: sum(len(p.unanswered()) + p.not_acked() for p in (seq, burster)),
            lambda u: not u,
            lambda u: (
                f"{u} requests unanswered or not PUBACKed, no progress for {stall_s:.0f} s "
                "while the service answers the probe"
            ),
            0.5,
        )
        db = tmp / "data" / "edge-queue.db"

        def unfinished() -> int:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
                return conn.execute(
                    "SELECT count(*) FROM jobs WHERE state NOT IN ('succeeded','failed','cancelled')"
                ).fetchone()[0]

        deadline = time.monotonic() + 300
        while unfinished() and time.monotonic() < deadline:
            guard()
            time.sleep(0.2)
        probe.stop()
        wait_until(lambda: not probe.peer.unanswered(), time.monotonic() + args.probe_bound, 0.05)
        exit_code = svc.stop()
    except Exception as e:  # Hang, or anything else: report it with the checks, never hang here
        kind = {Hang: "HANG", Stalled: "STALLED"}.get(type(e))
        hang = f"{kind}: {e}" if kind else f"ERROR in the soak: {e!r}"
        log(f"{hang}; dumping the service's stacks to its log")
        stop.set()
        probe.stop()
        svc.dump_and_kill()
    elapsed = time.monotonic() - started
    stop.set()
    peers = (seq, burster, probe.peer)
    now = time.monotonic()
    waits = probe.waits(now)
    max_wait = max(waits, default=0.0)
    unanswered = {p.reply.rsplit("/", 1)[-1]: len(p.unanswered()) for p in peers}
    not_acked = sum(p.not_acked() for p in peers)
    not_ok = sum(1 for p in peers for rs in list(p.responses.values()) for r in rs if r[1] != "ok")
    for p in peers:
        p.close()

    # The store, read even after a hang (the service is dead by now).
    db = tmp / "data" / "edge-queue.db"
    jobs: dict[str, str] = {}
    outcomes: dict[str, int] = {}
    keys: dict[str, str] = {}
    successes: dict[str, int] = {}
    attempts: tuple[Any, Any] = (None, None)
    integrity = "not read"
    try:
        with sqlite3.connect(db, timeout=30) as conn:
            jobs = dict(conn.execute("SELECT job_id, state FROM jobs").fetchall())
            outcomes = dict(
                conn.execute(
                    "SELECT coalesce(json_extract(error, '$.code'), state), count(*) FROM jobs GROUP BY 1"
                ).fetchall()
            )
            keys = dict(conn.execute("SELECT key, job_ids FROM idempotency_keys").fetchall())
            successes = dict(
                conn.execute(
                    "SELECT job_id, count(*) FROM job_events WHERE to_state = 'succeeded' GROUP BY job_id"
                ).fetchall()
            )
            attempts = conn.execute("SELECT max(attempt), sum(attempt > 1) FROM jobs").fetchone()
            integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
    except sqlite3.Error as e:
        integrity = f"unreadable: {e}"
    stored = {k: json.loads(v) for k, v in keys.items()}
    all_keys = [f"soak-{i}" for i in range(args.jobs)] + burst_keys
    # Acknowledged: a PUBACK for at least one publish of the key (the broker took it for the
    # service's persistent session); its job must then be in the store.
    puback = [k for k in all_keys if seq.acked(k) or burster.acked(k)]
    lost = [k for k in puback if len(stored.get(k, [])) != 1 or stored[k][0] not in jobs]
    key_mismatch = []
    for k in all_keys:
        named = {r[2] for p in (seq, burster) for r in p.responses.get(k, []) if r[2]}
        if named and named != set(stored.get(k, [])):
            key_mismatch.append(k)
    not_terminal = [j for j, s in jobs.items() if s not in TERMINAL]
    double = [j for j, n in successes.items() if n > 1]
    expected = args.jobs + bursts * args.burst
    burst_acked = sum(1 for k in burst_keys if burster.acked(k))
    probe_unanswered = unanswered["probe"]
    checks = {
        "every acknowledged job exists": not lost,
        "one job per idempotency key": not key_mismatch
        and len(jobs) == len(stored) == len(puback) == len(all_keys) == expected,
        "every job terminal": not not_terminal,
        "no job succeeded twice": not double,
        "database integrity ok": integrity == "ok",
        "every request got a response": not any(unanswered.values()) and not not_acked and not not_ok,
        f"every probe answered within {args.probe_bound:g} s": max_wait <= args.probe_bound and not probe_unanswered,
        "no hang, stall or soak error": hang is None,
        "service never exited by itself": not svc.unexpected_exits,
        "clean stop exit 0": exit_code == 0,
    }
    ok = all(checks.values())
    extra = ""
    if bursts:
        extra += f"{burst_acked} of them in {bursts} bursts of {args.burst}, "
    # After a hang, acknowledged submits still queued in the broker were never read: not "lost".
    lost_words = "lost" if hang is None else "acknowledged but not stored when the run stopped"
    # PUBACK "No matching subscribers": the broker took the request and dropped it (the
    # service's session and subscription were gone).
    dropped = sum(n for p in peers for code, n in p.puback_codes.items() if code == "No matching subscribers")
    summary = (
        f"soak: {len(puback)} acknowledged, {extra}{len(jobs)} jobs stored, {len(not_terminal)} not terminal, "
        f"outcomes {outcomes}, {len(lost)} {lost_words}, "
        f"{len(key_mismatch)} key mismatches, {len(double)} succeeded twice, {kills} kill -9 cycles"
        f"{f' ({burst_kills_done} during bursts)' if bursts else ''}, "
        f"{broker.restarts if broker else 0} broker restarts, "
        f"{sum(unanswered.values()) + not_acked} requests unanswered ({not_ok} not ok"
        f"{f', {dropped} dropped by the broker: no matching subscribers' if dropped else ''}), "
        f"probe max wait {max_wait:.1f} s (bound {args.probe_bound:g} s, {len(waits)} probes), "
        f"{attempts[1] or 0} jobs needed >1 attempt (max {attempts[0]}), integrity {integrity}, "
        f"{elapsed:.0f} s, seed {seed}: {'PASS' if ok else 'FAIL'}"
        + (f" ({hang})" if hang else "")
        + (f" (failed: {', '.join(k for k, v in checks.items() if not v)})" if not ok else "")
    )
    print(summary)
    tail = svc.tail()
    if not ok:
        print(f"--- service log tail ({svc.log_path}) ---\n{tail}\n---", file=sys.stderr)
    suffix = "-bursts" if bursts or args.broker_restarts else ""
    out = args.out or ROOT / "bench" / "results" / f"soak-{datetime.now(UTC):%Y-%m-%d}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "summary": summary,
                "checks": checks,
                "outcomes": outcomes,
                "jobs": args.jobs,
                "kills": kills,
                "burst": args.burst,
                "bursts": bursts,
                "burst_kills": burst_kills_done,
                "burst_stats": burst_stats,
                "broker": args.broker,
                "broker_settings": broker.settings + "persistence true" if broker else f"system {host}:{port}",
                "broker_restarts": broker.restarts if broker else 0,
                "broker_down_s": [round(x, 2) for x in broker.down_s] if broker else [],
                "probe": {
                    "bound_s": args.probe_bound,
                    "probes": len(waits),
                    "max_wait_s": round(max_wait, 2),
                    "over_bound": sum(1 for w in waits if w > args.probe_bound),
                    "unanswered": probe_unanswered,
                },
                "unanswered": unanswered,
                "not_pubacked": not_acked,
                "responses_not_ok": not_ok,
                "puback_reason_codes": {p.reply.rsplit("/", 1)[-1]: dict(p.puback_codes) for p in peers},
                "unexpected_exits": svc.unexpected_exits,
                "hang": hang,
                "lost_sample": lost[:20],
                "key_mismatch_sample": key_mismatch[:20],
                "service_log_tail": tail if not ok else None,
                "seed": seed,
                "code": code,
                "elapsed_s": round(elapsed, 1),
                "work_dir": str(tmp),
            },
            indent=2,
        )
        + "\n"
    )
    if broker is not None:
        broker.stop()
    else:  # leave no retained soak topics on a shared broker
        harness.use_port(port)
        harness.clear_retained(base)
    if ok:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        log(f"kept {tmp} (store, service.log, broker/) for a post-mortem")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
