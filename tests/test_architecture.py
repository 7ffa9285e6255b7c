"""The core's structure, as docs/architecture.md describes it: few top-level modules, packages by concern each
with a docstring, no import circle among the core's files."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "kvcore"
#: the most modules kvcore's top level may hold (the rest live in packages by concern)
TOP_LEVEL_MAX = 12


def _core_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the core."""
    modules = {}
    for path in sorted(CORE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The core modules ``path`` imports (at any depth of the file: lazy imports count), each resolved to the
    module that defines it (``from kvcore.x import y`` is ``kvcore.x.y`` when that is a module, else
    ``kvcore.x``)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_the_top_level_holds_few_modules():
    top = sorted(p.name for p in CORE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_MAX, f"{len(top)} modules at kvcore/'s top level ({top}): put them in a package"


def test_every_package_of_the_core_says_what_it_owns():
    for init in sorted(CORE.rglob("__init__.py")):
        if init.parent.name == "configs":
            continue
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc and len(doc) > 80, f"{init.relative_to(ROOT)} has no docstring saying what the package owns"


def test_no_import_circle_among_the_core_files():
    modules = _core_modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    # a package's __init__ re-exporting its own modules is not a circle through the package
    seen, stack, on_stack = set(), [], set()

    def visit(node):
        seen.add(node)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt in on_stack:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if nxt not in seen:
                visit(nxt)
        stack.pop()
        on_stack.discard(node)

    for name in sorted(graph):
        if name not in seen:
            visit(name)

