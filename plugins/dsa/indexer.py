"""The DSA pool's indexer pages on the device: token-granular writes into, and sequence-ordered reads out of, the
page-indexed indexer buffer (:class:`IndexerPages`, bound to one pool's buffer), their Triton kernels and the
one-call functions ``set_index_k_triton`` / ``get_index_k_triton`` (with their torch references).

A page holds 64 keys (``key_bytes`` each), then, for the fp8 indexer, their 64 float32 scales; token ``loc`` is
slot ``loc % 64`` of page ``loc // 64`` (:mod:`kvcore_dsa.layout`).  All offsets are int64.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kvcore.kernels.addresses import KeepsAddresses
from kvcore.kernels.launch import UNPLANNED, KernelArgs, Launcher, Plan, remember
from kvcore.kernels.row_move import next_pow2
from kvcore_dsa.checks import check_device, check_loc
from kvcore_dsa.layout import INDEX_PAGE_SIZE, INDEX_SCALE_BYTES, index_page_bytes_of

__all__ = ["IndexerPages", "get_index_k_native", "get_index_k_triton", "set_index_k_native", "set_index_k_triton"]

_INDEX_BLOCK_N = 32  # x (128 key bytes + 4 scale bytes) per program
_INDEX_NUM_WARPS = 4


@triton.jit(do_not_specialize=["layer", "loc_stride", "n_tokens"])
def _set_index_k_kernel(
    buf_ptr,
    layer,
    loc_ptr,
    loc_stride,
    n_tokens,
    k_ptr,
    k_sn,
    k_sd,
    s_ptr,
    s_sn,
    s_sd,
    PAGE: tl.constexpr,
    LAYER_BYTES: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    KEY_BYTES: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_n = offs_n < n_tokens
    loc = tl.load(loc_ptr + offs_n * loc_stride, mask=mask_n, other=0).to(tl.int64)
    page_base = layer.to(tl.int64) * LAYER_BYTES + (loc // PAGE) * PAGE_BYTES
    slot = loc % PAGE
    cols = tl.arange(0, KEY_BYTES)
    k = tl.load(k_ptr + offs_n[:, None] * k_sn + cols[None, :].to(tl.int64) * k_sd, mask=mask_n[:, None])
    tl.store(buf_ptr + (page_base + slot * KEY_BYTES)[:, None] + cols[None, :], k, mask=mask_n[:, None])
    if HAS_SCALE:
        j = tl.arange(0, 4)
        s = tl.load(s_ptr + offs_n[:, None] * s_sn + j[None, :].to(tl.int64) * s_sd, mask=mask_n[:, None])
        dst = page_base + PAGE * KEY_BYTES + slot * 4
        tl.store(buf_ptr + dst[:, None] + j[None, :], s, mask=mask_n[:, None])


@triton.jit(do_not_specialize=["layer", "page_stride", "seq_len"])
def _get_index_k_kernel(
    buf_ptr,
    layer,
    page_ptr,
    page_stride,
    seq_len,
    k_out,
    s_out,
    PAGE: tl.constexpr,
    LAYER_BYTES: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    KEY_BYTES: tl.constexpr,
    WANT_K: tl.constexpr,
    WANT_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_n = i < seq_len
    page = tl.load(page_ptr + (i // PAGE) * page_stride, mask=mask_n, other=0).to(tl.int64)
    page_base = layer.to(tl.int64) * LAYER_BYTES + page * PAGE_BYTES
    slot = i % PAGE
    if WANT_K:
        cols = tl.arange(0, KEY_BYTES)
        k = tl.load(buf_ptr + (page_base + slot * KEY_BYTES)[:, None] + cols[None, :], mask=mask_n[:, None])
        tl.store(k_out + i[:, None] * KEY_BYTES + cols[None, :], k, mask=mask_n[:, None])
    if WANT_S:
        j = tl.arange(0, 4)
        src = page_base + PAGE * KEY_BYTES + slot * 4
        s = tl.load(buf_ptr + src[:, None] + j[None, :], mask=mask_n[:, None])
        tl.store(s_out + i[:, None] * 4 + j[None, :], s, mask=mask_n[:, None])


#: the argument lists of the two kernels (:class:`kvcore.kernels.launch.KernelArgs`): per call the buffer's address,
#: the layer, the locations' (or pages') address, the plan's stride and the count; then the keys' and scales'
#: addresses and (a write's) strides.  Pointers as addresses.
_SET_ARGS = KernelArgs(
    _set_index_k_kernel,
    runtime="buf_ptr layer loc_ptr loc_stride n_tokens k_ptr k_sn k_sd s_ptr s_sn s_sd",
    constexprs="PAGE LAYER_BYTES PAGE_BYTES KEY_BYTES HAS_SCALE BLOCK_N",
    pointers="buf_ptr loc_ptr k_ptr s_ptr",
)
_GET_ARGS = KernelArgs(
    _get_index_k_kernel,
    runtime="buf_ptr layer page_ptr page_stride seq_len k_out s_out",
    constexprs="PAGE LAYER_BYTES PAGE_BYTES KEY_BYTES WANT_K WANT_S BLOCK_N",
    pointers="buf_ptr page_ptr k_out s_out",
)


# ==========================================================================================================
# The pool's view: the buffer bound once, the Triton kernels or their torch references
# ==========================================================================================================


def _key_bytes(index_k: torch.Tensor) -> torch.Tensor:
    """[N, D] keys of any dtype -> [N, D * itemsize] uint8 (a view when the last dim is packed)."""
    if index_k.dim() == 3 and index_k.shape[1] == 1:
        index_k = index_k[:, 0]
    if index_k.dim() != 2:
        raise ValueError(f"index_k must be [N, D], got {tuple(index_k.shape)}")
    if index_k.stride(1) != 1:
        index_k = index_k.contiguous()
    return index_k if index_k.dtype == torch.uint8 else index_k.view(torch.uint8)


def _scale_bytes(index_k_scale: torch.Tensor, n: int) -> torch.Tensor:
    """[N] / [N, 1] float32 or [N, 4] uint8 -> [N, 4] uint8 (a view when possible)."""
    s = index_k_scale
    if s.dtype == torch.float32:
        s = s.reshape(n, 1) if s.numel() == n else s
        if s.dim() != 2 or s.shape != (n, 1):
            raise ValueError(f"index_k_scale must hold one float32 per token ({n}), got {tuple(index_k_scale.shape)}")
        s = (s if s.stride(1) == 1 else s.contiguous()).view(torch.uint8)
    elif s.dtype == torch.uint8:
        s = s.reshape(n, INDEX_SCALE_BYTES) if s.numel() == n * INDEX_SCALE_BYTES else s
        if s.shape != (n, INDEX_SCALE_BYTES):
            raise ValueError(f"index_k_scale as bytes must be [{n}, 4] uint8, got {tuple(index_k_scale.shape)}")
    else:
        raise ValueError(f"index_k_scale must be float32 or uint8 bytes, got {s.dtype}")
    return s


#: the plan of an indexer write that the general path takes (keys or scales in another form than the packed one)
_GENERAL = object()


class IndexerPages(KeepsAddresses):
    """Writes and reads of one pool's indexer pages (see the module docstring): the Triton kernels
    (``use_triton``) or their torch references, sharing the checks; fixed geometry computed once.

    :param index_buf: contiguous uint8 ``[L, pages, page_bytes]``; a page is 64 keys of ``key_bytes`` then,
        when ``has_scale``, 64 float32 scales.
    """

    def __init__(self, index_buf: torch.Tensor, key_bytes: int, has_scale: bool, use_triton: bool = True):
        if index_buf.dtype != torch.uint8 or index_buf.dim() != 3 or not index_buf.is_contiguous():
            raise ValueError(
                f"index buffer must be contiguous uint8 [L, pages, page_bytes], got {index_buf.dtype} {tuple(index_buf.shape)}"
            )
        page_bytes = index_page_bytes_of(key_bytes, has_scale)
        if index_buf.shape[2] != page_bytes:
            raise ValueError(f"index pages hold {index_buf.shape[2]} bytes, keys of {key_bytes} bytes need {page_bytes}")
        self.index_buf, self.key_bytes, self.has_scale, self.use_triton = index_buf, key_bytes, has_scale, use_triton
        self.layers, self.page_bytes = index_buf.shape[0], page_bytes
        self._set = Launcher(_SET_ARGS, index_buf.device)
        self._get = Launcher(_GET_ARGS, index_buf.device)
        self._layer_bytes = index_buf.stride(0)
        # the constexprs both kernels take: the pages' geometry
        self._geometry = dict(PAGE=INDEX_PAGE_SIZE, LAYER_BYTES=self._layer_bytes, PAGE_BYTES=page_bytes,
                              KEY_BYTES=key_bytes)  # fmt: skip
        self.device, self._device_index = index_buf.device, index_buf.get_device()
        self._empty_bytes = torch.empty(0, dtype=torch.uint8, device=self.device)  # new outputs: see empty_of
        self._bind_addresses()

    def _bind_addresses(self) -> None:
        """The pages' address; the plans start empty."""
        self._buf_ptr = self.index_buf.data_ptr()
        self._set_plans: dict[tuple, Plan | None] = {}
        self._get_plans: dict[tuple, Plan | None] = {}

    def _check_layer(self, layer_index: int) -> None:
        if not 0 <= layer_index < self.layers:
            raise ValueError(f"layer_index {layer_index} out of range for {self.layers} layers")

    def _pages(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(keys ``[pages, 64, key_bytes]``, scales ``[pages, 64, 4]`` or None) of one layer, as views."""
        layer = self.index_buf[layer_index]
        keys = layer[:, : INDEX_PAGE_SIZE * self.key_bytes].view(-1, INDEX_PAGE_SIZE, self.key_bytes)
        scales = layer[:, INDEX_PAGE_SIZE * self.key_bytes :].view(-1, INDEX_PAGE_SIZE, INDEX_SCALE_BYTES)
        return keys, scales if self.has_scale else None

    def set(self, layer_index: int, loc: torch.Tensor, index_k: torch.Tensor, index_k_scale=None) -> None:
        """See :func:`set_index_k_triton`.  The common call (keys ``[N, D]`` with packed columns, scales None or
        packed ``[N]`` float32) is checked and planned once per call signature (:mod:`kvcore.kernels.launch`) and
        launched without views; any other goes through :meth:`_set_general`."""
        if not self.use_triton:
            self._set_general(layer_index, loc, index_k, index_k_scale)
            return
        s = index_k_scale
        lp, kp, n, ks = loc.data_ptr(), index_k.data_ptr(), loc.numel(), index_k.shape
        if s is None:
            sp, scales, s_agrees = kp, None, True
        else:
            sp, ss = s.data_ptr(), s.shape
            scales = (ss[1:], s.stride(), s.dtype, s.get_device(), sp & 15)
            s_agrees = len(ss) == 1 and ss[0] == n
        signature = ((n - 1).bit_length() if n else -1, loc.stride(), loc.dtype, loc.get_device(), lp & 15, ks[1:],
                     index_k.stride(), index_k.dtype, index_k.get_device(), kp & 15, scales)  # fmt: skip
        plan = self._set_plans.get(signature, UNPLANNED)
        if plan is UNPLANNED:
            plan = remember(self._set_plans, signature, self._plan_set(loc, index_k, s, lp, kp, sp))
        elif not (ks and ks[0] == n and s_agrees):  # counts other than the signature's first call's: checked there
            plan = _GENERAL
        if plan is _GENERAL:
            self._set_general(layer_index, loc, index_k, index_k_scale)
            return
        if not 0 <= layer_index < self.layers:
            self._check_layer(layer_index)
        if plan is not None:  # (no closure here: its cells would cost every call)
            loc_stride, k_strides, s_strides = plan.fixed  # the runtime arguments (_SET_ARGS), then the plan's
            plan(n, (self._buf_ptr, layer_index, lp, loc_stride, n, kp, *k_strides, sp, *s_strides),
                 (self.index_buf, loc, index_k, index_k if s is None else s))  # fmt: skip

    @staticmethod
    def _byte_views(buf: torch.Tensor, loc: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor
                    ) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """The tensors behind a write's addresses as the dispatcher sees them: keys and scales as bytes."""
        return buf, loc, keys.view(torch.uint8), scales.view(torch.uint8)

    def _plan_set(self, loc: torch.Tensor, index_k: torch.Tensor, s, lp: int, kp: int, sp: int):
        """The plan of a packed call (None: no rows), or ``_GENERAL`` for a call the general path takes."""
        n = check_loc(loc)
        shape, ks = index_k.shape, index_k.stride()
        item = index_k.dtype.itemsize
        if n == 0 or len(shape) != 2 or shape[0] != n or shape[1] * item != self.key_bytes or ks[1] != 1:
            return _GENERAL
        if s is None:
            if self.has_scale:
                return _GENERAL
            ss = (0, 0)
        else:
            if (not self.has_scale or s.dtype is not torch.float32 or s.dim() != 1 or s.stride(0) != 1
                    or s.shape[0] != n):  # fmt: skip
                return _GENERAL
            ss = (INDEX_SCALE_BYTES, 1)
        dev = self._device_index
        if loc.get_device() != dev or index_k.get_device() != dev or (s is not None and s.get_device() != dev):
            check_device(dev, self.device, loc=loc, index_k=index_k, **({} if s is None else {"index_k_scale": s}))
        block_n = min(_INDEX_BLOCK_N, next_pow2(n))
        byte_strides = (ks[0] * item, 1)
        key = (byte_strides, ss, kp & 15, sp & 15, loc.dtype, lp & 15, block_n)
        constexprs = _SET_ARGS.constexprs(**self._geometry, HAS_SCALE=s is not None, BLOCK_N=block_n)
        return Plan(self._set, key, block_n, (1, 1), _INDEX_NUM_WARPS, (loc.stride(0), byte_strides, ss),
                    self._byte_views, constexprs)  # fmt: skip

    def _set_general(self, layer_index: int, loc: torch.Tensor, index_k: torch.Tensor, index_k_scale) -> None:
        """:meth:`set` of any accepted form: keys of any dtype and token stride, scales as float32 or their
        bytes, through views and copies made per call."""
        self._check_layer(layer_index)
        n = check_loc(loc)
        keys = _key_bytes(index_k)
        if keys.shape[0] != n:
            raise ValueError(f"{n} locations but {keys.shape[0]} index keys")
        if keys.shape[1] != self.key_bytes:
            raise ValueError(f"index keys of {keys.shape[1]} bytes, the pages hold keys of {self.key_bytes} bytes")
        if (index_k_scale is not None) != self.has_scale:
            raise ValueError("scales are given for an indexer without scales" if index_k_scale is not None
                             else "this indexer keeps a scale per key; pass index_k_scale")  # fmt: skip
        fast_scale = (index_k_scale is not None and index_k_scale.dtype == torch.float32 and index_k_scale.dim() == 1
                      and index_k_scale.stride(0) == 1)  # fmt: skip
        if fast_scale and index_k_scale.shape[0] != n:
            raise ValueError(f"index_k_scale must hold one float32 per token ({n}), got {tuple(index_k_scale.shape)}")
        scales = None if index_k_scale is None or (fast_scale and self.use_triton) else _scale_bytes(index_k_scale, n)
        if n == 0:
            return
        if not self.use_triton:
            page_keys, page_scales = self._pages(layer_index)
            loc = loc.long()
            page, slot = loc // INDEX_PAGE_SIZE, loc % INDEX_PAGE_SIZE
            page_keys[page, slot] = keys
            if scales is not None:
                page_scales[page, slot] = scales
            return
        if index_k_scale is None:
            s, ss = keys, (0, 0)
        elif fast_scale:
            # one view instead of _scale_bytes' two: the kernel reads the 4 bytes of token i at byte 4 i
            s, ss = index_k_scale.view(torch.uint8), (4, 1)
        else:
            s, ss = scales, scales.stride()
        self._launch_set(layer_index, loc, n, keys, keys.stride(), s, ss, (self.index_buf, loc, keys, s))

    def _launch_set(self, layer_index, loc, n, keys, ks, s, ss, tensors) -> None:
        """One launch of the set kernel; ``ks`` / ``ss`` are the keys' and scales' byte strides, and ``s is
        keys`` when there are no scales."""
        dev = self._device_index
        if loc.get_device() != dev or keys.get_device() != dev or s.get_device() != dev:
            check_device(dev, self.device, loc=loc, index_k=keys, index_k_scale=s)
        block_n = min(_INDEX_BLOCK_N, next_pow2(n))
        kp, sp, lp = keys.data_ptr(), s.data_ptr(), loc.data_ptr()
        key = (ks, ss, kp & 15, sp & 15, loc.dtype, lp & 15, block_n)
        constexprs = _SET_ARGS.constexprs(**self._geometry, HAS_SCALE=s is not keys, BLOCK_N=block_n)
        self._set(key, -(-n // block_n), 1, (
            self._buf_ptr, layer_index, lp, loc.stride(0), n, kp, ks[0], ks[1], sp, ss[0], ss[1], *constexprs,
        ), tensors, _INDEX_NUM_WARPS)  # fmt: skip

    def _check_get(self, layer_index: int, seq_len: int, page_indices: torch.Tensor) -> None:
        self._check_layer(layer_index)
        if page_indices.dim() != 1 or page_indices.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"page_indices must be a 1-D int32/int64 tensor, got {page_indices.dtype} {tuple(page_indices.shape)}"
            )
        needed = -(-seq_len // INDEX_PAGE_SIZE)
        if seq_len < 0 or page_indices.shape[0] < needed:
            raise ValueError(f"seq_len={seq_len} needs {needed} page indices, got {page_indices.shape[0]}")

    def _check_outputs(self, seq_len: int, k_out: torch.Tensor | None, s_out: torch.Tensor | None) -> None:
        if k_out is not None and (k_out.dtype != torch.uint8 or k_out.shape != (seq_len, self.key_bytes) or not k_out.is_contiguous()):
            raise ValueError(f"k_out must be contiguous uint8 [{seq_len}, {self.key_bytes}], got {k_out.dtype} {tuple(k_out.shape)}")
        if s_out is not None:
            if not self.has_scale:
                raise ValueError("this indexer buffer keeps no scales")
            if s_out.dtype != torch.uint8 or s_out.shape != (seq_len, INDEX_SCALE_BYTES) or not s_out.is_contiguous():
                raise ValueError(f"s_out must be contiguous uint8 [{seq_len}, 4], got {s_out.dtype} {tuple(s_out.shape)}")

    def get_new(self, layer_index: int, seq_len: int, page_indices: torch.Tensor, want_k: bool, want_s: bool
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        """A sequence's keys ``[seq_len, key_bytes]`` and/or scales ``[seq_len, 4]`` (uint8) as new contiguous
        tensors (None for what is not wanted); otherwise as :meth:`get`.  Planned once per call signature; new
        outputs are 16-byte aligned (the caching allocator's blocks are), which the plan takes for granted and
        checks."""
        if seq_len < 0:
            self._check_get(layer_index, seq_len, page_indices)
        k_bytes, s_bytes = self.key_bytes, INDEX_SCALE_BYTES
        new = self._empty_bytes.new_empty_strided
        k_out = new((seq_len, k_bytes), (k_bytes, 1)) if want_k else None
        s_out = new((seq_len, s_bytes), (s_bytes, 1)) if want_s else None
        if not self.use_triton:
            self._check_get(layer_index, seq_len, page_indices)
            if want_s and not self.has_scale:
                raise ValueError("this indexer buffer keeps no scales")
            self.get(layer_index, seq_len, page_indices, k_out, s_out)
            return k_out, s_out
        k = k_out if k_out is not None else s_out
        s = s_out if s_out is not None else k
        pp = page_indices.data_ptr()
        kp, sp = (k.data_ptr(), s.data_ptr()) if k is not None else (0, 0)
        signature = ((seq_len - 1).bit_length() if seq_len else -1, page_indices.stride(), page_indices.dtype,
                     page_indices.get_device(), pp & 15, want_k, want_s)  # fmt: skip
        plan = self._get_plans.get(signature, UNPLANNED)
        # a first call, outputs less aligned than plans take them, or too few pages (refused)
        if plan is UNPLANNED or (kp | sp) & 15 or page_indices.numel() * INDEX_PAGE_SIZE < seq_len:
            self._check_get(layer_index, seq_len, page_indices)
            if want_s and not self.has_scale:
                raise ValueError("this indexer buffer keeps no scales")
            if page_indices.get_device() != self._device_index:
                check_device(self._device_index, self.device, page_indices=page_indices)
            plan = self._plan_get(seq_len, page_indices, kp, sp, pp, want_k, want_s)
            if not (kp | sp) & 15:  # (a plan of unaligned outputs is used once, and forgotten at the next miss)
                remember(self._get_plans, signature, plan)
        self._fire_get(plan, seq_len, layer_index, pp, kp, sp, page_indices, k, s)
        return k_out, s_out

    def get(self, layer_index: int, seq_len: int, page_indices: torch.Tensor, k_out: torch.Tensor | None,
            s_out: torch.Tensor | None, check: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
            ) -> None:  # fmt: skip
        """See :func:`get_index_k_triton`.  Checked and planned once per call signature; ``check(seq_len, k_out,
        s_out)``, when given, is a caller's own check of the outputs, run before this one's."""
        if not self.use_triton:
            if check is not None:
                check(seq_len, k_out, s_out)
            self._get_native(layer_index, seq_len, page_indices, k_out, s_out)
            return
        k = k_out if k_out is not None else s_out
        s = s_out if s_out is not None else k
        pp = page_indices.data_ptr()
        if k is None:
            kp = sp = 0
            outputs, counts_agree = None, True
        else:
            kp, sp, k_shape, s_shape = k.data_ptr(), s.data_ptr(), k.shape, s.shape
            outputs = (k_shape[1:], k.stride(), k.dtype, k.get_device(), kp & 15, s_shape[1:], s.stride(), s.dtype,
                       s.get_device(), sp & 15)  # fmt: skip
            counts_agree = bool(k_shape) and k_shape[0] == seq_len and bool(s_shape) and s_shape[0] == seq_len
        signature = (check, (seq_len - 1).bit_length() if seq_len else -1, page_indices.stride(), page_indices.dtype,
                     page_indices.get_device(), pp & 15, k_out is not None, s_out is not None, outputs)  # fmt: skip
        plan = self._get_plans.get(signature, UNPLANNED)
        # a first call, or outputs or pages of other counts than the call's (refused)
        if plan is UNPLANNED or not counts_agree or page_indices.numel() * INDEX_PAGE_SIZE < seq_len:
            if check is not None:
                check(seq_len, k_out, s_out)
            self._check_get(layer_index, seq_len, page_indices)
            self._check_outputs(seq_len, k_out, s_out)
            if k is not None:
                check_device(self._device_index, self.device, page_indices=page_indices, k_out=k, s_out=s)
            plan = remember(self._get_plans, signature, self._plan_get(
                seq_len, page_indices, kp, sp, pp, k_out is not None, s_out is not None))  # fmt: skip
        self._fire_get(plan, seq_len, layer_index, pp, kp, sp, page_indices, k, s)

    def _get_native(self, layer_index: int, seq_len: int, page_indices: torch.Tensor, k_out, s_out) -> None:
        self._check_get(layer_index, seq_len, page_indices)
        self._check_outputs(seq_len, k_out, s_out)
        if seq_len == 0 or (k_out is None and s_out is None):
            return
        page_keys, page_scales = self._pages(layer_index)
        i = torch.arange(seq_len, device=self.index_buf.device)
        page, slot = page_indices.long()[i // INDEX_PAGE_SIZE], i % INDEX_PAGE_SIZE
        if k_out is not None:
            k_out.copy_(page_keys[page, slot])
        if s_out is not None:
            s_out.copy_(page_scales[page, slot])

    def _plan_get(self, seq_len: int, page_indices: torch.Tensor, kp: int, sp: int, pp: int, want_k: bool,
                  want_s: bool) -> Plan | None:  # fmt: skip
        if seq_len == 0 or not (want_k or want_s):
            return None
        block_n = min(_INDEX_BLOCK_N, next_pow2(seq_len))
        key = (kp & 15, sp & 15, page_indices.dtype, pp & 15, want_k, want_s, block_n)
        constexprs = _GET_ARGS.constexprs(**self._geometry, WANT_K=want_k, WANT_S=want_s, BLOCK_N=block_n)
        return Plan(self._get, key, block_n, (1, 1), _INDEX_NUM_WARPS, page_indices.stride(0), constexprs=constexprs)

    def _fire_get(self, plan: Plan | None, seq_len: int, layer_index: int, pp: int, kp: int, sp: int, page_indices, k,
                  s) -> None:  # fmt: skip
        if not 0 <= layer_index < self.layers:
            self._check_layer(layer_index)
        if plan is not None:
            # the runtime arguments (_GET_ARGS; the plan's fixed part is the pages' stride), then the plan's constexprs
            plan(seq_len, (self._buf_ptr, layer_index, pp, plan.fixed, seq_len, kp, sp),
                 (self.index_buf, page_indices, k, s))  # fmt: skip


# ==========================================================================================================
# One call each (tests, benchmarks); pools keep an IndexerPages
# ==========================================================================================================


def _indexer(index_buf: torch.Tensor, key_bytes: int, use_triton: bool) -> IndexerPages:
    """An :class:`IndexerPages` for a buffer whose pages hold keys of ``key_bytes`` (with scales when the page
    size says so)."""
    return IndexerPages(index_buf, key_bytes, index_buf.shape[-1] == index_page_bytes_of(key_bytes, True), use_triton)


def set_index_k_triton(
    index_buf: torch.Tensor, layer_index: int, loc: torch.Tensor, index_k: torch.Tensor, index_k_scale=None
) -> None:
    """Write indexer keys (and scales) of tokens ``loc`` into their pages: token ``loc`` is slot ``loc % 64`` of
    page ``loc // 64``.

    :param index_buf: contiguous uint8 ``[L, pages, page_bytes]``; a page is 64 keys then (fp8) 64 scales.
    :param loc: ``[N]`` int32/int64 token locations.
    :param index_k: ``[N, D]`` keys, copied as raw bytes (fp8 or uint8 for the fp8 indexer, bf16 for the bf16
        one), any token stride.
    :param index_k_scale: fp8 indexer: ``[N]`` float32 (or ``[N, 4]`` uint8 holding them); None for bf16 keys.
    """
    keys = _key_bytes(index_k)
    IndexerPages(index_buf, keys.shape[1], index_k_scale is not None).set(layer_index, loc, index_k, index_k_scale)


def set_index_k_native(
    index_buf: torch.Tensor, layer_index: int, loc: torch.Tensor, index_k: torch.Tensor, index_k_scale=None
) -> None:
    """Torch reference of :func:`set_index_k_triton`."""
    keys = _key_bytes(index_k)
    IndexerPages(index_buf, keys.shape[1], index_k_scale is not None, use_triton=False).set(
        layer_index, loc, index_k, index_k_scale
    )


def get_index_k_triton(
    index_buf: torch.Tensor, layer_index: int, seq_len: int, page_indices: torch.Tensor,
    k_out: torch.Tensor | None, s_out: torch.Tensor | None, *, key_bytes: int,
) -> None:  # fmt: skip
    """Read a sequence's indexer keys and/or scales in token order (one launch for both).

    Token ``i`` of the sequence lives in page ``page_indices[i // 64]`` at slot ``i % 64``.

    :param index_buf: contiguous uint8 ``[L, pages, page_bytes]``.
    :param seq_len: tokens to read.
    :param page_indices: ``[>= ceil(seq_len / 64)]`` int32/int64 pages of the sequence.
    :param k_out: contiguous uint8 ``[seq_len, key_bytes]`` or None.
    :param s_out: contiguous uint8 ``[seq_len, 4]`` (float32 scale bytes) or None.
    :param key_bytes: bytes of one key (128 fp8, 256 bf16).
    """
    _indexer(index_buf, key_bytes, True).get(layer_index, seq_len, page_indices, k_out, s_out)


def get_index_k_native(
    index_buf: torch.Tensor, layer_index: int, seq_len: int, page_indices: torch.Tensor,
    k_out: torch.Tensor | None, s_out: torch.Tensor | None, *, key_bytes: int,
) -> None:  # fmt: skip
    """Torch reference of :func:`get_index_k_triton`."""
    _indexer(index_buf, key_bytes, False).get(layer_index, seq_len, page_indices, k_out, s_out)
