"""A deliberately broken acme backend, ``acme_broken``, for showing that ``kvcore check`` catches what goes wrong
in real backends.  ``kv_cache.options.defect`` picks one defect:

- ``wrong_row``: stores every token one slot further on;
- ``padding``: also writes the first token into the padding page;
- ``layout_bytes``: declares one page fewer than the pool allocates (the padding page forgotten);
- ``overlapping_move``: moves token by token in place, so a move whose sources and targets overlap reads rows it
  has already overwritten;
- ``twice``: its allocator hands the same page to two allocations.

Register it with ``kvcore check acme_broken --plugin broken_acme kv_cache.options.defect=...`` (this directory on
``PYTHONPATH``); it is no entry point, so nothing selects it by accident.
"""

from __future__ import annotations

import attrs
import torch

from kvcore.backend import BackendSpec
from kvcore.config import key
from kvcore.hookspecs import hookimpl
from kvcore_acme import plugin as acme
from kvcore_acme.allocator import AcmePageAllocator
from kvcore_acme.layout import ACME_DTYPES
from kvcore_acme.pool import AcmeKVPool

BACKEND = "acme_broken"
DEFECTS = ("none", "wrong_row", "padding", "layout_bytes", "overlapping_move", "twice")


@attrs.define
class BrokenOptions:
    defect: str = key("none", validator=attrs.validators.in_(DEFECTS), doc="the defect: " + ", ".join(DEFECTS))


class BrokenPool(AcmeKVPool):
    def __init__(self, *args, defect: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.defect = defect

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, *args, **kwargs):
        if self.defect == "wrong_row":
            loc = (loc % self.size) + 1
        super().set_kv_buffer(layer, loc, cache_k, cache_v, *args, **kwargs)
        if self.defect == "padding":
            super().set_kv_buffer(layer, torch.zeros_like(loc[:1]), cache_k[:1], cache_v[:1])

    def move_kv_cache(self, tgt_loc, src_loc):
        if self.defect != "overlapping_move":
            return super().move_kv_cache(tgt_loc, src_loc)
        for rows in self.token_rows().values():
            for t, s in zip(rows.row_of(tgt_loc).tolist(), rows.row_of(src_loc).tolist()):
                rows.rows[:, t] = rows.rows[:, s]


class BrokenAllocator(AcmePageAllocator):
    def alloc(self, need_size):
        out = super().alloc(need_size)
        if out is not None and len(out) >= 2 * self.page_size:  # its second page is its first one again
            out = torch.cat((out[: self.page_size], out[: self.page_size], out[2 * self.page_size :]))
        return out


def layout(request):
    declared = acme.layout(request)
    if request.options.defect != "layout_bytes":
        return declared
    (kv,) = declared.buffers
    return attrs.evolve(declared, buffers=[attrs.evolve(kv, pad_tokens=0)])


def create_pool(request, layout, sizes):
    return BrokenPool(size=sizes["tokens"], head_num=request.head_num, head_dim=request.head_dim,
                      defect=request.options.defect, **request.pool_kwargs())  # fmt: skip


@hookimpl
def kvcore_register_backends():
    return [BackendSpec(name=BACKEND, attention=("mha",), layout=layout, create_pool=create_pool, kv_dtypes=ACME_DTYPES,
                        devices=("cuda", "cpu"), vendors=(acme.VENDOR,), priority=-1, options_schema=BrokenOptions,
                        description="acme with one defect (kv_cache.options.defect), for kvcore check's own tests")]  # fmt: skip


@hookimpl
def kvcore_choose_allocator(backend, request, pool, sizes):
    if backend.name != BACKEND:
        return None
    cls = BrokenAllocator if request.options.defect == "twice" else AcmePageAllocator
    return cls(sizes["tokens"], request.page_size, request.kv_dtype, request.device, kvcache=pool)
