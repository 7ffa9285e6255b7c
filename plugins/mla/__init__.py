"""kvcore_mla: the MLA pool family (DeepSeek multi-head latent attention), plugin ``mla``."""

from __future__ import annotations

import importlib

#: public name -> the module that defines it (imported on first use: importing the package stays light,
#: so a test kit can choose interpreted or compiled Triton kernels before any kernel module loads)
_PUBLIC = {
    "MLATokenToKVPool": "kvcore_mla.pool",
    "MLADims": "kvcore_mla.layout",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
