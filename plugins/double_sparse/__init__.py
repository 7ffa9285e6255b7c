"""kvcore_double_sparse: the DoubleSparse pool family (plugin ``double_sparse``): MHA keys and values plus each
token's heavy-channel labels, which DoubleSparse attention reads to pick the tokens worth attending to.

Builds on the base family ``kvcore_mha``: keys, values and labels are stored in one launch by ``RowStore``, the
MHA family's store of per-token rows.
"""

from __future__ import annotations

from kvcore.plugins.lazy import lazy_getattr

_PUBLIC = {"DoubleSparseTokenToKVPool": "kvcore_double_sparse.pool", "DoubleSparseOptions": "kvcore_double_sparse.plugin"}

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC)
