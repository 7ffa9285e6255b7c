"""kvcore_k_only: keys without values (plugin ``k_only``), for index layers that never read V (MiniMax's sparse
index layers): half the bytes per token of an MHA pool of the same heads.

Builds on the base family ``kvcore_mha``: its keys are stored by ``RowStore``, the MHA family's store of
per-token rows.
"""

from __future__ import annotations

from kvcore.plugins.lazy import lazy_getattr

_PUBLIC = {"MHATokenToKOnlyPool": "kvcore_k_only.pool"}

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC)
