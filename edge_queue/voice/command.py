"""One voice command on a Wyoming connection (:class:`Command`): ``transcribe`` ->
``audio-start`` -> ``audio-chunk``\\* -> ``audio-stop``, its audio written to a WAV of its own
as it arrives, then its job's end as a ``transcript``.

Refusals raise :class:`~edge_queue.errors.RequestError` with the code the listener sends in
Wyoming's ``error`` event: ``invalid_request`` (an event out of order, an audio format that is
not PCM), ``audio_too_long`` (past ``wyoming.max_audio_s``; the rest of that audio, up to its
``audio-stop``, is read and dropped), a refused submit's code, or a failed job's code.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import wave
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

from wyoming.event import Event

from edge_queue.config.wyoming import WyomingSettings
from edge_queue.errors import ErrorCode, RequestError

log = logging.getLogger(__name__)

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
    """

    def __init__(self, cfg: WyomingSettings, voice_dir: Path, gateway: Gateway, name: str) -> None:
        self.cfg, self.voice_dir, self.gateway, self.name = cfg, voice_dir, gateway, name
        self.language: str | None = None
        self.wav: wave.Wave_write | None = None
        self.path: Path | None = None
        self.written = 0
        self.limit = 0
        self.refused = False  # over max_audio_s: the rest of the audio is dropped
        self.count = 0  # commands on this connection

    async def handle(self, event: Event, reader: asyncio.StreamReader) -> Event | None:
        """The answer to ``event`` (``None``: none). Raises :class:`~edge_queue.errors.RequestError`."""
        kind, data = event.type, event.data
        if kind == "transcribe":
            self.discard()
            self.language = whisper_language(data.get("language"))
            return None
        if kind == "audio-start":
            self._start(data)
            return None
        if kind == "audio-chunk":
            if self.refused:
                return None
            if self.wav is None:
                raise RequestError("audio-chunk before audio-start", code=ErrorCode.INVALID_REQUEST)
            self._write(event.payload or b"")
            return None
        if kind == "audio-stop":
            if self.refused:
                self.refused = False
                return None  # the error was sent with the chunk that passed the limit
            if self.wav is None:
                raise RequestError("audio-stop before audio-start", code=ErrorCode.INVALID_REQUEST)
            return await self._answer(reader)
        return None  # an event of another service (wake, tts, ping...): not ours to answer

    def _start(self, data: dict[str, Any]) -> None:
        self.discard()
        rate, width, channels = data.get("rate"), data.get("width"), data.get("channels")
        if not (
            isinstance(rate, int)
            and 1000 <= rate <= 192_000
            and width in (1, 2, 3, 4)
            and isinstance(channels, int)
            and 1 <= channels <= 8
        ):
            raise RequestError(
                "audio-start needs rate (1000-192000 Hz), width (1-4 bytes) and channels (1-8)",
                code=ErrorCode.INVALID_REQUEST,
            )
        self.count += 1
        self.path = self.voice_dir / f"{self.name}-{self.count}.wav"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self.wav = wave.open(os.fdopen(fd, "wb"), "wb")
        self.wav.setnchannels(channels)
        self.wav.setsampwidth(int(width))
        self.wav.setframerate(rate)
        self.written, self.limit = 0, int(self.cfg.max_audio_s * rate) * int(width) * channels

    def _write(self, pcm: bytes) -> None:
        assert self.wav is not None
        self.written += len(pcm)
        if self.written > self.limit:
            self.discard()
            self.refused = True
            raise RequestError(
                f"the command's audio is over {self.cfg.max_audio_s:g} s (wyoming.max_audio_s)",
                code=ErrorCode.AUDIO_TOO_LONG,
            )
        self.wav.writeframesraw(pcm)

    async def _answer(self, reader: asyncio.StreamReader) -> Event:
        assert self.wav is not None and self.path is not None
        self.wav.close()  # the header's sizes written
        self.wav = None
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

    def discard(self) -> None:
        """Drop the command's audio: the WAV closed and deleted."""
        if self.wav is not None:
            try:
                self.wav.close()
            except OSError:
                pass
            self.wav = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None


def _code(value: Any) -> ErrorCode:
    try:
        return ErrorCode(str(value))
    except ValueError:
        return ErrorCode.INTERNAL_ERROR
