"""kvcore_mha: the MHA/GQA pool family (plugin ``mha``)."""

from __future__ import annotations

import importlib

#: public name -> the module that defines it (imported on first use: importing the package stays light,
#: so a test kit can choose interpreted or compiled Triton kernels before any kernel module loads)
_PUBLIC = {
    "MHATokenToKVPool": "kvcore_mha.pool",
    "KVStore": "kvcore_mha.kernels",
    "RowStore": "kvcore_mha.row_store",
    "NoOpMHATokenToKVPool": "kvcore_mha.noop",
    "PageMajorMHATokenToKVPool": "kvcore_mha.page_major",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
