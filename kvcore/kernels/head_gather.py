"""Gathering the keys and values of a batch's tokens into ``[batch, heads, seq, dim]``, in one launch
(:func:`gather_heads`): what an attention implementation that takes dense per-row K/V (transformers' SDPA and
eager attention) reads from a paged cache.

Sources are a layer's K and V rows as a pool hands them out: token rows ``[rows, heads, dim]`` (a token-major
pool's ``get_key_buffer``) or a paged view ``[pages, page_size, heads, dim]`` (a page-major pool's), any strides
with the head dim packed.  ``locs[b, t]`` is the location of token ``t`` of batch row ``b``.  The outputs are
contiguous, in ``out_dtype``: the rows as stored when the dtypes agree, else converted through float32 and, when a
scale is given, multiplied by it (what the torch reference, ``rows.to(float32) * scale`` then ``.to(out_dtype)``,
computes: fp8 widens exactly, float32 -> bf16/fp16 rounds to nearest even on both paths), so the two agree bit for
bit.  One launch replaces an index gather and a ``transpose().contiguous()`` copy per tensor: half the bytes moved
and a quarter of the launches of the torch path.

:meth:`HeadGather.store_and_gather` also writes a step's new keys and values into the layer's rows in the same
launch (converted as a K/V pool's ``set_kv_buffer`` converts them), for callers that may write a pool's rows
themselves (``KVCache.set_kv_buffer_writes_rows``): a transformers layer's step is then one launch.

The kernels are in :mod:`kvcore.kernels.head_gather_kernels`; this module plans and launches them.
"""

from __future__ import annotations

import sys

import torch

from kvcore.kernels import dtypes
from kvcore.kernels.addresses import KeepsAddresses
from kvcore.kernels.dtypes import is_fp8_dtype
from kvcore.kernels.fp8 import torch_e4m3fn_saturates
from kvcore.kernels.head_gather_kernels import GATHER_ARGS, STORE_GATHER_ARGS
from kvcore.kernels.head_rows import gather_heads_native, put_rows, store_and_gather_native, take_rows
from kvcore.kernels.kernel_mode import triton_interpreting
from kvcore.kernels.launch import _RAW_STREAM, UNPLANNED, Plan, cdiv, launch_hooks_installed, launcher_for, remember
from kvcore.kernels.row_move import next_pow2
from kvcore.kernels.tensor_guard import layout_guard

__all__ = ["HeadGather", "gather_heads", "gather_heads_native", "gather_heads_triton", "put_rows", "room_for",
           "store_and_gather_native", "take_rows"]

#: elements a program moves per step of its head loop (tokens x heads x dim); the token block is this over the padded
#: head width times the heads a step moves
_TILE_ELEMS = 4096
_NUM_WARPS = 4
#: heads a program moves per step of its head loop (a power of two; fewer when the layers have fewer): all eight KV
#: heads of a Llama-3-8B-wide layer in one step, so a program's loads of every head are in flight at once
#: (benchmarks/probe_store_gather_device.py --heads: 3-15% less device time than a head a step where the copies bound
#: a step, up to 3.8x less at short rows of an fp8 cache)
_HEADS_PER_TILE = 8

#: how many holders (tensors, views included, and storage objects) a storage has, given its address:
#: ``torch._C._storage_Use_Count`` (None: outputs are never reused)
_STORAGE_USES = getattr(torch._C, "_storage_Use_Count", None)


def _paged(buffer: torch.Tensor) -> tuple[int, int, int, int]:
    """``(page size, page stride, row stride, head stride)`` of a token-row ``[rows, heads, dim]`` buffer (one
    token a page) or a paged ``[pages, page_size, heads, dim]`` view, in elements."""
    if buffer.stride(-1) != 1:
        raise ValueError(f"gather_heads needs the head dim packed (stride 1), got strides {buffer.stride()}")
    if buffer.dim() == 3:
        return 1, buffer.stride(0), buffer.stride(0), buffer.stride(1)
    if buffer.dim() == 4:
        return buffer.shape[1], buffer.stride(0), buffer.stride(1), buffer.stride(2)
    raise ValueError(f"gather_heads takes [rows, heads, dim] or [pages, page_size, heads, dim], got {tuple(buffer.shape)}")


def _kv_layout(k: torch.Tensor, v: torch.Tensor, out_dtype: torch.dtype) -> tuple[int, tuple, tuple]:
    """``(page size, K's (page, row, head) strides, V's)`` of K/V rows gathered into ``out_dtype``, after the
    checks every gather makes: head dims packed, one page size, a float output."""
    (page, *k_strides), (v_page, *v_strides) = _paged(k), _paged(v)
    if page != v_page:
        raise ValueError(f"K and V views of another page size: {page} and {v_page}")
    if out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"gather_heads writes float32, float16 or bfloat16, not {out_dtype}")
    return page, tuple(k_strides), tuple(v_strides)


def _constexprs(k: torch.Tensor, v: torch.Tensor, page: int, out_dtype: torch.dtype, k_scale, v_scale) -> tuple:
    """``(BLOCK_T, the kernel's constexprs)`` of K/V rows like ``k`` / ``v`` (their original dtype) gathered into
    ``out_dtype``; the scales apply to converted rows only."""
    scaled = k.dtype != out_dtype and (k_scale is not None or v_scale is not None)
    heads, dk, dv = k.shape[-2], k.shape[-1], v.shape[-1]
    block_dk, block_dv = next_pow2(dk), next_pow2(dv)
    block_h = min(_HEADS_PER_TILE, next_pow2(heads))
    block_t = max(1, _TILE_ELEMS // (max(block_dk, block_dv) * block_h))
    code_in = dtypes.dtype_code(k.dtype, "the cache")
    code_out = dtypes.dtype_code(out_dtype, "out_dtype") if k.dtype != out_dtype else code_in
    return block_t, GATHER_ARGS.constexprs(HEADS=heads, DK=dk, DV=dv, BLOCK_DK=block_dk, BLOCK_DV=block_dv,
                                            BLOCK_H=block_h, PAGE=page, BLOCK_T=block_t, IN=code_in, OUT=code_out,
                                            SCALED=scaled, HW_CVT=not triton_interpreting())  # fmt: skip


def _outputs(k: torch.Tensor, v: torch.Tensor, locs: torch.Tensor, out_dtype: torch.dtype):
    batch, seq = locs.shape
    heads = k.shape[-2]
    return (torch.empty((batch, heads, seq, k.shape[-1]), dtype=out_dtype, device=k.device),
            torch.empty((batch, heads, seq, v.shape[-1]), dtype=out_dtype, device=k.device))  # fmt: skip


def _checked_length(length: int, width: int) -> int:
    """``length`` as a count of a row's first tokens, checked against the row's ``width`` locations."""
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= width:
        raise ValueError(f"length must be an int in 0..{width} (the locations' width), got {length!r}")
    return length


def _first_tokens(locs: torch.Tensor, length: int) -> torch.Tensor:
    """``locs[:, :length]``, the length checked."""
    return locs[:, : _checked_length(length, locs.shape[1])]


def _store_geometry(plan: Plan, batch: int, seq: int, q: int, row_stride: int, out_len: int | None = None,
                    first_block: int = 0) -> tuple[tuple, tuple]:  # fmt: skip
    """``(grid, tail)`` of a planned store-and-gather launch: its grid over ``batch`` rows of ``seq`` tokens, the
    newest ``q`` of them stored, and the arguments after its runtime addresses (``row_stride``: the locations'
    stride between rows), the plan's fixed ones last.  ``out_len``: tokens a row of the outputs holds (None:
    ``seq``); ``first_block``: the first token block written (the blocks before it are not launched)."""
    return ((-(-seq // plan.block_n) - first_block, batch, 2),
            (seq, seq - q, row_stride, seq if out_len is None else out_len, first_block, *plan.suffix))  # fmt: skip


def _repeat_if(repeat, last: tuple | None, locs: torch.Tensor, length: int | None):
    """``repeat`` when the launch it repeats, ``last`` (its locations and length first), was of ``locs`` (the same
    tensor) and ``length`` (the same value and type), else None."""
    if (repeat is None or last is None or last[0] is not locs or last[1] != length
            or last[1].__class__ is not length.__class__):  # fmt: skip
        return None
    return repeat


def _declined(k_new: torch.Tensor, v_new: torch.Tensor, layer: int) -> None:
    """What a repeat declines goes nowhere (:meth:`HeadGather.follow_layers` names another taker): None."""
    return None


def room_for(seq: int) -> int:
    """Tokens a row of kept outputs has room for when they are allocated for ``seq`` (:class:`HeadGather`'s reused
    outputs, resident rows): an eighth more, at least 64, so that a decode's next steps, one token longer each, use
    the same memory, and a decode allocates them again once every ``seq / 8`` steps at most."""
    return seq + max(64, seq // 8)


def gather_heads_triton(k: torch.Tensor, v: torch.Tensor, locs: torch.Tensor, out_dtype: torch.dtype,
                        k_scale: float | None = None, v_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Keys and values of tokens ``locs`` (``[batch, seq]``) as two contiguous ``[batch, heads, seq, dim]`` tensors
    of ``out_dtype``, in one launch (see the module docstring).  ``k_scale`` / ``v_scale`` multiply rows that are
    converted (another dtype than ``out_dtype``) and are ignored otherwise."""
    if locs.dim() != 2 or k.shape[-2] != v.shape[-2] or k.dtype != v.dtype:
        raise ValueError(f"gather_heads takes locs [batch, seq] and K/V of one dtype and head count, got locs "
                         f"{tuple(locs.shape)}, K {tuple(k.shape)} {k.dtype}, V {tuple(v.shape)} {v.dtype}")  # fmt: skip
    k_out, v_out = _outputs(k, v, locs, out_dtype)
    source_dtype = k.dtype
    batch, seq = locs.shape
    if not batch or not seq:
        return k_out, v_out
    if locs.stride(1) != 1:
        locs = locs.contiguous()
    page, (kps, krs, khs), (vps, vrs, vhs) = _kv_layout(k, v, out_dtype)
    block_t, constexprs = _constexprs(k, v, page, out_dtype, k_scale, v_scale)
    if is_fp8_dtype(source_dtype):  # fp8 reaches the kernel as its bytes; its code says how to decode them
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    args = (k, v, k_out, v_out, locs, seq, locs.stride(0), kps, krs, khs, vps, vrs, vhs,
            1.0 if k_scale is None else float(k_scale), 1.0 if v_scale is None else float(v_scale), *constexprs)  # fmt: skip
    key = (k.dtype, out_dtype, locs.dtype, locs.stride(1), kps, krs, khs, vps, vrs, vhs,
           *(t.data_ptr() % 16 == 0 for t in (k, v, k_out, v_out, locs)))  # fmt: skip
    launcher_for(GATHER_ARGS, k.device)(key, cdiv(seq, block_t), batch, args, num_warps=_NUM_WARPS, grid_z=2)
    return k_out, v_out


class HeadGather(KeepsAddresses):
    """:func:`gather_heads` for every layer of one pool, planned once: what the layers' K/V rows fix (their layout,
    dtype and addresses, the output dtype, the scales) is checked and worked out here, so a call allocates the two
    outputs, reads the locations' layout and launches once (a transformers cache gathers once per layer and step).

    :param k_layers: each layer's K rows as the pool hands them out (token rows ``[rows, heads, dim]`` or a paged
        view), all of one shape, strides and dtype; kept, so their memory stays.
    :param v_layers: the same for V (the same dtype, heads and page size as K).
    :param out_dtype: float32, float16 or bfloat16.
    :param k_scale: multiplies converted K rows (another dtype than ``out_dtype``), as :func:`gather_heads`.
    :param v_scale: the same for V.
    :param use_triton: the kernel (True) or :func:`gather_heads_native`.
    :param reuse_outputs: the kernel writes into the two tensors a call before returned, when nothing holds them any
        more (no Python reference but this object's, no view of their memory), their memory holds the call's shapes
        (they are resized in place to them: a pair is allocated with room for more tokens a row, :func:`room_for`)
        and the device's current stream is the one they were last written on; otherwise it allocates two.  A caller that
        reads them on another stream must keep a reference until that stream is done.  What a transformers cache
        wants: a layer's keys and values are dropped before the next layer's update, which then allocates nothing,
        and a decode step's first layer resizes the pair the step before left.
    """

    def __init__(self, k_layers, v_layers, out_dtype: torch.dtype, k_scale: float | None = None,
                 v_scale: float | None = None, *, use_triton: bool, reuse_outputs: bool = False):  # fmt: skip
        k_layers, v_layers = list(k_layers), list(v_layers)
        if not k_layers or len(k_layers) != len(v_layers):
            raise ValueError(f"HeadGather takes as many K as V layers (at least one), got {len(k_layers)} and "
                             f"{len(v_layers)}")  # fmt: skip
        k0, v0 = k_layers[0], v_layers[0]
        for name, layers in (("K", k_layers), ("V", v_layers)):
            first = layers[0]
            for i, x in enumerate(layers):
                if x.shape != first.shape or x.stride() != first.stride() or x.dtype != first.dtype:
                    raise ValueError(f"{name} rows of layer {i} are laid out unlike layer 0's: {tuple(x.shape)} "
                                     f"{x.stride()} {x.dtype}, against {tuple(first.shape)} {first.stride()} "
                                     f"{first.dtype}")  # fmt: skip
        if k0.shape[-2] != v0.shape[-2] or k0.dtype != v0.dtype:
            raise ValueError(f"K and V rows of one dtype and head count, got {tuple(k0.shape)} {k0.dtype} and "
                             f"{tuple(v0.shape)} {v0.dtype}")  # fmt: skip
        page, k_strides, v_strides = _kv_layout(k0, v0, out_dtype)
        self.k_layers, self.v_layers, self.out_dtype = k_layers, v_layers, out_dtype
        self.k_scale, self.v_scale, self.use_triton = k_scale, v_scale, use_triton
        self.heads, self.dk, self.dv = k0.shape[-2], k0.shape[-1], v0.shape[-1]
        self._template = torch.empty((0,), dtype=out_dtype, device=k0.device)  # outputs: new_empty of it
        #: the last outputs, written again when free (``reuse_outputs``): (keys, values, their ``(batch, seq)``, the
        #: stream they were last written on, their storage objects, the storages' addresses and use counts when free,
        #: the outputs' reference counts when free, their data addresses)
        self._spare: tuple | None = None
        self._free_uses: tuple[int, int] | None = None  # the storages' use counts of a pair nothing else holds
        self._free_refs: int | None = None  # sys.getrefcount of an output nothing else holds, in _outputs
        self._reuse = bool(reuse_outputs) and _STORAGE_USES is not None
        self._current_stream = _RAW_STREAM if k0.device.type == "cuda" and _RAW_STREAM is not None else None
        #: store_and_gather's last direct launch, for a call that differs from it only in the layer and the new
        #: rows' and outputs' addresses, or also in the length of the same rows of locations (_last_at_length):
        #: (locs and the length given, what of locs the launch took, the outputs' shape ``(batch, seq)``, the new
        #: keys' shape and a guard of the new rows' layout (:func:`~kvcore.kernels.tensor_guard.layout_guard`: one
        #: call compares shapes, strides, dtype and device), the layer's and the addresses' alignment, the launch's
        #: callable, grid, stream getter and device, head and tail, its plan)
        self._last_launch: tuple | None = None
        #: None, or ``repeat(k_new, v_new, layer)``: the last direct launch again for another layer and its new rows
        #: (the same locations and length), or None when it may not (see :meth:`_repeater`, :meth:`repeat_for`)
        self.repeat = None
        #: what the repeats made from now on follow: ``(lengths, otherwise, reach)`` (see :meth:`follow_layers`)
        self._follow: tuple = (None, _declined, None)
        if not use_triton:
            return
        self._block_t, self._constexprs = _constexprs(k0, v0, page, out_dtype, k_scale, v_scale)
        self._tail = (*k_strides, *v_strides, 1.0 if k_scale is None else float(k_scale),
                      1.0 if v_scale is None else float(v_scale))  # fmt: skip
        as_bytes = is_fp8_dtype(k0.dtype)  # the dispatcher sees fp8 rows as their bytes, as the kernel reads them
        self._kernel_layers = [(k.view(torch.uint8), v.view(torch.uint8)) if as_bytes else (k, v)
                               for k, v in zip(k_layers, v_layers)]  # fmt: skip
        self._bind_addresses()
        self._key = (k0.dtype, out_dtype, *k_strides, *v_strides)
        self._launch = launcher_for(GATHER_ARGS, k0.device)
        self._device_index = k0.get_device()
        self._plans: dict[tuple, Plan] = {}
        # store_and_gather: the layers' conversion codes and the output's, and what a store adds to them
        *_, block_dk, block_dv, block_h, page, _, code_in, code_out, scaled, hw_cvt = self._constexprs
        self._store_constexprs = STORE_GATHER_ARGS.constexprs(
            HEADS=self.heads, DK=self.dk, DV=self.dv, BLOCK_DK=block_dk, BLOCK_DV=block_dv, BLOCK_H=block_h,
            PAGE=page, BLOCK_T=self._block_t, IN=code_in, OUT=code_out,
            STORE=dtypes.conversion_code(out_dtype, k0.dtype, "the cache"), SATURATE=torch_e4m3fn_saturates(),
            SCALED=scaled, HW_CVT=hw_cvt,
        )  # fmt: skip
        self._store_launch = launcher_for(STORE_GATHER_ARGS, k0.device)
        self._store_plans: dict[tuple, Plan] = {}

    #: a copy (``copy.deepcopy``) starts without the spare outputs and the last launch (:meth:`release`)
    not_copied = ("_spare", "_last_launch", "repeat")

    def _bind_addresses(self) -> None:
        """The layers' addresses the kernels take, and their alignment (the Triton path)."""
        if not self.use_triton:
            return
        self._addresses = [(k.data_ptr(), v.data_ptr()) for k, v in zip(self.k_layers, self.v_layers)]
        self._aligned = [(k % 16 == 0, v % 16 == 0) for k, v in self._addresses]  # what Triton specializes on
        #: per alignment of the layers' addresses: each layer's addresses, None where the layer's differs
        self._addresses_aligned = {a: [at if al == a else None for at, al in zip(self._addresses, self._aligned)]
                                   for a in set(self._aligned)}  # fmt: skip

    def __call__(self, layer: int, locs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of tokens ``locs`` (``[batch, seq]`` int32/int64, on the pool's device, the token dim
        packed) of layer ``layer`` (0-based index into the layers given), as :func:`gather_heads` returns them."""
        if not self.use_triton:
            return gather_heads_native(self.k_layers[layer], self.v_layers[layer], locs, self.out_dtype, self.k_scale,
                                       self.v_scale)  # fmt: skip
        batch, seq = locs.shape
        k_out, v_out, ko, vo = self._outputs(batch, seq)
        if not batch or not seq:
            return k_out, v_out
        kp, vp = self._addresses[layer]
        lp = locs.data_ptr()
        signature = (locs.dtype, locs.stride(1), locs.get_device(), lp & 15, batch, (ko & 15) | (vo & 15) << 4,
                     self._aligned[layer])  # fmt: skip
        plan = self._plans.get(signature, UNPLANNED)
        if plan is UNPLANNED:
            plan = self._plans[signature] = self._plan(locs, batch, k_out, v_out, self._aligned[layer])
        entry = plan.entry
        if entry is not None and not launch_hooks_installed():  # Plan.__call__'s direct launch, inlined
            entry[0](-(-seq // plan.block_n), batch, 2, plan.raw_stream(plan.device_index), *entry[1], kp, vp, ko, vo,
                     lp, seq, locs.stride(0), *plan.suffix)  # fmt: skip
        else:
            k, v = self._kernel_layers[layer]
            plan(seq, (kp, vp, ko, vo, lp, seq, locs.stride(0)), lambda: (k, v, k_out, v_out, locs))
        return k_out, v_out

    def _plan(self, locs: torch.Tensor, batch: int, k_out: torch.Tensor, v_out: torch.Tensor,
              aligned: tuple[bool, bool]) -> Plan:  # fmt: skip
        """The plan of a call's signature, after its checks (the locations' dtype, layout and device)."""
        if locs.dim() != 2 or locs.dtype not in (torch.int32, torch.int64) or locs.stride(1) != 1:
            raise ValueError(f"locs must be [batch, seq] int32/int64 with the token dim packed, got {locs.dtype} "
                             f"{tuple(locs.shape)} strides {locs.stride()}")  # fmt: skip
        if locs.get_device() != self._device_index:
            raise ValueError(f"locs is on {locs.device}, the layers on {self._template.device}")
        key = (*self._key, *aligned, locs.dtype, locs.data_ptr() % 16 == 0, k_out.data_ptr() % 16 == 0,
               v_out.data_ptr() % 16 == 0)  # fmt: skip
        return Plan(self._launch, key, self._block_t, (batch, 2), _NUM_WARPS, constexprs=self._constexprs,
                    tail=self._tail)  # fmt: skip

    def store_and_gather(self, layer: int, locs: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                         length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Store every row's newest ``q`` tokens, then gather all of its tokens, in one launch: ``k_new`` /
        ``v_new`` (``[batch, heads, q, dim]`` of ``out_dtype``, the head dim packed) are written to layer ``layer``'s
        rows at locations ``locs[:, length - q : length]``, converted as a K/V pool's ``set_kv_buffer`` converts (in
        the rows' dtype: as they are, or divided by the scale in float32 when given, then rounded once to nearest
        even), and the keys and values of tokens ``locs[:, :length]`` are returned as :meth:`__call__` returns them.
        Bit for bit what that store followed by :meth:`__call__` gives (:func:`store_and_gather_native`).  The new
        tokens' locations must be distinct and not among the row's older ones.

        :param length: the tokens of each row, at most ``locs.shape[1]`` (None: all of them).  A caller whose rows
            grow a token a step (a decode) passes the same request-table rows each step with the new length,
            which spares it a view a step and this method the work of comparing another locations tensor."""
        if not self.use_triton:
            if length is not None:
                locs = _first_tokens(locs, length)
            return store_and_gather_native(self.k_layers[layer], self.v_layers[layer], locs, k_new, v_new,
                                           self.out_dtype, self.k_scale, self.v_scale)  # fmt: skip
        last = self._last_launch
        moved = last is not None and (last[0] is not locs or last[1] != length)  # the same rows at another length?
        if moved:
            last = self._last_at_length(last, locs, length)
        if last is not None:  # the last direct launch again for a call that differs only in the layer and addresses
            (_, _, lp, lshape, lstride, ldtype, out_shape, _, rows_ok, aligned, align, run, grid, stream, index, head,
             tail, _) = last  # fmt: skip
            if (rows_ok(k_new, v_new) and self._aligned[layer] == aligned and locs.data_ptr() == lp
                    and locs.shape == lshape and locs.stride() == lstride and locs.dtype is ldtype
                    and not launch_hooks_installed()):  # fmt: skip
                on = stream(index)
                k_out, v_out, ko, vo = self._outputs(*out_shape, on)
                knp, vnp = k_new.data_ptr(), v_new.data_ptr()
                if (ko & 15) | (vo & 15) << 4 | (knp & 15) << 8 | (vnp & 15) << 12 == align:
                    kp, vp = self._addresses[layer]
                    run(*grid, on, *head, kp, vp, ko, vo, lp, knp, vnp, *tail)
                    if moved:  # a forward's first layer: its later layers repeat this launch
                        self.repeat = self._repeater(last, on)
                    return k_out, v_out
        batch, seq = locs.shape
        if length is not None:
            seq = _checked_length(length, seq)
        ks, vs = k_new.shape, v_new.shape
        q = ks[2] if len(ks) == 4 else -1
        k_out, v_out, ko, vo = self._outputs(batch, seq)
        if not batch or not 0 < q <= seq:  # nothing to store, or a call the checks refuse
            if batch and q:
                self._store_plan(locs, batch, seq, k_new, v_new, k_out, v_out, self._aligned[layer])  # raises
            return self(layer, locs if length is None else locs[:, :seq])
        kp, vp = self._addresses[layer]
        lp, knp, vnp = locs.data_ptr(), k_new.data_ptr(), v_new.data_ptr()
        lst, kst, vst = locs.stride(), k_new.stride(), v_new.stride()
        signature = (locs.dtype, lst[1], locs.get_device(), batch, ks, kst, k_new.dtype, k_new.get_device(), vs, vst,
                     v_new.dtype, v_new.get_device(),
                     (lp & 15) | (ko & 15) << 4 | (vo & 15) << 8 | (knp & 15) << 12 | (vnp & 15) << 16,
                     self._aligned[layer])  # fmt: skip
        plan = self._store_plans.get(signature, UNPLANNED)
        if plan is UNPLANNED:
            plan = remember(self._store_plans, signature,
                            self._store_plan(locs, batch, seq, k_new, v_new, k_out, v_out, self._aligned[layer]))
        entry = plan.entry
        if entry is not None and not launch_hooks_installed():  # Plan.__call__'s direct launch, inlined
            grid, tail = _store_geometry(plan, batch, seq, q, lst[0])
            on = plan.raw_stream(plan.device_index)
            entry[0](*grid, on, *entry[1], kp, vp, ko, vo, lp, knp, vnp, *tail)
            self._last_launch = last = (  # what a call like this one launches again (see above)
                locs, length, lp, locs.shape, lst, locs.dtype, (batch, seq), ks, layout_guard(k_new, v_new),
                self._aligned[layer], (ko & 15) | (vo & 15) << 4 | (knp & 15) << 8 | (vnp & 15) << 12, entry[0], grid,
                plan.raw_stream, plan.device_index, entry[1], tail, plan,
            )  # fmt: skip
            self.repeat = self._repeater(last, on)
        else:
            k, v = self._kernel_layers[layer]
            plan(seq, (kp, vp, ko, vo, lp, knp, vnp, seq, seq - q, locs.stride(0), seq, 0),
                 lambda: (k, v, k_out, v_out, locs, k_new, v_new))  # fmt: skip
        return k_out, v_out

    def _last_at_length(self, last: tuple, locs: torch.Tensor, length: int | None) -> tuple | None:
        """The last direct launch ``last`` for ``locs`` and ``length``: the same rows of locations (the same tensor,
        or another of the same address, strides and dtype: a view of another width) read to another length (the
        next step of a decode: its first layer), or None.  The same signature (the plan, the batch, the strides and
        dtype of the locations); only the grid and the lengths after the runtime addresses change, and the result
        is kept as the last launch."""
        (_, _, lp, _, lstride, ldtype, out_shape, kshape, rows_ok, aligned, align, run, _, stream, index, head, _,
         plan) = last  # fmt: skip
        if locs is not last[0] and (locs.data_ptr() != lp or locs.dtype is not ldtype or locs.dim() != 2
                                    or locs.stride() != lstride):  # (the caller checks the same tensor's again)
            return None
        batch, seq = lshape = locs.shape
        if length is not None:
            if length.__class__ is not int or not 0 <= length <= seq:
                return None  # (the full path says why)
            seq = length
        q = kshape[2]
        if batch != out_shape[0] or not 0 < q <= seq:
            return None
        grid, tail = _store_geometry(plan, batch, seq, q, lstride[0])
        self.repeat = None  # (it repeated the launch this one replaces)
        self._last_launch = last = (locs, length, lp, lshape, lstride, ldtype, (batch, seq), kshape, rows_ok, aligned,
                                    align, run, grid, stream, index, head, tail, plan)  # fmt: skip
        return last

    def _repeater(self, last: tuple, stream: int):
        """``repeat(k_new, v_new, layer)``: the direct launch ``last``, just made on raw stream ``stream``, again for
        another layer and its new rows (:meth:`store_and_gather` of the same locations and length), into the same spare
        outputs, or None when the call is not one it may repeat (or what :meth:`follow_layers` says).  It may when the
        new rows have the same shapes, strides, dtype, device and address alignment, the layer's addresses the same
        alignment, the locations the same address, and the spare pair is the one ``last`` wrote, on the same stream,
        held by nothing else (:meth:`_outputs`'s checks).  None (no repeat) when the outputs are not reused or
        ``last`` did not write the spare pair.  Kept as :attr:`repeat` while ``last`` is the last launch, so a
        forward's first layer makes one for the others: whether a profiler's launch hook is installed (launches then
        go through Triton's dispatcher, which calls it) is asked by that launch, once a forward, not by every repeat.

        Followed layers (:meth:`follow_layers`) with a ``reach``, and a launch of whole rows of locations read to a
        length: the repeat also takes the next forward's first layer (layer 0, with every layer at the length
        ``last`` stored and the same new rows' layout) while the rows stay within the launch's locations, the spare
        pair's room and the rows' reach (read here; a first layer past it asks ``reach`` to extend it first).  It
        resizes the pair in place to the new length and from then on repeats the launch at that length: a decode's
        steps are one Python call a layer, the first included (:meth:`store_and_gather` of that length gives the same
        launch), until the rows outgrow the outputs' room or the locations.

        Everything the checks compare is bound once here, in a closure, and the new rows' layout is compared in one
        call (the launch's guard): a call touches little that a decode step's other work may have pushed out of the
        CPU's caches."""
        spare = self._spare
        (locs, length, lp, lshape, lstride, _, out_shape, k_shape, rows_ok, aligned, align, run, grid, raw_stream,
         index, head, tail, plan) = last  # fmt: skip
        if not self._reuse or spare is None or spare[2] != out_shape or spare[3] != stream:
            return None
        gx, gy, gz = grid
        _, _, _, _, _, k_at, v_at, k_free, v_free, refs, ko, vo, room = spare
        new_align = align >> 8  # the new rows' part of the launch's alignment
        gather, addresses = self, self._addresses_aligned[aligned]
        count, uses = sys.getrefcount, _STORAGE_USES
        lengths, otherwise, reach = self._follow
        batch, end = out_shape
        q = k_shape[2]
        before = end - q
        # how far a forward's first layer may take the rows: never past the locations' width and the outputs' room
        # (0: no further than this launch), and within them as far as the caller's reach, which it may extend
        bound = min(lshape[1], room // batch) if reach is not None and length is not None else 0
        limit = min(reach(), bound) if bound else 0
        last_layer = len(self._addresses) - 1

        def repeat(k_new: torch.Tensor, v_new: torch.Tensor, layer: int, *extra, **options):
            nonlocal spare, end, before, gx, tail, limit
            if lengths is None or lengths[layer] == before:  # a later layer of this forward
                grows = False
            elif not layer and end + q <= bound and lengths[0] == end and lengths[last_layer] == end:
                grows = True  # the next forward's first layer (within the rows' reach: below)
            else:
                return otherwise(k_new, v_new, layer)
            at = addresses[layer]
            k_out, v_out = spare[0], spare[1]  # (locals, as _outputs counts its references)
            if (at is not None and gather._spare is spare and count(k_out) == refs and count(v_out) == refs
                    and uses(k_at) == k_free and uses(v_at) == v_free and rows_ok(k_new, v_new)
                    and locs.data_ptr() == lp):  # fmt: skip
                on = raw_stream(index)
                knp, vnp = k_new.data_ptr(), v_new.data_ptr()
                if on == stream and (knp & 15) | (vnp & 15) << 4 == new_align:
                    if grows:  # the outputs resized in place, the launch at the new length from now on
                        if end + q > limit:  # past the rows' reach: the caller extends it first (takes pages)
                            limit = min(reach(end + q), bound)
                        resized = gather._resize_spare(batch, end + q) if end + q <= limit else None
                        if resized is None:
                            k_out = v_out = None  # (the full path counts the outputs' references)
                            return otherwise(k_new, v_new, layer)
                        spare, before, end = resized, end, end + q
                        (gx, _, _), tail = _store_geometry(plan, batch, end, q, lstride[0])
                    run(gx, gy, gz, on, *head, at[0], at[1], ko, vo, lp, knp, vnp, *tail)
                    if lengths is not None:
                        lengths[layer] = end
                    return k_out, v_out
            k_out = v_out = None
            return otherwise(k_new, v_new, layer)

        return repeat

    def follow_layers(self, lengths: list[int], otherwise, reach=None) -> None:
        """Make the repeats made from now on (:attr:`repeat`) a caller's per-layer update, called as transformers
        calls ``Cache.update``: ``repeat(key_states, value_states, layer_idx, *extra)`` (``extra`` ignored).  A repeat
        of a launch of rows of ``seq`` tokens, ``q`` of them new, then launches for layer ``layer`` only when
        ``lengths[layer] == seq - q`` (the layer holds the tokens before the new ones, and not yet these) and sets it
        to ``seq``; a call it declines it hands to ``otherwise(k_new, v_new, layer)`` and returns what that returns
        (instead of None).  ``lengths`` is the caller's list (one entry a layer), read and written in place.  A cache
        can then serve a forward's later layers with the repeat itself, in one Python call a layer.

        :param reach: None, or ``reach(want=0)``: how many tokens a row of the locations may hold with nothing for the
            caller to do first (their locations written, the rows not edited), read once when a repeat is made; given
            ``want``, the caller first gives every row locations for ``want`` tokens if it can (writing them into the
            rows of locations the launch reads, on the device's current stream) and returns the reach then.  A repeat
            of a launch read to a length (``store_and_gather``'s ``length``) then also takes the next forward's first
            layer (layer 0, ``q`` more new tokens, every layer holding ``seq``) as long as the rows stay within the
            reach, asking for more when they would pass it (see :meth:`_repeater`): the caller must drop the repeat
            before anything else that moves the reach (a new batch, a crop, rows taking locations otherwise)."""
        self._follow = (lengths, otherwise, reach)

    def repeat_for(self, locs: torch.Tensor, length: int | None):
        """:attr:`repeat` when it repeats a launch of these locations (the same tensor) and length, else None: what a
        caller binding it for a forward's later layers checks once."""
        return _repeat_if(self.repeat, self._last_launch, locs, length)

    def release(self) -> None:
        """Drop what calls keep for the next: the spare outputs (their memory goes back to torch's allocator), the
        last launch and its repeat (with the locations they hold)."""
        self._spare = self._last_launch = self.repeat = None

    def _outputs(self, batch: int, seq: int, stream: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """The two outputs of a call and their addresses: the spare pair when ``reuse_outputs`` allows it (see the
        class), resized in place when the call's shapes differ and its memory holds them, else two new tensors
        (then kept as the spare, with room for :func:`room_for` tokens a row).  ``stream``: the device's current raw
        stream, when the caller has read it already."""
        if not self._reuse:
            new = self._template.new_empty
            k_out, v_out = new((batch, self.heads, seq, self.dk)), new((batch, self.heads, seq, self.dv))
            return k_out, v_out, k_out.data_ptr(), v_out.data_ptr()
        if stream is None:
            stream = self._current_stream(self._device_index) if self._current_stream is not None else 0
        if self._spare is not None:
            k_out, v_out, shape, on_stream, _, k_at, v_at, k_free, v_free, refs, ko, vo, room = self._spare
            # Nothing else holds them: their Python references are the spare tuple's and these locals' (as counted
            # when the pair was new), and their memory is held by them and the spare's storage objects alone (a
            # view, a detached or set_ tensor would hold it too).
            if (on_stream == stream and sys.getrefcount(k_out) == refs and sys.getrefcount(v_out) == refs
                    and _STORAGE_USES(k_at) == k_free and _STORAGE_USES(v_at) == v_free):  # fmt: skip
                if shape == (batch, seq):
                    return k_out, v_out, ko, vo
                if batch * seq <= room and self._resize_spare(batch, seq) is not None:  # a decode's next step
                    self.repeat = None  # (it holds the old spare tuple: the outputs' references would count one more)
                    return k_out, v_out, ko, vo
            del k_out, v_out
        new = self._template.new_empty
        room = batch * room_for(seq)
        k_out, v_out = new((room, self.heads, 1, self.dk)), new((room, self.heads, 1, self.dv))
        self._resized(k_out, v_out, batch, seq)  # (tensors of this mode: it does not refuse)
        k_mem, v_mem = k_out.untyped_storage(), v_out.untyped_storage()  # kept: their addresses stay valid
        k_at, v_at = k_mem._cdata, v_mem._cdata
        free = self._free_uses
        if free is None:  # a new tensor's storage and the storage object kept of it: counted once
            free = self._free_uses = (_STORAGE_USES(k_at), _STORAGE_USES(v_at))
        refs = self._free_refs
        if refs is None:  # what getrefcount shows above for an output nothing else holds: a tuple's and a local's
            held = (k_out,)
            refs = self._free_refs = sys.getrefcount(k_out)
            del held
        ko, vo = k_out.data_ptr(), v_out.data_ptr()
        self.repeat = None
        self._spare = (k_out, v_out, (batch, seq), stream, (k_mem, v_mem), k_at, v_at, *free, refs, ko, vo, room)
        return k_out, v_out, ko, vo

    def _resize_spare(self, batch: int, seq: int) -> tuple | None:
        """The spare pair resized in place to a call of ``batch`` rows of ``seq`` tokens (the caller checked that
        nothing else holds it and that its memory holds them), kept as the spare with its new shape and returned;
        None when torch refuses (see :meth:`_resized`), the spare as it was."""
        spare = self._spare
        if not self._resized(spare[0], spare[1], batch, seq):
            return None
        spare = self._spare = (spare[0], spare[1], (batch, seq), *spare[3:])
        return spare

    def _resized(self, k_out: torch.Tensor, v_out: torch.Tensor, batch: int, seq: int) -> bool:
        """Whether ``k_out`` / ``v_out`` now have the shapes of a call of ``batch`` rows of ``seq`` tokens (contiguous,
        over the memory they have: the caller checked it holds them); False when torch refuses to resize them (an
        inference-mode tensor outside inference mode), which leaves them as they were."""
        try:
            k_out.resize_((batch, self.heads, seq, self.dk))
            v_out.resize_((batch, self.heads, seq, self.dv))
        except RuntimeError:
            return False
        return True

    def _store_plan(self, locs: torch.Tensor, batch: int, seq: int, k_new: torch.Tensor, v_new: torch.Tensor,
                    k_out: torch.Tensor, v_out: torch.Tensor, aligned: tuple[bool, bool]) -> Plan:  # fmt: skip
        """The plan of a :meth:`store_and_gather` signature, after its checks (the gather's, and the new rows'
        shapes, dtype, layout and device)."""
        gather = self._plan(locs, batch, k_out, v_out, aligned)  # the locations' checks
        for name, x, dim in (("k_new", k_new, self.dk), ("v_new", v_new, self.dv)):
            if x.dim() != 4 or x.shape[0] != batch or x.shape[1] != self.heads or x.shape[3] != dim:
                raise ValueError(f"{name} must be [batch, heads, q, dim] = [{batch}, {self.heads}, q, {dim}], got "
                                 f"{tuple(x.shape)}")  # fmt: skip
            if x.dtype != self.out_dtype or x.stride(3) != 1 or x.get_device() != self._device_index:
                raise ValueError(f"{name} must be {self.out_dtype} with its head dim packed, on "
                                 f"{self._template.device}; got {x.dtype}, strides {x.stride()}, on {x.device}")  # fmt: skip
        q = k_new.shape[2]
        if v_new.shape[2] != q or not 0 < q <= seq:
            raise ValueError(f"k_new and v_new must bring the same number of new tokens, at most the {seq} of locs, "
                             f"got {k_new.shape[2]} and {v_new.shape[2]}")  # fmt: skip
        strides = (*k_new.stride()[:3], *v_new.stride()[:3])
        key = (gather.key, k_new.dtype, strides, k_new.data_ptr() % 16 == 0, v_new.data_ptr() % 16 == 0)
        return Plan(self._store_launch, key, self._block_t, (batch, 2), _NUM_WARPS,
                    constexprs=self._store_constexprs, tail=strides + self._tail)  # fmt: skip


def gather_heads(k: torch.Tensor, v: torch.Tensor, locs: torch.Tensor, out_dtype: torch.dtype,
                 k_scale: float | None = None, v_scale: float | None = None, *, use_triton: bool):  # fmt: skip
    """:func:`gather_heads_triton` or :func:`gather_heads_native`."""
    impl = gather_heads_triton if use_triton else gather_heads_native
    return impl(k, v, locs, out_dtype, k_scale, v_scale)
