"""README.md's runnable examples: each is a file under examples/ shown verbatim in a README section."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def shown_example(heading: str, example: str) -> str:
    """The README section under ``heading`` (up to the end of the file), after checking that its first python
    block is ``examples/<example>`` verbatim."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index(heading):]
    shown = section[section.index("```python\n") + len("```python\n"):]
    shown = shown[: shown.index("```\n")]
    program = ROOT / "examples" / example
    assert shown == program.read_text(encoding="utf-8"), f"README.md's example differs from examples/{example}"
    return section
