"""kvcore_mla: the MLA pool family (DeepSeek multi-head latent attention), plugin ``mla``, and a *base family*.

A base family is one that other families build on.  What they may use of it is ``__all__``, and nothing else
of its modules; those names are kept stable for them (see "Building on a base family" in
docs/writing-a-backend.md):

- ``MLATokenToKVPool``: the latent-row pool, held as a sub-pool (``kvcore_mamba``'s ``mamba_mla`` full-attention
  layers) or subclassed (``kvcore_dsa``).  A subclass may rely on what the class docstring calls stable (the
  constructor with ``kv_cache_dim`` for a wider row format, ``set_mla_kv_buffer``, ``get_mla_kv_buffer``,
  ``set_kv_buffer``, ``buffers``, ``token_buffers``, the ``kv_cache`` tensor) and on two hooks:
  ``_create_buffers()`` (extend it after ``super()._create_buffers()`` to allocate more buffers) and
  ``_read_into(rows, local, loc, out, dst_dtype)`` (a gather into the caller's ``out``, through the subclass's
  own rows object);
- ``PageMajorMLATokenToKVPool``: the same latent rows page-major (a page of all layers contiguous), optionally
  laid over given memory with virtual pages its owner maps and moves (``memory=``, ``virtual_pages=``,
  ``remap_pages``, ``move_pages``, ``translate_loc``): the full-attention pages of a unified memory;
- ``mla_layout``: the latent buffer of either pool, declared without allocating (``kv_cache_dim``, ``sized_by``
  and ``name`` for a family that widens or renames it, ``page_major`` for the page-major pool's);
- ``MLADims``: the ``model.mla`` section; every backend that reads ``model.mla`` declares it with this class.

Families that build on it: ``dsa``, ``mamba`` (its ``mamba_mla`` backend) and ``fp4`` (its ``fp4_mla`` backend
reads ``model.mla``).
"""

from __future__ import annotations

from kvcore.plugins.lazy import lazy_getattr

#: public name -> the module that defines it (imported on first use: importing the package stays light,
#: so a test kit can choose interpreted or compiled Triton kernels before any kernel module loads)
_PUBLIC = {
    "MLATokenToKVPool": "kvcore_mla.pool",
    "PageMajorMLATokenToKVPool": "kvcore_mla.page_major",
    "MLADims": "kvcore_mla.layout",
    "mla_layout": "kvcore_mla.layout",
}

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC)
