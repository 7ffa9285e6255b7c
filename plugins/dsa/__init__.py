"""kvcore_dsa: the DSA pool family (DeepSeek sparse attention: MLA rows plus an fp8 indexer cache), plugin ``dsa``.

Builds on the base family ``kvcore_mla``: ``DSATokenToKVPool`` subclasses ``MLATokenToKVPool`` (through the
hooks ``kvcore_mla``'s docstring names), its layout extends ``mla_layout``, and the backend reads ``model.mla``
(``MLADims``) besides its own ``model.dsa``.  Two variants of the pool: ``LayerSplitDSATokenToKVPool`` (the layers
sharded over context-parallel ranks, ``parallel.cp_size``) and ``HiSparseDSATokenToKVPool`` with
``HiSparseTokenToKVPoolAllocator`` (every token in pinned host memory, a share of them hot on the device,
``kv_cache.options.host_to_device_ratio``).
"""

from __future__ import annotations

from kvcore.plugins.lazy import lazy_getattr

#: public name -> the module that defines it (imported on first use: importing the package stays light,
#: so a test kit can choose interpreted or compiled Triton kernels before any kernel module loads)
_PUBLIC = {
    "DSATokenToKVPool": "kvcore_dsa.pool",
    "NSATokenToKVPool": "kvcore_dsa.pool",
    "DSADims": "kvcore_dsa.layout",
    "LayerSplitDSATokenToKVPool": "kvcore_dsa.layer_split",
    "HiSparseDSATokenToKVPool": "kvcore_dsa.hisparse",
    "HiSparseTokenToKVPoolAllocator": "kvcore_dsa.hisparse",
}

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC)
