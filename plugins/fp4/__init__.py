"""kvcore_fp4: block-scaled low-precision KV caches (block FP4, NVFP4, MXFP8), plugin ``fp4``.

Builds on the base family ``kvcore_mla`` for the model section only: the ``fp4_mla`` backend reads ``model.mla``
(``MLADims``).  Its pools are its own (codes and block scales, not MHA or MLA rows).
"""

from __future__ import annotations

from kvcore.plugins.lazy import lazy_getattr

#: public name -> the module that defines it (imported on first use: importing the package stays light,
#: so a test kit can choose interpreted or compiled Triton kernels before any kernel module loads)
_PUBLIC = {
    "MHATokenToKVPoolFP4": "kvcore_fp4.pool",
    "MLATokenToKVPoolFP4": "kvcore_fp4.pool",
    "RECIPES": "kvcore_fp4.formats",
}

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC)
