"""The file-system half of the watch folders (docs/operations.md, "Watch folders").

:class:`FolderWatcher` runs in a thread of its own and owns every file-system call: it takes
events from watchdog (inotify, or watchdog's polling observer on network file systems:
:mod:`.watches`), scans a folder at start and when it comes back, waits for each file to settle
(:mod:`.settling`), checks that the folder is still there, and hands over files that are
complete (:class:`~.settling.Ready`). A stat that hangs on a
dead network share blocks this thread only, never the service's loop. It knows nothing of the
store or MQTT: the service's half is :mod:`edge_queue.watch.folders`.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
import time
from collections import deque
from typing import Any

from edge_queue.config.settings import WatchSettings
from edge_queue.requests.browse import utf8_name
from edge_queue.store import iso

from .files import file_system_type, in_watch, is_network_fs, resolves_inside, skip_reason
from .settling import Candidates, Ready
from .watches import (
    OVERFLOW_LOGGER,
    EventHandler,
    OverflowHandler,
    WatchState,
    on_watchdog_death,
    schedule,
    unschedule,
)

log = logging.getLogger(__name__)

#: How often a watched folder's presence (and identity: a folder removed and made again is a
#: new inode, which inotify does not follow) is checked, in seconds, in ``events`` mode; in
#: ``poll`` mode at each ``poll_interval_s``.
PRESENCE_S = 2.0
#: Sub-folder levels below a watch folder that a scan descends into at most; deeper ones are
#: logged and left out (a tree thousands of levels deep would exhaust the recursion of a walk).
MAX_DEPTH = 64
#: Seconds after lost inotify events during which a file written and not seen closed is not
#: waited for as held open (its close may have been lost): it settles by size and time alone.
LOST_EVENTS_DISTRUST_S = 120.0


class FolderWatcher:
    """Watches the folders of ``watches`` in a thread and hands over complete files.

    A file is handed over (:meth:`take`) once its size and modification time have not changed
    for the watch's ``settle_s`` seconds since the last event or change seen, and only when
    that version differs from ``known`` (path -> ``(size, mtime_ns, digest)``, the versions
    already taken on). In ``events`` mode a file seen written (``IN_MODIFY``) and not closed
    since (``IN_CLOSE_WRITE``) waits longer (:data:`~.settling.OPEN_WRITER_FACTOR`); a close
    ends nothing by itself, as a recorder may open and close its file many times. ``wake`` (the
    service's wake-up socket) is sent one byte whenever something is ready or a watch's state
    changed.
    """

    def __init__(self, watches: list[WatchSettings], known: dict[str, tuple[int, int, str]], wake: socket.socket):
        self.candidates = Candidates(list(watches), known)
        self._wake_service = wake
        self._lock = threading.Lock()
        self._events: list[tuple[int, str, str, str]] = []
        self._ready: deque[Ready] = deque()
        self._changed = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._skipped: set[str] = set()  # paths logged as not taken (_skip_once)
        self._watchdog_died: str | None = None  # set by the thread exception hook (start)
        self._thread = threading.Thread(target=self._run, name="edge-queue-watch", daemon=True)
        self._overflow = OverflowHandler(self.post)
        self.states: list[WatchState] = []
        for w in watches:
            root = os.path.realpath(w.path)
            fs_type = file_system_type(root)
            mode = w.mode if w.mode != "auto" else ("poll" if is_network_fs(fs_type) else "events")
            self.states.append(WatchState(cfg=w, root=root, mode=mode, fs_type=fs_type))

    # -- the service's side ---------------------------------------------------------------

    def start(self) -> None:
        logging.getLogger(OVERFLOW_LOGGER).addHandler(self._overflow)
        on_watchdog_death(self._watchdog_thread_died)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        logging.getLogger(OVERFLOW_LOGGER).removeHandler(self._overflow)
        self._stop.set()
        self._wake.set()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)

    def take(self, limit: int) -> list[Ready]:
        """Up to ``limit`` complete files, in the order they became ready."""
        with self._lock:
            n = min(limit, len(self._ready))
            return [self._ready.popleft() for _ in range(n)]

    def pending(self) -> int:
        with self._lock:
            return len(self._ready)

    def take_changed(self) -> bool:
        """True once after a watch's state changed (for ``<base>/info``)."""
        with self._lock:
            changed, self._changed = self._changed, False
            return changed

    def describe(self) -> list[dict[str, Any]]:
        """Each watch as ``<base>/info`` shows it (docs/topics.md, ``info``)."""
        with self._lock:
            return [
                {
                    "path": str(s.cfg.path),
                    "kind": s.cfg.kind,
                    "recursive": s.cfg.recursive,
                    "mode": s.mode,
                    "state": s.state,
                    "since": iso(s.since),
                    **({"error": s.error} if s.error else {}),
                }
                for s in self.states
            ]

    def post(self, index: int, event_type: str, src: str, dest: str) -> None:
        """Record a watchdog event (called from watchdog's threads)."""
        with self._lock:
            self._events.append((index, event_type, src, dest))
        self._wake.set()

    def _watchdog_thread_died(self, why: str) -> None:
        """A thread of watchdog died (called on that thread): its watches fail at the next turn."""
        self._watchdog_died = why
        self._wake.set()

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._turn(time.monotonic())
            except Exception:  # a bug must not end watching for good
                log.exception("watch folders: unexpected error; going on")
                self._stop.wait(1.0)
            self._wake.wait(self._wait_s(time.monotonic()))
            self._wake.clear()
        for s in self.states:
            unschedule(s)

    def _wait_s(self, mono: float) -> float:
        waits = [s.next_check - mono for s in self.states]
        waits += self.candidates.waits_s(mono)
        return max(0.01, min(waits, default=PRESENCE_S))

    def _turn(self, mono: float) -> None:
        if (died := self._watchdog_died) is not None:
            self._watchdog_died = None
            for s in self.states:
                if s.state == "watching" and s.observer is not None:
                    self._fail(s, died)
        for i, s in enumerate(self.states):
            if mono >= s.next_check:
                s.next_check = mono + (PRESENCE_S if s.mode == "events" else s.cfg.poll_interval_s)
                self._check_presence(i, s)
        with self._lock:
            events, self._events = self._events, []
        for index, event_type, src, dest in events:
            self._on_event(index, event_type, src, dest)
        self._settle(time.monotonic())

    def _set_state(self, s: WatchState, state: str, error: str | None = None) -> None:
        with self._lock:
            s.state, s.since, s.error = state, time.time(), error
            self._changed = True
        self._notify()

    def _notify(self) -> None:
        try:
            self._wake_service.send(b"\0")
        except OSError:
            pass

    def _check_presence(self, index: int, s: WatchState) -> None:
        """Notice a folder that went (removed, share unmounted) or came back, or was replaced
        by another folder of the same name (a new inode: inotify watched the old one)."""
        if os.path.realpath(s.cfg.path) != s.root:
            # a symbolic link put in the folder's place (or in a parent's): it may lead out of
            # the media roots, so nothing there is listed, and its target is not logged
            if s.state != "outside":
                unschedule(s)
                self.candidates.forget(index)
                s.identity = None
                log.warning(
                    "watch folder %s now leads elsewhere (a symbolic link was put in its place): not watched "
                    "until it is the folder it was at start-up again",
                    s.cfg.path,
                )
                self._set_state(s, "outside")
            return
        try:
            st = os.lstat(s.root)
            identity = (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None
        except OSError:
            identity = None
        if identity is not None and identity == s.identity and s.state == "watching":
            if s.observer is not None and not all(e.is_alive() for e in getattr(s.observer, "emitters", ())):
                self._fail(s, "watchdog's emitter thread ended")
            return
        if s.state == "failed" and identity is not None and identity == s.identity:
            return
        if identity is None:
            if s.state != "missing":
                unschedule(s)
                self.candidates.forget(index)
                s.identity = None
                log.warning(
                    "watch folder %s is missing (removed, or its share unmounted); watching for its return",
                    s.cfg.path,
                )
                self._set_state(s, "missing")
            return
        was = s.state
        unschedule(s)
        try:
            error = schedule(s, EventHandler(self.post, index))
        except (FileNotFoundError, NotADirectoryError):
            unschedule(s)
            s.next_check = time.monotonic() + 0.5  # gone between the stat and the watch: reported next
            return
        s.identity = identity
        if was in ("missing", "outside"):
            log.info("watch folder %s is back; scanning it", s.cfg.path)
        elif was == "watching":
            log.info("watch folder %s was replaced by a new folder; watching and scanning it", s.cfg.path)
        else:
            log.info(
                "watching %s for %s jobs (%s%s, settle %g s%s)",
                s.cfg.path,
                s.cfg.kind,
                s.mode,
                f" every {s.cfg.poll_interval_s:g} s" if s.mode == "poll" else "",
                s.cfg.settle_s,
                ", with sub-folders" if s.cfg.recursive else "",
            )
        self._set_state(s, "watching", error)
        self._scan(index, s.root)

    def _on_event(self, index: int, event_type: str, src: str, dest: str) -> None:
        if event_type == "overflow":
            for i, st in enumerate(self.states):
                if st.state == "watching" and st.mode == "events":
                    log.warning("watch folder %s: inotify events were lost; scanning it", st.cfg.path)
                    # a lost close would keep a finished file waiting as if still written
                    st.distrust_until = time.monotonic() + LOST_EVENTS_DISTRUST_S
                    self.candidates.distrust_writers(i)
                    self._scan(i, st.root)
            return
        s = self.states[index]
        if event_type == "deleted":
            self.candidates.waiting.pop(src, None)
            if src.rstrip("/") == s.root.rstrip("/"):
                s.next_check = 0.0  # the folder itself: check it now
            return
        if event_type == "moved":
            self.candidates.waiting.pop(src, None)
            src, event_type = dest, "created"
        if not src:
            return
        if os.path.isdir(src):
            if event_type == "created" and s.cfg.recursive and in_watch(s.root, s.cfg.recursive, src + "/x"):
                self._scan(index, src)  # a folder moved in brings files no event announced
            return
        self._consider(index, src, time.monotonic(), event=True)
        if (c := self.candidates.waiting.get(src)) is not None and s.mode == "events":
            if event_type == "modified":
                c.writing = time.monotonic() >= s.distrust_until
            elif event_type == "closed":
                c.writing = False

    def _scan(self, index: int, folder: str) -> None:
        """Every file under ``folder`` (sub-folders when recursive) as a candidate: the files
        that arrived while edge-queue was stopped or the folder was away."""
        s = self.states[index]
        if not resolves_inside(s.root, folder):
            s.next_check = 0.0  # a symbolic link put in its place: its check now, nothing read
            return
        mono = time.monotonic()
        base_depth = folder.rstrip("/").count("/")
        try:
            for dirpath, dirnames, filenames in os.walk(folder):
                if s.cfg.recursive and dirpath.count("/") - base_depth >= MAX_DEPTH:
                    if dirnames:
                        self._skip_once(s, dirpath, f"its sub-folders are more than {MAX_DEPTH} levels deep")
                    dirnames[:] = []
                dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if s.cfg.recursive else []
                for name in sorted(filenames):
                    self._consider(index, os.path.join(dirpath, name), mono, event=False)
        except OSError as e:
            log.warning("watch folder %s: cannot scan %s: %s", s.cfg.path, folder, e)

    def _consider(self, index: int, path: str, mono: float, *, event: bool) -> None:
        s = self.states[index]
        if not in_watch(s.root, s.cfg.recursive, path):
            return
        if not resolves_inside(s.root, os.path.dirname(path)):
            s.next_check = 0.0  # a symbolic link put in its place: its check now, nothing read
            return
        reason = skip_reason(os.path.basename(path), s.cfg.include, s.cfg.exclude)
        if reason is not None:
            if reason != "not included":
                log.debug("watch %s: %s skipped (%s)", s.cfg.path, path, reason)
            return
        try:
            st = os.lstat(path)
        except OSError:
            self.candidates.waiting.pop(path, None)
            return
        if not stat.S_ISREG(st.st_mode):
            if stat.S_ISLNK(st.st_mode):
                self._skip_once(s, path, "a symbolic link (a watch takes the files put in its folder only)")
            return
        if not utf8_name(path):
            self._skip_once(s, path, "its name is not UTF-8, which MQTT topics and JSON cannot carry: rename it")
            return
        self.candidates.consider(index, path, st, mono, event=event)

    def _fail(self, s: WatchState, why: str) -> None:
        """watchdog stopped watching ``s`` (one of its threads died: a folder tree too deep for
        it, say): said in the log and in ``<base>/info``, not silent."""
        log.error(
            "watch folder %s: watching stopped (%s; see the lines above): new files are not taken until "
            "edge-queue restarts",
            s.cfg.path,
            why,
        )
        unschedule(s)
        self._set_state(s, "failed", f"the file-system watcher failed: {why}")

    def _skip_once(self, s: WatchState, path: str, why: str) -> None:
        """Log once per run that ``path`` is not taken, and why."""
        if path in self._skipped:
            return
        if len(self._skipped) >= 10_000:
            self._skipped.clear()
        self._skipped.add(path)
        shown = path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        log.warning("watch %s: %s is not taken: %s", s.cfg.path, shown, why)

    def _settle(self, mono: float) -> None:
        """Hand over the candidates that stood still for their watch's ``settle_s``."""
        for ready in self.candidates.settled(mono):
            with self._lock:
                self._ready.append(ready)
            self._notify()
