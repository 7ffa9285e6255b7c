"""kvcore_unified: one memory for hybrid models (work in progress, issue 29): a byte range shared by full-attention KV
pages and per-request recurrent state (or sliding-window pages), growing from its two ends, so the split between
them follows the workload instead of a ratio fixed at start-up.

So far :class:`~kvcore_unified.allocator.MultiEndedAllocator`, the bookkeeping of the two ends (virtual ids that stay
valid across compaction, batched envelope moves); the pools over the shared range and the plugin's backend come
next.  Builds on no family yet; it will compose ``kvcore_mha`` / ``kvcore_mla`` and ``kvcore_mamba`` / ``kvcore_swa``
through their public classes.
"""

from __future__ import annotations

from kvcore.plugins.lazy import lazy_getattr

#: public name -> the module that defines it (imported on first use)
_PUBLIC = {"MultiEndedAllocator": "kvcore_unified.allocator", "LOW": "kvcore_unified.allocator",
           "HIGH": "kvcore_unified.allocator"}  # fmt: skip

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC)
