"""Hot-path kernels of the MHA pool: writing new K/V rows into the cache, and moving rows between slots.

Buffer format (see the pool): all layers of K live in one contiguous tensor ``k_cache`` of shape
``[L, R, H, Dk]`` and V in ``v_cache`` of shape ``[L, R, H, Dv]`` (R = size + page_size rows, row 0 is
padding).  The storage dtype is the cache dtype, except fp8 caches, which are stored as ``torch.uint8``
holding float8_e4m3fn / float8_e5m2 bytes.  Offsets are computed in int64 (pools exceed 2**31 bytes).

Every kernel has a torch reference of the same signature beside it (``*_native``).  Nothing here picks an
implementation: a pool keeps one :class:`KVStore` bound to its caches, on the kernel or the reference by its
kernels mode (see ``kvcore.kernels.kernel_mode``); the store checks and plans each call signature once and launches the
compiled kernel directly (:mod:`kvcore.kernels.launch`).  ``store_kv_triton`` / ``store_kv_native`` build one per call.

``store_kv_triton``
    One launch writes K and V: grid ``(token blocks, column blocks of K + column blocks of V)``; a program
    copies a ``[BLOCK_N, BLOCK_C]`` tile (rows of the layer addressed through ``loc``, columns of the
    flattened ``H * D`` row), converting to the cache dtype on the way.  Column blocks are up to
    ``STORE_MAX_BLOCK_C`` elements wide and ``BLOCK_N`` fills a tile of ``STORE_TILE_ELEMS`` elements.
    Sources may be strided in the token and head dims (qkv splits); when the head dim is packed
    (``stride(1) == D * stride(2)`` and ``stride(2) == 1``) the load is a plain contiguous row.

Moves between slots are the family-independent row move of :mod:`kvcore.kernels.row_move` (``KVCache.move_kv_cache``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kvcore.kernels import dtypes
from kvcore.kernels.addresses import KeepsAddresses
from kvcore.kernels.dtypes import is_fp8_dtype, storage_dtype
from kvcore.kernels.fp8 import f32_to_bf16_bits, f32_to_fp8_bits, f32_to_fp8_bits_hw, torch_e4m3fn_saturates
from kvcore.kernels.kernel_mode import triton_interpreting
from kvcore.kernels.launch import UNPLANNED, KernelArgs, Launcher, Plan, cdiv, launch_hooks_installed, remember
from kvcore.kernels.row_move import next_pow2 as _next_pow2

__all__ = [
    "KVStore",
    "store_kv_native",
    "store_kv_triton",
]

# store_kv tiling (elements, not bytes).
STORE_MAX_BLOCK_C = 1024
STORE_TILE_ELEMS = 4096  # elements per program when converting (fp8 32k tokens: 0.92 of the copy ceiling)
STORE_COPY_TILE_ELEMS = 2048  # same-dtype stores (bf16 32k tokens: 0.92, against 0.90 with 4096)

_STORE_NUM_WARPS = 4

_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)
# The conversion codes of kvcore.kernels.dtypes, as the kernel compares them.
_SAME = tl.constexpr(dtypes.SAME)
_F32 = tl.constexpr(dtypes.F32)
_F16 = tl.constexpr(dtypes.F16)
_BF16 = tl.constexpr(dtypes.BF16)

# Scale modes.
_SCALE_NONE = 0
_SCALE_VALUE = 1
_SCALE_POINTER = 2


# ==========================================================================================================
# store_kv
# ==========================================================================================================


def _scale_tensor(scale, device) -> torch.Tensor:
    """The scale as a float32 tensor of shape [1] on ``device`` (a device tensor, so that torch divides
    element-wise instead of multiplying by a host-computed reciprocal)."""
    return torch.as_tensor(scale, dtype=torch.float32).to(device).reshape(1)


def _convert_native(x: torch.Tensor, cache_dtype: torch.dtype, scale) -> torch.Tensor:
    """``x`` as the cache stores it: copied when it already has the cache dtype (any scale ignored), else
    divided by ``scale`` in float32 (when given) and converted; fp8 viewed as its uint8 storage."""
    if x.dtype == cache_dtype:
        y = x
    elif scale is not None:
        y = (x.float() / _scale_tensor(scale, x.device)).to(cache_dtype)
    else:
        y = x.to(cache_dtype)
    return y.view(torch.uint8) if is_fp8_dtype(cache_dtype) else y


@triton.jit
def _store_tile(
    dst_ptr,
    src_ptr,
    loc_ptr,
    loc_stride,
    map_ptr,
    n_tokens,
    pid_n,
    pid_c,
    src_sn,
    src_sh,
    src_sd,
    scale_ptr,
    scale_value,
    D: tl.constexpr,
    HD: tl.constexpr,
    DST_ROW_STRIDE: tl.constexpr,
    SRC_PACKED: tl.constexpr,
    OUT: tl.constexpr,
    SATURATE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HW_CVT: tl.constexpr,
    HAS_MAP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGE_ROWS: tl.constexpr,
):
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_n = offs_n < n_tokens
    mask = mask_n[:, None] & (cols < HD)[None, :]
    rows = tl.load(loc_ptr + offs_n.to(tl.int64) * loc_stride, mask=mask_n, other=0).to(tl.int64)
    if HAS_MAP:  # the rows are map[loc] (a sliding-window sub-pool's slots of full-pool locations)
        rows = tl.load(map_ptr + rows, mask=mask_n, other=0).to(tl.int64)
    if PAGE_ROWS > 0:  # page-major rows: token t's row is (t // PAGE_SIZE) * PAGE_ROWS + t % PAGE_SIZE
        rows += (rows // PAGE_SIZE) * (PAGE_ROWS - PAGE_SIZE)

    if SRC_PACKED:
        src_off = offs_n.to(tl.int64)[:, None] * src_sn + cols[None, :]
    else:
        heads = (cols // D).to(tl.int64)
        dims = (cols % D).to(tl.int64)
        src_off = offs_n.to(tl.int64)[:, None] * src_sn + (heads * src_sh + dims * src_sd)[None, :]
    x = tl.load(src_ptr + src_off, mask=mask, other=0)
    dst = dst_ptr + rows[:, None] * DST_ROW_STRIDE + cols[None, :]

    if OUT == _SAME:
        tl.store(dst, x, mask=mask)
    else:
        xf = x.to(tl.float32)
        if SCALE_MODE == 1:
            xf = tl.math.div_rn(xf, tl.zeros_like(xf) + scale_value)
        elif SCALE_MODE == 2:
            s = tl.load(scale_ptr).to(tl.float32)
            xf = tl.math.div_rn(xf, tl.zeros_like(xf) + s)
        if OUT == _F32:
            tl.store(dst, xf, mask=mask)
        elif OUT == _F16:
            tl.store(dst, xf.to(tl.float16), mask=mask)
        elif OUT == _BF16:
            if HW_CVT:
                tl.store(dst, xf.to(tl.bfloat16), mask=mask)
            else:
                tl.store(dst, f32_to_bf16_bits(xf).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            if HW_CVT:
                tl.store(dst, f32_to_fp8_bits_hw(xf, OUT, SATURATE).to(tl.uint8), mask=mask)
            else:
                tl.store(dst, f32_to_fp8_bits(xf, OUT, SATURATE).to(tl.uint8), mask=mask)


@triton.jit(do_not_specialize=["layer", "loc_stride", "n_tokens"])
def _store_kv_kernel(
    k_cache_ptr,
    v_cache_ptr,
    layer,
    k_src_ptr,
    v_src_ptr,
    loc_ptr,
    loc_stride,
    map_ptr,
    n_tokens,
    k_src_sn,
    k_src_sh,
    k_src_sd,
    v_src_sn,
    v_src_sh,
    v_src_sd,
    k_scale_ptr,
    v_scale_ptr,
    k_scale_value,
    v_scale_value,
    DK: tl.constexpr,
    DV: tl.constexpr,
    HDK: tl.constexpr,
    HDV: tl.constexpr,
    K_LAYER_STRIDE: tl.constexpr,
    V_LAYER_STRIDE: tl.constexpr,
    K_ROW_STRIDE: tl.constexpr,
    V_ROW_STRIDE: tl.constexpr,
    K_PACKED: tl.constexpr,
    V_PACKED: tl.constexpr,
    OUT: tl.constexpr,
    SATURATE: tl.constexpr,
    K_SCALE_MODE: tl.constexpr,
    V_SCALE_MODE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_CK: tl.constexpr,
    BLOCK_CV: tl.constexpr,
    NUM_CB_K: tl.constexpr,
    HW_CVT: tl.constexpr,
    HAS_MAP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGE_ROWS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_c = tl.program_id(1)
    if pid_c < NUM_CB_K:
        _store_tile(
            k_cache_ptr + layer.to(tl.int64) * K_LAYER_STRIDE, k_src_ptr, loc_ptr, loc_stride, map_ptr, n_tokens, pid_n,
            pid_c, k_src_sn, k_src_sh, k_src_sd, k_scale_ptr, k_scale_value,
            DK, HDK, K_ROW_STRIDE, K_PACKED, OUT, SATURATE, K_SCALE_MODE, BLOCK_N, BLOCK_CK, HW_CVT, HAS_MAP, PAGE_SIZE,
            PAGE_ROWS,
        )  # fmt: skip
    else:
        _store_tile(
            v_cache_ptr + layer.to(tl.int64) * V_LAYER_STRIDE, v_src_ptr, loc_ptr, loc_stride, map_ptr, n_tokens, pid_n,
            pid_c - NUM_CB_K, v_src_sn, v_src_sh, v_src_sd, v_scale_ptr, v_scale_value,
            DV, HDV, V_ROW_STRIDE, V_PACKED, OUT, SATURATE, V_SCALE_MODE, BLOCK_N, BLOCK_CV, HW_CVT, HAS_MAP, PAGE_SIZE,
            PAGE_ROWS,
        )  # fmt: skip


#: the store kernel's argument list (:class:`kvcore.kernels.launch.KernelArgs`): per call the caches' addresses, the
#: layer, the inputs', the locations' and the map's, the count; then the inputs' strides (the plan's), and the
#: scales (per call, or the plan's); its pointers are passed as addresses
_STORE_ARGS = KernelArgs(
    _store_kv_kernel,
    runtime=("k_cache_ptr v_cache_ptr layer k_src_ptr v_src_ptr loc_ptr loc_stride map_ptr n_tokens",
             "k_src_sn k_src_sh k_src_sd v_src_sn v_src_sh v_src_sd",
             "k_scale_ptr v_scale_ptr k_scale_value v_scale_value"),
    constexprs="DK DV HDK HDV K_LAYER_STRIDE V_LAYER_STRIDE K_ROW_STRIDE V_ROW_STRIDE K_PACKED V_PACKED OUT SATURATE "
               "K_SCALE_MODE V_SCALE_MODE BLOCK_N BLOCK_CK BLOCK_CV NUM_CB_K HW_CVT HAS_MAP PAGE_SIZE PAGE_ROWS",
    pointers="k_cache_ptr v_cache_ptr k_src_ptr v_src_ptr loc_ptr map_ptr k_scale_ptr v_scale_ptr",
)  # fmt: skip


def _scale_args(scale, dummy: torch.Tensor):
    """(mode, pointer, value) for a scale given as None, a python number, or a 0-d/1-element tensor.
    Tensors are read inside the kernel (no host sync; CUDA-graph safe)."""
    if scale is None:
        return _SCALE_NONE, dummy, 1.0
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"a scale tensor must hold one element, got shape {tuple(scale.shape)}")
        if scale.device != dummy.device:
            raise ValueError(f"scale tensor on {scale.device}, cache on {dummy.device}")
        return _SCALE_POINTER, scale, 1.0
    return _SCALE_VALUE, dummy, float(scale)


def _scale_signature(scale) -> tuple | type | None:
    """What a call signature holds of a scale: None, ``float`` for a python number (its value is read per call),
    or a tensor's element count, dtype, device and alignment (its address is read per call)."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        return scale.numel(), scale.dtype, scale.get_device(), scale.data_ptr() & 15
    return float


def _scale_call(mode: int, scale, dummy_ptr: int) -> tuple[int, float]:
    """(pointer, value) a call passes for a scale of the given mode (the pointer of an unread scale is
    ``dummy_ptr``, a cache's own address)."""
    if mode == _SCALE_POINTER:
        return scale.data_ptr(), 1.0
    return dummy_ptr, float(scale) if mode == _SCALE_VALUE else 1.0


class KVStore(KeepsAddresses):
    """The K/V store bound to one pool's caches: the Triton kernel (``use_triton``) or its torch reference.

    What is fixed at pool creation (shapes, strides, constexprs, the launcher) is computed once; what is fixed by
    a call's signature (its tensors' shapes, strides, dtypes, devices and alignments, the kind of each scale) is
    checked and planned on the signature's first call (:class:`kvcore.kernels.launch.Plan`); a call reads its signature,
    finds its plan and launches once.  Both paths share the checks.

    :param k_cache: ``[L, R, H, Dk]`` cache, rows contiguous (``stride(2) == Dk``, ``stride(3) == 1``),
        dtype ``storage_dtype(cache_dtype)``.
    :param v_cache: ``[L, R, H, Dv]`` cache, same conditions.
    :param cache_dtype: the cache's logical dtype.
    :param use_triton: the Triton kernel (True) or the torch reference (False).
    :param index_map: when given, the store's own map: every call writes rows ``index_map[loc]`` (a page-major
        pool's token -> row map) and passes no map of its own.  1-D int32/int64 on the caches' device, checked here
        once: its shape, dtype and address must stay as they are (its values are read by every launch).
    :param pages: ``(page_size, rows_per_page)``: the caches' rows are page-major, token ``t`` (after any map) at
        row ``(t // page_size) * rows_per_page + t % page_size``, computed inside the launch (a page-major pool's
        physical tokens; no table read).  ``page_size`` a power of two, ``rows_per_page`` at least ``page_size``.
    """

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_dtype: torch.dtype, use_triton: bool = True,
                 index_map: torch.Tensor | None = None, pages: tuple[int, int] | None = None):  # fmt: skip
        ks, vs = k_cache.shape, v_cache.shape
        if len(ks) != 4 or len(vs) != 4 or ks[:3] != vs[:3]:
            raise ValueError(f"caches must be [L, R, H, D] alike, got {tuple(ks)} and {tuple(vs)}")
        want = storage_dtype(cache_dtype)
        if k_cache.dtype != want or v_cache.dtype != want:
            raise ValueError(
                f"cache_dtype {cache_dtype} is stored as {want}, got k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
            )
        kcs, vcs = k_cache.stride(), v_cache.stride()
        if kcs[3] != 1 or kcs[2] != ks[3] or vcs[3] != 1 or vcs[2] != vs[3]:
            raise ValueError("cache rows must be contiguous ([H, D] packed)")
        self.k_cache, self.v_cache, self.cache_dtype, self.use_triton = k_cache, v_cache, cache_dtype, use_triton
        self.layers, self.heads, self.dk, self.dv = ks[0], ks[2], ks[3], vs[3]
        self.k_shape, self.v_shape = (ks[2], ks[3]), (vs[2], vs[3])
        self.launch = Launcher(_STORE_ARGS, k_cache.device)
        self._device_index = k_cache.get_device()
        self._saturate, self._hw_cvt = torch_e4m3fn_saturates(), not triton_interpreting()
        self._codes: dict[torch.dtype, int] = {}
        self._check_index_map(index_map)
        if index_map is not None and index_map.get_device() != self._device_index:
            raise ValueError(f"index_map must be on {k_cache.device}, got {index_map.device}")
        self._own_map = index_map
        self._bind_addresses()
        self._page_size, self._page_rows = (1, 0) if pages is None else pages
        if pages is not None and (self._page_size < 1 or self._page_size & (self._page_size - 1)
                                  or self._page_rows < self._page_size):  # fmt: skip
            raise ValueError(f"pages=(page_size, rows_per_page) needs a power-of-two page_size and rows_per_page >= "
                             f"page_size, got {pages}")  # fmt: skip

    def _bind_addresses(self) -> None:
        """The caches' and the own index map's addresses; the plans, which keep them, start empty."""
        self._cache_ptrs = (self.k_cache.data_ptr(), self.v_cache.data_ptr())
        self._own_map_address = 0 if self._own_map is None else self._own_map.data_ptr()
        self._plans: dict[tuple, Plan | None] = {}

    # -- checks ---------------------------------------------------------------------------------------------

    def _code(self, dtype: torch.dtype) -> int:
        code = self._codes.get(dtype)
        if code is None:
            if dtype not in _FLOAT_INPUTS and dtype != self.cache_dtype:
                raise ValueError(f"unsupported input dtype {dtype} for cache dtype {self.cache_dtype}")
            code = self._codes[dtype] = dtypes.conversion_code(dtype, self.cache_dtype, "cache_k")
        return code

    def _check_layer(self, layer_index: int) -> None:
        if not 0 <= layer_index < self.layers:
            raise ValueError(f"layer_index {layer_index} out of range for {self.layers} layers")

    @staticmethod
    def _check_index_map(index_map: torch.Tensor | None) -> None:
        if index_map is not None and (index_map.dim() != 1 or index_map.dtype not in (torch.int32, torch.int64)):
            raise ValueError(
                f"index_map must be a 1-D int32/int64 tensor, got {index_map.dtype} {tuple(index_map.shape)}"
            )
        if index_map is not None and index_map.stride(0) != 1:  # the kernel reads entry i at index_map + i
            raise ValueError(f"index_map must be contiguous, got stride {index_map.stride(0)}")

    def _check_not_remapped(self, index_map: torch.Tensor | None) -> None:
        """A store with a map of its own takes no other (``index_map`` is the call's map, or the store's own)."""
        if self._own_map is not None and index_map is not self._own_map:
            raise ValueError("this store writes every call through its own index_map: a call passes none")

    def _check(self, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> tuple[int, int]:
        """The checks of the inputs both paths make (the kernel's also checks their devices): (rows, conversion
        code)."""
        loc_dtype = loc.dtype
        if loc.dim() != 1 or (loc_dtype is not torch.int32 and loc_dtype is not torch.int64):
            raise ValueError(f"loc must be a 1-D int32/int64 tensor, got {loc_dtype} {tuple(loc.shape)}")
        n = loc.shape[0]
        if cache_k.shape != (n, *self.k_shape):
            raise ValueError(f"cache_k must be [N, H, Dk] = {(n, *self.k_shape)}, got {tuple(cache_k.shape)}")
        if cache_v.shape != (n, *self.v_shape):
            raise ValueError(f"cache_v must be [N, H, Dv] = {(n, *self.v_shape)}, got {tuple(cache_v.shape)}")
        src_dtype = cache_k.dtype
        if cache_v.dtype != src_dtype:
            raise ValueError(f"cache_k and cache_v must share a dtype, got {src_dtype} and {cache_v.dtype}")
        return n, self._code(src_dtype)

    # -- plans and the one launch ----------------------------------------------------------------------------

    def _spec(self, n_pad: int, out: int, kss: tuple, vss: tuple, k_mode: int, v_mode: int, mapped: bool) -> tuple:
        """(BLOCK_N, column blocks, the kernel's constexprs) of a call's tokens (rounded up to a power of two),
        conversion, input strides and scale modes, with or without an index map."""
        hdk, hdv = self.heads * self.dk, self.heads * self.dv
        block_n, block_ck, block_cv, num_cb_k, num_cb = _store_plan(hdk, hdv, n_pad, out == dtypes.SAME)
        kcs, vcs = self.k_cache.stride(), self.v_cache.stride()
        constexprs = _STORE_ARGS.constexprs(
            DK=self.dk, DV=self.dv, HDK=hdk, HDV=hdv, K_LAYER_STRIDE=kcs[0], V_LAYER_STRIDE=vcs[0],
            K_ROW_STRIDE=kcs[1], V_ROW_STRIDE=vcs[1], K_PACKED=kss[2] == 1 and kss[1] == self.dk,
            V_PACKED=vss[2] == 1 and vss[1] == self.dv, OUT=out, SATURATE=self._saturate, K_SCALE_MODE=k_mode,
            V_SCALE_MODE=v_mode, BLOCK_N=block_n, BLOCK_CK=block_ck, BLOCK_CV=block_cv, NUM_CB_K=num_cb_k,
            HW_CVT=self._hw_cvt, HAS_MAP=mapped, PAGE_SIZE=self._page_size, PAGE_ROWS=self._page_rows,
        )  # fmt: skip
        return block_n, num_cb, constexprs

    def _plan(self, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, k_scale, v_scale,
              index_map: torch.Tensor | None) -> Plan | None:  # fmt: skip
        """The plan of a call's signature (:mod:`kvcore.kernels.launch`), after the full checks of the call; None when
        the call has no rows.

        ``plan.fixed`` is ``(K cache address, V cache address, loc stride, rest, per call)``, the plan's
        constexprs its own (:data:`_STORE_ARGS`).  ``per call`` None (the common case): no scale is read (none
        given, or the inputs have the cache dtype, which ignores them), the kernel reads the inputs as they are,
        every runtime argument after the token count is the plan's ``tail`` (``rest`` is empty), and the tensors
        behind the addresses are the call's own.  Otherwise it is ``(K scale mode, V scale mode, whether the
        kernel reads the inputs as their bytes)``, ``rest`` is the inputs' strides (the runtime arguments after the
        token count up to the scales' pointers), and each scale's pointer and value are read per call
        (:func:`_scale_call`).  The token count is the call's own (:mod:`kvcore.kernels.launch`).
        """
        self._check_index_map(index_map)
        self._check_not_remapped(index_map)
        n, out = self._check(loc, cache_k, cache_v)
        if n == 0:
            return None
        device = self._device_index
        if cache_k.get_device() != device or cache_v.get_device() != device or loc.get_device() != device:
            raise ValueError(f"loc, cache_k and cache_v must be on {self.k_cache.device}, got {loc.device}, "
                             f"{cache_k.device} and {cache_v.device}")  # fmt: skip
        if index_map is None:
            map_key = None
        else:
            if index_map.get_device() != device:
                raise ValueError(f"index_map must be on {self.k_cache.device}, got {index_map.device}")
            map_key = (index_map.dtype, index_map.data_ptr() & 15)
        if out == dtypes.SAME:
            k_scale = v_scale = None  # SGLang's rule: scales apply only to inputs that are converted
        k_ptr, v_ptr = self._cache_ptrs
        if k_scale is None and v_scale is None:
            k_mode = v_mode = _SCALE_NONE
            k_sp, v_sp = k_ptr, v_ptr
        else:
            k_mode, k_scale_t, _ = _scale_args(k_scale, self.k_cache)
            v_mode, v_scale_t, _ = _scale_args(v_scale, self.v_cache)
            k_sp, v_sp = k_scale_t.data_ptr(), v_scale_t.data_ptr()
        kss, vss = cache_k.stride(), cache_v.stride()
        kp, vp = cache_k.data_ptr(), cache_v.data_ptr()
        block_n, num_cb, constexprs = self._spec(1 << (n - 1).bit_length(), out, kss, vss, k_mode, v_mode,
                                                 map_key is not None)  # fmt: skip
        key = (block_n, out, cache_k.dtype, kss, vss, kp & 15, vp & 15, loc.dtype, loc.data_ptr() & 15, k_sp & 15,
               v_sp & 15, map_key, k_mode, v_mode)  # fmt: skip
        if k_mode == _SCALE_POINTER or v_mode == _SCALE_POINTER:  # Triton specializes on a scale tensor's dtype too
            key += (k_scale_t.dtype, v_scale_t.dtype)
        strides = (*kss, *vss)
        byte_views = out == dtypes.SAME and cache_k.dtype != self.k_cache.dtype  # fp8 inputs into an fp8 cache
        if k_mode == v_mode == _SCALE_NONE and not byte_views:
            return Plan(self.launch, key, block_n, (num_cb, 1), _STORE_NUM_WARPS, (k_ptr, v_ptr, loc.stride(0), (), None),
                        constexprs=constexprs, tail=(*strides, k_ptr, v_ptr, 1.0, 1.0))  # fmt: skip
        fixed = (k_ptr, v_ptr, loc.stride(0), strides, (k_mode, v_mode, byte_views))
        return Plan(self.launch, key, block_n, (num_cb, 1), _STORE_NUM_WARPS, fixed, constexprs=constexprs)

    def _byte_tensors(self, loc, cache_k, cache_v, index_map) -> Callable[[], tuple[torch.Tensor, ...]]:
        """The tensors behind the addresses of a call whose fp8 inputs the kernel reads as their bytes, for a
        launch through Triton's dispatcher (kernel order): views, made only when the dispatcher needs them."""
        kc, vc = self.k_cache, self.v_cache
        map_t = loc if index_map is None else index_map
        return lambda: (kc, vc, cache_k.view(torch.uint8), cache_v.view(torch.uint8), loc, map_t, kc, vc)

    def __call__(self, layer_index: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                 k_scale=None, v_scale=None, index_map: torch.Tensor | None = None) -> None:  # fmt: skip
        """Store ``cache_k`` / ``cache_v`` at rows ``loc`` of layer ``layer_index`` (rows ``index_map[loc]`` when
        an index map is given, or the store has its own: a 1-D int32/int64 tensor on the cache's device, read in
        the kernel); see :func:`store_kv_triton`."""
        if not self.use_triton:
            self._store_native(layer_index, loc, cache_k, cache_v, k_scale, v_scale, index_map)
            return
        lp, kp, vp = loc.data_ptr(), cache_k.data_ptr(), cache_v.data_ptr()
        if index_map is None:  # no map, or the store's own (checked at creation: nothing to read)
            index_map = self._own_map
            mp, map_signature = lp if index_map is None else self._own_map_address, None
        else:
            mp = index_map.data_ptr()
            map_signature = (index_map.stride(), index_map.dtype, index_map.get_device(), mp & 15)
        scales = None if k_scale is None and v_scale is None else (_scale_signature(k_scale), _scale_signature(v_scale))
        n, ks, vs = loc.numel(), cache_k.shape, cache_v.shape
        try:  # the heads and widths one by one (a slice costs more); the strides' length holds the dims' count
            signature = ((n - 1).bit_length() if n else -1, loc.stride(), loc.dtype, loc.get_device(), ks[1], ks[2],
                         cache_k.stride(), cache_k.dtype, cache_k.get_device(), vs[1], vs[2], cache_v.stride(),
                         cache_v.dtype, cache_v.get_device(), (lp & 15) | (kp & 15) << 4 | (vp & 15) << 8,
                         map_signature, scales)  # fmt: skip
        except IndexError:  # an input of fewer than three dims: the checks refuse it
            self._plan(loc, cache_k, cache_v, k_scale, v_scale, index_map)
            raise
        plan = self._plans.get(signature, UNPLANNED)
        if plan is UNPLANNED or ks[0] != n or vs[0] != n:  # a first call, or inputs of another count (refused)
            plan = remember(self._plans, signature, self._plan(loc, cache_k, cache_v, k_scale, v_scale, index_map))
        if not 0 <= layer_index < self.layers:
            self._check_layer(layer_index)
        if plan is None:
            return
        k_ptr, v_ptr, loc_stride, _, per_call = plan.fixed
        if per_call is not None:
            self._launch_reading_more(plan, n, layer_index, loc, cache_k, cache_v, k_scale, v_scale, index_map, lp,
                                      kp, vp, mp)  # fmt: skip
            return
        entry = plan.entry
        if entry is not None and not launch_hooks_installed():  # Plan.__call__'s direct launch, inlined
            entry[0](-(-n // plan.block_n), plan.grid_y, 1, plan.raw_stream(plan.device_index), *entry[1], k_ptr,
                     v_ptr, layer_index, kp, vp, lp, loc_stride, mp, n, *plan.suffix)  # fmt: skip
            return
        kc, vc = self.k_cache, self.v_cache  # the tensors behind the addresses are the call's own
        plan(n, (k_ptr, v_ptr, layer_index, kp, vp, lp, loc_stride, mp, n),
             (kc, vc, cache_k, cache_v, loc, loc if index_map is None else index_map, kc, vc))  # fmt: skip

    def _launch_reading_more(self, plan: Plan, n: int, layer_index: int, loc, cache_k, cache_v, k_scale, v_scale,
                             index_map, lp: int, kp: int, vp: int, mp: int) -> None:  # fmt: skip
        """Launch a plan whose scales are read per call, or whose inputs the kernel reads as their bytes (kept out
        of :meth:`__call__`, which builds no closure: the closure's cells would cost every call)."""
        k_ptr, v_ptr, loc_stride, strides, (k_mode, v_mode, byte_views) = plan.fixed
        k_sp, k_value = _scale_call(k_mode, k_scale, k_ptr)
        v_sp, v_value = _scale_call(v_mode, v_scale, v_ptr)
        args = (k_ptr, v_ptr, layer_index, kp, vp, lp, loc_stride, mp, n, *strides, k_sp, v_sp, k_value, v_value)
        if byte_views:  # scales are ignored then (the inputs have the cache dtype)
            plan(n, args, self._byte_tensors(loc, cache_k, cache_v, index_map))
            return
        kc, vc = self.k_cache, self.v_cache
        k_scale_t = k_scale if k_mode == _SCALE_POINTER else kc
        v_scale_t = v_scale if v_mode == _SCALE_POINTER else vc
        plan(n, args, (kc, vc, cache_k, cache_v, loc, loc if index_map is None else index_map, k_scale_t, v_scale_t))

    # -- the torch reference -----------------------------------------------------------------------------------

    def _store_native(self, layer_index: int, loc, cache_k, cache_v, k_scale, v_scale, index_map) -> None:
        """The torch reference, after the checks the kernel path makes (but the devices')."""
        if index_map is None:
            index_map = self._own_map
        self._check_index_map(index_map)
        self._check_not_remapped(index_map)
        self._check_layer(layer_index)
        n, _ = self._check(loc, cache_k, cache_v)
        if n == 0:
            return
        idx = loc.long() if index_map is None else index_map[loc.long()].long()
        if self._page_rows:
            idx = idx + torch.div(idx, self._page_size, rounding_mode="floor") * (self._page_rows - self._page_size)
        self.k_cache[layer_index, idx] = _convert_native(cache_k, self.cache_dtype, k_scale)
        self.v_cache[layer_index, idx] = _convert_native(cache_v, self.cache_dtype, v_scale)


def store_kv_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer_index: int,
    loc: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    *,
    k_scale=None,
    v_scale=None,
    cache_dtype: torch.dtype,
    index_map: torch.Tensor | None = None,
) -> None:
    """Write ``cache_k`` [N, H, Dk] and ``cache_v`` [N, H, Dv] into rows ``loc`` of layer ``layer_index``
    (one launch; pools keep a :class:`KVStore` instead of calling this).

    :param k_cache: ``[L, R, H, Dk]`` cache, rows contiguous (``stride(2) == Dk``, ``stride(3) == 1``),
        dtype ``storage_dtype(cache_dtype)``.
    :param v_cache: ``[L, R, H, Dv]`` cache, same conditions.
    :param layer_index: 0-based layer in the stacked caches.
    :param loc: ``[N]`` int32 or int64 row indices (distinct; duplicates leave one unspecified writer).
    :param cache_k: ``[N, H, Dk]`` float32/float16/bfloat16, or ``cache_dtype`` itself (then copied as is,
        fp8 included); any strides (qkv-split views need no copy).
    :param cache_v: ``[N, H, Dv]`` likewise.  Neither input is modified.
    :param k_scale: when ``cache_k`` has another dtype than the cache (SGLang's rule), K is divided by this
        scale (IEEE division in float32, one rounding) before it is converted; ignored for inputs already in
        the cache dtype.  A python number or a 0-d/1-element tensor on the cache's device (read in the kernel).
    :param v_scale: likewise for V.
    :param cache_dtype: the cache's logical dtype.  Same as the input: plain copy; float casts round to
        nearest even; fp8 bytes are bit-exact with ``(x.float() / scale).to(cache_dtype)`` of the torch
        running the process (see ``kvcore.kernels.fp8`` for e4m3fn overflow).
    :param index_map: when given, the rows written are ``index_map[loc]`` (1-D int32/int64 on the cache's
        device, read in the kernel: no separate gather of the indices).
    """
    KVStore(k_cache, v_cache, cache_dtype)(layer_index, loc, cache_k, cache_v, k_scale, v_scale, index_map)


def store_kv_native(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer_index: int,
    loc: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    *,
    k_scale=None,
    v_scale=None,
    cache_dtype: torch.dtype,
    index_map: torch.Tensor | None = None,
) -> None:
    """Torch reference of :func:`store_kv_triton` (same signature and semantics)."""
    KVStore(k_cache, v_cache, cache_dtype, use_triton=False)(layer_index, loc, cache_k, cache_v, k_scale, v_scale,
                                                            index_map)  # fmt: skip


def _store_plan(hdk: int, hdv: int, n_pad: int, copy: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_CK, BLOCK_CV, column blocks of K, column blocks of K + V) of the store kernel."""
    block_ck = min(_next_pow2(hdk), STORE_MAX_BLOCK_C)
    block_cv = min(_next_pow2(hdv), STORE_MAX_BLOCK_C)
    tile = STORE_COPY_TILE_ELEMS if copy else STORE_TILE_ELEMS
    block_n = max(1, min(tile // max(block_ck, block_cv), n_pad))
    num_cb_k = cdiv(hdk, block_ck)
    return block_n, block_ck, block_cv, num_cb_k, num_cb_k + cdiv(hdv, block_cv)
