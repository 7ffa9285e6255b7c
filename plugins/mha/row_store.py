"""Writing the rows of the same tokens into one, two or three stacked buffers in one launch (:class:`RowStore`).

The MHA pool's own K/V store (:class:`kvcore_mha.kernels.KVStore`) is tuned for exactly two buffers with
scales; pools built on MHA's rows that keep another number of per-token buffers (keys only; keys, values and
DoubleSparse's channel labels) use this.  Each buffer is ``[L, R, H, D]`` (rows ``[H, D]`` packed, any ``D``),
stored in its cache dtype's storage dtype (fp8 as uint8), and every input is converted to it as
:func:`kvcore_mha.kernels.store_kv_triton` converts (same tile code, so the same bits); inputs may be strided
in the token and head dims.  A torch reference runs the same checks and writes the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from kvcore.kernels import dtypes
from kvcore.kernels.addresses import KeepsAddresses
from kvcore.kernels.dtypes import storage_dtype
from kvcore.kernels.fp8 import torch_e4m3fn_saturates
from kvcore.kernels.kernel_mode import triton_interpreting
from kvcore.kernels.launch import UNPLANNED, KernelArgs, Launcher, Plan, cdiv, remember
from kvcore.kernels.row_move import next_pow2
from kvcore_mha.kernels import STORE_MAX_BLOCK_C, STORE_TILE_ELEMS, _convert_native, _store_tile

__all__ = ["RowStore"]

MAX_BUFFERS = 3
_NUM_WARPS = 4
#: a tile converting into fp8 is bound by the encoder's ALU work, not by memory, and runs faster small: 1024
#: elements over 2 warps measured 0.71-0.78 of the copy ceiling where 4096 over 4 warps measured 0.64-0.68
#: (MiniMax's 128-wide fp8 index keys, 32768 rows, H200, 2026-12-03, benchmarks/probe_fp8_rows.py)
FP8_TILE_ELEMS = 1024
_FP8_NUM_WARPS = 2


@triton.jit(do_not_specialize=["layer", "loc_stride", "n_tokens"])
def _store_rows_kernel(
    a_ptr, b_ptr, c_ptr, layer, a_src, b_src, c_src, loc_ptr, loc_stride, n_tokens,
    a_sn, a_sh, a_sd, b_sn, b_sh, b_sd, c_sn, c_sh, c_sd,
    A_D: tl.constexpr, A_HD: tl.constexpr, A_LS: tl.constexpr, A_RS: tl.constexpr, A_PACKED: tl.constexpr,
    A_OUT: tl.constexpr, A_BC: tl.constexpr, A_CB: tl.constexpr,
    B_D: tl.constexpr, B_HD: tl.constexpr, B_LS: tl.constexpr, B_RS: tl.constexpr, B_PACKED: tl.constexpr,
    B_OUT: tl.constexpr, B_BC: tl.constexpr, B_CB: tl.constexpr,
    C_D: tl.constexpr, C_HD: tl.constexpr, C_LS: tl.constexpr, C_RS: tl.constexpr, C_PACKED: tl.constexpr,
    C_OUT: tl.constexpr, C_BC: tl.constexpr,
    SATURATE: tl.constexpr, BLOCK_N: tl.constexpr, HW_CVT: tl.constexpr,
):  # fmt: skip
    # grid: (token blocks, column blocks of A + of B + of C); a buffer with no column blocks is never reached
    pid_n = tl.program_id(0)
    pid_c = tl.program_id(1)
    lay = layer.to(tl.int64)
    if pid_c < A_CB:
        _store_tile(a_ptr + lay * A_LS, a_src, loc_ptr, loc_stride, loc_ptr, n_tokens, pid_n, pid_c, a_sn, a_sh, a_sd,
                    loc_ptr, 1.0, A_D, A_HD, A_RS, A_PACKED, A_OUT, SATURATE, 0, BLOCK_N, A_BC, HW_CVT, False, 1, 0)  # fmt: skip
    elif pid_c < A_CB + B_CB:
        _store_tile(b_ptr + lay * B_LS, b_src, loc_ptr, loc_stride, loc_ptr, n_tokens, pid_n, pid_c - A_CB, b_sn, b_sh,
                    b_sd, loc_ptr, 1.0, B_D, B_HD, B_RS, B_PACKED, B_OUT, SATURATE, 0, BLOCK_N, B_BC, HW_CVT, False, 1, 0)  # fmt: skip
    else:
        _store_tile(c_ptr + lay * C_LS, c_src, loc_ptr, loc_stride, loc_ptr, n_tokens, pid_n, pid_c - A_CB - B_CB, c_sn,
                    c_sh, c_sd, loc_ptr, 1.0, C_D, C_HD, C_RS, C_PACKED, C_OUT, SATURATE, 0, BLOCK_N, C_BC, HW_CVT, False, 1, 0)  # fmt: skip


#: the per-buffer constexprs of :func:`_store_rows_kernel`, each prefixed with its slot's letter (the last slot has
#: no ``CB``, its column blocks' count)
_SLOT_FIELDS = ("D", "HD", "LS", "RS", "PACKED", "OUT", "BC", "CB")
#: the store kernel's argument list (:class:`kvcore.kernels.launch.KernelArgs`): per call the caches' addresses,
#: the layer, the inputs' and the locations' addresses; the plan's loc stride; the count; the plan's strides.  Its
#: pointers are passed as addresses.
_ROWS_ARGS = KernelArgs(
    _store_rows_kernel,
    runtime=("a_ptr b_ptr c_ptr layer a_src b_src c_src loc_ptr loc_stride n_tokens",
             "a_sn a_sh a_sd b_sn b_sh b_sd c_sn c_sh c_sd"),
    constexprs=[" ".join(f"{slot}_{f}" for f in _SLOT_FIELDS[: 8 if slot != "C" else 7]) for slot in "ABC"]
    + ["SATURATE BLOCK_N HW_CVT"],
    pointers="a_ptr b_ptr c_ptr a_src b_src c_src loc_ptr",
)  # fmt: skip


class RowStore(KeepsAddresses):
    """Stores the rows of the same ``loc`` into every one of ``caches`` (1 to 3 stacked ``[L, R, H, D]`` buffers
    with the same ``L`` and ``R``), one launch per call, or through the torch reference (``use_triton=False``).

    What a call's signature fixes (its tensors' shapes, strides, dtypes, devices and alignments) is checked and
    planned on the signature's first call (:class:`kvcore.kernels.launch.Plan`); a call reads its signature, finds its plan
    and launches once, its addresses and layer read per call.  Buffer slots past ``len(caches)`` are padded with
    the first buffer and input (the kernel never reaches them).

    :param caches: the stacked buffers, rows packed, dtype ``storage_dtype(cache_dtype)``.
    :param cache_dtype: the caches' logical dtype.
    :param names: what error messages call each input (``("cache_k", "cache_v", "cache_label")``).
    """

    def __init__(self, caches: Sequence[torch.Tensor], cache_dtype: torch.dtype, use_triton: bool = True,
                 names: Sequence[str] = ("cache_k", "cache_v", "cache_label")):  # fmt: skip
        if not 1 <= len(caches) <= MAX_BUFFERS:
            raise ValueError(f"RowStore writes 1 to {MAX_BUFFERS} buffers, got {len(caches)}")
        want = storage_dtype(cache_dtype)
        for cache in caches:
            s = cache.stride()
            if cache.dim() != 4 or cache.shape[:2] != caches[0].shape[:2] or cache.dtype != want:
                raise ValueError(f"caches must be [L, R, H, D] of {want} with the same L and R, got "
                                 f"{[(tuple(c.shape), c.dtype) for c in caches]}")  # fmt: skip
            if s[3] != 1 or s[2] != cache.shape[3]:
                raise ValueError("cache rows must be contiguous ([H, D] packed)")
        self.caches, self.cache_dtype, self.use_triton = list(caches), cache_dtype, use_triton
        self.names = tuple(names[: len(caches)])
        self.layers = caches[0].shape[0]
        self.row_shapes = [tuple(c.shape[2:]) for c in caches]
        self.launch = Launcher(_ROWS_ARGS, caches[0].device)
        self._saturate, self._hw_cvt = torch_e4m3fn_saturates(), not triton_interpreting()
        self._pad = MAX_BUFFERS - len(caches)
        self._padded_caches = (*caches, *[caches[0]] * self._pad)
        self._bind_addresses()

    def _bind_addresses(self) -> None:
        """The caches' addresses; the plans start empty."""
        self._cache_ptrs = tuple(c.data_ptr() for c in self._padded_caches)
        self._plans: dict[tuple, Plan | None] = {}

    def _check(self, loc: torch.Tensor, inputs: Sequence[torch.Tensor], layer_index: int | None = None) -> None:
        """The checks of a call (the layer's too, unless ``layer_index`` is None)."""
        if len(inputs) != len(self.caches):
            raise ValueError(f"expected {len(self.caches)} inputs ({', '.join(self.names)}), got {len(inputs)}")
        if layer_index is not None:
            self._check_layer(layer_index)
        if loc.dim() != 1 or loc.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"loc must be a 1-D int32/int64 tensor, got {loc.dtype} {tuple(loc.shape)}")
        device = self.caches[0].device
        for name, x, shape in zip(self.names, inputs, self.row_shapes):
            if tuple(x.shape) != (loc.shape[0], *shape):
                raise ValueError(f"{name} must be [N, H, D] = {(loc.shape[0], *shape)}, got {tuple(x.shape)}")
            if x.device != device:
                raise ValueError(f"{name} is on {x.device}, the pool on {device}")
        if loc.device != device:
            raise ValueError(f"loc is on {loc.device}, the pool on {device}")

    def _check_layer(self, layer_index: int) -> None:
        if not 0 <= layer_index < self.layers:
            raise ValueError(f"layer_index {layer_index} out of range for {self.layers} layers")

    def _codes(self, inputs: Sequence[torch.Tensor]) -> list[int]:
        return [dtypes.conversion_code(x.dtype, self.cache_dtype, name) for name, x in zip(self.names, inputs)]

    def __call__(self, layer_index: int, loc: torch.Tensor, *inputs: torch.Tensor) -> None:
        """Write ``inputs[i]`` (``[N, H_i, D_i]``, float32/float16/bfloat16 or the cache dtype) at rows ``loc`` of
        ``layer_index`` in ``caches[i]``; the inputs are never modified."""
        if not self.use_triton:
            self._store_native(layer_index, loc, inputs)
            return
        lp, n = loc.data_ptr(), loc.numel()
        signature = [(n - 1).bit_length() if n else -1, loc.stride(), loc.dtype, loc.get_device(), lp & 15]
        addresses = []
        counts_agree = True
        for x in inputs:
            address, shape = x.data_ptr(), x.shape
            addresses.append(address)
            signature += (shape[1:], x.stride(), x.dtype, x.get_device(), address & 15)
            if not shape or shape[0] != n:
                counts_agree = False
        signature = tuple(signature)
        plan = self._plans.get(signature, UNPLANNED)
        if plan is UNPLANNED or not counts_agree:  # a first call, or inputs of another count (refused)
            plan = remember(self._plans, signature, self._plan(loc, inputs))
        if not 0 <= layer_index < self.layers:
            self._check_layer(layer_index)
        if plan is None:
            return
        rest, byte_views = plan.fixed
        addresses += addresses[:1] * self._pad
        args = (*self._cache_ptrs, layer_index, *addresses, lp, rest[0], n, *rest[1:])
        if byte_views:
            plan(n, args, self._byte_tensors(loc, inputs))
        else:
            plan(n, args, (*self._padded_caches, *inputs, *inputs[:1] * self._pad, loc))

    def _plan(self, loc: torch.Tensor, inputs: Sequence[torch.Tensor]) -> Plan | None:
        """The plan of a call's signature (:mod:`kvcore.kernels.launch`), after the full checks of the call; None when
        the call has no rows.  ``plan.fixed`` is ``(every runtime argument after loc's address but the token count,
        whether the kernel reads some input as its bytes)``; the constexprs are the plan's own."""
        self._check(loc, inputs)
        codes = self._codes(inputs)
        n = loc.shape[0]
        if n == 0:
            return None
        byte_views = any(self._byte_view(x, code, c) for x, code, c in zip(inputs, codes, self.caches))
        inputs = self._kernel_inputs(inputs, codes)
        to_fp8 = any(code in (dtypes.E4M3FN, dtypes.E5M2) for code in codes)
        tile, warps = (FP8_TILE_ELEMS, _FP8_NUM_WARPS) if to_fp8 else (STORE_TILE_ELEMS, _NUM_WARPS)
        block_n, columns, constexprs = self._spec(1 << (n - 1).bit_length(), inputs, codes, tile)
        key = (block_n, loc.dtype, loc.data_ptr() % 16,
               *((x.dtype, x.stride(), x.data_ptr() % 16, code) for x, code in zip(inputs, codes)))  # fmt: skip
        srcs = [*inputs, *[inputs[0]] * self._pad]
        strides = [s for x in srcs for s in x.stride()]
        rest = (loc.stride(0), *strides)
        return Plan(self.launch, key, block_n, (columns, 1), warps, (rest, byte_views), constexprs=constexprs)

    @staticmethod
    def _byte_view(x: torch.Tensor, code: int, cache: torch.Tensor) -> bool:
        """Whether the kernel reads input ``x`` as its bytes (fp8 into an fp8 cache)."""
        return code == dtypes.SAME and x.dtype != cache.dtype

    def _kernel_inputs(self, inputs: Sequence[torch.Tensor], codes: Sequence[int]) -> list[torch.Tensor]:
        """The inputs as the kernel reads them (fp8 into an fp8 cache: its bytes)."""
        views = zip(inputs, codes, self.caches)
        return [x.view(torch.uint8) if self._byte_view(x, code, cache) else x for x, code, cache in views]

    def _byte_tensors(self, loc: torch.Tensor, inputs: Sequence[torch.Tensor]
                      ) -> Callable[[], tuple[torch.Tensor, ...]]:  # fmt: skip
        """The tensors behind the addresses of a call with inputs the kernel reads as their bytes, for a launch
        through Triton's dispatcher (kernel order): views, made only when the dispatcher needs them (and a closure
        built here, not in :meth:`__call__`, whose every call its cells would cost)."""

        def tensors() -> tuple[torch.Tensor, ...]:
            kernel_inputs = self._kernel_inputs(inputs, self._codes(inputs))
            return *self._padded_caches, *kernel_inputs, *kernel_inputs[:1] * self._pad, loc

        return tensors

    def _store_native(self, layer_index: int, loc: torch.Tensor, inputs: Sequence[torch.Tensor]) -> None:
        """The torch reference, after the same checks."""
        self._check(loc, inputs, layer_index)
        self._codes(inputs)
        if loc.shape[0] == 0:
            return
        rows = loc.long()
        for cache, x in zip(self.caches, inputs):
            cache[layer_index, rows] = _convert_native(x, self.cache_dtype, None)

    def _spec(self, n_pad: int, inputs, codes, tile: int) -> tuple:
        """(BLOCK_N, column blocks in all, the kernel's constexprs) of a call's tokens (rounded up to a power of
        two), inputs and conversions, in tiles of about ``tile`` elements."""
        named, blocks, widths = {}, 0, []
        for slot, letter in enumerate("ABC"[:MAX_BUFFERS]):
            if slot < len(self.caches):
                cache, x, code = self.caches[slot], inputs[slot], codes[slot]
                heads, dim = cache.shape[2], cache.shape[3]
                block_c = min(next_pow2(heads * dim), STORE_MAX_BLOCK_C)
                cb = cdiv(heads * dim, block_c)
                packed = x.stride(2) == 1 and x.stride(1) == dim
                fields = (dim, heads * dim, cache.stride(0), cache.stride(1), packed, code, block_c, cb)
                widths.append(block_c)
            else:  # a slot past the caches: never reached (no column blocks)
                fields, cb = (1, 1, 0, 1, True, dtypes.SAME, 1, 0), 0
            blocks += cb
            named.update((f"{letter}_{field}", value) for field, value in zip(_SLOT_FIELDS, fields))
        del named["C_CB"]  # the last slot needs no block count
        block_n = max(1, min(tile // max(widths), n_pad))
        return block_n, blocks, _ROWS_ARGS.constexprs(**named, SATURATE=self._saturate, BLOCK_N=block_n,
                                                      HW_CVT=self._hw_cvt)  # fmt: skip
