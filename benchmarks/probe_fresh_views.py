"""Trial caches for ``bench_hf_generate.py`` (issue 31): does attention after kvcore's update run slower because the
update hands it the same two tensors every layer and runs no torch op of its own?

Inside a real step, attention after kvcore's later-layer update has measured slower than after DynamicCache's (the
twentieth session's parts probe; the twenty-seventh's CPU proxy), while the ``null`` bound (an update that makes two
``as_strided`` views and stores nothing) runs at 1.016-1.031 of DynamicCache.  ``null`` differs from kvcore's
``kvnolaunch`` (kvcore's Python without its launches) in two ways: it hands out new tensor objects, made by a torch
op.  These two caches split that:

- ``kvfresh``: kvcore's cache whose later layers (the head gather's repeat) return two new ``as_strided`` views of
  the reused output pair instead of the pair itself: new objects, from a torch op each.
- ``kvwarm``: the same two views made and dropped; the pair itself returned (a torch op each, no new objects handed
  on).

Both are :class:`~kvcore.kernels.head_gather.HeadGather`'s repeat with one line changed (the return); the rest is the
library's closure as of this file's commit, so that the trial adds no Python frame.  Not caches to use: trials only.
"""

from __future__ import annotations

import sys

import torch

from kvcore.integrations.transformers import PagedKVCache
from kvcore.kernels.head_gather import _STORAGE_USES, HeadGather


class _ViewsHeadGather(HeadGather):
    """A head gather whose repeats make two views of the output pair (see the module): ``hand_views`` says whether
    they are returned (``kvfresh``) or dropped (``kvwarm``)."""

    hand_views = True

    def _repeater(self, last: tuple, stream: int):
        spare = self._spare
        (locs, _, lp, _, _, _, out_shape, k_shape, rows_ok, aligned, align, run, grid, raw_stream, index, head, tail,
         _) = last  # fmt: skip
        if not self._reuse or spare is None or spare[2] != out_shape or spare[3] != stream:
            return None
        gx, gy, gz = grid
        _, _, _, _, _, k_at, v_at, k_free, v_free, refs, ko, vo, _ = spare
        new_align = align >> 8
        gather, addresses = self, self._addresses_aligned[aligned]
        count, uses = sys.getrefcount, _STORAGE_USES
        lengths, otherwise = self._follow
        end = out_shape[1]
        before = end - k_shape[2]
        k_size, v_size = tuple(spare[0].shape), tuple(spare[1].shape)
        k_stride, v_stride = spare[0].stride(), spare[1].stride()
        hand = self.hand_views

        def repeat(k_new: torch.Tensor, v_new: torch.Tensor, layer: int, *extra, **options):
            if lengths is None or lengths[layer] == before:
                at = addresses[layer]
                k_out, v_out = spare[0], spare[1]
                if (at is not None and gather._spare is spare and count(k_out) == refs and count(v_out) == refs
                        and uses(k_at) == k_free and uses(v_at) == v_free and rows_ok(k_new, v_new)
                        and locs.data_ptr() == lp):  # fmt: skip
                    on = raw_stream(index)
                    knp, vnp = k_new.data_ptr(), v_new.data_ptr()
                    if on == stream and (knp & 15) | (vnp & 15) << 4 == new_align:
                        run(gx, gy, gz, on, *head, at[0], at[1], ko, vo, lp, knp, vnp, *tail)
                        if lengths is not None:
                            lengths[layer] = end
                        k_view, v_view = k_out.as_strided(k_size, k_stride), v_out.as_strided(v_size, v_stride)
                        if hand:
                            return k_view, v_view
                        return k_out, v_out
            return otherwise(k_new, v_new, layer)

        return repeat


class _DroppedViewsHeadGather(_ViewsHeadGather):
    hand_views = False


class FreshViewsPagedKVCache(PagedKVCache):
    """``kvfresh``: kvcore's cache whose later layers return new views of the reused output pair (see the module)."""

    gather_class = _ViewsHeadGather

    def _gather_for(self, dtype: torch.dtype) -> HeadGather:
        gather = super()._gather_for(dtype)
        if type(gather) is HeadGather:
            gather.__class__ = self.gather_class
        return gather


class WarmViewsPagedKVCache(FreshViewsPagedKVCache):
    """``kvwarm``: the same views made and dropped; the pair itself returned (see the module)."""

    gather_class = _DroppedViewsHeadGather
