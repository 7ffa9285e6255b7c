"""The core's structure, as docs/architecture.md describes it: few top-level modules, packages by concern each
with a docstring, no import circle among the core's files, no family imported by the core, families built on the
declared bases only through their public names, no module too long to read."""

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



def _family_imports(path: Path) -> list[str]:
    """The ``kvcore_*`` packages ``path`` imports, at any depth of the file (lazy imports count), as
    ``"line N: name"``: ``import kvcore_x``, ``from kvcore_x... import``, and ``importlib.import_module`` /
    ``__import__`` of a constant name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if not node.level else []
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            names = [node.args[0].value] if called in ("import_module", "__import__") else []
        else:
            continue
        found += [f"line {node.lineno}: {n}" for n in names if isinstance(n, str) and n.startswith("kvcore_")]
    return found


def test_the_core_imports_no_family():
    """The core knows no family: no module under kvcore/ imports a ``kvcore_*`` package (the families are plugins,
    reached through the registry and its hooks only)."""
    offending = {
        str(path.relative_to(ROOT)): found for path in sorted(CORE.rglob("*.py")) if (found := _family_imports(path))
    }
    assert not offending, f"core modules import family packages: {offending}"



# -- families: which are bases, and what a family may take from another ------------------------------------------

#: the base families: the only families another family (a plugin under plugins/, or an example vendor under
#: examples/) may import from, and then only names of their ``__all__``.  docs/writing-a-backend.md ("Building
#: on a base family") lists the same, which the second test below checks.
BASES = ("mha", "mla", "mamba", "swa")


def _family_packages() -> dict[str, tuple[Path, Path]]:
    """Every family package (``kvcore_<name>``) -> (its package directory, the directory of all its files):
    plugins/<name>/ for both (its tests are inside), an example vendor's package and its distribution."""
    found = {f"kvcore_{d.name}": (d, d) for d in sorted((ROOT / "plugins").iterdir()) if (d / "__init__.py").exists()}
    for init in sorted((ROOT / "examples").glob("*/kvcore_*/__init__.py")):
        found[init.parent.name] = (init.parent, init.parent.parent)
    return found


def _cross_family_imports(path: Path, package: str, families) -> list[tuple[str, tuple[str, ...] | None, int]]:
    """``(module, names, line)`` of every import in ``path`` (at any depth: lazy imports count) from a family other
    than ``package``; ``names`` is None for ``import module``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            top = node.module.split(".")[0]
            if top in families and top != package:
                found.append((node.module, tuple(alias.name for alias in node.names), node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names
                      if alias.name.split(".")[0] in families and alias.name.split(".")[0] != package]  # fmt: skip
    return found


def _all_cross_family_imports():
    """``(package, file, module, names, line)`` of every import a family makes from another."""
    families = _family_packages()
    return [(package, path, *found) for package, (_, files) in families.items() for path in sorted(files.rglob("*.py"))
            for found in _cross_family_imports(path, package, families)]  # fmt: skip


def test_a_family_imports_from_another_only_a_bases_public_names():
    """Families build on each other only through the bases' ``__all__``: ``from kvcore_mha import X`` (or ``from
    kvcore_mha.pool import X`` where X is the very object ``kvcore_mha`` exports), X in ``kvcore_mha.__all__``."""
    import importlib

    problems = []
    for _, path, module, names, line in _all_cross_family_imports():
        other, where = module.split(".")[0], f"{path.relative_to(ROOT)}:{line}"
        if other.removeprefix("kvcore_") not in BASES:
            problems.append(f"{where} imports from {other}, which is no base family (bases: {', '.join(BASES)})")
            continue
        if names is None:
            problems.append(f"{where}: `import {module}`; import names of {other}.__all__ instead")
            continue
        base = importlib.import_module(other)
        for name in names:
            if name not in base.__all__:
                problems.append(f"{where} imports {name} from {module}; {other}.__all__ does not export it")
            elif module != other and getattr(importlib.import_module(module), name) is not getattr(base, name):
                problems.append(f"{where} imports {name} from {module}, not the {name} that {other} exports")
    assert not problems, "\n".join(problems)


def test_bases_and_what_builds_on_them_are_declared():
    """The guide lists exactly :data:`BASES`; each base's package docstring says it is one, and each family that
    imports from a base names it in its package docstring (a paragraph "Builds on ... ``kvcore_mha``")."""
    import re

    guide = (ROOT / "docs" / "writing-a-backend.md").read_text(encoding="utf-8")
    assert "\n## Building on a base family\n" in guide, "docs/writing-a-backend.md has no 'Building on a base family'"
    section = guide.split("\n## Building on a base family\n", 1)[1].split("\n## ", 1)[0]
    listed = re.search(r"^\*\*Base families:\*\* (.+)$", section, re.M)
    assert listed, "the guide's 'Building on a base family' has no '**Base families:** ...' line"
    assert set(re.findall(r"`kvcore_(\w+)`", listed.group(1))) == set(BASES), listed.group(0)
    used: dict[str, set[str]] = {}
    for package, _, module, _, _ in _all_cross_family_imports():
        used.setdefault(package, set()).add(module.split(".")[0])
    for package, (directory, _) in _family_packages().items():
        doc = ast.get_docstring(ast.parse((directory / "__init__.py").read_text(encoding="utf-8"))) or ""
        if package.removeprefix("kvcore_") in BASES:
            assert "base family" in doc, f"{package}'s package docstring does not say it is a base family"
        bases = sorted(used.get(package, ()))
        if bases:
            builds_on = next((p for p in doc.split("\n\n") if p.startswith("Builds on")), "")
            missing = [b for b in bases if f"``{b}``" not in builds_on]
            assert not missing, (f"{package} imports from {bases}; its package docstring needs a paragraph "
                                 f"'Builds on ...' naming {missing}")  # fmt: skip


#: the longest a module of the core or a family may be
MODULE_LINES_MAX = 700


def test_no_module_is_too_long_to_read():
    long = []
    for base in (CORE, ROOT / "plugins"):
        for path in sorted(base.rglob("*.py")):
            if "tests" in path.parts:
                continue
            lines = path.read_text(encoding="utf-8").count("\n")
            if lines > MODULE_LINES_MAX:
                long.append(f"{path.relative_to(ROOT)} ({lines} lines)")
    assert not long, f"modules over {MODULE_LINES_MAX} lines: {', '.join(long)}"


def test_every_package_is_in_the_distribution():
    """Each package under kvcore/ and plugins/ is listed in pyproject.toml's packages, so a wheel (not only an
    editable install) holds it."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    where = {Path(path): name for name, path in setuptools["package-dir"].items()}
    missing = []
    for init in sorted([*CORE.rglob("__init__.py"), *(ROOT / "plugins").rglob("__init__.py")]):
        folder = init.parent.relative_to(ROOT)
        for base, name in where.items():
            if folder == base or base in folder.parents:
                dotted = ".".join([name, *folder.relative_to(base).parts])
                break
        else:
            missing.append(str(folder))
            continue
        if dotted not in listed:
            missing.append(dotted)
    assert not missing, f"packages missing from pyproject.toml's [tool.setuptools] packages: {missing}"
