"""What runs inside a worker child process: take a job, run its kind, report over the pipe.

The worker never touches MQTT or the store. Its parent (``supervisor``) sends
``run``, ``cancel``, ``outputs_ok`` and ``stop`` messages; the worker answers with ``ready``,
``progress``, ``chunk`` (a finished chunk of a long job, kept by the service for its next
attempt), ``outputs`` (the files an attempt is about to move into place, which it moves once the
service's ``outputs_ok`` says they are recorded),
``done`` and ``failed`` (with the worker's ``rss_mb`` and the attempt's run time ``took_s``) and
``log`` messages (plain dicts,
pickled by ``multiprocessing``).

This is the one place where exceptions of a job become outcomes: a
:class:`~edge_queue.errors.JobError` keeps its code; any other exception is
``internal_error`` (retryable) with the exception's type and text as the message.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import queue
import resource
import signal
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import orjson

from edge_queue.config.settings import Settings
from edge_queue.errors import EdgeQueueError, ErrorCode, JobCancelled, JobError, MediaError
from edge_queue.kinds import registry
from edge_queue.kinds.media import container_duration_s, held_input, open_media

#: Seconds between two progress messages of one job (stage changes are always sent).
PROGRESS_INTERVAL_S = 0.25
#: Outcomes sent in one message at most, and how long the first of them may wait (seconds).
#: P1 (bench/p1_throughput.py, 4 alternated runs of 5,000 no-op jobs, with workers holding up
#: to 256): 64 gave 2,147 jobs/s with one request per job and 2,797 with batches, against
#: 1,927 and 2,340 with 16, at the same service CPU per job.
OUTCOME_BATCH = 64
OUTCOME_BATCH_S = 0.005
#: Seconds between cancel checks while a job waits for the service to record its outputs.
OUTPUTS_POLL_S = 0.2


def fits_lane(seconds: float | None, within_s: float) -> bool:
    """True when an input of ``seconds`` (its container's duration; ``None``: unknown) may run
    on the short lane, which takes inputs of at most ``within_s`` seconds (``short_lane_s``)."""
    return seconds is not None and seconds <= within_s


def input_seconds(path: str | None) -> float | None:
    """The duration the input's container declares, in seconds; ``None`` when it declares none
    or cannot be opened (its kind says why when it runs)."""
    try:
        with open_media(path or "") as container:
            return container_duration_s(container)
    except MediaError:
        return None


def as_json(value: Any) -> Any:
    """``value`` with numpy numbers and arrays made plain JSON values, ready for the store.
    Raises ``TypeError`` (or ``ValueError``) naming what is not JSON (a set, an object), so that
    a kind's odd result fails its job here instead of the service's turn."""
    try:
        return orjson.loads(orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY))
    except TypeError:
        json.dumps(value)  # what orjson refuses and json takes (lone surrogates, huge integers)
        return value


class _PipeLogHandler(logging.Handler):
    """Forwards log records to the service, which logs them with its own configuration."""

    def __init__(self, send: Any) -> None:
        super().__init__()
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._send({"op": "log", "level": record.levelno, "name": record.name, "message": record.getMessage()})
        except Exception:  # the pipe is gone: the parent is going away too
            pass


class _Context:
    """The :class:`~edge_queue.kinds.base.JobContext` of one attempt."""

    def __init__(self, worker: _Worker, job: dict[str, Any]) -> None:
        self._worker = worker
        self.job_id: str = job["job_id"]
        self.attempt: int = job["attempt"]
        self.output_dir = Path(job["output_dir"])
        self.settings = worker.settings
        self._last_sent = 0.0
        self._last_stage: str | None = None
        kept = job.get("kept")
        self.kept: list[dict[str, Any]] = [c["data"] for c in kept] if isinstance(kept, list) else []
        written = job.get("written")
        self.written: dict[str, dict[str, Any]] = written if isinstance(written, dict) else {}

    def progress(self, percent: float, stage: str | None = None, eta_s: float | None = None) -> None:
        now = time.monotonic()
        if stage == self._last_stage and now - self._last_sent < PROGRESS_INTERVAL_S and percent < 100:
            return
        self._last_sent, self._last_stage = now, stage
        self._worker.send(
            {
                "op": "progress",
                "job_id": self.job_id,
                "attempt": self.attempt,
                "progress": max(0.0, min(100.0, float(percent))),
                "stage": stage,
                "eta_s": eta_s,
            }
        )

    def keep_chunk(self, index: int, data: dict[str, Any]) -> None:
        try:
            data = as_json(data)
        except (TypeError, ValueError) as e:  # not kept: a later attempt decodes this chunk again
            logging.getLogger("edge_queue.workers.worker").warning(
                "job %s: chunk %d not kept: %s", self.job_id, index, e
            )
            return
        self._worker.send({"op": "chunk", "job_id": self.job_id, "attempt": self.attempt, "index": index, "data": data})

    def claim_outputs(self, files: dict[str, dict[str, Any]]) -> None:
        key = (self.job_id, self.attempt)
        self._worker.send({"op": "outputs", "job_id": self.job_id, "attempt": self.attempt, "files": files})
        while True:  # the service answers after its commit
            with self._worker.lock_claims:
                if key in self._worker.claim_answers:
                    answer = self._worker.claim_answers.pop(key)
                    break
                self._worker.claimed.clear()
            self._worker.claimed.wait(OUTPUTS_POLL_S)
            self.checkpoint()
        if not answer:
            raise JobError(
                "the service did not record this attempt's outputs (the attempt is no longer the job's)",
                code=ErrorCode.INTERNAL_ERROR,
            )

    def checkpoint(self) -> None:
        if self._worker.cancel_requested(self.job_id):
            raise JobCancelled("cancelled at a checkpoint")


class _Worker:
    def __init__(self, conn: Connection, settings: Settings) -> None:
        self.conn = conn
        self.settings = settings
        self.kinds = registry(settings.extra_kinds)
        self.jobs: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        self._timer: threading.Timer | None = None
        #: the service's answers to ``outputs`` (:meth:`_Context.claim_outputs`), by (job, attempt)
        self.claim_answers: dict[tuple[str, int], bool] = {}
        self.claimed = threading.Event()
        self.lock_claims = threading.Lock()
        #: loading a model ahead of any job (``warm``): a ``stop`` meanwhile ends the process at once
        self.warming = False

    def send(self, msg: dict[str, Any]) -> None:
        """Send one message (after any outcomes still waiting, so the order holds)."""
        with self._lock:
            self._flush_locked()
            self.conn.send(msg)

    def report(self, outcome: dict[str, Any]) -> None:
        """Send an outcome: at once when no other job waits here; otherwise it waits for the
        next ones, at most :data:`OUTCOME_BATCH` outcomes or :data:`OUTCOME_BATCH_S` seconds,
        so that many short jobs cost the service one message."""
        with self._lock:
            self._pending.append(outcome)
            if len(self._pending) >= OUTCOME_BATCH or self.jobs.empty():
                self._flush_locked()
            elif self._timer is None:
                self._timer = threading.Timer(OUTCOME_BATCH_S, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pending:
            self.conn.send(self._pending if len(self._pending) > 1 else self._pending[0])
            self._pending = []

    def release(self, job_ids: list[str] | None) -> None:
        """Give back the jobs of ``job_ids`` (all, for ``None``) that wait in this worker's
        queue, not started: one ``released`` message names them (``[job_id, attempt]`` pairs;
        none when every one of them has started or ended meanwhile; ``all`` when the whole
        queue was asked for). The service puts them back in the queue or, cancelled, ends them
        (:meth:`~.prefetch.Prefetch.release`)."""
        wanted = None if job_ids is None else set(job_ids)
        with self.jobs.mutex:  # the queue's own lock: the main thread takes its next job meanwhile
            waiting = self.jobs.queue
            jobs = [j for j in waiting if j is not None and "job_id" in j]  # not a warm-up (``warm``)
            gone = [j for j in jobs if wanted is None or j["job_id"] in wanted]
            kept = [j for j in waiting if not any(j is g for g in gone)]
            waiting.clear()
            waiting.extend(kept)
        self.send({"op": "released", "all": wanted is None, "jobs": [[j["job_id"], j["attempt"]] for j in gone]})

    def cancel_requested(self, job_id: str) -> bool:
        return job_id in self._cancelled

    def read_loop(self) -> None:
        """Reader thread: queue ``run`` messages, flag ``cancel``s at once, end on ``stop``/EOF."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                # The service is gone (even kill -9): nobody can use our result. Leave now,
                # rather than finish a job whose attempt the next service run will requeue.
                os._exit(0)
            op = msg.get("op")
            if op == "run":  # one or several jobs, run in order
                for job in msg["jobs"]:
                    self.jobs.put(job)
            elif op == "cancel":
                self._cancelled.add(msg["job_id"])
            elif op == "outputs_ok":
                with self.lock_claims:
                    self.claim_answers[(msg["job_id"], msg["attempt"])] = bool(msg.get("ok"))
                    self.claimed.set()
            elif op == "warm":  # the short lane's worker: load the model now (:func:`_warm`)
                self.jobs.put({"op": "warm"})
            elif op == "warm_voice":  # with [wyoming] on: a voice command's model (:func:`_warm_voice`)
                self.jobs.put({"op": "warm_voice"})
            elif op == "release":
                self.release(msg.get("job_ids"))
            elif op == "stop":
                if self.warming:  # no job runs: nothing is lost, and a model load takes seconds
                    os._exit(0)
                self.jobs.put(None)
                return

    def run_one(self, job: dict[str, Any]) -> dict[str, Any]:
        """Run one attempt; returns the ``done`` or ``failed`` message for the service."""
        ctx = _Context(self, job)
        base = {"job_id": job["job_id"], "attempt": job["attempt"]}
        log = logging.getLogger("edge_queue.workers.worker")
        try:
            kind = self.kinds[job["kind"]]()
            options = kind.Options.model_validate(job["options"])
            # the input opened once, checked on its descriptor, and read through it alone
            with held_input(job["input"] or "") if kind.needs_input else contextlib.nullcontext():
                ctx.checkpoint()
                if (within := job.get("within_s")) is not None and not fits_lane(input_seconds(job["input"]), within):
                    reason = f"its input is longer than the short lane takes ({within:g} s): left for a worker"
                    return {**base, "op": "unstarted", "reason": reason}
                result = kind.run(ctx, job["input"], options)
            try:
                result = as_json(result)
            except (TypeError, ValueError) as e:
                raise JobError(
                    f"the {job['kind']} kind returned a result that is not JSON: {e}"[:500],
                    code=ErrorCode.INTERNAL_ERROR,
                ) from e
        except EdgeQueueError as e:
            return {**base, "op": "failed", "code": str(e.code), "message": e.message, "retryable": e.retryable}
        except Exception as e:  # any other failure of a kind is ours to report, not to die of
            if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                # Retrying cannot make a folder writable: say so at once.
                return {
                    **base,
                    "op": "failed",
                    "code": str(ErrorCode.OUTPUT_NOT_WRITABLE),
                    "message": f"cannot write {e.filename or 'the output'}: {e.strerror}",
                    "retryable": False,
                }
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                # Another attempt can succeed once space is freed: retried after the backoff.
                return {
                    **base,
                    "op": "failed",
                    "code": str(ErrorCode.DISK_FULL),
                    "message": f"no space left writing {e.filename or 'the output'}: free space, then it is retried",
                    "retryable": True,
                }
            log.exception("job %s: unexpected error", job["job_id"])
            return {
                **base,
                "op": "failed",
                "code": str(ErrorCode.INTERNAL_ERROR),
                "message": f"{type(e).__name__}: {e}"[:1000],
                "retryable": True,
            }
        finally:
            self._cancelled.discard(job["job_id"])
        return {**base, "op": "done", "result": result}

    def rss_mb(self) -> float:
        """Resident set size now, in MiB (from /proc; peak from getrusage where /proc is absent)."""
        try:
            with open("/proc/self/statm") as fh:
                pages = int(fh.read().split()[1])
            return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
        except OSError:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _die_with_parent() -> None:
    """Linux: ask the kernel for SIGKILL when the parent dies (``PR_SET_PDEATHSIG``), so a
    ``kill -9`` of the service cannot leave a worker running a job nobody will collect. The
    parent is multiprocessing's forkserver, which exits as soon as the service is gone (its
    end of the forkserver's "alive" pipe closes)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _thread_lock_for_tqdm() -> None:
    """faster-whisper makes a tqdm progress bar for every transcription, and tqdm's first bar
    creates a multiprocessing lock (a POSIX semaphore). A worker ended in the middle of a job
    leaves it registered, and Python's resource tracker then warns of a "leaked semaphore" at
    every stop. A thread lock serves: a worker's bars are never shared with another process."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _next_job(worker: _Worker, idle_s: float) -> dict[str, Any] | None:
    """The next job (``None``: stop); meanwhile, every ``idle_s`` seconds without one, the
    models not used for that long are released (``transcribe.idle_unload_s``; 0: never)."""
    while True:
        try:
            return worker.jobs.get(timeout=idle_s or None)
        except queue.Empty:
            from edge_queue.kinds.whisper import unload_idle

            unload_idle(idle_s)


def is_voice_command(job: dict[str, Any], settings: Settings) -> bool:
    """True for a job of the Wyoming listener's (``[wyoming]`` on, its input in
    ``Settings.voice_dir``): the models it decoded with are kept past
    ``transcribe.idle_unload_s`` (docs/configuration.md), as a Wyoming server keeps its model,
    so that a command after a quiet spell does not wait for one to load."""
    text = job.get("input")
    voice = f"{settings.voice_dir}/"
    return settings.wyoming.enabled and isinstance(text, str) and text.startswith(voice)


def warm_models(settings: Settings) -> list[str | None]:
    """The ``transcribe.model`` settings the short lane loads ahead, in order: the one that
    tells the language (``transcribe.model``; None: the bundled base); with ``[wyoming]`` on,
    then the models of ``transcribe.language_models`` (by default tiny.en for English), which
    a voice command given its language loads first. A worker keeps at most two models
    (:data:`~edge_queue.kinds.whisper.KEEP_MODELS`): the last two loaded stay."""
    from edge_queue.kinds.languages import routes

    wanted: list[str | None] = [settings.transcribe.model]
    if settings.wyoming.enabled:
        wanted += [ref for ref in dict.fromkeys(routes(settings.transcribe).values()) if ref not in wanted]
    return wanted


def voice_models(settings: Settings) -> list[str | None]:
    """The ``transcribe.model`` settings voice commands go to: the models of
    ``transcribe.language_models`` (by default tiny.en, for English), else ``transcribe.model``."""
    from edge_queue.kinds.languages import routes

    return [*dict.fromkeys(routes(settings.transcribe).values())] or [settings.transcribe.model]


def _warm_voice(settings: Settings) -> None:
    """Load :func:`voice_models` as a voice command will, and keep them past
    ``transcribe.idle_unload_s`` (:func:`~edge_queue.kinds.whisper.keep_warm_since`): the
    first command after a start does not wait for its model, as a Wyoming server loads its
    model before it listens."""
    from edge_queue.kinds.whisper import keep_warm_since

    t0 = time.monotonic()
    if _load_ahead(settings, voice_models(settings), "voice commands"):
        keep_warm_since(t0)


def _warm(settings: Settings) -> None:
    """Load :func:`warm_models` as its jobs will (the short lane)."""
    _load_ahead(settings, warm_models(settings), "short lane")


def _load_ahead(settings: Settings, models: list[str | None], who: str) -> bool:
    """Load ``models`` as their jobs will (the same cache key: the model resolved for
    ``transcribe.compute_type``, so int8's stored copy of a bundled model). False when one
    cannot be loaded: logged at DEBUG, the first job that needs it says what is wrong."""
    from edge_queue.kinds.transcribe import load_model, model_threads, resolve_model

    cfg = settings.transcribe
    t0 = time.monotonic()
    try:
        for setting in models:
            ref = resolve_model(setting, Path(settings.data_dir) / "models", cfg.compute_type)
            load_model(ref, cfg.compute_type, model_threads(settings), cfg.device, cfg.chunks_at_once)
    except Exception as e:  # as without the warm-up: the first job tells
        logging.getLogger(__name__).debug("%s: no model loaded ahead: %s", who, e)
        return False
    logging.getLogger(__name__).debug("%s: model loaded ahead in %.1f s", who, time.monotonic() - t0)
    return True


def main(conn: Connection, settings: Settings) -> None:
    """Entry point of a worker process (forked by the supervisor's ``forkserver``).

    SIGINT is ignored (a Ctrl-C in the terminal reaches the service, which stops the workers
    itself); SIGTERM ends the process at once.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    from edge_queue.kinds.media import confine_inputs

    # inputs are checked again when they are opened: the media roots, and the HTTP API's
    # uploads (only its jobs may name them: docs/http-api.md, "Uploads"), and the Wyoming
    # listener's voice commands (only theirs: docs/home-assistant.md, "Voice (Assist)")
    confine_inputs([*settings.media_roots, settings.uploads_dir, settings.voice_dir])
    _thread_lock_for_tqdm()
    worker = _Worker(conn, settings)
    root = logging.getLogger()
    root.handlers[:] = [_PipeLogHandler(worker.send)]
    root.setLevel(settings.log_level)
    threading.Thread(target=worker.read_loop, name="pipe-reader", daemon=True).start()
    worker.send({"op": "ready", "pid": os.getpid(), "rss_mb": round(worker.rss_mb(), 1)})
    idle_s = settings.transcribe.idle_unload_s
    while (job := _next_job(worker, idle_s)) is not None:
        if job.get("op") == "warm":
            worker.warming = True
            _warm(settings)
            worker.warming = False
            idle_s = 0.0  # the lane keeps its models: a film's next short job finds them loaded
            continue
        if job.get("op") == "warm_voice":
            worker.warming = True
            _warm_voice(settings)
            worker.warming = False
            continue
        t0 = time.monotonic()
        outcome = worker.run_one(job)
        outcome["took_s"] = time.monotonic() - t0
        if is_voice_command(job, settings):  # its model stays loaded for the next command
            from edge_queue.kinds.whisper import keep_warm_since

            keep_warm_since(t0)
        outcome["rss_mb"] = round(worker.rss_mb(), 1)
        worker.report(outcome)
    worker.flush()
