"""What the Wyoming listener answers to ``describe``: one ``asr`` program, its installed models
and the languages each speaks (its Info events, in the README of OHF-Voice/wyoming), built once at start so that
``describe`` is answered at once whatever the queue does (Home Assistant probes it with a 1-s
timeout: ``homeassistant/components/wyoming/data.py``).

A voice command goes where any ``transcribe`` job goes (:func:`~edge_queue.kinds.languages.routes`):
a language of ``transcribe.language_models`` (by default English, while ``transcribe.model`` is
unset) to its model, the rest to ``transcribe.model`` or the bundled multilingual base.
"""

from __future__ import annotations

from typing import Any

from wyoming.info import AsrModel, AsrProgram, Attribution, Info

from edge_queue import package_version
from edge_queue.config.settings import Settings
from edge_queue.kinds import bundled
from edge_queue.kinds.languages import WHISPER_LANGUAGES, model_languages, routes

#: The program's name as Home Assistant shows it (its Wyoming service's title).
PROGRAM = "edge-queue"
PROGRAM_URL = "https://github.com/edge-queue/edge-queue"
#: Whisper's authors, for every model (all are Whisper's, converted for CTranslate2).
WHISPER = Attribution(name="OpenAI", url="https://github.com/openai/whisper")


def installed_models(settings: Settings) -> dict[str, list[str]]:
    """Model name -> the sorted language codes a voice command goes to it in: the models a
    ``transcribe`` job may use that are installed here (a bundled model whose package is
    missing is left out; a model of the user's, a folder or a name, is taken as installed)."""
    cfg = settings.transcribe
    out: dict[str, set[str]] = {}
    routed = routes(cfg)
    default = cfg.model if cfg.model is not None else bundled.BASE
    if default != bundled.BASE or bundled.base_installed():
        out[bundled.label(default)] = set(_languages(default)) - set(routed)
    for language, ref in routed.items():
        if ref == bundled.TINY_EN and bundled.tiny_en() is None:
            continue
        if ref == bundled.BASE and not bundled.base_installed():
            continue
        out.setdefault(bundled.label(ref), set()).add(language)
    return {name: sorted(langs) for name, langs in out.items() if langs}


def _languages(ref: str) -> frozenset[str]:
    if ref == bundled.BASE:
        return WHISPER_LANGUAGES
    if ref == bundled.TINY_EN:
        return frozenset({"en"})
    return model_languages(ref)


def info_event_data(settings: Settings) -> dict[str, Any]:
    """The ``info`` event's data: one installed ``asr`` program with :func:`installed_models`."""
    version = package_version()
    models = [
        AsrModel(
            name=name,
            attribution=WHISPER,
            installed=True,
            description=f"Whisper {name}",
            version=None,
            languages=languages,
        )
        for name, languages in installed_models(settings).items()
    ]
    program = AsrProgram(
        name=PROGRAM,
        attribution=Attribution(name="edge-queue", url=PROGRAM_URL),
        installed=True,
        description="edge-queue: speech to text as jobs of the queue",
        version=version,
        models=models,
    )
    return Info(asr=[program]).event().data
