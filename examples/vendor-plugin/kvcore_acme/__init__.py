"""kvcore_acme: an example vendor backend for kvcore (vendor ``acme``, backend ``acme``).

What a vendor really changes, and nothing else:

- the buffer layout (:mod:`kvcore_acme.layout`): one buffer per rank, ``[layers, pages, 2, page_size, heads,
  head_dim]``, K and V of a page side by side, as paged-attention kernels like to read them;
- the store kernel for that layout (:mod:`kvcore_acme.kernels`: Triton, with its torch reference);
- the pool (:mod:`kvcore_acme.pool`), a :class:`kvcore.pools.KVCache` that tells kvcore where each token's K
  and V rows live, so that kvcore's own moves, CPU offload and checks work on it unchanged;
- the allocator (:mod:`kvcore_acme.allocator`): most recently freed pages first;
- the registration (:mod:`kvcore_acme.plugin`).

Its tests (``tests/``) are kvcore's conformance kit and nothing else, plus a deliberately broken variant
that ``kvcore check`` must fail.
"""

from kvcore.plugins.lazy import lazy_getattr

#: public name -> the module that defines it: the pool imports Triton, so it is loaded on first use only
_PUBLIC = {"AcmeKVPool": "kvcore_acme.pool", "AcmePageAllocator": "kvcore_acme.allocator"}

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC)
