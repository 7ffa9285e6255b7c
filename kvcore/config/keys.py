"""Every config key described: its dotted path, type, default and meaning, from the schema's own field docs
(``kvcore config``, docs/configuration.md)."""

from __future__ import annotations


import attrs
from omegaconf import MISSING

from kvcore.config.schema import EngineConfig, engine_schema, type_name


@attrs.frozen
class KeyDoc:
    """One config key, for ``kvcore config``: its dotted path, type, default and meaning."""

    path: str
    type: str
    default: str
    doc: str


def _default_text(field: attrs.Attribute) -> str:
    if isinstance(field.default, attrs.Factory):
        return "{}" if field.default.factory is dict else ""
    if field.default is MISSING:
        return "required"
    return "null" if field.default is None else str(field.default)


def describe_keys(schema: type, prefix: str = "") -> list[KeyDoc]:
    """Every key of an attrs config schema, depth first: nested sections (``model.mla``) are expanded."""
    import typing

    hints = typing.get_type_hints(schema)
    keys: list[KeyDoc] = []
    for field in attrs.fields(schema):
        tp = hints.get(field.name, field.type)
        nested = [a for a in (getattr(tp, "__args__", None) or (tp,)) if isinstance(a, type) and attrs.has(a)]
        path = f"{prefix}{field.name}"
        if nested:
            keys += describe_keys(nested[0], f"{path}.")
        else:
            keys.append(KeyDoc(path, type_name(tp), _default_text(field), field.metadata.get("doc", "")))
    return keys


def all_keys(registry) -> list[KeyDoc]:
    """Every key a config may set with the plugins of ``registry`` (a :class:`~kvcore.plugins.Registry`): the
    core schema, the plugins' model sections, and each backend's ``kv_cache.options`` (the doc names the
    backend)."""
    keys = describe_keys(engine_schema(registry.model_sections))
    for backend in sorted(registry.backends.values(), key=lambda b: b.name):
        if backend.options_schema is not None:
            for k in describe_keys(backend.options_schema, "kv_cache.options."):
                keys.append(attrs.evolve(k, doc=f"backend {backend.name}: {k.doc}"))
    sections = [f.name for f in attrs.fields(EngineConfig)]
    return sorted(keys, key=lambda k: sections.index(k.path.split(".")[0]))  # stable: each section in order


def keys_markdown(keys: list[KeyDoc]) -> str:
    """The keys as the markdown table docs/configuration.md carries (``kvcore config --markdown``)."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    rows += [f"| `{k.path}` | {k.type} | {k.default} | {k.doc} |" for k in keys]
    return "\n".join(rows) + "\n"
