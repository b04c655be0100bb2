"""The rooms of edge_queue stay small and apart (docs/architecture.md): read from the source
with ``ast``, nothing is imported or run.

- no class over 350 lines and no module over 600 lines;
- no import cycle among edge_queue modules, counting imports inside functions and under
  ``TYPE_CHECKING``;
- no module reaches into another's ``_private`` names; a library's private names are used only
  where :data:`LIBRARY_PRIVATE` lists them (each pinned and checked by
  tests/test_private_names.py);
- every module docs/architecture.md names exists, and every module is named there;
- the rooms are in dependency order: each folder of the package is one room of
  docs/architecture.md, and a module imports only modules of its own room or of rooms after it
  on that page (so no cycle ties two rooms either), and the page's table of which room imports
  which is the one the code has.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "edge_queue"
MAX_CLASS_LINES = 350
MAX_MODULE_LINES = 600

#: module (path under the repository) -> private names of libraries it may use, by name.
#: ``os._exit`` is the standard library's documented way to end a forked child.
LIBRARY_PRIVATE: dict[str, set[str]] = {
    "edge_queue/workers/worker.py": {"_exit"},
    # paho-mqtt's, pinned and listed in PAHO_PRIVATE
    "edge_queue/mqtt/paho_client.py": {"_topic", "_set_as_published", "_sock_recv"},
    # amqtt's, pinned and listed in AMQTT_PRIVATE
    "edge_queue/mqtt/embedded_broker.py": {"_sessions", "_tasks_queue"},
    # the logging HOWTO's documented optimization ("Optimization": set logging._srcfile to None)
    "edge_queue/cli/main.py": {"_srcfile"},
}


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The edge_queue modules ``name`` imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def test_no_test_or_bench_module_is_too_large() -> None:
    """The suite's and the benchmarks' own modules keep the same bound: what several of them
    share lives in ``tests/helpers/`` or a bench module of its own, not in a grown test module."""
    too_large = [
        f"{path.relative_to(ROOT)}: {n} lines (limit {MAX_MODULE_LINES})"
        for folder in (ROOT / "tests", ROOT / "bench")
        for path in sorted(folder.rglob("*.py"))
        # (not the benchmarks' reference venvs, bench/.venv-*: other projects' code)
        if "node_modules" not in path.parts
        and not any(part.startswith(".venv") for part in path.parts)
        and (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert too_large == []


def test_no_class_or_module_is_too_large() -> None:
    too_large = []
    for name, path in modules().items():
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > MAX_MODULE_LINES:
            too_large.append(f"module {name}: {lines} lines (limit {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    too_large.append(f"class {name}.{node.name}: {size} lines (limit {MAX_CLASS_LINES})")
    assert too_large == []


def test_no_import_cycle() -> None:
    mods = modules()
    graph = {name: imports_of(name, path, set(mods)) for name, path in mods.items()}
    # Tarjan's strongly connected components: every component of more than one module is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_cycle_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    # the check would miss the cycles it exists for if it read module-level imports only
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from .b import g\n")
    assert imports_of("edge_queue.a", a, {"edge_queue.a", "edge_queue.b"}) == {"edge_queue.b"}
    a.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n")
    assert imports_of("edge_queue.a", a, {"edge_queue.a", "edge_queue.b"}) == {"edge_queue.b"}


def private_uses(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of each use of a ``_private`` name that is not the module's own:
    ``obj._name`` on anything but ``self``/``cls``/``super()``, and ``from x import _name``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue  # an override calling the library's own version: listed by name below
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom):
            found += [
                (node.lineno, f"from {'.' * node.level}{node.module or ''} import {a.name}")
                for a in node.names
                if a.name[0] == "_"
            ]
    return found


def test_no_module_reaches_into_private_names() -> None:
    reached = []
    for path in modules().values():
        where = str(path.relative_to(ROOT))
        allowed = LIBRARY_PRIVATE.get(where, set())
        for line, text in private_uses(path):
            if re.search(r"\._?\w+$", text) and text.rsplit(".", 1)[-1] in allowed:
                continue
            reached.append(f"{where}:{line}: {text}")
    assert reached == []


def test_the_private_check_sees_what_it_is_for(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("from .store import _row\nx = store._conn\ny = self._own\nz = super()._hook()\n")
    assert [text for _, text in private_uses(f)] == ["from .store import _row", "store._conn"]


def architecture_modules() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return set(re.findall(r"`(edge_queue/[\w/]+\.py)`", text))


@pytest.mark.parametrize("listed", sorted(architecture_modules()))
def test_every_module_docs_architecture_names_exists(listed: str) -> None:
    assert (ROOT / listed).is_file(), f"docs/architecture.md names {listed}, which does not exist"


def test_docs_architecture_names_every_module() -> None:
    named = architecture_modules()
    missing = [str(p.relative_to(ROOT)) for p in modules().values() if str(p.relative_to(ROOT)) not in named]
    assert missing == [], f"docs/architecture.md does not say where these live: {missing}"


def rooms_in_order() -> list[tuple[str, list[str]]]:
    """docs/architecture.md's rooms, in the page's order: ``(heading, [module path, ...])``."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    body = text[text.index("## The rooms") : text.index("\n## ", text.index("## The rooms") + 1)]
    rooms = []
    for section in body.split("\n### ")[1:]:
        heading = section.splitlines()[0]
        rooms.append((heading, re.findall(r"^\| `(edge_queue/[\w/]+\.py)` \|", section, re.M)))
    return rooms


def upward_imports(rooms: list[tuple[str, list[str]]], graph: dict[str, set[str]], paths: dict[str, str]) -> list[str]:
    """``a -> b`` for each import from a module to one in a room before its own."""
    place = {path: i for i, (_, listed) in enumerate(rooms) for path in listed}
    return [
        f"{paths[a]} ({rooms[place[paths[a]]][0]}) -> {paths[b]} ({rooms[place[paths[b]]][0]})"
        for a, targets in sorted(graph.items())
        for b in sorted(targets)
        if place[paths[a]] > place[paths[b]]
    ]


def test_each_folder_is_one_room() -> None:
    rooms = rooms_in_order()
    room_of = {path: heading for heading, listed in rooms for path in listed}
    by_folder: dict[str, set[str]] = {}
    for path in modules().values():
        rel = path.relative_to(ROOT)
        if rel.parent != Path("edge_queue"):
            by_folder.setdefault(str(rel.parent), set()).add(room_of.get(str(rel), "(not named)"))
    assert {folder: headings for folder, headings in by_folder.items() if len(headings) != 1} == {}
    # and every folder's room names it in its heading, so that the page and `ls` say the same
    assert [f for f, (h,) in ((f, tuple(hs)) for f, hs in by_folder.items()) if f"`{f}/`" not in h] == []


def test_rooms_import_only_the_rooms_after_them() -> None:
    mods = modules()
    paths = {name: str(path.relative_to(ROOT)) for name, path in mods.items()}
    graph = {name: imports_of(name, path, set(mods)) for name, path in mods.items()}
    assert upward_imports(rooms_in_order(), graph, paths) == []


def test_the_room_order_check_sees_an_upward_import() -> None:
    rooms = [("Top: `edge_queue/top/`", ["edge_queue/top/a.py"]), ("Low: `edge_queue/low/`", ["edge_queue/low/b.py"])]
    paths = {"edge_queue.top.a": "edge_queue/top/a.py", "edge_queue.low.b": "edge_queue/low/b.py"}
    assert upward_imports(rooms, {"edge_queue.top.a": {"edge_queue.low.b"}, "edge_queue.low.b": set()}, paths) == []
    assert upward_imports(rooms, {"edge_queue.top.a": set(), "edge_queue.low.b": {"edge_queue.top.a"}}, paths) == [
        "edge_queue/low/b.py (Low: `edge_queue/low/`) -> edge_queue/top/a.py (Top: `edge_queue/top/`)"
    ]


def room_label(heading: str) -> str:
    """The name the dependency table gives a room: ``cli/`` for a folder, else its first words."""
    folder = re.search(r"`edge_queue/(\w+)/`", heading)
    return f"{folder[1]}/" if folder else heading.split(":")[0].lower()


def test_the_dependency_table_is_the_code_s() -> None:
    rooms = rooms_in_order()
    label = {path: room_label(heading) for heading, listed in rooms for path in listed}
    mods = modules()
    code: dict[str, set[str]] = {room_label(heading): set() for heading, _ in rooms}
    for name, path in mods.items():
        here = label[str(path.relative_to(ROOT))]
        for target in imports_of(name, path, set(mods)):
            there = label[str(mods[target].relative_to(ROOT))]
            if there != here:
                code[here].add(there)
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("## Dependency direction") : text.index("## One submit")]
    documented: dict[str, set[str]] = {room: set() for room in code}
    for room, imported in re.findall(r"^\| (.+?) \| (.+?) \|$", table, re.M)[1:]:  # after the header
        names = {n.strip().strip("`") for n in re.sub(r"\([^)]*\)", "", imported).split(",")}
        documented[room.strip("`")] = names
    assert documented == code
