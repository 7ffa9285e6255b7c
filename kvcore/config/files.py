"""Where config files are: the config groups (``model``, ``hardware``), the configs shipped with kvcore, and the
file a group option names.  Reads the file system only (no torch, no schema), so the ``kvcore`` command lists the
shipped models and hardware in its help without importing torch."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from kvcore.errors import ConfigError


GROUPS = ("model", "hardware")


def packaged_configs() -> Path:
    """The configs directory shipped with kvcore."""
    return Path(str(resources.files("kvcore.configs")))


def group_dirs(group: str, engine_file: Path) -> list[Path]:
    dirs = [engine_file.parent / group, packaged_configs() / group]
    unique: list[Path] = []
    for d in dirs:
        if d not in unique:
            unique.append(d)
    return unique


def available_options(group: str, engine_file: Path | None = None) -> list[str]:
    """Option names of a config group (``model`` or ``hardware``)."""
    engine_file = engine_file or packaged_configs() / "engine.yaml"
    names = {p.stem for d in group_dirs(group, engine_file) if d.is_dir() for p in d.glob("*.yaml")}
    return sorted(names)


def group_file(group: str, option: str, engine_file: Path) -> Path:
    candidate = Path(option)
    if candidate.suffix in (".yaml", ".yml"):
        for path in (candidate, engine_file.parent / candidate):
            if path.is_file():
                return path
    for d in group_dirs(group, engine_file):
        path = d / f"{option}.yaml"
        if path.is_file():
            return path
    raise ConfigError(
        f"{group}={option!r} is not a known {group} config; "
        f"valid options: {', '.join(available_options(group, engine_file))} (or a path to a .yaml file)"
    )
