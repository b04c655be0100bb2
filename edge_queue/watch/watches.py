"""One watch folder as the watcher thread keeps it (docs/operations.md, "Watch folders"): its
run-time state (:class:`WatchState`) and its watchdog observer, started on inotify or polling
(:func:`schedule`) and stopped (:func:`unschedule`); watchdog's events handed on to the watcher
(:class:`EventHandler`), and the two ways watchdog can stop telling: the kernel's inotify queue
overflowed (:class:`OverflowHandler`), or one of watchdog's threads died
(:func:`on_watchdog_death`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edge_queue.config.settings import WatchSettings

log = logging.getLogger(__name__)

#: What watchdog logs when the kernel's inotify queue overflowed and events were lost
#: (``watchdog.observers.inotify_c``): the watch folders in ``events`` mode are scanned again.
OVERFLOW_LOGGER = "watchdog.observers.inotify_c"

#: Where a watchdog event goes: ``(watch index, event type, source path, destination path)``;
#: index -1 and type ``overflow`` for inotify's lost events.
Post = Callable[[int, str, str, str], None]


@dataclass(slots=True)
class WatchState:
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


class OverflowHandler(logging.Handler):
    """Hears watchdog's warning that the kernel dropped inotify events, and asks the watcher
    for a scan of its folders (the events lost may have announced new files)."""

    def __init__(self, post: Post) -> None:
        super().__init__(logging.WARNING)
        self.post = post

    def emit(self, record: logging.LogRecord) -> None:
        if "overflow" in record.getMessage():
            self.post(-1, "overflow", "", "")


class EventHandler:
    """watchdog event handler of the watch ``index``: records the event and wakes the watcher
    thread (``post``)."""

    def __init__(self, post: Post, index: int) -> None:
        self.post, self.index = post, index

    def dispatch(self, event: Any) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return
        self.post(self.index, event.event_type, os.fsdecode(event.src_path), os.fsdecode(event.dest_path or b""))


def on_watchdog_death(died: Callable[[str], None]) -> None:
    """Chain a hook to ``threading.excepthook`` that tells ``died`` why, after the hook before
    it ran, when a thread of watchdog dies (its watches see nothing more)."""
    previous = threading.excepthook

    def hook(args: Any) -> None:
        previous(args)
        if args.thread is not None and type(args.thread).__module__.startswith("watchdog"):
            died(f"{args.exc_type.__name__} in watchdog's {type(args.thread).__name__}")

    threading.excepthook = hook


def schedule(s: WatchState, handler: EventHandler) -> str | None:
    """Start watchdog's observer for ``s``; falls back to polling when inotify cannot watch
    (the ``fs.inotify.max_user_watches`` limit). Returns that fallback's reason. Raises
    ``FileNotFoundError`` or ``NotADirectoryError`` when the folder is gone."""
    from watchdog.observers import Observer
    from watchdog.observers.polling import PollingObserver

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


def unschedule(s: WatchState) -> None:
    """Stop ``s``'s observer, if it has one (waiting 2 s at most for its threads)."""
    if s.observer is not None:
        try:
            s.observer.stop()
            s.observer.join(2.0)
        except Exception:  # an observer whose folder went away may fail to stop cleanly
            log.debug("stopping the observer of %s failed", s.cfg.path, exc_info=True)
        s.observer = None
