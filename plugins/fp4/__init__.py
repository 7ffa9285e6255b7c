"""kvcore_fp4: block-scaled low-precision KV caches (block FP4, NVFP4, MXFP8), plugin ``fp4``."""

from __future__ import annotations

import importlib

#: public name -> the module that defines it (imported on first use: importing the package stays light,
#: so a test kit can choose interpreted or compiled Triton kernels before any kernel module loads)
_PUBLIC = {
    "MHATokenToKVPoolFP4": "kvcore_fp4.pool",
    "MLATokenToKVPoolFP4": "kvcore_fp4.pool",
    "RECIPES": "kvcore_fp4.formats",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
