"""The tests' own layout (docs/architecture.md, "Tests"), read from the source with ``ast``:

- no test module imports another (``tests/test_*.py`` and ``tests/conftest.py``, nor a helper):
  what several test modules share lives in tests/helpers/, counting imports inside functions;
- tests/helpers/ holds no ``test_`` module (pytest would collect it), and every helper module
  that defines a fixture is in tests/conftest.py's ``pytest_plugins``, so that no test module
  imports a fixture by name;
- docs/architecture.md's "Tests" names every helper module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from .conftest import ROOT, pytest_plugins

TESTS = ROOT / "tests"
HELPERS = TESTS / "helpers"


def python_files() -> list[Path]:
    """Every Python file of tests/ (the browser driver's node_modules aside)."""
    return [p for p in sorted(TESTS.rglob("*.py")) if "node_modules" not in p.parts]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_test_module(name: str) -> bool:
    """``tests.test_load``, ``tests.browser.test_x``: a module pytest collects from tests/."""
    parts = name.split(".")
    return parts[0] == "tests" and any(part.startswith("test_") for part in parts[1:])


def imported_test_modules(path: Path, name: str, root: Path = ROOT) -> list[tuple[int, str]]:
    """``(line, module)`` of each test module that the file ``path`` (the module ``name``)
    imports, anywhere in the file: ``from .test_x import y``, ``from . import test_x``,
    ``import tests.test_x``, ``from tests.test_x import y``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module]
            if (root / module.replace(".", "/")).is_dir():  # a package: its names may be modules
                targets += [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        found += [(node.lineno, t) for t in targets if is_test_module(t) and t != name]
    return found


def test_no_test_module_imports_another() -> None:
    imports = [
        f"{path.relative_to(ROOT)}:{line}: imports {module}"
        for path in python_files()
        for line, module in imported_test_modules(path, module_name(path))
    ]
    assert imports == [], "what two test modules share goes to tests/helpers/:\n" + "\n".join(imports)


def test_the_import_check_sees_every_way_of_importing_a_test_module(tmp_path: Path) -> None:
    (tmp_path / "tests" / "helpers").mkdir(parents=True)
    lines = [
        "from .test_load import PrivateMosquitto",
        "from . import test_store",
        "import tests.test_docs",
        "from tests.test_page import Browser",
        "def f():",
        "    from .test_nodes import hub_env",
        "from .helpers.page import Browser",  # a helper: fine
        "from .conftest import ROOT",  # the conftest: fine
        "from .helpers import page",  # fine
        "from .helpers.nodes import test_like_name",  # a name, not a module: fine
    ]
    module = tmp_path / "tests" / "test_a.py"
    module.write_text("\n".join(lines) + "\n")
    assert imported_test_modules(module, "tests.test_a", tmp_path) == [
        (1, "tests.test_load"),
        (2, "tests.test_store"),
        (3, "tests.test_docs"),
        (4, "tests.test_page"),
        (6, "tests.test_nodes"),
    ]
    helper = tmp_path / "tests" / "helpers" / "rig.py"
    helper.write_text("from ..test_load import Rig\n")
    assert imported_test_modules(helper, "tests.helpers.rig", tmp_path) == [(1, "tests.test_load")]


def test_helpers_are_not_collected_and_their_fixtures_are_every_test_s() -> None:
    assert sorted(p.name for p in HELPERS.glob("test_*.py")) == []
    with_fixtures = {
        module_name(path)
        for path in sorted(HELPERS.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and any("fixture" in ast.unparse(d) for d in node.decorator_list)
    }
    assert with_fixtures - set(pytest_plugins) == set(), "tests/conftest.py's pytest_plugins misses these"


def test_docs_architecture_names_every_helper_module() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`(tests/helpers/\w+\.py)`", text[text.index("\n## Tests") :]))
    modules = {str(p.relative_to(ROOT)) for p in HELPERS.glob("*.py") if p.name != "__init__.py"}
    assert (sorted(modules - named), sorted(named - modules)) == ([], []), "not named there, named but gone"
