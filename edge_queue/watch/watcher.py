"""The file-system half of the watch folders (docs/operations.md, "Watch folders").

:class:`FolderWatcher` runs in a thread of its own and owns every file-system call: it takes
events from watchdog (inotify, or watchdog's polling observer on network file systems), scans a
folder at start and when it comes back, waits for each file to settle, checks that the folder
is still there, and hands over files that are complete (:class:`Ready`). A stat that hangs on a
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
from dataclasses import dataclass, field
from typing import Any

from edge_queue.config.settings import WatchSettings
from edge_queue.requests.browse import utf8_name
from edge_queue.store import iso

from .files import (
    FolderStems,
    file_digest,
    file_system_type,
    in_watch,
    is_network_fs,
    resolves_inside,
    skip_reason,
)

log = logging.getLogger(__name__)

#: How often a watched folder's presence (and identity: a folder removed and made again is a
#: new inode, which inotify does not follow) is checked, in seconds, in ``events`` mode; in
#: ``poll`` mode at each ``poll_interval_s``.
PRESENCE_S = 2.0
#: A file that inotify saw written and not yet closed (``IN_CLOSE_WRITE``) waits for the close,
#: or for this many times ``settle_s`` without a change (at least :data:`OPEN_WRITER_MIN_S`
#: seconds): a writer that pauses while it holds the file open (a stalled network copy) is not
#: taken for finished, and one that never closes it is not waited for forever.
OPEN_WRITER_FACTOR = 12
OPEN_WRITER_MIN_S = 60.0
#: Sub-folder levels below a watch folder that a scan descends into at most; deeper ones are
#: logged and left out (a tree thousands of levels deep would exhaust the recursion of a walk).
MAX_DEPTH = 64
#: What watchdog logs when the kernel's inotify queue overflowed and events were lost
#: (``watchdog.observers.inotify_c``): the watch folders in ``events`` mode are scanned again.
OVERFLOW_LOGGER = "watchdog.observers.inotify_c"
#: Seconds after lost inotify events during which a file written and not seen closed is not
#: waited for as held open (its close may have been lost): it settles by size and time alone.
LOST_EVENTS_DISTRUST_S = 120.0


@dataclass(frozen=True, slots=True)
class Ready:
    """A complete file handed over by the watcher: one version of it (size in bytes,
    modification time in ns, content digest). ``touched``: the same content as the version
    taken on before, with a new modification time (no job). ``same_stem``: another file in its
    folder shares its stem (it may be an output written beside that one)."""

    index: int
    path: str
    size: int
    mtime_ns: int
    digest: str
    touched: bool = False
    same_stem: bool = False


@dataclass(slots=True)
class _Candidate:
    index: int
    size: int
    mtime_ns: int
    since: float  # monotonic time its size or modification time last changed
    writing: bool = False  # inotify saw it written and not closed since


@dataclass(slots=True)
class _State:
    """One watch's run-time state (owned by the watcher thread; read under its lock)."""

    cfg: WatchSettings
    root: str
    mode: str  # "events" or "poll"
    fs_type: str | None
    #: "watching", "missing", "outside" (it leads elsewhere now) or "failed" (watchdog's thread died)
    state: str = "starting"
    since: float = field(default_factory=time.time)
    identity: tuple[int, int] | None = None
    observer: Any = None
    next_check: float = 0.0
    error: str | None = None
    #: until when (monotonic) inotify's open-for-writing events are not trusted: events were
    #: lost, a close among them, so files settle by their size and time alone meanwhile
    distrust_until: float = 0.0


class _OverflowHandler(logging.Handler):
    """Hears watchdog's warning that the kernel dropped inotify events, and asks the watcher
    for a scan of its folders (the events lost may have announced new files)."""

    def __init__(self, owner: FolderWatcher) -> None:
        super().__init__(logging.WARNING)
        self.owner = owner

    def emit(self, record: logging.LogRecord) -> None:
        if "overflow" in record.getMessage():
            self.owner.post(-1, "overflow", "", "")


class _Handler:
    """watchdog event handler: records the event and wakes the watcher thread."""

    def __init__(self, owner: FolderWatcher, index: int) -> None:
        self.owner, self.index = owner, index

    def dispatch(self, event: Any) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return
        self.owner.post(self.index, event.event_type, os.fsdecode(event.src_path), os.fsdecode(event.dest_path or b""))


class FolderWatcher:
    """Watches the folders of ``watches`` in a thread and hands over complete files.

    A file is handed over (:meth:`take`) once its size and modification time have not changed
    for the watch's ``settle_s`` seconds since the last event or change seen, and only when
    that version differs from ``known`` (path -> ``(size, mtime_ns, digest)``, the versions
    already taken on). In ``events`` mode a file seen written (``IN_MODIFY``) and not closed
    since (``IN_CLOSE_WRITE``) waits longer (:data:`OPEN_WRITER_FACTOR`); a close ends nothing
    by itself, as a recorder may open and close its file many times. ``wake`` (the service's
    wake-up socket) is sent one byte whenever something is ready or a watch's state changed.
    """

    def __init__(self, watches: list[WatchSettings], known: dict[str, tuple[int, int, str]], wake: socket.socket):
        self.known = dict(known)
        self._wake_service = wake
        self._lock = threading.Lock()
        self._events: list[tuple[int, str, str, str]] = []
        self._ready: deque[Ready] = deque()
        self._changed = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._candidates: dict[str, _Candidate] = {}
        self._skipped: set[str] = set()  # paths logged as not taken (_skip_once)
        self._watchdog_died: str | None = None  # set by the thread exception hook (start)
        self._thread = threading.Thread(target=self._run, name="edge-queue-watch", daemon=True)
        self._overflow = _OverflowHandler(self)
        self.states: list[_State] = []
        for w in watches:
            root = os.path.realpath(w.path)
            fs_type = file_system_type(root)
            mode = w.mode if w.mode != "auto" else ("poll" if is_network_fs(fs_type) else "events")
            self.states.append(_State(cfg=w, root=root, mode=mode, fs_type=fs_type))

    # -- the service's side ---------------------------------------------------------------

    def start(self) -> None:
        logging.getLogger(OVERFLOW_LOGGER).addHandler(self._overflow)
        previous = threading.excepthook

        def hook(args: Any) -> None:  # a thread of watchdog died: its watches see nothing more
            previous(args)
            if args.thread is not None and type(args.thread).__module__.startswith("watchdog"):
                self._watchdog_died = f"{args.exc_type.__name__} in watchdog's {type(args.thread).__name__}"
                self._wake.set()

        threading.excepthook = hook
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
            self._unschedule(s)

    def _wait_s(self, mono: float) -> float:
        waits = [s.next_check - mono for s in self.states]
        for c in self._candidates.values():
            waits.append(c.since + self._settle_s(c) - mono)
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

    def _set_state(self, s: _State, state: str, error: str | None = None) -> None:
        with self._lock:
            s.state, s.since, s.error = state, time.time(), error
            self._changed = True
        self._notify()

    def _notify(self) -> None:
        try:
            self._wake_service.send(b"\0")
        except OSError:
            pass

    def _check_presence(self, index: int, s: _State) -> None:
        """Notice a folder that went (removed, share unmounted) or came back, or was replaced
        by another folder of the same name (a new inode: inotify watched the old one)."""
        if os.path.realpath(s.cfg.path) != s.root:
            # a symbolic link put in the folder's place (or in a parent's): it may lead out of
            # the media roots, so nothing there is listed, and its target is not logged
            if s.state != "outside":
                self._unschedule(s)
                self._forget_candidates(index)
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
                self._unschedule(s)
                self._forget_candidates(index)
                s.identity = None
                log.warning(
                    "watch folder %s is missing (removed, or its share unmounted); watching for its return",
                    s.cfg.path,
                )
                self._set_state(s, "missing")
            return
        was = s.state
        self._unschedule(s)
        try:
            error = self._schedule(index, s)
        except (FileNotFoundError, NotADirectoryError):
            self._unschedule(s)
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

    def _schedule(self, index: int, s: _State) -> str | None:
        """Start watchdog's observer for ``s``; falls back to polling when inotify cannot
        watch (the ``fs.inotify.max_user_watches`` limit). Returns that fallback's reason."""
        from watchdog.observers import Observer
        from watchdog.observers.polling import PollingObserver

        handler = _Handler(self, index)
        error = None
        if s.mode == "events":
            try:
                observer: Any = Observer()
                observer.schedule(handler, s.root, recursive=s.cfg.recursive)
                observer.start()
                s.observer = observer
                return None
            except (FileNotFoundError, NotADirectoryError):
                raise
            except OSError as e:  # ENOSPC: max_user_watches; EMFILE: max_user_instances
                error = f"inotify: {e}; polling every {s.cfg.poll_interval_s:g} s instead"
                log.error("watch folder %s: %s (raise fs.inotify.max_user_watches)", s.cfg.path, error)
                s.mode = "poll"
        observer = PollingObserver(timeout=s.cfg.poll_interval_s)
        observer.schedule(handler, s.root, recursive=s.cfg.recursive)
        observer.start()
        s.observer = observer
        return error

    @staticmethod
    def _unschedule(s: _State) -> None:
        if s.observer is not None:
            try:
                s.observer.stop()
                s.observer.join(2.0)
            except Exception:  # an observer whose folder went away may fail to stop cleanly
                log.debug("stopping the observer of %s failed", s.cfg.path, exc_info=True)
            s.observer = None

    def _forget_candidates(self, index: int) -> None:
        self._candidates = {p: c for p, c in self._candidates.items() if c.index != index}

    def _on_event(self, index: int, event_type: str, src: str, dest: str) -> None:
        if event_type == "overflow":
            for i, st in enumerate(self.states):
                if st.state == "watching" and st.mode == "events":
                    log.warning("watch folder %s: inotify events were lost; scanning it", st.cfg.path)
                    # a lost close would keep a finished file waiting as if still written
                    st.distrust_until = time.monotonic() + LOST_EVENTS_DISTRUST_S
                    for held in self._candidates.values():
                        if held.index == i:
                            held.writing = False
                    self._scan(i, st.root)
            return
        s = self.states[index]
        if event_type == "deleted":
            self._candidates.pop(src, None)
            if src.rstrip("/") == s.root.rstrip("/"):
                s.next_check = 0.0  # the folder itself: check it now
            return
        if event_type == "moved":
            self._candidates.pop(src, None)
            src, event_type = dest, "created"
        if not src:
            return
        if os.path.isdir(src):
            if event_type == "created" and s.cfg.recursive and in_watch(s.root, s.cfg.recursive, src + "/x"):
                self._scan(index, src)  # a folder moved in brings files no event announced
            return
        self._consider(index, src, time.monotonic(), event=True)
        if (c := self._candidates.get(src)) is not None and s.mode == "events":
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
            self._candidates.pop(path, None)
            return
        if not stat.S_ISREG(st.st_mode):
            if stat.S_ISLNK(st.st_mode):
                self._skip_once(s, path, "a symbolic link (a watch takes the files put in its folder only)")
            return
        if not utf8_name(path):
            self._skip_once(s, path, "its name is not UTF-8, which MQTT topics and JSON cannot carry: rename it")
            return
        known = self.known.get(path)
        old = self._candidates.get(path)
        if old is None and not event and known is not None and known[:2] == (st.st_size, st.st_mtime_ns):
            return  # taken on before, unchanged
        if old is not None and (old.size, old.mtime_ns) == (st.st_size, st.st_mtime_ns) and not event:
            return
        writing = old.writing if old is not None else False
        self._candidates[path] = _Candidate(index, st.st_size, st.st_mtime_ns, mono, writing)

    def _fail(self, s: _State, why: str) -> None:
        """watchdog stopped watching ``s`` (one of its threads died: a folder tree too deep for
        it, say): said in the log and in ``<base>/info``, not silent."""
        log.error(
            "watch folder %s: watching stopped (%s; see the lines above): new files are not taken until "
            "edge-queue restarts",
            s.cfg.path,
            why,
        )
        self._unschedule(s)
        self._set_state(s, "failed", f"the file-system watcher failed: {why}")

    def _skip_once(self, s: _State, path: str, why: str) -> None:
        """Log once per run that ``path`` is not taken, and why."""
        if path in self._skipped:
            return
        if len(self._skipped) >= 10_000:
            self._skipped.clear()
        self._skipped.add(path)
        shown = path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        log.warning("watch %s: %s is not taken: %s", s.cfg.path, shown, why)

    def _settle_s(self, c: _Candidate) -> float:
        """How long ``c`` must stand still: ``settle_s``, longer while a writer holds it open."""
        settle = self.states[c.index].cfg.settle_s
        return max(settle * OPEN_WRITER_FACTOR, OPEN_WRITER_MIN_S) if c.writing else settle

    def _settle(self, mono: float) -> None:
        """Hand over the candidates that stood still for their watch's ``settle_s``."""
        stems = FolderStems()  # each folder listed once per pass, not once per file
        for path, c in list(self._candidates.items()):
            s = self.states[c.index]
            if mono - c.since < self._settle_s(c):
                continue
            try:
                st = os.stat(path)
            except OSError:
                del self._candidates[path]
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
                del self._candidates[path]  # an empty file is not a recording yet: its writes bring it back
                continue
            if (st.st_size, st.st_mtime_ns) != (c.size, c.mtime_ns):
                c.size, c.mtime_ns, c.since = st.st_size, st.st_mtime_ns, mono
                continue
            del self._candidates[path]
            known = self.known.get(path)
            if known is not None and known[:2] == (c.size, c.mtime_ns):
                continue
            try:
                digest = file_digest(path, c.size)
            except OSError as e:
                log.warning("watch %s: cannot read %s: %s", s.cfg.path, path, e)
                continue
            touched = known is not None and known[0] == c.size and known[2] == digest
            self.known[path] = (c.size, c.mtime_ns, digest)
            with self._lock:
                self._ready.append(
                    Ready(c.index, path, c.size, c.mtime_ns, digest, touched, not touched and stems.shares_stem(path))
                )
            self._notify()
