"""kvcore_unified: one memory for hybrid models (work in progress, issue 29): a byte range shared by full-attention KV
pages and per-request recurrent state (or sliding-window pages), growing from its two ends, so the split between
them follows the workload instead of a ratio fixed at start-up.

So far :class:`~kvcore_unified.allocator.MultiEndedAllocator`, the bookkeeping of the two ends (virtual ids that stay
valid across compaction, batched envelope moves); :class:`~kvcore_unified.memory.UnifiedMemory`, the bytes and who
moves what in them; and :class:`~kvcore_unified.full_pages.UnifiedPagedAllocator`, SGLang's paged allocator over the
low end, mapping pages in a ``kvcore_mha`` page-major pool laid over the shared bytes (its public ``memory=`` /
``virtual_pages=`` form).  The state side (``kvcore_mamba``, ``kvcore_swa``), the plugin's backend and ``build_pools``
come next.

Builds on ``kvcore_mha`` through its public classes (the page-major pool over given memory, in the tests and in what
the backend will build).
"""

from __future__ import annotations

from kvcore.plugins.lazy import lazy_getattr

#: public name -> the module that defines it (imported on first use)
_PUBLIC = {"MultiEndedAllocator": "kvcore_unified.allocator", "LOW": "kvcore_unified.allocator",
           "HIGH": "kvcore_unified.allocator", "UnifiedMemory": "kvcore_unified.memory",
           "UnifiedPagedAllocator": "kvcore_unified.full_pages"}  # fmt: skip

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC)
