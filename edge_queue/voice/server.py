"""The Wyoming listener (``[wyoming]``): a TCP server on a thread of its own with its own
asyncio loop, speaking the Wyoming protocol (its Event Flow, in the README of OHF-Voice/wyoming) as
Home Assistant's ``wyoming`` integration calls it (``homeassistant/components/wyoming/stt.py``,
``data.py``):

- ``describe`` -> ``info`` (:mod:`.info`, built once at start: answered at once, never waiting
  on the loop);
- ``transcribe`` (``language``) -> ``audio-start`` -> ``audio-chunk``\\* -> ``audio-stop`` ->
  ``transcript`` (``text``, ``language``), or ``error`` (``text``, ``code``: one of
  docs/topics.md, "Error codes").

The audio is written as it arrives to a WAV of its own in ``<data_dir>/voice`` (0700, files
0600), handed to the loop as a job (:class:`~.intake.VoiceIntake`), and deleted once the
command is answered (or its caller is gone). Bounds: ``wyoming.max_connections`` and
``wyoming.connections_per_address``, ``wyoming.max_audio_s`` of audio per command, an event
header of :data:`MAX_LINE_BYTES`, its data of :data:`MAX_DATA_BYTES` and a chunk of
:data:`MAX_PAYLOAD_BYTES`, ``wyoming.idle_timeout_s`` without a byte (answered ``timeout``) or
for an answer the caller does not read (dropped), ``wyoming.wait_s`` for the job. Whatever a
connection provokes ends that connection alone, with an ``error`` event when it can be sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import threading
from collections import Counter
from concurrent.futures import Future
from typing import Any, Protocol

from wyoming.event import Event, async_write_event

from edge_queue.config.settings import Settings
from edge_queue.errors import ErrorCode, RequestError

from .command import Command
from .info import info_event_data
from .mdns import Announcement, announcement

log = logging.getLogger(__name__)

#: Bytes of one event's JSON header line, at most (Home Assistant's are under 200).
MAX_LINE_BYTES = 64 * 1024
#: Bytes of an event's additional data, at most.
MAX_DATA_BYTES = 64 * 1024
#: Bytes of one event's payload (an audio chunk), at most: over 1 s of the largest format a
#: command may send (48-kHz stereo s16, 192,000 bytes; Home Assistant sends chunks of about
#: 10 ms). A connection holds about three times it while it reads one, so 32 connections
#: sending the largest take some 25 MiB, not the 200 MiB that chunks of 2 MiB took.
MAX_PAYLOAD_BYTES = 256 * 1024
#: Seconds the server's thread is given to bind, and to stop.
START_S = STOP_S = 5.0


class CommandGateway(Protocol):
    """The loop's side (:class:`~.intake.VoiceIntake`)."""

    def transcribe(self, wav: Any, language: str | None) -> tuple[Future[dict[str, Any]], Future[dict[str, Any]]]: ...

    def cancel(self, job_id: str) -> None: ...


class VoiceServer:
    """The listener: :meth:`start` binds and serves on a thread; :meth:`stop` ends it."""

    def __init__(self, settings: Settings, gateway: CommandGateway, instance_id: str = "") -> None:
        self.settings, self.cfg, self.gateway = settings, settings.wyoming, gateway
        self.instance_id = instance_id  # the installation's (the store's), in the mDNS name
        self.info = Event("info", info_event_data(settings))
        self.voice_dir = settings.voice_dir
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: asyncio.base_events.Server | None = None
        self.thread: threading.Thread | None = None
        self.port: int | None = None  # the port bound (``wyoming.port``, or the one 0 gave)
        self.announcement: Announcement | None = None  # ``wyoming.zeroconf``'s, once bound
        self.per_address: Counter[str] = Counter()
        self.open = 0
        self.stopping = False
        self._started = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> None:
        """Make ``voice_dir`` (0700) and bind ``wyoming.host:port`` on the server's thread.
        Raises ``OSError`` when the port cannot be bound."""
        self.voice_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.voice_dir, 0o700)  # the service's own, whatever the umask or an earlier mode
        for stale in self.voice_dir.glob("*.wav"):  # of a run that died mid-command
            stale.unlink(missing_ok=True)
        self.thread = threading.Thread(target=self._run, name="wyoming", daemon=True)
        self.thread.start()
        self._started.wait(START_S)
        if self._error is not None:
            raise self._error
        log.info("Wyoming listener on %s:%s (docs/home-assistant.md, Voice)", self.cfg.host, self.port)

    def _run(self) -> None:
        loop = self.loop = asyncio.new_event_loop()
        try:
            self.server = loop.run_until_complete(
                asyncio.start_server(self._serve, self.cfg.host, self.cfg.port, limit=MAX_LINE_BYTES)
            )
            self.port = self.server.sockets[0].getsockname()[1]
        except OSError as e:
            self._error = e
            self._started.set()
            loop.close()
            return
        self.announcement = announcement(self.settings, self.port, self.instance_id)
        if self.announcement is not None:
            loop.create_task(self.announcement.start())
        self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    def stop(self) -> None:
        """Stop listening and close every connection (their commands' callers get nothing
        more; their jobs were let go by the intake's own stop)."""
        loop, self.stopping = self.loop, True
        if loop is None or self.thread is None or loop.is_closed():
            return

        async def _close() -> None:
            if self.server is not None:
                self.server.close()
            if self.announcement is not None:  # withdrawn first: its tasks are on this loop
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.announcement.stop(), STOP_S / 2)
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            # each connection's own end: its socket closed, its command's WAV deleted
            await asyncio.wait(tasks, timeout=STOP_S / 2) if tasks else None
            for _ in range(2):  # the closed transports' own callbacks (call_soon) run: sockets shut
                await asyncio.sleep(0)
            loop.stop()

        with contextlib.suppress(RuntimeError):  # the loop ended already
            asyncio.run_coroutine_threadsafe(_close(), loop)
        self.thread.join(STOP_S)

    # -- one connection -----------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if peer else "?"
        if self.open >= self.cfg.max_connections or self.per_address[address] >= self.cfg.connections_per_address:
            log.info("Wyoming: a connection from %s refused: too many open (wyoming.*connections*)", address)
            busy = _error_event(ErrorCode.BUSY, "too many connections open; try again")
            if await self._send(writer, busy, quiet=True):
                writer.close()
            else:
                writer.transport.abort()
            return
        self.open += 1
        self.per_address[address] += 1
        min_free = self.settings.limits.min_free_disk_mb * 2**20
        command = Command(self.cfg, self.voice_dir, self.gateway, secrets.token_hex(8), min_free)
        stuck = False  # an answer the caller did not read: the connection is dropped, not flushed
        try:
            await self._events(reader, writer, command)
        except TimeoutError:  # (an OSError: before it)
            log.info("Wyoming: %s read no answer for %g s: dropped", address, self.cfg.idle_timeout_s)
            stuck = True
        except (OSError, asyncio.IncompleteReadError):
            pass  # the caller went away
        except _Idle:
            log.info("Wyoming: %s sent nothing for %g s: closed", address, self.cfg.idle_timeout_s)
            stuck = not await self._send(writer, _error_event(ErrorCode.TIMEOUT, _IDLE_TEXT), quiet=True)
        except Exception:  # whatever a hostile stream may provoke, the caller is told and the listener lives
            log.exception("Wyoming: the connection of %s failed", address)
            stuck = not await self._send(writer, _error_event(ErrorCode.INTERNAL_ERROR, "internal error"), quiet=True)
        finally:
            command.discard()
            self.open -= 1
            self.per_address[address] -= 1
            if self.per_address[address] <= 0:
                del self.per_address[address]
            if stuck:
                writer.transport.abort()
            else:
                writer.close()

    async def _send(self, writer: asyncio.StreamWriter, event: Event, *, quiet: bool = False) -> bool:
        """Write ``event``; raises ``TimeoutError`` when the caller has not read it within
        ``wyoming.idle_timeout_s`` (``quiet``: returns False instead, and False when it is gone)."""
        try:
            await asyncio.wait_for(async_write_event(event, writer), self.cfg.idle_timeout_s)
        except (TimeoutError, OSError):
            if not quiet:
                raise
            return False
        return True

    async def _events(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, command: Command) -> None:
        while not self.stopping:
            try:
                event = await asyncio.wait_for(read_event(reader), self.cfg.idle_timeout_s)
            except TimeoutError:
                raise _Idle from None
            except RequestError as e:
                await self._send(writer, _error_event(e.code, e.message))
                return  # the stream cannot be read past a bad event
            if event is None:
                return
            if event.type == "describe":
                await self._send(writer, self.info)
                continue
            try:
                answer = await command.handle(event, reader)
            except RequestError as e:
                command.discard()
                await self._send(writer, _error_event(e.code, e.message))
                continue
            except ConnectionResetError:
                raise  # the caller went away while its command waited
            except OSError as e:  # the command's WAV could not be written
                command.discard()
                code = ErrorCode.DISK_FULL if e.errno == errno.ENOSPC else ErrorCode.INTERNAL_ERROR
                log.warning("Wyoming: a command's audio cannot be written to %s: %s", self.voice_dir, e)
                text = f"the command's audio cannot be written: {e.strerror or e}"
                await self._send(writer, _error_event(code, text))
                continue
            if answer is not None:
                await self._send(writer, answer)


async def read_event(reader: asyncio.StreamReader) -> Event | None:
    """One event (``None`` at the end of the stream), within :data:`MAX_LINE_BYTES`,
    :data:`MAX_DATA_BYTES` and :data:`MAX_PAYLOAD_BYTES`, as ``wyoming.event.async_read_event``
    reads it. Raises :class:`~edge_queue.errors.RequestError` ``payload_too_large`` or
    ``invalid_request`` for what cannot be read."""
    import json

    try:
        line = await reader.readline()
    except (ValueError, asyncio.LimitOverrunError):
        raise RequestError(f"an event header over {MAX_LINE_BYTES} bytes", code=ErrorCode.PAYLOAD_TOO_LARGE) from None
    if not line:
        return None
    try:
        header = json.loads(line)
        kind, data = header["type"], header.get("data") or {}
        data_length, payload_length = _length(header.get("data_length")), _length(header.get("payload_length"))
        if not isinstance(kind, str) or not isinstance(data, dict):
            raise ValueError("type must be a string and data an object")
    except (ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: nesting too deep
        raise RequestError(f"not a Wyoming event: {str(e)[:200]}", code=ErrorCode.INVALID_REQUEST) from None
    if data_length > MAX_DATA_BYTES or payload_length > MAX_PAYLOAD_BYTES:
        raise RequestError(
            f"an event's data or payload over {MAX_DATA_BYTES} or {MAX_PAYLOAD_BYTES} bytes",
            code=ErrorCode.PAYLOAD_TOO_LARGE,
        )
    if data_length:
        try:
            more = json.loads(await reader.readexactly(data_length))
            if not isinstance(more, dict):
                raise ValueError("not an object")
        except (ValueError, RecursionError):
            raise RequestError("an event's data is not a JSON object", code=ErrorCode.INVALID_REQUEST) from None
        data.update(more)
    payload = await reader.readexactly(payload_length) if payload_length else None
    return Event(type=kind, data=data, payload=payload)


def _length(value: Any) -> int:
    """An event's ``data_length`` or ``payload_length``: absent, or a whole number >= 0
    (``1.5``, ``"12"``, ``Infinity`` or ``true`` are not). Raises ``ValueError``."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a length must be a whole number of bytes, not {str(value)[:20]}")
    return value


class _Idle(Exception):
    """The caller sent nothing for ``wyoming.idle_timeout_s``."""


_IDLE_TEXT = "nothing received for wyoming.idle_timeout_s: closed"


def _error_event(code: ErrorCode, text: str) -> Event:
    """Wyoming's ``error`` event (``text``, ``code``: ours, docs/topics.md "Error codes")."""
    return Event("error", {"text": text, "code": str(code)})


def start_voice(settings: Settings, gateway: CommandGateway, instance_id: str = "") -> VoiceServer | None:
    """The listener when ``wyoming.enabled``, started; ``None`` when disabled, or when its
    port cannot be bound (logged as an error: the service runs without it). ``instance_id``:
    the installation's, which makes its mDNS name its own on the LAN."""
    if not settings.wyoming.enabled:
        return None
    server = VoiceServer(settings, gateway, instance_id)
    try:
        server.start()
    except OSError as e:
        log.error("Wyoming listener: cannot listen on %s:%s: %s", settings.wyoming.host, settings.wyoming.port, e)
        return None
    return server
