"""MHATokenToKVPoolFP4: K/V in a block-scaled format (block FP4, NVFP4 or MXFP8), quantized on store and
dequantized by location on read."""

from __future__ import annotations

import torch

from kvcore.errors import ConfigError
from kvcore.pools import KVCache, check_post_capture, gather_outputs, tokens_of
from kvcore.sample import random_nonzero
from kvcore_fp4 import kernels as block_kernels
from kvcore_fp4.formats import RECIPES, dequantize, quantize

#: the relative RMS error each format's round trip stays under on normal rows (kvcore.testing's lossy check;
#: measured 0.112 / 0.095 / 0.030, README)
LOSSY_BOUNDS = {"fp4_e2m1": 0.125, "nvfp4": 0.11, "mxfp8": 0.04}


def _read_dtype(dtype: torch.dtype, kv_format: str) -> tuple[torch.dtype, str]:
    """SGLang builds its FP4 pools with ``dtype=torch.float4_e2m1fn_x2``: that means block FP4, read as bf16."""
    if dtype == getattr(torch, "float4_e2m1fn_x2", None):
        return torch.bfloat16, "fp4_e2m1"
    return dtype, kv_format


def _refuse_scales(kv_format: str, k_scale, v_scale) -> None:
    """Block-scaled rows carry their own scales: a K/V scale other than None or 1.0 is an error."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None and not (isinstance(scale, (int, float)) and scale == 1.0):
            raise ValueError(f"{kv_format} rows carry their own block scales; pass {name}=None")


def _into(out: tuple[torch.Tensor, ...] | None, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The torch path's results, or, given caller outputs, copied into them."""
    if out is None:
        return values
    for o, value in zip(out, values):
        o.copy_(value)
    return out


def _rows_of(loc: torch.Tensor) -> int:
    """N of ``[N]`` int32/int64 locations, which a planned call takes as they are; -1 for any other ``loc`` (the
    general paths flatten it or refuse it: :func:`_flat_loc`)."""
    if loc.dim() != 1 or (loc.dtype is not torch.int64 and loc.dtype is not torch.int32):
        return -1
    return loc.shape[0]


def _writes_as_given(block_rows: block_kernels.BlockRows, loc: torch.Tensor, a: torch.Tensor, b: torch.Tensor
                     ) -> bool:  # fmt: skip
    """Whether a store's planned path takes a call as given (``check`` of
    :meth:`~kvcore_fp4.kernels.BlockRows.store`): ``[N]`` locations, N > 0, and the two parts exactly
    ``[N, heads, width]`` (K and V ``[N, H, Dk]`` / ``[N, H, Dv]``; nope and rope ``[N, 1, kv_lora_rank]`` /
    ``[N, 1, qk_rope_head_dim]``).  Any other call takes the pool's general path, with its reshapes and errors."""
    n, parts = _rows_of(loc), block_rows.parts
    return n > 0 and a.shape == (n, parts.heads, parts.k_width) and b.shape == (n, parts.heads, parts.v_width)


def _latent_rows_as_given(block_rows: block_kernels.BlockRows, loc: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether a store of whole latent rows takes a call as given (``check`` of
    :meth:`~kvcore_fp4.kernels.BlockRows.store_rows`): ``[N]`` locations, N > 0, rows exactly ``[N, 1, W]`` or
    ``[N, W]`` (W = kv_lora_rank + qk_rope_head_dim).  Any other call takes the pool's general path."""
    n, width = _rows_of(loc), block_rows.parts.k_width + block_rows.parts.v_width
    return n > 0 and rows.shape in ((n, 1, width), (n, width))


def _reads_as_given(block_rows: block_kernels.BlockRows, loc: torch.Tensor, a: torch.Tensor, b: torch.Tensor
                    ) -> bool:  # fmt: skip
    """Whether a read's planned path takes a call as given (``check`` of
    :meth:`~kvcore_fp4.kernels.BlockRows.gather`): ``[N]`` locations and outputs of one dtype, exactly
    ``[N, heads, width]`` (as :func:`_writes_as_given`).  Any other call takes the pool's general path, with its
    errors."""
    n, parts = _rows_of(loc), block_rows.parts
    return n >= 0 and a.shape == (n, parts.heads, parts.k_width) and b.shape == (
        n, parts.heads, parts.v_width) and a.dtype == b.dtype  # fmt: skip


def _planned_read(block_rows: block_kernels.BlockRows, local: int, loc: torch.Tensor, dst_dtype: torch.dtype | None,
                  default_dtype: torch.dtype, out) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """A pool's usual read through its block rows' plans: new outputs of ``dst_dtype or default_dtype`` (``out``
    None), or the two tensors of ``out`` (no ``dst_dtype`` given); None, having read nothing, for any other call
    (the pool's general path then takes it, with its checks and errors)."""
    if out is None:
        return block_rows.gather_new(local, loc, dst_dtype or default_dtype, _reads_as_given)
    if dst_dtype is None and type(out) is tuple and len(out) == 2:
        if block_rows.gather(local, loc, out[0], out[1], _reads_as_given):
            return out
    return None


def _flat_loc(loc: torch.Tensor) -> torch.Tensor:
    """Locations as a 1-D int32/int64 tensor (the kernels read either; no copy for the usual 1-D call)."""
    if loc.dtype is not torch.int64 and loc.dtype is not torch.int32:
        raise ValueError(f"loc must be an int32/int64 tensor, got {loc.dtype}")
    return loc if loc.dim() == 1 else loc.reshape(-1)


class _BlockScaledPool(KVCache):
    """What the two block-scaled pools share, from the constructor on: the read dtype and the format (SGLang's
    ``dtype=torch.float4_e2m1fn_x2`` means block FP4 read as bfloat16), the format's recipe, the check that every
    part's width is whole blocks, ``store_dtype`` (uint8: the buffers hold codes and block scales, as SGLang's FP4
    pools say), nvfp4's global scales, the block rows' kernels, the buffers by name, and the conformance kit's
    lossy-storage protocol (``kvcore.testing.LOSSY``, see :class:`~kvcore.pools.KVCache`).

    A subclass's constructor: ``super().__init__`` first, then its code and scale buffers, then
    :meth:`_bind_rows` (which finalizes the allocation)."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, layer_num: int, device: str,
                 enable_memory_saver: bool, start_layer: int | None, end_layer: int | None, kernels: str,
                 kv_format: str, widths: dict[str, int]):  # fmt: skip
        """:class:`~kvcore.pools.KVCache`'s checks, then the format and every part's width (``widths``: the
        constructor keyword naming the width -> its values per head)."""
        dtype, kv_format = _read_dtype(dtype, kv_format)
        super().__init__(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer,
                         kernels)  # fmt: skip
        self.store_dtype = torch.uint8  # every K/V buffer holds codes or block scales, as bytes
        if kv_format not in RECIPES:
            raise ConfigError(f"kv_format={kv_format!r} is not one of {', '.join(RECIPES)}")
        self.kv_format, self.recipe = kv_format, RECIPES[kv_format]
        for what, width in widths.items():
            self.recipe.check_width(width, what)
        self.global_scale = (
            torch.ones(layer_num, 1, 2, dtype=torch.float32, device=device) if self.recipe.global_scale else None
        )

    def _bytes(self, *shape: int) -> torch.Tensor:
        """A zeroed uint8 buffer (codes or block scales)."""
        return torch.zeros(shape, dtype=torch.uint8, device=self.device)

    def _bind_rows(self, parts: block_kernels.Parts) -> None:
        """Bind the block rows' kernels to the buffers (once: shapes and strides are fixed now) and finalize the
        allocation."""
        self._rows = block_kernels.BlockRows(parts)
        self._out_device = parts.k_data.device  # where reads allocate their results
        self._finalize_allocation()

    def _with_global_scale(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.global_scale is not None:
            named["global_scale"] = self.global_scale
        return named

    def token_buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer but the per-layer global scales: codes and block scales, one row per token."""
        return {name: buf for name, buf in self.buffers().items() if name != "global_scale"}

    def _globals(self, local: int) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """The global scales of a local layer's two parts (1.0 when the format keeps none)."""
        if self.global_scale is None:
            return 1.0, 1.0
        return self.global_scale[local, 0, 0], self.global_scale[local, 0, 1]

    # -- the lossy-storage protocol ------------------------------------------------------------------------

    @property
    def lossy_bound(self) -> float:
        return LOSSY_BOUNDS[self.kv_format]

    def _random_parts(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        return {part: random_nonzero((n, heads, width), torch.float32, generator, 2.0, self.device)
                for part, heads, width in self._value_parts()}  # fmt: skip


class MHATokenToKVPoolFP4(_BlockScaledPool):
    """Keys and values of MHA/GQA layers in a block-scaled format (``kv_format``: ``fp4_e2m1``, ``nvfp4`` or
    ``mxfp8``, see :mod:`kvcore_fp4.formats`).

    Buffers (stacked over layers, ``size + page_size`` rows, row 0 padding): ``k_data`` / ``v_data`` hold the
    codes, ``k_scale`` / ``v_scale`` the block scales, and for nvfp4 ``global_scale[layer, 0, 0 | 1]`` the K / V
    global scales (1.0 until :meth:`set_kv_global_scale`).  Moves and CPU offload carry codes and scales
    together.

    Reads: :meth:`get_kv_buffer_by_loc` dequantizes only the rows asked for (what attention backends call);
    :meth:`get_key_buffer` / :meth:`get_value_buffer` dequantize a whole layer, as SGLang's pool does, for
    compatibility.  ``dtype`` is what reads return (SGLang's ``torch.float4_e2m1fn_x2`` means block FP4 read as
    bfloat16); ``store_dtype`` is ``torch.uint8``, what the code and scale buffers hold (as in SGLang).

    Stores and reads by location run one Triton launch each (:mod:`kvcore_fp4.kernels`), or the torch
    references of :mod:`kvcore_fp4.formats` with ``kernels="native"``; both write the same bytes.

    SGLang's per-layer buffer names are views of the same bytes: ``k_buffer[i]`` / ``v_buffer[i]`` are local layer
    ``i``'s codes ``[size + page_size, head_num, code bytes]`` uint8 (``head_dim // 2`` bytes for FP4, as in
    SGLang), and ``k_scale_buffer[i]`` / ``v_scale_buffer[i]`` its block scales flattened over the heads,
    ``[size + page_size, head_num * scale bytes]`` uint8 (``head_num * head_dim // 16`` for FP4, as in SGLang).
    The V views follow ``v_head_dim`` (SGLang sizes V like K).

    SGLang's constructor keywords ``enable_alt_stream`` and ``enable_kv_cache_copy`` are accepted either way (one
    launch quantizes and stores K and V; :meth:`move_kv_cache` always exists, moving codes and scales together);
    ``post_capture_active=True`` is a :class:`~kvcore.errors.ConfigError` (kvcore allocates the pool when built).
    """

    alt_stream = None

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str,
        enable_memory_saver: bool,
        v_head_dim: int | None = None,
        start_layer: int | None = None,
        end_layer: int | None = None,
        enable_alt_stream: bool = True,
        enable_kv_cache_copy: bool = False,
        post_capture_active: bool = False,
        kernels: str = "auto",
        kv_format: str = "fp4_e2m1",
    ):
        check_post_capture(type(self).__name__, post_capture_active)
        self.head_num, self.head_dim = head_num, head_dim
        self.v_head_dim = v_head_dim if v_head_dim is not None else head_dim
        super().__init__(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer,
                         kernels, kv_format, {"head_dim": self.head_dim, "v_head_dim": self.v_head_dim})  # fmt: skip
        r, rows = self.recipe, size + page_size
        self.k_data = self._bytes(layer_num, rows, head_num, r.data_bytes(self.head_dim))
        self.k_scale = self._bytes(layer_num, rows, head_num, r.scale_bytes(self.head_dim))
        self.v_data = self._bytes(layer_num, rows, head_num, r.data_bytes(self.v_head_dim))
        self.v_scale = self._bytes(layer_num, rows, head_num, r.scale_bytes(self.v_head_dim))
        self.k_buffer, self.v_buffer = list(self.k_data.unbind(0)), list(self.v_data.unbind(0))
        self.k_scale_buffer = [t.view(rows, -1) for t in self.k_scale.unbind(0)]
        self.v_scale_buffer = [t.view(rows, -1) for t in self.v_scale.unbind(0)]
        self._bind_rows(block_kernels.Parts(
            r, head_num, self.k_data, self.k_scale, self.head_dim, self.v_data, self.v_scale, self.v_head_dim,
            self.global_scale,
        ))  # fmt: skip

    # -- buffers ------------------------------------------------------------------------------------------

    def buffers(self) -> dict[str, torch.Tensor]:
        return self._with_global_scale(
            {"k_data": self.k_data, "k_scale": self.k_scale, "v_data": self.v_data, "v_scale": self.v_scale}
        )

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """SGLang's ``(K bytes, V bytes)`` of an MHA-shaped pool, all layers, padding included: K's codes and block
        scales (and, for nvfp4, K's half of the global scales), then V's.  Their sum is every buffer's bytes."""
        k = self.k_data.nbytes + self.k_scale.nbytes
        v = self.v_data.nbytes + self.v_scale.nbytes
        if self.global_scale is not None:
            k, v = k + self.global_scale.nbytes // 2, v + self.global_scale.nbytes // 2
        return k, v

    def set_kv_global_scale(self, layer, k_scale: float, v_scale: float) -> None:
        """nvfp4's calibration: the decode scales of a layer's K and V (``amax / (6 x 448)`` of what the layer
        will store puts its largest block at the top of e4m3).  Set before storing: rows already stored
        keep the codes of the old scale."""
        if self.global_scale is None:
            raise ValueError(f"{self.kv_format} keeps no global scale; only nvfp4 does")
        if not (k_scale > 0 and v_scale > 0):
            raise ValueError(f"global scales must be positive, got {k_scale}, {v_scale}")
        local = self.local_layer(layer)
        self.global_scale[local, 0] = torch.tensor([k_scale, v_scale], dtype=torch.float32, device=self.device)

    # -- writes -------------------------------------------------------------------------------------------

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, k_scale=None,
                      v_scale=None, layer_id_override: int | None = None) -> None:  # fmt: skip
        """Quantize K ``[N, H, Dk]`` and V ``[N, H, Dv]`` (any float dtype) into rows ``loc`` of ``layer``.

        Block-scaled rows carry their own scales: ``k_scale`` / ``v_scale`` must be None (or 1.0)."""
        if k_scale is not None or v_scale is not None:
            _refuse_scales(self.kv_format, k_scale, v_scale)
        local = self.local_layer(layer, layer_id_override)
        loc = tokens_of(loc)
        if self._use_triton and self._rows.store(local, loc, cache_k, cache_v, _writes_as_given):
            return  # the usual call ([N, H, D] rows), checked once per call signature
        loc = _flat_loc(loc)
        n = loc.shape[0]
        if cache_k.shape != (n, self.head_num, self.head_dim):
            cache_k = self._as_rows(layer, "cache_k", cache_k, n, self.head_dim)
        if cache_v.shape != (n, self.head_num, self.v_head_dim):
            cache_v = self._as_rows(layer, "cache_v", cache_v, n, self.v_head_dim)
        if self._use_triton:
            if n:
                self._rows.store(local, loc, cache_k, cache_v)
            return
        kg, vg = self._globals(local)
        loc = loc.long()
        for data, scales, x, g in ((self.k_data, self.k_scale, cache_k, kg), (self.v_data, self.v_scale, cache_v, vg)):
            codes, block_scales = quantize(x, self.recipe, g)
            data[local, loc] = codes
            scales[local, loc] = block_scales

    def _as_rows(self, layer, what: str, x: torch.Tensor, n: int, width: int) -> torch.Tensor:
        """``[N, H * D]`` rows as ``[N, H, D]``; any other shape is an error."""
        if tuple(x.shape) != (n, self.head_num * width):
            raise ValueError(f"layer {layer}: {what} must be [N, H, D] = {(n, self.head_num, width)}, got {tuple(x.shape)}")
        return x.reshape(n, self.head_num, width)

    # -- reads --------------------------------------------------------------------------------------------

    def get_kv_buffer_by_loc(self, layer, loc: torch.Tensor, dst_dtype: torch.dtype | None = None, *, out=None
                             ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """K ``[N, H, Dk]`` and V ``[N, H, Dv]`` of rows ``loc``, dequantized to ``dst_dtype`` (default the
        pool's ``dtype``): only those rows are read.  ``out``: kvcore extension, ``(k, v)`` of those shapes (any
        strides, one float dtype) to read into instead of allocating; returned."""
        local = self._read_layer(layer)
        if self._use_triton:  # the usual calls, checked once per call signature
            read = _planned_read(self._rows, local, loc, dst_dtype, self.dtype, out)
            if read is not None:
                return read
        loc = _flat_loc(loc)
        n = loc.shape[0]
        shapes = ((n, self.head_num, self.head_dim), (n, self.head_num, self.v_head_dim))
        out = None if out is None else gather_outputs(out, shapes, dst_dtype, "get_kv_buffer_by_loc")
        dst = out[0].dtype if out is not None else dst_dtype or self.dtype
        if self._use_triton:
            k, v = out or (torch.empty(shape, dtype=dst, device=self._out_device) for shape in shapes)
            self._rows.gather(local, loc, k, v)
            return k, v
        kg, vg = self._globals(local)  # the kernel reads them itself
        loc = loc.long()
        k = dequantize(self.k_data[local, loc], self.k_scale[local, loc], self.recipe, dst, kg)
        v = dequantize(self.v_data[local, loc], self.v_scale[local, loc], self.recipe, dst, vg)
        return _into(out, k, v)

    def _whole_layer(self, layer_id: int, data: torch.Tensor, scales: torch.Tensor, which: int) -> torch.Tensor:
        local = self._read_layer(layer_id)
        return dequantize(data[local], scales[local], self.recipe, self.dtype, self._globals(local)[which])

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """A whole layer's keys dequantized (SGLang's accessor; reads every row: prefer
        :meth:`get_kv_buffer_by_loc`)."""
        return self._whole_layer(layer_id, self.k_data, self.k_scale, 0)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """A whole layer's values dequantized (see :meth:`get_key_buffer`)."""
        return self._whole_layer(layer_id, self.v_data, self.v_scale, 1)

    def _value_parts(self):
        return (("k", self.head_num, self.head_dim), ("v", self.head_num, self.v_head_dim))

    def self_test_values(self, layer: int, loc: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Random float32 K/V through :meth:`set_kv_buffer`; returns them (the kit's lossy check)."""
        values = self._random_parts(loc.numel(), generator)
        self.set_kv_buffer(layer, loc, values["k"], values["v"])
        return values

    def read_values(self, layer: int, loc: torch.Tensor) -> dict[str, torch.Tensor]:
        k, v = self.get_kv_buffer_by_loc(layer, loc, torch.float32)
        return {"k": k, "v": v}

    def self_test_write(self, layer: int, loc: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Random bf16 K/V rows through :meth:`set_kv_buffer`; the expected bytes are the format's codes."""
        rows = {
            name: random_nonzero((loc.numel(), self.head_num, width), torch.bfloat16, generator, 2.0, self.device)
            for name, width in (("k", self.head_dim), ("v", self.v_head_dim))
        }
        self.set_kv_buffer(layer, loc, rows["k"], rows["v"])
        kg, vg = self._globals(self.local_layer(layer))
        expected = {}
        for name, g in (("k", kg), ("v", vg)):
            expected[f"{name}_data"], expected[f"{name}_scale"] = quantize(rows[name], self.recipe, g)
        return expected


class MLATokenToKVPoolFP4(_BlockScaledPool):
    """MLA latent rows (``kv_lora_rank`` nope values, then ``qk_rope_head_dim`` rope values) in a block-scaled
    format; nope and rope are quantized separately (no block straddles them: both widths are whole blocks).

    Buffers: ``kv_data`` ``[L, R, 1, row codes]``, ``kv_scale`` ``[L, R, 1, row blocks]`` and, for nvfp4,
    ``global_scale[layer, 0, 0 | 1]`` for nope / rope.  :meth:`get_mla_kv_buffer` dequantizes only the rows
    asked for; :meth:`get_key_buffer` a whole layer (SGLang's accessor).  ``dtype`` is what reads return,
    ``store_dtype`` (``torch.uint8``) what the buffers hold.
    SGLang's per-layer names are views of the same bytes: ``kv_buffer[i]`` (codes ``[R, 1, code bytes]``) and
    ``kv_scale_buffer[i]`` (scales ``[R, scale bytes]``).  :meth:`get_kv_size_bytes` is one int, as for MLA.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str,
        enable_memory_saver: bool,
        start_layer: int | None = None,
        end_layer: int | None = None,
        kernels: str = "auto",
        kv_format: str = "fp4_e2m1",
    ):
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        widths = {"kv_lora_rank": kv_lora_rank, "qk_rope_head_dim": qk_rope_head_dim}
        super().__init__(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer,
                         kernels, kv_format, widths)  # fmt: skip
        r, width, rows = self.recipe, kv_lora_rank + qk_rope_head_dim, size + page_size
        self.kv_data = self._bytes(layer_num, rows, 1, r.data_bytes(width))
        self.kv_scale = self._bytes(layer_num, rows, 1, r.scale_bytes(width))
        self.kv_buffer = list(self.kv_data.unbind(0))  # SGLang's per-layer names: codes [R, 1, code bytes]
        self.kv_scale_buffer = [t.view(rows, -1) for t in self.kv_scale.unbind(0)]  # scales [R, scale bytes]
        nd, ns = r.data_bytes(kv_lora_rank), r.scale_bytes(kv_lora_rank)
        self._split = (nd, ns)
        self._bind_rows(block_kernels.Parts(
            r, 1, self.kv_data[..., :nd], self.kv_scale[..., :ns], kv_lora_rank, self.kv_data[..., nd:],
            self.kv_scale[..., ns:], qk_rope_head_dim, self.global_scale,
        ))  # fmt: skip

    def buffers(self) -> dict[str, torch.Tensor]:
        return self._with_global_scale({"kv_data": self.kv_data, "kv_scale": self.kv_scale})

    # -- writes -------------------------------------------------------------------------------------------

    def set_mla_kv_buffer(self, layer, loc: torch.Tensor, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor,
                          layer_id_override: int | None = None) -> None:  # fmt: skip
        """Quantize nope ``[N, 1, kv_lora_rank]`` and rope ``[N, 1, qk_rope_head_dim]`` (or ``[N, W]``) into rows
        ``loc``, each part with its own block scales (one launch)."""
        local = self.local_layer(layer, layer_id_override)
        loc = tokens_of(loc)
        if self._use_triton and self._rows.store(local, loc, cache_k_nope, cache_k_rope, _writes_as_given):
            return  # the usual call ([N, 1, W] parts), checked once per call signature
        loc = _flat_loc(loc)
        n = loc.shape[0]
        if cache_k_nope.shape != (n, 1, self.kv_lora_rank):
            cache_k_nope = self._as_part(layer, "cache_k_nope", cache_k_nope, n, self.kv_lora_rank)
        if cache_k_rope.shape != (n, 1, self.qk_rope_head_dim):
            cache_k_rope = self._as_part(layer, "cache_k_rope", cache_k_rope, n, self.qk_rope_head_dim)
        if n == 0:
            return
        if self._use_triton:
            self._rows.store(local, loc, cache_k_nope, cache_k_rope)
            return
        nd, ns = self._split
        loc = loc.long()
        for (data, scales), x, g in zip(((slice(0, nd), slice(0, ns)), (slice(nd, None), slice(ns, None))),
                                        (cache_k_nope, cache_k_rope), self._globals(local)):  # fmt: skip
            codes, block_scales = quantize(x, self.recipe, g)
            self.kv_data[local, loc, :, data] = codes
            self.kv_scale[local, loc, :, scales] = block_scales

    @staticmethod
    def _as_part(layer, what: str, x: torch.Tensor, n: int, width: int) -> torch.Tensor:
        """A part of ``N`` rows of ``width`` values in any shape (``[N, W]``, ``[N, 1, W]``) as ``[N, 1, W]``."""
        if x.numel() != n * width or x.shape[0] != n:
            raise ValueError(f"layer {layer}: {what} must be [N, 1, {width}] with N = {n}, got {tuple(x.shape)}")
        return x.reshape(n, 1, width)

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v=None, k_scale=None, v_scale=None,
                      layer_id_override: int | None = None) -> None:  # fmt: skip
        """Store already concatenated latent rows ``[N, 1, kv_lora_rank + qk_rope_head_dim]`` (``cache_v`` is
        ignored, as in SGLang; block-scaled rows take no ``k_scale`` / ``v_scale``)."""
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"{self.kv_format} rows carry their own block scales; pass k_scale=None, v_scale=None")
        loc = tokens_of(loc)
        if self._use_triton:  # the usual call ([N, 1, W] rows): checked once per call signature, no views made
            local = self.local_layer(layer, layer_id_override)
            if self._rows.store_rows(local, loc, cache_k, _latent_rows_as_given):
                return
        flat = cache_k.reshape(cache_k.shape[0], -1)
        r = self.kv_lora_rank
        self.set_mla_kv_buffer(layer, loc, flat[:, :r], flat[:, r:], layer_id_override)

    # -- reads --------------------------------------------------------------------------------------------

    def get_mla_kv_buffer(self, layer, loc: torch.Tensor, dst_dtype: torch.dtype | None = None, *, out=None):
        """``(cache_k_nope [N, 1, kv_lora_rank], cache_k_rope [N, 1, qk_rope_head_dim])`` of rows ``loc``,
        dequantized to ``dst_dtype`` (default the pool's ``dtype``): only those rows are read.  ``out``: kvcore
        extension, the two tensors (any strides, one float dtype) to read into instead of allocating; returned."""
        local = self._read_layer(layer)
        if self._use_triton:  # the usual calls, checked once per call signature
            read = _planned_read(self._rows, local, loc, dst_dtype, self.dtype, out)
            if read is not None:
                return read
        loc = _flat_loc(loc)
        n = loc.shape[0]
        shapes = ((n, 1, self.kv_lora_rank), (n, 1, self.qk_rope_head_dim))
        out = None if out is None else gather_outputs(out, shapes, dst_dtype, "get_mla_kv_buffer")
        dst = out[0].dtype if out is not None else dst_dtype or self.dtype
        if self._use_triton:
            nope, rope = out or (torch.empty(shape, dtype=dst, device=self._out_device) for shape in shapes)
            self._rows.gather(local, loc, nope, rope)
            return nope, rope
        nd, ns = self._split
        gn, gr = self._globals(local)
        loc = loc.long()
        data, scales = self.kv_data[local, loc], self.kv_scale[local, loc]
        nope = dequantize(data[..., :nd], scales[..., :ns], self.recipe, dst, gn)
        rope = dequantize(data[..., nd:], scales[..., ns:], self.recipe, dst, gr)
        return _into(out, nope, rope)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """A whole layer's latent rows dequantized ``[R, 1, kv_lora_rank + qk_rope_head_dim]`` (SGLang's
        accessor; reads every row: prefer :meth:`get_mla_kv_buffer`)."""
        every = torch.arange(self.kv_data.shape[1], device=self.kv_data.device)
        return torch.cat(self.get_mla_kv_buffer(layer_id, every), dim=-1)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The nope part of :meth:`get_key_buffer`."""
        return self.get_key_buffer(layer_id)[..., : self.kv_lora_rank]

    def _value_parts(self):
        return (("nope", 1, self.kv_lora_rank), ("rope", 1, self.qk_rope_head_dim))

    def self_test_values(self, layer: int, loc: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Random float32 nope and rope through :meth:`set_mla_kv_buffer`; returns them (the kit's lossy check)."""
        values = self._random_parts(loc.numel(), generator)
        self.set_mla_kv_buffer(layer, loc, values["nope"], values["rope"])
        return values

    def read_values(self, layer: int, loc: torch.Tensor) -> dict[str, torch.Tensor]:
        nope, rope = self.get_mla_kv_buffer(layer, loc, torch.float32)
        return {"nope": nope, "rope": rope}

    def self_test_write(self, layer: int, loc: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Random bf16 nope and rope through :meth:`set_mla_kv_buffer`; the expected bytes are their codes."""
        nope = random_nonzero((loc.numel(), 1, self.kv_lora_rank), torch.bfloat16, generator, 2.0, self.device)
        rope = random_nonzero((loc.numel(), 1, self.qk_rope_head_dim), torch.bfloat16, generator, 2.0, self.device)
        self.set_mla_kv_buffer(layer, loc, nope, rope)
        gn, gr = self._globals(self.local_layer(layer))
        (nd, ns), (rd, rs) = quantize(nope, self.recipe, gn), quantize(rope, self.recipe, gr)
        return {"kv_data": torch.cat((nd, rd), -1), "kv_scale": torch.cat((ns, rs), -1)}
