"""One voice command on a Wyoming connection (:class:`Command`): ``transcribe`` ->
``audio-start`` -> ``audio-chunk``\\* -> ``audio-stop``, its audio written to a WAV of its own
as it arrives, then its job's end as a ``transcript``.

Refusals raise :class:`~edge_queue.errors.RequestError` with the code the listener sends in
Wyoming's ``error`` event: ``invalid_request`` (an event out of order, an audio format outside
:data:`RATES`, :data:`WIDTHS` and :data:`CHANNELS`, a chunk of another format than its
``audio-start`` or not a whole number of frames), ``audio_too_long`` (past
``wyoming.max_audio_s``), ``disk_full`` (an ``audio-start`` whose longest audio would leave the
disk less than ``limits.min_free_disk_mb``), a refused submit's code, or a failed job's code. A command refused
during its audio is told once: the rest of that audio, up to its ``audio-stop``, is read and
dropped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
import wave
from concurrent.futures import Future
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from wyoming.event import Event

from edge_queue.config.wyoming import WyomingSettings
from edge_queue.errors import ErrorCode, RequestError

log = logging.getLogger(__name__)

#: The audio formats a command may send: Hz, bytes a sample, channels (Home Assistant sends
#: 16 kHz, 2, 1). At most 48 kHz stereo: ``wyoming.max_audio_s`` of it is a bounded file.
RATES, WIDTHS, CHANNELS = range(8000, 48_001), range(1, 5), range(1, 3)
FORMAT_KEYS = ("rate", "width", "channels")
#: How often a command waiting for its job looks whether its caller is still there (seconds).
CALLER_CHECK_S = 0.1


class Gateway(Protocol):
    def transcribe(self, wav: Any, language: str | None) -> tuple[Future[dict[str, Any]], Future[dict[str, Any]]]: ...

    def cancel(self, job_id: str) -> None: ...


def whisper_language(tag: Any) -> str | None:
    """Whisper's code of a language tag as Home Assistant sends it (``en``, ``en-US``,
    ``pt_BR`` -> ``en``, ``pt``); ``None`` for none."""
    if not isinstance(tag, str) or not tag.strip():
        return None
    return tag.strip().replace("_", "-").split("-")[0].lower()[:8]


class Command:
    """One connection's command, event by event (:meth:`handle`).

    Args:
        cfg: ``[wyoming]``.
        voice_dir: where the audio goes (the service's own, 0700).
        gateway: the loop's side (:class:`~.intake.VoiceIntake`).
        name: the WAV's name, unique to the connection.
        min_free_bytes: the free space the disk keeps (``limits.min_free_disk_mb``): a command
            whose longest audio would go below it is refused at its ``audio-start``.
    """

    def __init__(
        self, cfg: WyomingSettings, voice_dir: Path, gateway: Gateway, name: str, min_free_bytes: int = 0
    ) -> None:
        self.cfg, self.voice_dir, self.gateway, self.name = cfg, voice_dir, gateway, name
        self.min_free_bytes = min_free_bytes
        self.language: str | None = None
        self.wav: wave.Wave_write | None = None
        self.file: BinaryIO | None = None  # the WAV's file (wave closes only the files it opened)
        self.path: Path | None = None
        self.written = 0
        self.limit = 0
        self.refused = False  # refused during its audio: the rest of it is dropped
        self.format: tuple[int, int, int] = (0, 0, 0)  # audio-start's rate, width, channels
        self.count = 0  # commands on this connection

    async def handle(self, event: Event, reader: asyncio.StreamReader) -> Event | None:
        """The answer to ``event`` (``None``: none). Raises :class:`~edge_queue.errors.RequestError`."""
        kind, data = event.type, event.data
        if kind == "transcribe":
            self.discard()
            self.refused = False
            self.language = whisper_language(data.get("language"))
            return None
        if kind == "audio-start":
            self.refused = False
            self._refusing(self._start, data)
            return None
        if kind == "audio-chunk":
            if self.refused:
                return None
            if self.wav is None:
                raise RequestError("audio-chunk before audio-start", code=ErrorCode.INVALID_REQUEST)
            self._refusing(self._write, data, event.payload or b"")
            return None
        if kind == "audio-stop":
            if self.refused:
                self.refused = False
                return None  # the error was sent with the chunk that passed the limit
            if self.wav is None:
                raise RequestError("audio-stop before audio-start", code=ErrorCode.INVALID_REQUEST)
            return await self._answer(reader)
        return None  # an event of another service (wake, tts, ping...): not ours to answer

    def _refusing(self, step: Any, *args: Any) -> None:
        """Run ``step``; when it refuses, the command's audio is discarded and the rest of it,
        up to its ``audio-stop``, dropped (its caller is told once)."""
        try:
            step(*args)
        except RequestError:
            self.discard()
            self.refused = True
            raise

    def _start(self, data: dict[str, Any]) -> None:
        self.discard()
        fmt = _format(data)
        if fmt is None:
            raise RequestError(
                f"audio-start needs rate ({RATES.start}-{RATES.stop - 1} Hz), width ({WIDTHS.start}-"
                f"{WIDTHS.stop - 1} bytes) and channels ({CHANNELS.start}-{CHANNELS.stop - 1})",
                code=ErrorCode.INVALID_REQUEST,
            )
        rate, width, channels = self.format = fmt
        longest = int(self.cfg.max_audio_s * rate) * width * channels
        free = shutil.disk_usage(self.voice_dir).free
        if free - longest < self.min_free_bytes:
            raise RequestError(
                f"{free // 2**20} MiB free where edge-queue keeps {self.min_free_bytes // 2**20} "
                "(limits.min_free_disk_mb): the command is refused",
                code=ErrorCode.DISK_FULL,
            )
        self.count += 1
        self.path = self.voice_dir / f"{self.name}-{self.count}.wav"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self.file = os.fdopen(fd, "wb")
        self.wav = wave.open(self.file, "wb")
        self.wav.setnchannels(channels)
        self.wav.setsampwidth(width)
        self.wav.setframerate(rate)
        self.written, self.limit = 0, longest

    def _write(self, data: dict[str, Any], pcm: bytes) -> None:
        assert self.wav is not None
        rate, width, channels = self.format
        if any(key in data and data[key] != value for key, value in zip(FORMAT_KEYS, self.format, strict=True)):
            raise RequestError(
                f"an audio-chunk of another format than its audio-start ({rate} Hz, {width} bytes, {channels} ch)",
                code=ErrorCode.INVALID_REQUEST,
            )
        if len(pcm) % (width * channels):
            raise RequestError(
                f"an audio-chunk of {len(pcm)} bytes is not whole frames of {width * channels} bytes",
                code=ErrorCode.INVALID_REQUEST,
            )
        self.written += len(pcm)
        if self.written > self.limit:
            raise RequestError(
                f"the command's audio is over {self.cfg.max_audio_s:g} s (wyoming.max_audio_s)",
                code=ErrorCode.AUDIO_TOO_LONG,
            )
        self.wav.writeframesraw(pcm)

    async def _answer(self, reader: asyncio.StreamReader) -> Event:
        assert self.wav is not None and self.path is not None
        self._close()  # the header's sizes written
        try:
            return await self._run(reader)
        finally:
            self.discard()

    async def _run(self, reader: asyncio.StreamReader) -> Event:
        assert self.path is not None
        started = time.monotonic()
        answered, ended = self.gateway.transcribe(self.path, self.language)
        try:
            response = await asyncio.wrap_future(answered)
        except asyncio.CancelledError:
            if answered.cancelled():
                raise RequestError("the service is stopping", code=ErrorCode.STOPPING) from None
            raise
        if response.get("status") != "ok":
            ended.cancel()
            err = response.get("error") or {}
            message = str(err.get("message", "")).replace(f"{self.voice_dir}/", "")  # no path of the box
            raise RequestError(message, code=_code(err.get("code")))
        job_id = response["data"]["jobs"][0]["job_id"]
        job = await self._wait(reader, ended, job_id)
        if job is None:
            raise ConnectionResetError("the caller went away")
        if job.get("state") != "succeeded":
            err = job.get("error") or {}
            raise RequestError(
                f"job {job_id} {job.get('state')}: {err.get('message', '')}", code=_code(err.get("code"))
            )
        result = job.get("result") or {}
        text = str(result.get("text") or "")
        log.info("Wyoming: job %s answered in %.2f s after audio-stop", job_id, time.monotonic() - started)
        data: dict[str, Any] = {"text": text}
        if result.get("language"):
            data["language"] = result["language"]
        return Event("transcript", data)

    async def _wait(
        self, reader: asyncio.StreamReader, ended: Future[dict[str, Any]], job_id: str
    ) -> dict[str, Any] | None:
        """The job's object once it ended; ``None`` when the caller went away first (the job is
        cancelled unless it runs). Raises ``timeout`` after ``wyoming.wait_s``,
        ``stopping`` when the service stops."""
        end = asyncio.wrap_future(ended)
        deadline = time.monotonic() + self.cfg.wait_s
        try:
            while not end.done():
                if reader.at_eof():
                    self.gateway.cancel(job_id)
                    return None
                if time.monotonic() >= deadline:
                    self.gateway.cancel(job_id)
                    raise RequestError(
                        f"job {job_id} did not end within {self.cfg.wait_s:g} s (wyoming.wait_s)",
                        code=ErrorCode.TIMEOUT,
                    )
                await asyncio.wait({end}, timeout=CALLER_CHECK_S)
        finally:
            if not end.done():
                end.cancel()
        if end.cancelled():
            raise RequestError("the service is stopping", code=ErrorCode.STOPPING)
        return end.result()

    def _close(self) -> None:
        """Close the WAV (its header written) and its file. Raises ``OSError``."""
        wav, file, self.wav, self.file = self.wav, self.file, None, None
        try:
            if wav is not None:
                wav.close()
        finally:
            if file is not None:
                file.close()

    def discard(self) -> None:
        """Drop the command's audio: the WAV closed and deleted."""
        try:
            self._close()
        except OSError:
            pass
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None


def _format(data: dict[str, Any]) -> tuple[int, int, int] | None:
    """``audio-start``'s (rate, width, channels) when within :data:`RATES`, :data:`WIDTHS` and
    :data:`CHANNELS` (whole numbers, not ``true``), else ``None``."""
    values: list[int] = []
    for key, allowed in zip(FORMAT_KEYS, (RATES, WIDTHS, CHANNELS), strict=True):
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value not in allowed:
            return None
        values.append(value)
    return values[0], values[1], values[2]


def _code(value: Any) -> ErrorCode:
    try:
        return ErrorCode(str(value))
    except ValueError:
        return ErrorCode.INTERNAL_ERROR
