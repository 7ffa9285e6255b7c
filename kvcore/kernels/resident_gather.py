"""A head gather whose outputs stay between calls: every layer keeps its gathered keys and values, and a step
writes only its new tokens into them.

:class:`~kvcore.kernels.head_gather.HeadGather` hands attention ``[batch, heads, seq, dim]`` keys and values
gathered from the pool on every call: a decode step reads and writes every token of every layer again, as
``DynamicCache``'s ``torch.cat`` does.  :class:`ResidentHeadGather` keeps each layer's gathered rows (its *resident
rows*, ``[batch, heads, room, dim]`` with room for more tokens) and returns views of them; a
:meth:`~ResidentHeadGather.store_and_gather` stores the new tokens in the pool and writes, in the same launch, only
the tokens its rows lack (a decode step: one token a row) into them.  A step's device work no longer grows with the
rows' length.  The price is memory: the rows of every layer, in the output dtype (what ``DynamicCache`` holds), on
top of the pool.
"""

from __future__ import annotations

import torch

from kvcore.kernels.head_gather import HeadGather, _checked_length, _repeat_if, _store_geometry, room_for
from kvcore.kernels.head_rows import store_and_gather_native
from kvcore.kernels.launch import UNPLANNED, launch_hooks_installed, remember
from kvcore.kernels.tensor_guard import layout_guard

__all__ = ["ResidentHeadGather"]


class _Rows:
    """Every layer's resident rows: ``k`` / ``v`` ``[layers, batch, heads, room, dim]`` of the output dtype,
    ``valid[layer]`` the tokens of each row of ``layer`` that hold what the pool holds at the locations ``source``
    (the locations' address, row stride and dtype) names, the per-layer addresses the kernel writes; ``seen``: the
    length of the views last made, and every layer's views of it (see :meth:`all_views`)."""

    __slots__ = ("k", "v", "batch", "room", "valid", "source", "addresses", "seen")

    def __init__(self, template: torch.Tensor, layers: int, batch: int, heads: int, dk: int, dv: int, room: int,
                 source: tuple):  # fmt: skip
        self.k = template.new_empty((layers, batch, heads, room, dk))
        self.v = template.new_empty((layers, batch, heads, room, dv))
        self.batch, self.room, self.source = batch, room, source
        self.valid = [0] * layers
        k_step, v_step = self.k[0].nbytes, self.v[0].nbytes  # (a layer's rows, in bytes)
        k0, v0 = self.k.data_ptr(), self.v.data_ptr()
        self.addresses = [(k0 + layer * k_step, v0 + layer * v_step) for layer in range(layers)]
        self.seen: tuple | None = None

    def all_views(self, seq: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Every layer's first ``seq`` tokens a row: the layers' keys and their values, ``[batch, heads, seq, dim]``
        views, made in two calls for all the layers (a decode step's first layer makes them for its later ones) and
        kept until another length is asked for."""
        seen = self.seen
        if seen is None or seen[0] != seq:
            seen = self.seen = (seq, self.k.narrow(3, 0, seq).unbind(0), self.v.narrow(3, 0, seq).unbind(0))
        return seen[1], seen[2]

    def views(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s first ``seq`` tokens a row: two ``[batch, heads, seq, dim]`` views."""
        k, v = self.all_views(seq)
        return k[layer], v[layer]


class _Bound:
    """A direct launch of :class:`ResidentHeadGather`'s, bound once for the calls like it: the same locations object
    (and address), the same resident rows, new rows of the same layout (one guard call) and address alignment, a
    layer whose pool and rows have the alignment of the plan's (``targets[layer]``: its pool's and rows' addresses,
    else None).  A forward's first layer launches through it and gets the repeat for the later ones."""

    __slots__ = ("gather", "plan", "run", "head", "locs", "lp", "row_stride", "rows", "targets", "guard",
                 "new_align")  # fmt: skip

    def __init__(self, gather: ResidentHeadGather, plan, locs: torch.Tensor, rows: _Rows, targets: list,
                 k_new: torch.Tensor, v_new: torch.Tensor):  # fmt: skip
        self.gather, self.plan, (self.run, self.head) = gather, plan, plan.entry
        self.locs, self.lp, self.row_stride = locs, locs.data_ptr(), locs.stride(0)
        self.rows, self.targets = rows, targets
        self.guard = layout_guard(k_new, v_new)
        self.new_align = (k_new.data_ptr() & 15) | (v_new.data_ptr() & 15) << 4

    def takes(self, layer: int, locs: torch.Tensor, rows: _Rows, k_new: torch.Tensor, v_new: torch.Tensor) -> bool:
        """Whether a call of ``layer`` with these locations, rows and new rows launches as this binding's does."""
        return (locs is self.locs and rows is self.rows and self.targets[layer] is not None
                and locs.data_ptr() == self.lp and self.guard(k_new, v_new)
                and (k_new.data_ptr() & 15) | (v_new.data_ptr() & 15) << 4 == self.new_align)  # fmt: skip

    def launch(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, seq: int, q: int, first_block: int):
        """Launch a call this binding takes (rows of ``seq`` tokens, the newest ``q`` stored, token blocks from
        ``first_block`` on written); returns ``repeat(k_new, v_new, layer)``, the same launch for another layer and
        its new rows, which declines what the binding does not take or a layer whose rows lack a token before the
        first block written (None, or as :meth:`~kvcore.kernels.head_gather.HeadGather.follow_layers` says); it
        returns the layer's views."""
        plan, rows, run, head, targets, guard, locs, lp, new_align = (self.plan, self.rows, self.run, self.head,
                                                                      self.targets, self.guard, self.locs, self.lp,
                                                                      self.new_align)  # fmt: skip
        (gx, gy, gz), tail = _store_geometry(plan, rows.batch, seq, q, self.row_stride, rows.room, first_block)
        raw_stream, index = plan.raw_stream, plan.device_index
        run(gx, gy, gz, raw_stream(index), *head, *targets[layer], lp, k_new.data_ptr(), v_new.data_ptr(), *tail)
        valid, gather, first = rows.valid, self.gather, first_block * plan.block_n
        valid[layer] = seq
        k_views, v_views = rows.all_views(seq)
        lengths, otherwise, _ = gather._follow
        before = seq - q

        def repeat(k_new: torch.Tensor, v_new: torch.Tensor, layer: int, *extra, **options):
            if lengths is None or lengths[layer] == before:
                at = targets[layer]
                if (at is not None and gather._rows is rows and valid[layer] >= first and guard(k_new, v_new)
                        and locs.data_ptr() == lp):  # fmt: skip
                    knp, vnp = k_new.data_ptr(), v_new.data_ptr()
                    if (knp & 15) | (vnp & 15) << 4 == new_align:
                        run(gx, gy, gz, raw_stream(index), *head, *at, lp, knp, vnp, *tail)
                        valid[layer] = seq
                        if lengths is not None:
                            lengths[layer] = seq
                        return k_views[layer], v_views[layer]
            return otherwise(k_new, v_new, layer)

        return repeat


class ResidentHeadGather(HeadGather):
    """:class:`~kvcore.kernels.head_gather.HeadGather` whose :meth:`store_and_gather` returns views of the layer's
    resident rows (see the module docstring) and writes into them only the tokens they lack.

    A layer's rows hold, for the locations they were gathered from (the same address, row stride and dtype), what
    the pool held at the last call of that layer: a call stores its ``q`` new tokens and writes tokens
    ``min(held, length - q) .. length - 1`` (from the start of that token block) into the rows.  Locations at
    another address, another batch, or rows longer than their room gather every token again (into new rows, room
    for :func:`~kvcore.kernels.head_gather.room_for` tokens).  The views stay valid until the layer's next call
    writes its rows.  Calls at one length return the same view objects (every layer's are made together): read
    them, do not change their shape or strides in place.

    The caller keeps the rows true: after changing the pool's rows of the held tokens by any other means (a store of
    its own, rows copied or moved, the request table's rows rewritten), it calls :meth:`release`.  Dropping tokens
    from the end of a row (a crop) needs nothing: the next call writes from its new tokens on.

    Takes :class:`~kvcore.kernels.head_gather.HeadGather`'s arguments, but ``reuse_outputs`` (the outputs are the
    resident rows); :meth:`__call__` (a gather without a store) allocates its outputs.
    """

    def __init__(self, k_layers, v_layers, out_dtype: torch.dtype, k_scale: float | None = None,
                 v_scale: float | None = None, *, use_triton: bool):  # fmt: skip
        super().__init__(k_layers, v_layers, out_dtype, k_scale, v_scale, use_triton=use_triton)
        self._rows: _Rows | None = None
        #: ``(locs, length)`` of the last direct launch, which :attr:`repeat` repeats
        self._repeats: tuple | None = None
        self._bound: _Bound | None = None  # the last direct launch's plan, locations, rows and new rows' layout

    #: a copy (``copy.deepcopy``) starts without resident rows, as after :meth:`release`
    not_copied = (*HeadGather.not_copied, "_rows", "_repeats", "_bound")

    def release(self) -> None:
        """Drop the resident rows (their memory goes back to torch's allocator) and the repeat."""
        super().release()
        self._rows = self._repeats = self._bound = None

    def repeat_for(self, locs: torch.Tensor, length: int | None):
        """:attr:`repeat` when it repeats a launch of these locations (the same tensor) and length, else None."""
        return _repeat_if(self.repeat, self._repeats, locs, length)

    def rows_held(self, layer: int) -> int:
        """Tokens of each row layer ``layer``'s resident rows hold (0: none)."""
        return 0 if self._rows is None else self._rows.valid[layer]

    def store_and_gather(self, layer: int, locs: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                         length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """:meth:`HeadGather.store_and_gather <kvcore.kernels.head_gather.HeadGather.store_and_gather>`, bit for bit,
        returning views of layer ``layer``'s resident rows (see the class)."""
        if locs.dim() != 2:
            raise ValueError(f"locs must be [batch, seq], got {tuple(locs.shape)}")
        batch, width = locs.shape
        seq = width if length is None else _checked_length(length, width)
        ks = k_new.shape
        q = ks[2] if len(ks) == 4 else -1
        if not batch or not 0 < q <= seq:  # nothing to store, or refused: HeadGather's path answers or says why
            self.repeat = None
            return super().store_and_gather(layer, locs, k_new, v_new, length)
        rows = self._rows_for(batch, seq, locs)
        first = min(rows.valid[layer], seq - q)
        if not self.use_triton:
            got = store_and_gather_native(self.k_layers[layer], self.v_layers[layer], locs[:, first:seq], k_new, v_new,
                                          self.out_dtype, self.k_scale, self.v_scale)  # fmt: skip
            rows.k[layer, :, :, first:seq] = got[0]
            rows.v[layer, :, :, first:seq] = got[1]
            rows.valid[layer] = seq
            return rows.views(layer, seq)
        bound = self._bound
        if bound is None or not bound.takes(layer, locs, rows, k_new, v_new):
            bound = self._bind(layer, locs, rows, batch, seq, k_new, v_new)
        first_block = first // self._block_t
        if bound is not None and not launch_hooks_installed():  # the plan's direct launch, inlined
            self.repeat = bound.launch(layer, k_new, v_new, seq, q, first_block)
            self._repeats = (locs, length)
            return rows.views(layer, seq)
        plan = self._plan_of(layer, locs, rows, batch, seq, k_new, v_new)
        (kp, vp), (ko, vo) = self._addresses[layer], rows.addresses[layer]
        k, v = self._kernel_layers[layer]
        k_out, v_out = rows.k[layer], rows.v[layer]
        tail = (seq, seq - q, locs.stride(0), rows.room, first_block)
        plan(seq - first_block * plan.block_n, (kp, vp, ko, vo, locs.data_ptr(), k_new.data_ptr(), v_new.data_ptr(),
                                                *tail), lambda: (k, v, k_out, v_out, locs, k_new, v_new))  # fmt: skip
        rows.valid[layer] = seq
        self.repeat = None
        return rows.views(layer, seq)

    def _plan_of(self, layer: int, locs: torch.Tensor, rows: _Rows, batch: int, seq: int, k_new: torch.Tensor,
                 v_new: torch.Tensor):  # fmt: skip
        """The store-and-gather plan of a call (the full checks on a signature's first call)."""
        ko, vo = rows.addresses[layer]
        lp, knp, vnp = locs.data_ptr(), k_new.data_ptr(), v_new.data_ptr()
        aligned = self._aligned[layer]
        signature = (locs.dtype, locs.stride(1), locs.get_device(), batch, k_new.shape, k_new.stride(), k_new.dtype,
                     k_new.get_device(), v_new.shape, v_new.stride(), v_new.dtype, v_new.get_device(),
                     (lp & 15) | (ko & 15) << 4 | (vo & 15) << 8 | (knp & 15) << 12 | (vnp & 15) << 16,
                     aligned)  # fmt: skip
        plan = self._store_plans.get(signature, UNPLANNED)
        if plan is UNPLANNED:
            plan = remember(self._store_plans, signature,
                            self._store_plan(locs, batch, seq, k_new, v_new, rows.k[layer], rows.v[layer], aligned))
        return plan

    def _bind(self, layer: int, locs: torch.Tensor, rows: _Rows, batch: int, seq: int, k_new: torch.Tensor,
              v_new: torch.Tensor) -> _Bound | None:  # fmt: skip
        """A :class:`_Bound` of a call's plan, kept as the binding of calls like it, or None until the plan launches
        directly (its first launch goes through Triton's dispatcher)."""
        plan = self._plan_of(layer, locs, rows, batch, seq, k_new, v_new)
        self._bound = None
        if plan.entry is None:
            return None
        ko, vo = rows.addresses[layer]
        out_align = (ko & 15) | (vo & 15) << 4
        targets = [None if at is None or (rk & 15) | (rv & 15) << 4 != out_align else (*at, rk, rv)
                   for at, (rk, rv) in zip(self._addresses_aligned[self._aligned[layer]], rows.addresses)]  # fmt: skip
        self._bound = bound = _Bound(self, plan, locs, rows, targets, k_new, v_new)
        return bound

    def _rows_for(self, batch: int, seq: int, locs: torch.Tensor) -> _Rows:
        """The resident rows a call of ``batch`` rows of ``seq`` tokens at ``locs`` writes: the ones held, when they
        have the batch and the room (none of their tokens counted held when the locations are others), else new
        ones (the old ones dropped first)."""
        rows = self._rows
        source = (locs.data_ptr(), locs.stride(0), locs.dtype)
        if rows is None or rows.batch != batch or rows.room < seq:
            self._rows = self.repeat = self._repeats = self._bound = rows = None
            rows = self._rows = _Rows(self._template, len(self.k_layers), batch, self.heads, self.dk, self.dv,
                                      room_for(seq), source)  # fmt: skip
        elif rows.source != source:
            rows.valid[:] = [0] * len(rows.valid)  # (in place: a repeat bound to these rows sees it)
            rows.source = source
        return rows
