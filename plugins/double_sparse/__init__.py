"""kvcore_double_sparse: the DoubleSparse pool family (plugin ``double_sparse``): MHA keys and values plus each
token's heavy-channel labels, which DoubleSparse attention reads to pick the tokens worth attending to."""

from __future__ import annotations

import importlib

_PUBLIC = {"DoubleSparseTokenToKVPool": "kvcore_double_sparse.pool", "DoubleSparseOptions": "kvcore_double_sparse.plugin"}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
