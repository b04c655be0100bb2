"""``get``'s reading of a job's output files: the whole transcript (``text``) and its segments
(``segment_list``), from the files the service's own worker wrote, only while they are still
those files (:mod:`edge_queue.written`), and cut to fit the answer in one MQTT packet.

What cannot be read is said in ``result.output_errors`` (format -> ``{"code", "message"}``):
``output_missing``, ``output_changed`` (a link in its path, not a regular file, another size or
content) or ``output_unrecorded`` (no record of the file being written by this service: a node's
job, or a job of a release before the record).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from edge_queue.errors import ErrorCode
from edge_queue.mqtt import payloads
from edge_queue.written import NotTheFileWritten, read_written

from .ports import QueuePort

#: Bytes of an answer beside its job object: the envelope, a ``transaction``, the topic and
#: the packet's own header (``get`` cuts the text it reads to fit the rest of the packet).
ANSWER_OVERHEAD_BYTES = 8 * 2**10
#: ``get`` with ``segments``: at most this many bytes of segment text are returned.
SEGMENTS_MAX_BYTES = 1 * 2**20
#: A ``json`` output over this many bytes is not parsed (``segment_list`` empty and truncated).
SEGMENTS_READ_MAX_BYTES = 64 * 2**20


def read_outputs(svc: QueuePort, job: dict[str, Any], *, segments: bool) -> dict[str, Any]:
    """``get``'s job object: ``job`` with :func:`with_outputs` in its ``result`` when its text
    was cut or ``segments`` are asked for, within the packet the broker takes
    (``svc.packet_limit``) less the rest of the answer."""
    result = job.get("result")
    if not isinstance(result, dict) or not (result.get("text_truncated") or segments):
        return job
    room = svc.packet_limit() - len(payloads.encode(job)) - ANSWER_OVERHEAD_BYTES
    roots = [*map(str, svc.settings.media_roots), str(svc.settings.outputs_dir)]
    recorded = svc.job_store().output_files(job["job_id"])
    return {**job, "result": with_outputs(result, recorded, roots, segments=segments, room=room)}


def with_outputs(
    result: dict[str, Any], recorded: dict[str, dict[str, Any]], roots: list[str], *, segments: bool, room: int
) -> dict[str, Any]:
    """``result`` (a transcription's) with the whole text when it was cut (``text``,
    ``text_truncated``), with ``segment_list`` and ``segment_list_truncated`` when ``segments``
    (and, for a job that wrote a ``json`` and an ``srt`` or ``vtt``, the latter's cues as
    ``cue_list`` and ``cue_list_truncated``; for one that wrote a ``txt`` and no ``json``, the
    ``txt``'s lines as ``line_list`` and ``line_list_truncated``: :func:`txt_lines`), and
    ``output_errors`` for what could not be read. ``recorded``: the job's files as the store
    recorded them (path -> identity); ``roots``: the media roots and the outputs folder, below
    which no link is followed; ``room``: bytes of JSON the additions may take at most."""
    out, errors = dict(result), dict[str, Any]()
    given = result.get("outputs")
    outputs: dict[str, Any] = given if isinstance(given, dict) else {}
    if segments:
        listed = transcript_segments(outputs, recorded, roots, min(SEGMENTS_MAX_BYTES, room // 2), errors)
        out.update(listed)
        room -= len(orjson.dumps(listed))
        if "json" in outputs:  # the srt and vtt cues are laid out otherwise than the segments
            laid = {f: p for f, p in outputs.items() if f in ("srt", "vtt")}
            cued = transcript_segments(laid, recorded, roots, min(SEGMENTS_MAX_BYTES, max(room, 0) // 2), errors)
            if cued:
                out["cue_list"], out["cue_list_truncated"] = cued["segment_list"], cued["segment_list_truncated"]
                room -= len(orjson.dumps(cued))
        elif "txt" in outputs:  # the segments' text, which the srt and vtt cues do not keep
            lines = txt_lines(outputs["txt"], recorded, roots, min(SEGMENTS_MAX_BYTES, max(room, 0) // 2), errors)
            out.update(lines)
            room -= len(orjson.dumps(lines))
    if result.get("text_truncated"):
        out.update(full_text(outputs.get("txt"), recorded, roots, max(room, 0), errors))
    if errors:
        out["output_errors"] = errors
    return out


def _read(
    fmt: str, path: Any, recorded: dict[str, dict[str, Any]], roots: list[str], max_bytes: int, errors: dict[str, Any]
) -> tuple[bytes, bool] | None:
    """The first ``max_bytes`` of the ``fmt`` output at ``path`` and whether there was more;
    None (the reason in ``errors[fmt]``) when it is not the file the job wrote."""
    if not isinstance(path, str):
        return None
    ident = recorded.get(path)
    if ident is None:
        errors[fmt] = {
            "code": ErrorCode.OUTPUT_UNRECORDED,
            "message": "not read: the service has no record of writing this file",
        }
        return None
    try:
        return read_written(path, ident, roots, max_bytes)
    except NotTheFileWritten as e:
        errors[fmt] = {"code": e.code, "message": f"not read: {e.why}"}
        return None


def full_text(
    path: Any, recorded: dict[str, dict[str, Any]], roots: list[str], room: int, errors: dict[str, Any]
) -> dict[str, Any]:
    """``{"text": ..., "text_truncated": bool}`` from a transcription's ``txt`` output (its lines
    joined by spaces), at most ``room`` bytes of JSON (``text_truncated`` true when cut); ``{}``
    when it cannot be read."""
    read = _read("txt", path, recorded, roots, room, errors)
    if read is None:
        return {}
    raw, more = read
    text = " ".join(line.strip() for line in raw.decode("utf-8", "ignore").splitlines()).strip()
    size = len(orjson.dumps(text))
    while size > room and text:  # escapes make JSON longer than the text: cut in proportion
        more = True
        text = text[: max(0, int(len(text) * room / size) - 16)]
        size = len(orjson.dumps(text))
    return {"text": text, "text_truncated": more}


def txt_lines(
    path: Any, recorded: dict[str, dict[str, Any]], roots: list[str], max_bytes: int, errors: dict[str, Any]
) -> dict[str, Any]:
    """``{"line_list": [...], "line_list_truncated": bool}``: the lines of a transcription's
    ``txt`` output (one a segment, without their ``\n``: each followed by ``\n`` again, they
    give that file byte for byte), at most ``max_bytes`` of JSON, whole lines only; ``{}`` when
    it cannot be read."""
    read = _read("txt", path, recorded, roots, max_bytes, errors)
    if read is None:
        return {}
    raw, more = read
    text = raw.decode("utf-8", "replace") if not more else raw[: raw.rfind(b"\n") + 1].decode("utf-8", "replace")
    lines = text.split("\n")[:-1]  # the file ends with a line's \n
    size = len(orjson.dumps(lines))
    while size > max_bytes and lines:  # escapes make JSON longer than the text
        more = True
        size -= len(orjson.dumps(lines.pop())) + 1
    return {"line_list": lines, "line_list_truncated": more}


def transcript_segments(
    outputs: dict[str, Any],
    recorded: dict[str, dict[str, Any]],
    roots: list[str],
    max_bytes: int,
    errors: dict[str, Any],
) -> dict[str, Any]:
    """``{"segment_list": [{"start", "end", "text"}], "segment_list_truncated": bool}`` from a
    transcription's ``json`` output, else from its ``srt`` or ``vtt`` output (times in seconds,
    to the millisecond the file has), or ``{}`` when it wrote none of them or the file cannot be
    read. At most ``max_bytes`` of JSON (and at least one segment when it fits)."""
    fmt = next((f for f in ("json", "srt", "vtt") if f in outputs), "")
    read = _read(fmt, outputs[fmt], recorded, roots, SEGMENTS_READ_MAX_BYTES, errors) if fmt else None
    if read is None:
        return {}
    raw, more = read
    if more:
        return {"segment_list": [], "segment_list_truncated": True}
    try:
        segments = (orjson.loads(raw).get("segments") or []) if fmt == "json" else cues(raw.decode("utf-8"), fmt)
    except (ValueError, AttributeError):
        return {}
    out: list[dict[str, Any]] = []
    size = 64
    for s in segments if isinstance(segments, list) else []:
        if not isinstance(s, dict):
            break
        item = {"start": s.get("start"), "end": s.get("end"), "text": str(s.get("text", "")).strip()}
        size += len(orjson.dumps(item)) + 1
        if size > max_bytes:
            break
        out.append(item)
    return {"segment_list": out, "segment_list_truncated": len(out) < len(segments)}


_TIME = r"(\d{2,}):(\d\d):(\d\d)[,.](\d{3})"
_CUE = re.compile(rf"(?:(\d+)\n)?{_TIME} --> {_TIME}\n")


def cues(text: str, fmt: str) -> list[dict[str, Any]]:
    """The segments of a transcription's own ``srt`` or ``vtt`` output (kinds/transcribe.py,
    ``render``: cues joined by a blank line, an srt cue numbered from 1, a vtt file headed
    ``WEBVTT``), so that rendering them again gives the same bytes. Raises ValueError for a
    file that is not one."""
    at = 0
    if fmt == "vtt":
        if not text.startswith("WEBVTT\n\n"):
            raise ValueError("not a vtt output")
        at = len("WEBVTT\n\n")
    found: list[tuple[int, int, float, float]] = []  # header start, header end, start, end
    for m in _CUE.finditer(text, at):
        numbered = m.group(1) is not None
        if numbered != (fmt == "srt") or (numbered and int(m.group(1)) != len(found) + 1):
            continue  # cue text that looks like a header
        if (m.start() != at) if not found else (text[m.start() - 2 : m.start()] != "\n\n"):
            continue  # a cue begins the file, or follows a blank line
        g = [int(x) for x in m.groups()[1:]]
        start, end = ((((h * 60 + mi) * 60 + s) * 1000 + ms) / 1000 for h, mi, s, ms in (g[:4], g[4:]))
        found.append((m.start(), m.end(), start, end))
    if not found and text[at:]:
        raise ValueError(f"no cue in the {fmt} output")
    segments = []
    for i, (_, body, start, end) in enumerate(found):
        stop = found[i + 1][0] - 2 if i + 1 < len(found) else len(text) - 1
        segments.append({"start": start, "end": end, "text": text[body:stop]})
    return segments
