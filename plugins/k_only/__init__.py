"""kvcore_k_only: keys without values (plugin ``k_only``), for index layers that never read V (MiniMax's sparse
index layers): half the bytes per token of an MHA pool of the same heads."""

from __future__ import annotations

import importlib

_PUBLIC = {"MHATokenToKOnlyPool": "kvcore_k_only.pool"}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
