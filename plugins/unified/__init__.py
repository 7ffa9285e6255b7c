"""kvcore_unified: one memory for hybrid models (``memory.unified=true``, plugin ``unified``): a byte range shared by
full-attention KV pages and per-request recurrent state (or sliding-window pages), growing from its two ends, so
the split between them follows the workload instead of a ratio fixed at start-up.

- :class:`~kvcore_unified.allocator.MultiEndedAllocator`: the bookkeeping of the two ends (virtual ids that stay
  valid across compaction, batched envelope moves); :class:`~kvcore_unified.memory.UnifiedMemory`: the bytes, each
  side's pages, who moves what in them.
- :class:`~kvcore_unified.full_pages.UnifiedPagedAllocator`: SGLang's paged allocator over one side, mapping pages
  in a page-major pool laid over the shared bytes.
- :mod:`kvcore_unified.mamba` (:func:`init_unified_mamba_pools`, SGLang's factory keywords): a hybrid
  linear-attention model, MHA or MLA full-attention pages on the low side and each request's states
  (:class:`~kvcore_unified.states.UnifiedMambaPool`, one envelope per slot) on the high side.
- :mod:`kvcore_unified.swa` (:func:`init_unified_swa_pools`): a hybrid sliding-window model, full pages low and
  window pages high.
- :mod:`kvcore_unified.plugin`: builds them for ``kvcore.build_pools`` / ``kvcore up`` in place of the split pools.

Builds on the base families ``kvcore_mha`` and ``kvcore_mla`` (the page-major pools over given memory, with
virtual pages), ``kvcore_mamba`` (``MambaPool`` with its states laid over the high side, ``HybridLinearKVPool`` with
``full_kv_pool=``, the request table) and ``kvcore_swa`` (``SWAKVPool`` and its allocator over the two sides).
"""

from __future__ import annotations

from kvcore.plugins.lazy import lazy_getattr

#: public name -> the module that defines it (imported on first use)
_PUBLIC = {"MultiEndedAllocator": "kvcore_unified.allocator", "LOW": "kvcore_unified.allocator",
           "HIGH": "kvcore_unified.allocator", "UnifiedMemory": "kvcore_unified.memory",
           "UnifiedPagedAllocator": "kvcore_unified.full_pages", "UnifiedSWAKVPool": "kvcore_unified.swa",
           "UnifiedSWATokenToKVPoolAllocator": "kvcore_unified.swa", "init_unified_swa_pools": "kvcore_unified.swa",
           "kv_page_bytes": "kvcore_unified.full_pages", "latent_page_bytes": "kvcore_unified.full_pages",
           "unified_swa_kv_pool": "kvcore_unified.swa", "UnifiedPoolBundle": "kvcore_unified.bundle",
           "init_unified_mamba_pools": "kvcore_unified.mamba", "UnifiedHybridLinearKVPool": "kvcore_unified.mamba",
           "unified_hybrid_linear_kv_pool": "kvcore_unified.mamba", "UnifiedMambaPool": "kvcore_unified.states",
           "UnifiedHybridReqToTokenPool": "kvcore_unified.states", "state_envelope": "kvcore_unified.states"}  # fmt: skip

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC)
