"""Who speaks when, as plain functions over plain data (docs/topics.md, "Speakers"): voice
embeddings of a transcript's segments clustered into speakers, the speakers named
``SPEAKER_00``, ``SPEAKER_01``, ... in order of first appearance, given to segments and words,
and a segment two speakers share cut at the word where the speaker changes.

Clustering is agglomerative with average linkage on cosine distance (the linkage pyannote's
and most diarization pipelines' clustering uses), stopped at :data:`THRESHOLD`, then held
within ``min_speakers``..``max_speakers``. Only segments of at least :data:`ANCHOR_S` are
clustered (a shorter one's embedding is mostly padding); the others, and each window of a
long segment, take the speaker whose centroid is nearest; a speaker the clustering found is
never lost to that (:func:`kept_clusters`), so the bounds hold for the speakers reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Average cosine distance above which two groups of segments are two voices. Resemblyzer's
#: embeddings of one voice are 0.83-0.92 apart in cosine similarity, of JFK and the LibriVox
#: reader 0.47-0.58 (the shared clips, whole); docs/benchmarks.md, "Speakers".
THRESHOLD = 0.3
#: Segments shorter than this (s) are not clustered; they take the nearest speaker.
ANCHOR_S = 1.0
#: A run of words spoken in less than this (s) inside a segment takes the speaker of the
#: longer run beside it.
MIN_TURN_S = 1.0


@dataclass(frozen=True)
class Voice:
    """One segment's voice: its embedding (L2-normalized, shape (d,)), its duration (s), and
    its windows' embeddings (n, d) with each window's ``(start, end)`` in the recording (s)."""

    embedding: Any
    duration_s: float
    windows: Any
    spans: list[tuple[float, float]]


def clusters(
    embeddings: Any, threshold: float = THRESHOLD, min_speakers: int = 1, max_speakers: int | None = None
) -> list[int]:
    """A cluster index for each row of ``embeddings`` (n, d), L2-normalized: average-linkage
    agglomeration on cosine distance while the closest two clusters are within ``threshold``,
    and on past it while there are more than ``max_speakers``; never below ``min_speakers``
    (nor below 1). Indices are 0.. in no particular order. O(n²) memory and O(n²) a merge."""
    import numpy as np

    n = embeddings.shape[0]
    if n == 0:
        return []
    dist = 1.0 - embeddings @ embeddings.T
    np.fill_diagonal(dist, np.inf)
    size = np.ones(n)
    alive = np.ones(n, dtype=bool)
    members: list[list[int]] = [[i] for i in range(n)]
    count = n
    floor = max(1, min_speakers)
    while count > floor:
        flat = int(np.argmin(dist))
        a, b = divmod(flat, n)
        if dist[a, b] > threshold and (max_speakers is None or count <= max_speakers):
            break
        # Lance-Williams update for average linkage: b folded into a
        merged = (size[a] * dist[a] + size[b] * dist[b]) / (size[a] + size[b])
        dist[a], dist[:, a] = merged, merged
        dist[a, a] = np.inf
        dist[b], dist[:, b] = np.inf, np.inf
        size[a] += size[b]
        alive[b] = False
        members[a] += members[b]
        members[b] = []
        count -= 1
    labels = [0] * n
    for k, i in enumerate(np.flatnonzero(alive)):
        for j in members[i]:
            labels[j] = k
    return labels


def speaker_names(order: list[int]) -> dict[int, str]:
    """``SPEAKER_00``, ``SPEAKER_01``, ... for the cluster indices of ``order`` (labels in the
    recording's order) by their first appearance."""
    names: dict[int, str] = {}
    for label in order:
        if label not in names:
            names[label] = f"SPEAKER_{len(names):02d}"
    return names


def centroids(embeddings: Any, labels: list[int]) -> dict[int, Any]:
    """Each cluster's mean embedding, L2-normalized."""
    import numpy as np

    out = {}
    for label in sorted(set(labels)):
        mean = embeddings[[i for i, x in enumerate(labels) if x == label]].mean(axis=0)
        out[label] = mean / max(float(np.linalg.norm(mean)), 1e-12)
    return out


def nearest(embedding: Any, centres: dict[int, Any]) -> int:
    """The cluster whose centroid is closest in cosine to ``embedding``."""
    return max(centres, key=lambda k: float(embedding @ centres[k]))


def segment_labels(
    voices: list[Voice], min_speakers: int = 1, max_speakers: int | None = None, threshold: float = THRESHOLD
) -> tuple[list[int], dict[int, Any]]:
    """A cluster for each of ``voices`` (one a segment, in the recording's order) and the
    clusters' centroids: segments of at least :data:`ANCHOR_S` clustered (all of them when
    none is that long), the others given the nearest centroid."""
    import numpy as np

    if not voices:
        return [], {}
    anchors = [i for i, v in enumerate(voices) if v.duration_s >= ANCHOR_S] or list(range(len(voices)))
    matrix = np.stack([voices[i].embedding for i in anchors])
    found = clusters(matrix, threshold, min_speakers, max_speakers)
    centres = centroids(matrix, found)
    labels = {i: found[k] for k, i in enumerate(anchors)}
    return [labels[i] if i in labels else nearest(v.embedding, centres) for i, v in enumerate(voices)], centres


def word_labels(words: list[dict[str, Any]], voice: Voice, label: int, centres: dict[int, Any]) -> list[int]:
    """A cluster for each of a segment's ``words`` (``start``, ``end`` in s): the nearest
    centroid of the window whose middle is closest to the word's; with fewer than two windows,
    the segment's ``label``. Runs shorter than :data:`MIN_TURN_S` take the label before them
    (at the start, the one after)."""
    if len(voice.spans) < 2 or len(centres) < 2:
        return [label] * len(words)
    window_labels = [nearest(e, centres) for e in voice.windows]
    middles = [(a + b) / 2 for a, b in voice.spans]
    out = []
    for w in words:
        mid = (float(w["start"]) + float(w["end"])) / 2
        out.append(window_labels[min(range(len(middles)), key=lambda k: abs(middles[k] - mid))])
    return smoothed(words, out)


def smoothed(words: list[dict[str, Any]], labels: list[int]) -> list[int]:
    """``labels`` with each run of words spoken in under :data:`MIN_TURN_S` given the label of
    the longer run beside it, the shortest run first, until no run is that short or one run is
    left."""
    runs: list[list[int]] = []  # [label, first word, last word]
    for i, label in enumerate(labels):
        if runs and runs[-1][0] == label:
            runs[-1][2] = i
        else:
            runs.append([label, i, i])

    def spoken(run: list[int]) -> float:
        return float(words[run[2]]["end"]) - float(words[run[1]]["start"])

    while len(runs) > 1:
        k = min(range(len(runs)), key=lambda j: spoken(runs[j]))
        if spoken(runs[k]) >= MIN_TURN_S:
            break
        beside = [j for j in (k - 1, k + 1) if 0 <= j < len(runs)]
        j = max(beside, key=lambda j: spoken(runs[j]))
        lo, hi = min(j, k), max(j, k)
        runs[lo : hi + 1] = [[runs[j][0], runs[lo][1], runs[hi][2]]]
        for m in (lo, lo - 1):  # a run now beside one of its own label: one run
            if 0 <= m < len(runs) - 1 and runs[m][0] == runs[m + 1][0]:
                runs[m : m + 2] = [[runs[m][0], runs[m][1], runs[m + 1][2]]]
    out = list(labels)
    for label, a, b in runs:
        out[a : b + 1] = [label] * (b - a + 1)
    return out


def labelled(
    segments: list[dict[str, Any]], voices: list[Voice], min_speakers: int = 1, max_speakers: int | None = None
) -> tuple[list[dict[str, Any]], int]:
    """``segments`` (each ``start``, ``end``, ``text``, optional ``words``; one voice each, in
    order) with ``speaker`` on each segment and word, a segment two speakers share cut at the
    word where the speaker changes (its text the words', its tokens left out); and the number
    of speakers found (0 without segments)."""
    labels, centres = segment_labels(voices, min_speakers, max_speakers)
    per_word = kept_clusters(
        labels,
        [word_labels(s.get("words") or [], v, x, centres) for s, v, x in zip(segments, voices, labels, strict=True)],
    )
    pieces: list[tuple[dict[str, Any], int]] = []
    for seg, label, mine in zip(segments, labels, per_word, strict=True):
        pieces.extend(cut(seg, mine) if seg.get("words") else [(seg, label)])
    names = speaker_names([label for _, label in pieces])
    out = []
    for seg, label in pieces:
        named = {**seg, "speaker": names[label]}
        if seg.get("words"):
            named["words"] = [{**w, "speaker": names[label]} for w in seg["words"]]
        out.append(named)
    return out, len(names)


def kept_clusters(labels: list[int], per_word: list[list[int]]) -> list[list[int]]:
    """``per_word`` (each segment's words' clusters) with every cluster of ``labels`` (each
    segment's) still spoken somewhere: the words of each segment of a cluster no word kept
    take their segment's cluster again, until none is left out. The words' relabelling can
    move speakers within and between segments, never take a speaker the clustering found
    away (so ``min_speakers`` holds as it held for the segments)."""
    out = [list(mine) for mine in per_word]
    while True:
        spoken = {x for mine, label in zip(out, labels, strict=True) for x in (mine or [label])}
        lost = set(labels) - spoken
        if not lost:
            return out
        for k, label in enumerate(labels):
            if label in lost:
                out[k] = [label] * len(out[k])


def cut(seg: dict[str, Any], labels: list[int]) -> list[tuple[dict[str, Any], int]]:
    """``seg`` cut before each word whose label differs from the word before it: each piece
    with its words, their text, their times (the first piece keeps the segment's start, the
    last its end), and its label. A segment not cut is returned as it is."""
    words = seg["words"]
    bounds = [0] + [i for i in range(1, len(words)) if labels[i] != labels[i - 1]] + [len(words)]
    if len(bounds) == 2:
        return [(seg, labels[0])]
    out = []
    for k in range(len(bounds) - 1):
        group = words[bounds[k] : bounds[k + 1]]
        piece = {key: v for key, v in seg.items() if key not in ("words", "text", "start", "end", "tokens")}
        piece["start"] = seg["start"] if k == 0 else group[0]["start"]
        piece["end"] = seg["end"] if k == len(bounds) - 2 else group[-1]["end"]
        piece["text"] = "".join(w["word"] for w in group)
        piece["words"] = group
        out.append((piece, labels[bounds[k]]))
    return out
