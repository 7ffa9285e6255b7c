"""kvcore_mamba: hybrid Mamba / linear-attention pools (Qwen3-Next's gated DeltaNet, Mamba2), plugin ``mamba``."""

from __future__ import annotations

import importlib

#: public name -> the module that defines it (imported on first use: importing the package stays light,
#: so a test kit can choose interpreted or compiled Triton kernels before any kernel module loads)
_PUBLIC = {
    "MambaPool": "kvcore_mamba.pool",
    "HybridReqToTokenPool": "kvcore_mamba.pool",
    "HybridLinearKVPool": "kvcore_mamba.pool",
    "LinearAttentionDims": "kvcore_mamba.layout",
    "LinearStateParams": "kvcore_mamba.layout",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
