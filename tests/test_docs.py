"""The docs stay true: the configuration reference is what its generator writes from the schema today, every
relative link in docs/ and README.md points at a file that exists, and `kvcore config --markdown` prints the
same tables' rows."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def generator():
    spec = importlib.util.spec_from_file_location("generate_config_reference", DOCS / "generate_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_current():
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert text == generator().render(), "docs/configuration.md is stale: run python docs/generate_config_reference.py"


def test_configuration_reference_lists_every_builtin_key():
    from kvcore.config import all_keys

    gen = generator()
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    keys = all_keys(gen.builtin_registry())
    assert len(keys) > 50
    for k in keys:
        assert f"| `{k.path}` | {k.type} | {k.default} |" in text
    # the plugins' sections and options are there too
    assert "`model.mla.kv_lora_rank`" in text and "`kv_cache.options.index_dtype`" in text


@pytest.mark.parametrize("page", sorted(p.name for p in [*DOCS.glob("*.md"), ROOT / "README.md"]))
def test_relative_links_resolve(page):
    path = DOCS / page if (DOCS / page).exists() else ROOT / page
    text = path.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (path.parent / target).exists(), f"{page} links to {target}, which does not exist"


def _shown_imports(text: str) -> list[str]:
    """The import statements the Python code blocks of a page show (``import x`` / ``from x import a, b``), of
    kvcore's packages and its example vendors', each as one statement."""
    found, language = [], None
    for line in text.splitlines():
        fence = re.match(r"\s*```(\w*)", line)
        if fence:
            language = None if language is not None else fence.group(1)
            continue
        if language in ("python", "py"):
            statement = line.split("#")[0].strip()
            if re.match(r"(from\s+kvcore[\w.]*\s+import\s+[\w, ]+|import\s+kvcore[\w.]*)$", statement):
                found.append(statement)
    return found


@pytest.mark.parametrize("page", sorted(p.name for p in [*DOCS.glob("*.md"), ROOT / "README.md"]))
def test_every_import_the_docs_show_works(page):
    """Each ``import`` / ``from ... import ...`` of kvcore a page's code shows runs as written (the public paths:
    a name moved inside the core stays importable where the docs say it is)."""
    path = DOCS / page if (DOCS / page).exists() else ROOT / page
    for statement in _shown_imports(path.read_text(encoding="utf-8")):
        exec(compile(statement, f"{page}: {statement}", "exec"), {})  # noqa: S102 - the docs' own lines


def test_the_readme_shows_imports():
    """The check above has something to check: the README's engine example imports kvcore."""
    assert "import kvcore" in _shown_imports((ROOT / "README.md").read_text(encoding="utf-8"))


def test_the_readme_engine_example_is_the_example_file_and_runs(capsys):
    """README.md's "From engine code" shows examples/engine_loop.py verbatim, and the program runs as shown on the
    CPU default, printing what the README says it prints."""
    import runpy

    from readme_examples import shown_example

    section = shown_example("## From engine code", "engine_loop.py")
    runpy.run_path(str(ROOT / "examples" / "engine_loop.py"), run_name="__main__")
    printed = capsys.readouterr().out.strip()
    assert printed and f"`{printed}`" in section, f"the example printed {printed!r}, which the README does not show"


def test_the_readme_engine_file_is_the_example_file_and_kvcore_up_runs_it(capsys):
    """README.md shows examples/engine.yaml verbatim, and `kvcore up` on it plans, allocates and checks the pools
    it describes (a group option named by value: `model: tiny-mla`)."""
    from kvcore import load_config
    from kvcore.tools.cli import main

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    shown = readme[readme.index("```yaml\n# An engine config") + len("```yaml\n"):]
    shown = shown[: shown.index("```\n")]
    engine = ROOT / "examples" / "engine.yaml"
    assert shown == engine.read_text(encoding="utf-8"), "README.md's engine file differs from examples/engine.yaml"
    cfg = load_config(path=engine)
    assert (cfg.model.name, cfg.kv_cache.page_size, cfg.memory.max_total_tokens) == ("tiny-mla", 16, 4096)
    assert main(["up", str(engine)]) == 0
    assert "kvcore up: ready: 4096 tokens, 64 requests, backend mla" in capsys.readouterr().out
