"""kvcore_minimax_sparse: MiniMax's sparse attention pool (plugin ``minimax_sparse``; SGLang's
``MiniMaxSparseKVPool``): K and V of every layer, and for each sparse layer an index key per token (with an index
value unless the layer's index keeps none).

Builds on the base family ``kvcore_mha``: its main K/V are an ``MHATokenToKVPool`` and its index rows are written by
``RowStore``, declared with ``mha_layout``.
"""

from __future__ import annotations

from kvcore.plugins.lazy import lazy_getattr

#: public name -> the module that defines it (imported on first use)
_PUBLIC = {
    "MiniMaxSparseKVPool": "kvcore_minimax_sparse.pool",
    "MiniMaxSparseDims": "kvcore_minimax_sparse.layout",
}

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC)
