"""Watch folders: new files in a watched folder become jobs, once (docs/configuration.md,
"[[watch]]"; docs/operations.md, "Watch folders").

This is the service's half: it runs in the service's loop and turns the files that
:class:`~edge_queue.watch.watcher.FolderWatcher` (the file-system half, in a thread of its own) hands
over into jobs through the queue's typed ``submit``, as any intake's (a
:class:`~edge_queue.requests.models.SubmitRequest` run as the service's own request), and
records each file version in the store (``watch_files``) in the same transaction as its job, so
that a restart, a rescan or a touch makes no second job.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from edge_queue.component import Component
from edge_queue.config.settings import Settings, watch_problems
from edge_queue.errors import ConfigError, ErrorCode, RequestError
from edge_queue.requests import models
from edge_queue.requests.ports import WatchPort
from edge_queue.rules.lifecycle import IN_ATTEMPT
from edge_queue.store import BesideJob

from .settling import Ready
from .watcher import FolderWatcher

log = logging.getLogger(__name__)

#: Files taken on per service loop turn at most; the rest wait for the next turns.
PER_TURN = 200
#: A file refused for a passing reason (``queue_full``, ``disk_full``) is offered again after
#: this many seconds.
RETRY_S = 30.0
#: Seconds before a file named like the output of a running job is looked at again.
OUTPUT_WAIT_S = 2.0


def check_watches(settings: Settings, kinds: dict[str, Any]) -> None:
    """Raise :class:`ConfigError` naming every ``watch[<index>]`` problem: a path outside the
    media roots or overlapping another watch (:func:`~edge_queue.config.watch_problems`), an
    unknown kind (``kinds``: the registry), or options the kind refuses."""
    problems = watch_problems(settings)
    for i, w in enumerate(settings.watch):
        kind = kinds.get(w.kind or settings.default_kind)
        if kind is None:
            problems.append(f"watch[{i}].kind: unknown job kind {w.kind!r} (known: {', '.join(sorted(kinds))})")
            continue
        try:
            kind.check_options(kind.Options.model_validate(w.options), settings)
        except ValidationError as e:
            err = e.errors()[0]
            problems.append(f"watch[{i}].options.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}")
        except RequestError as e:
            problems.append(f"watch[{i}].{e.field or 'options'}: {e.message}")
    if problems:
        raise ConfigError("invalid watch configuration: " + "; ".join(problems))


class WatchFolders(Component):
    """The service's side of the watch folders, an :class:`~edge_queue.requests.ports.Intake`:
    files handed over by :class:`FolderWatcher` become jobs (one per file version, recorded in
    the store with the job).

    Raises :class:`ConfigError` (at construction) when a watch is outside the media roots,
    overlaps another, names an unknown kind, or has options its kind refuses.
    """

    def __init__(self, service: WatchPort) -> None:
        self.service = service
        settings: Settings = service.settings
        check_watches(settings, service.kinds)
        self.watches = [w.model_copy(update={"kind": w.kind or settings.default_kind}) for w in settings.watch]
        self.watcher: FolderWatcher | None = None
        self._turn: list[Ready] = []
        self._retry: list[tuple[float, Ready]] = []

    def boot(self) -> None:
        """Start watching (after the store is open): the versions taken on before come from
        the store, so nothing already done is submitted again."""
        if not self.watches:
            return
        roots = [os.path.realpath(w.path) for w in self.watches]
        known = self.service.job_store().watched.watched_files(roots)
        self.watcher = FolderWatcher(self.watches, known, self.service.wake_socket())
        self.watcher.start()

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()

    def info(self) -> list[dict[str, Any]]:
        """The ``watch`` entries of ``<base>/info``."""
        if self.watcher is None:
            return [
                {"path": str(w.path), "kind": w.kind, "recursive": w.recursive, "state": "starting"}
                for w in self.watches
            ]
        return self.watcher.describe()

    def wait_s(self, now: float) -> float | None:
        """Seconds until there is work for :meth:`turn`, or None."""
        if self.service.holding():
            return None  # the files wait for the broker (turn takes none)
        if self.watcher is not None and self.watcher.pending():
            return 0.0
        if self._retry:
            return max(0.0, min(t for t, _ in self._retry) - now)
        return None

    def committed(self) -> None:
        """The turn's commit succeeded: its files are recorded with their jobs."""
        self._turn = []

    def turn_failed(self, *, disk_full: bool = False) -> None:
        """The turn's commit failed: its files are offered again next turn."""
        self._retry.extend((0.0, r) for r in self._turn)
        self._turn = []

    def turn(self, now: float) -> None:
        """Take on the files handed over (within :data:`PER_TURN`), inside the turn's group
        commit; republish ``<base>/info`` when a watch's state changed. What it took on stays
        listed until :meth:`committed` or :meth:`turn_failed`."""
        svc = self.service
        if self.watcher is None or svc.holding():
            return
        if self.watcher.take_changed() and svc.connected():
            svc.publish_info()
        due = [r for t, r in self._retry if t <= now]
        if due:
            self._retry = [(t, r) for t, r in self._retry if t > now]
        items = due[:PER_TURN] + self.watcher.take(PER_TURN - min(len(due), PER_TURN))
        self._retry.extend((now, r) for r in due[PER_TURN:])
        beside: dict[str, list[BesideJob]] = {}
        for item in items:
            self._turn.append(item)
            self._take_on(item, now, beside)

    def _take_on(self, item: Ready, now: float, beside: dict[str, list[BesideJob]]) -> None:
        svc = self.service
        store = svc.job_store()
        w = self.watches[item.index]
        if item.touched:
            store.watched.touch_watched(item.path, item.mtime_ns, now)
            log.debug("watch %s: %s touched, content unchanged: no new job", w.path, item.path)
            return
        if item.same_stem:
            writer, job_id = self._own_output(item, beside)
            if writer == "wrote":
                store.watched.record_watched(item.path, item.size, item.mtime_ns, item.digest, "output", job_id, now)
                log.info("watch %s: %s is an output of job %s: not submitted", w.path, item.path, job_id)
                return
            if writer == "writing":
                self._retry.append((now + OUTPUT_WAIT_S, item))
                log.debug("watch %s: %s may be an output of running job %s: asking again", w.path, item.path, job_id)
                return
        key = hashlib.sha256(f"{item.path}\0{item.size}\0{item.mtime_ns}\0{item.digest}".encode()).hexdigest()
        body = {"kind": w.kind, "input": item.path, "options": w.options, "idempotency_key": "watch-" + key[:40]}
        try:
            request = models.validated("submit", body, default_kind=w.kind or "")
            assert isinstance(request, models.SubmitRequest)
            response = svc.submit_as_service(request)
        except RequestError as e:  # what the request's model refuses (a path over 4,096 characters)
            response = {"status": "error", "error": {"code": e.code, "message": e.message}}
        if response.get("status") == "ok":
            job = response["data"]["jobs"][0]
            store.watched.record_watched(item.path, item.size, item.mtime_ns, item.digest, "job", job["job_id"], now)
            log.info("watch %s: %s -> job %s", w.path, item.path, job["job_id"])
            return
        error = response.get("error") or {}
        code = str(error.get("code", ErrorCode.INTERNAL_ERROR))
        if code in (ErrorCode.QUEUE_FULL, ErrorCode.DISK_FULL, ErrorCode.INTERNAL_ERROR):
            self._retry.append((now + RETRY_S, item))
            log.warning("watch %s: %s not submitted yet (%s); trying again in %.0f s", w.path, item.path, code, RETRY_S)
            return
        store.watched.record_watched(item.path, item.size, item.mtime_ns, item.digest, f"refused:{code}", None, now)
        log.warning("watch %s: %s refused: %s: %s", w.path, item.path, code, error.get("message", ""))

    def _own_output(self, item: Ready, beside: dict[str, list[BesideJob]]) -> tuple[str | None, str | None]:
        """Whether edge-queue wrote ``item``: ``("wrote", job_id)`` when a job with ``output:
        beside`` whose input is in the same folder names it in its result; ``("writing",
        job_id)`` when such a job, whose input's stem followed by a dot starts ``item``'s name,
        is running now (it renames its finished outputs into place just before it reports);
        else ``(None, None)``: a recording named like an output is an input."""
        folder, name = os.path.split(item.path)
        if folder not in beside:
            beside[folder] = self.service.job_store().watched.beside_jobs(folder)
        running = None
        for job in beside[folder]:
            if item.path in job.written:
                return "wrote", job.job_id
            if (
                job.input != item.path
                and job.state in IN_ATTEMPT
                and name.startswith(Path(job.input).stem + ".")
                and item.mtime_ns / 1e9 >= job.created
            ):
                running = job.job_id
        return ("writing", running) if running else (None, None)
