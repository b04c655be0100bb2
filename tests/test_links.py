"""Every relative link and ``#anchor`` in README.md and docs/*.md resolves, and so does every
section named in words (``docs/topics.md, "Error codes"``) in the docs, unit files, broker and
example configurations and the package's docstrings.

A link names a file of the repository (relative to the Markdown file that holds it) and, after
``#``, a heading of that file (or of the same file for a bare ``#anchor``). Anchors are made by
GitHub's rules: the heading's rendered text (code spans and links give their text, emphasis
marks go), lowercased, every character that is not a letter, digit, space, ``-`` or ``_``
dropped, spaces turned into ``-``, and a heading whose anchor is already taken gets ``-1``,
``-2``... Links inside fenced code blocks and code spans are not links. External links
(``https:``, ``mailto:``...) are not checked: the tests run offline.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target "title"), and images ![alt](target); the target has no spaces or parentheses
# other than balanced ones, as in these docs.
INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
# docs/topics.md, "Error codes" / README, "Install" / docs/operations.md ("Sandbox")
NAMED_SECTION = re.compile(r"((?:[\w./-]+/)?(?:README|[\w-]+\.md)),? \(?\"([^\"]+)\"")
NAMED_IN = [
    *FILES,
    *sorted((ROOT / "systemd").iterdir()),
    *sorted((ROOT / "broker").iterdir()),
    *sorted((ROOT / "config").iterdir()),
    *sorted((ROOT / "edge_queue").rglob("*.py")),
]
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, with their 1-based numbers."""
    out: list[tuple[int, str]] = []
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's Markdown text (without the leading ``#``s)."""
    pieces = []
    for i, piece in enumerate(CODE_SPAN.split(heading)):
        # CODE_SPAN.split gives prose, fence, code, prose...: code is taken as written
        if i % 3 == 2:
            pieces.append(piece.strip())
        elif i % 3 == 0:
            piece = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", piece)  # a link gives its text
            pieces.append(re.sub(r"<[^>]+>", "", piece))  # inline HTML tags give nothing
    text = "".join(pieces).lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w: Unicode letters, digits and _
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file offers: its headings' (numbered when repeated) and
    ``<a name=...>`` / ``<a id=...>``."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        if m := HEADING.match(line):
            base = slug(m.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
        found.update(a.lower() for a in HTML_ANCHOR.findall(line))
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """Every link target of a Markdown file outside code, with its line number."""
    out: list[tuple[int, str]] = []
    for n, line in prose_lines(path.read_text(encoding="utf-8")):
        bare = CODE_SPAN.sub("", line)
        out.extend((n, m.group(2)) for m in INLINE_LINK.finditer(bare))
        if m := REFERENCE_DEF.match(bare):
            out.append((n, m.group(1)))
    return out


def broken(path: Path, target: str) -> str | None:
    """Why ``target``, a link in ``path``, does not resolve; ``None`` when it does."""
    if EXTERNAL.match(target):
        return None
    file_part, _, anchor = target.partition("#")
    dest = path if not file_part else (path.parent / unquote(file_part)).resolve()
    if not dest.exists():
        return f"{file_part} does not exist"
    if file_part and ROOT not in dest.parents:
        return f"{file_part} is outside the repository"
    if anchor:
        if dest.is_dir() or dest.suffix != ".md":
            return f"#{anchor} on {file_part}, which is not a Markdown file"
        if unquote(anchor).lower() not in anchors(dest):
            where = dest.relative_to(ROOT) if ROOT in dest.parents else dest
            return f"{where} has no heading with the anchor #{anchor}"
    return None


def unknown_section(path: Path, name: str, section: str) -> str | None:
    """Why the section ``section`` of the file ``name``, named in words in ``path``, cannot be
    found; ``None`` when a heading of that file reads so (or begins so: ``"[[watch]]"`` for
    ``[[watch]]: watch folders``). ``name`` is relative to ``path``'s folder or to the
    repository; ``README`` is ``README.md``."""
    if not name.endswith(".md"):
        name += ".md"
    dest = next((d for d in (path.parent / name, ROOT / name) if d.is_file()), None)
    if dest is None:
        return f"{name} does not exist"
    words = re.sub(r"\s*\n\s*(?:#:?\s*)?", " ", section)
    # "[kinds.<name>]" names the heading `[kinds.<name>]`: as a code span, <name> is text
    wanted = {slug(words), slug(f"`{words}`")}
    if any(a == w or a.startswith(w + "-") for a in anchors(dest) for w in wanted):
        return None
    where = dest.relative_to(ROOT) if ROOT in dest.parents else dest
    return f"{where} has no section {section!r}"


# -- the rules, on small texts ------------------------------------------------------------


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Run the tests", "run-the-tests"),
        ("`[[watch]]`: watch folders", "watch-watch-folders"),
        ("Permission denied, or read-only file system", "permission-denied-or-read-only-file-system"),
        ("Long jobs: resume", "long-jobs-resume"),
        ("`get` (with `segments`)", "get-with-segments"),
        ("What a *node* can do", "what-a-node-can-do"),
        ("A [link](x.md) here", "a-link-here"),
        ("`<base>/info`", "baseinfo"),
        ("<a name=x></a>Sandbox", "sandbox"),
        ("snake_case_key and 3.1.1", "snake_case_key-and-311"),
    ],
)
def test_slug_follows_githubs_rules(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_repeated_headings_are_numbered(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("# A\n## Notes\n```\n## Notes\n```\n## Notes\n## Notes\n", encoding="utf-8")
    assert anchors(doc) == {"a", "notes", "notes-1", "notes-2"}


def test_a_missing_file_or_anchor_is_found(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("# Here\n", encoding="utf-8")
    assert broken(doc, "#here") is None
    assert broken(doc, "#there") is not None
    assert broken(doc, "nowhere.md") is not None
    assert broken(doc, "https://example.org/#anything") is None


def test_a_section_named_in_words_must_exist(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("# Install\n## `[[watch]]`: watch folders\n## `[kinds.<name>]`: limits\n", encoding="utf-8")
    assert unknown_section(doc, "x.md", "Install") is None
    assert unknown_section(doc, "x.md", "[[watch]]") is None
    assert unknown_section(doc, "x.md", "[kinds.<name>]") is None
    assert unknown_section(doc, "x.md", "Installation") is not None
    assert unknown_section(doc, "y.md", "Install") is not None


def test_links_in_code_are_not_links(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "See [a](a.md#b) and `[c](c.md)`.\n```\n[d](d.md)\n```\n[e]: e.md#f\n",
        encoding="utf-8",
    )
    assert links(doc) == [(1, "a.md#b"), (5, "e.md#f")]


# -- the docs ----------------------------------------------------------------------------


def test_the_docs_have_links() -> None:
    assert sum(len(links(f)) for f in FILES) > 50


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    problems = [
        f"{path.relative_to(ROOT)}:{n}: [{target}] {why}"
        for n, target in links(path)
        if (why := broken(path, target)) is not None
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", NAMED_IN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_section_named_in_words_exists(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    problems = [
        f"{path.relative_to(ROOT)}: {m.group(0)} {why}"
        for m in NAMED_SECTION.finditer(text)
        if (why := unknown_section(path, m.group(1), m.group(2))) is not None
    ]
    assert not problems, "\n".join(problems)
