"""The rows of the Redis-backed references of issue 56 ("Ahead of Dramatiq's best"): P1 against
Dramatiq on Redis (RDB, Redis's default persistence; AOF fsynced always, informative) and P2
against Celery on Redis. Results stored before these sides existed give no rows."""

from __future__ import annotations

from typing import Any

from cells import fmt, row

#: Issue 56's P1 targets against Dramatiq on Redis with RDB: one request per job, and batches of 100.
P1_SINGLE_X, P1_BATCH_X = 1.5, 2.0


def p1_dramatiq_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """P1's rows against Dramatiq: edge-queue (durability full) single and batch divided by
    Dramatiq RDB (targets :data:`P1_SINGLE_X`, :data:`P1_BATCH_X`), and Dramatiq's own rows."""
    f = res["figures"]
    rdb, aof = f.get("dramatiq rdb"), f.get("dramatiq aof-always")
    if rdb is None:
        return []
    out = []
    for side, limit, how in (
        ("eq single full", P1_SINGLE_X, "one request per job"),
        ("eq batch full", P1_BATCH_X, "batches of 100"),
    ):
        v = f[side]
        ratio = f"{v.median / rdb.median:.2f}× Dramatiq RDB"
        if aof is not None:
            ratio += f", {v.median / aof.median:.2f}× Dramatiq AOF always"
        out.append(
            row(
                "P1",
                f"{res['n']:,} noop, {how}, full, against Dramatiq on Redis (issue 56)",
                f"≥ {limit:g}× Dramatiq on Redis with RDB (issue 56)",
                v,
                f"Dramatiq+Redis RDB {fmt(rdb)}" + (f"; AOF always {fmt(aof)}" if aof is not None else ""),
                ratio,
                v.median >= limit * rdb.median,
            )
        )
    version = res.get("dramatiq_version", "")
    what = f"Dramatiq {version} RedisBroker, 1 worker process, 8 threads, one send per job"
    out.append(row("P1", f"{what}; Redis RDB snapshots (its default persistence)", "(reference)", rdb, "", "", None))
    if aof is not None:
        out.append(
            row(
                "P1",
                f"{what}; Redis appendonly yes + appendfsync always (durable as full)",
                "(reference, informative)",
                aof,
                "",
                "",
                None,
            )
        )
    celery = f.get("celery rdb")
    if celery is not None:
        out.append(
            row(
                "P1",
                f"Celery {res.get('celery_version', '')} on Redis (RDB), 1 prefork child, one delay() per job",
                "(reference, informative)",
                celery,
                f"this tree, one request per job, full {fmt(f['eq single full'])}",
                f"this tree {f['eq single full'].median / celery.median:.2f}×",
                None,
            )
        )
    return out


def p2_celery_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """P2's rows against Celery on Redis: edge-queue's submit->succeeded p50 (target: at most
    Celery's, on the shipped broker) and p90 (informative) beside Celery's, and Celery's own rows."""
    f = res["figures"]
    if "celery: submit->succeeded p50" not in f:
        return []
    out = []
    for b in ("shipped", "nagle"):
        for p in (50, 90):
            key, ref = f"{b}: submit->succeeded p{p}", f[f"celery: submit->succeeded p{p}"]
            if key not in f:
                continue
            target = b == "shipped" and p == 50
            out.append(
                row(
                    "P2",
                    f"[{b} broker] submit->succeeded seen p{p} against Celery on Redis (issue 56)",
                    "≤ Celery on Redis (issue 56)" if target else "(informative)",
                    f[key],
                    f"Celery+Redis {fmt(ref)}",
                    f"{f[key].median / ref.median:.2f}× Celery",
                    f[key].median <= ref.median if target else None,
                )
            )
    for p in (50, 90):
        out.append(
            row(
                "P2",
                f"Celery {res.get('celery_version', '')} on Redis (RDB), 1 prefork child: "
                f"delay() -> result seen p{p} ({res['n']} tasks/run)",
                "(reference)",
                f[f"celery: submit->succeeded p{p}"],
                "",
                "",
                None,
            )
        )
    return out
