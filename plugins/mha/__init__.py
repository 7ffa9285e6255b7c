"""kvcore_mha: the MHA/GQA pool family (plugin ``mha``), and a *base family*.

A base family is one that other families build on.  What they may use of it is ``__all__``, and nothing else
of its modules; those names are kept stable for them (see "Building on a base family" in
docs/writing-a-backend.md):

- ``MHATokenToKVPool`` (K and V rows per token), ``PageMajorMHATokenToKVPool`` (SGLang's page-major layout: a
  page of all layers contiguous) and ``NoOpMHATokenToKVPool`` (a pool that keeps no rows): the pools a composite
  pool holds as sub-pools (``kvcore_swa``'s full and sliding-window pools, ``kvcore_mamba``'s full-attention
  layers) or accepts as ``full_kv_pool_class``; their constructors, ``buffers()``, ``token_rows()`` and the
  ``KVCache`` methods are what a composite calls;
- ``mha_layout`` / ``page_major_layout``: the buffers of those pools, declared without allocating, with
  ``prefix`` (buffer names) and ``sized_by`` (size group) for a family that declares several sub-pools;
- ``RowStore``: the one-launch store of one, two or three per-token buffers of MHA rows (``kvcore_k_only``,
  ``kvcore_double_sparse``); ``KVStore``: the MHA pool's own K/V store, bound to its buffers.

Families that build on it: ``swa``, ``mamba``, ``k_only``, ``double_sparse``, ``minimax_sparse`` (and the example
vendor ``zeta``).
"""

from __future__ import annotations

from kvcore.plugins.lazy import lazy_getattr

#: public name -> the module that defines it (imported on first use: importing the package stays light,
#: so a test kit can choose interpreted or compiled Triton kernels before any kernel module loads)
_PUBLIC = {
    "MHATokenToKVPool": "kvcore_mha.pool",
    "KVStore": "kvcore_mha.kernels",
    "RowStore": "kvcore_mha.row_store",
    "NoOpMHATokenToKVPool": "kvcore_mha.noop",
    "PageMajorMHATokenToKVPool": "kvcore_mha.page_major",
    "mha_layout": "kvcore_mha.layout",
    "page_major_layout": "kvcore_mha.layout",
}

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC)
