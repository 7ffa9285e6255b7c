"""MHATokenToKVPoolFP4: K/V in a block-scaled format (block FP4, NVFP4 or MXFP8), quantized on store and
dequantized by location on read."""

from __future__ import annotations

import torch

from kvcore.errors import ConfigError
from kvcore.pools import KVCache
from kvcore.sample import random_nonzero
from kvcore_fp4 import kernels
from kvcore_fp4.formats import RECIPES, dequantize, quantize


class MHATokenToKVPoolFP4(KVCache):
    """Keys and values of MHA/GQA layers in a block-scaled format (``kv_format``: ``fp4_e2m1``, ``nvfp4`` or
    ``mxfp8``, see :mod:`kvcore_fp4.formats`).

    Buffers (stacked over layers, ``size + page_size`` rows, row 0 padding): ``k_data`` / ``v_data`` hold the
    codes, ``k_scale`` / ``v_scale`` the block scales, and for nvfp4 ``global_scale[layer, 0, 0 | 1]`` the K / V
    global scales (1.0 until :meth:`set_kv_global_scale`).  Moves and CPU offload carry codes and scales
    together.

    Reads: :meth:`get_kv_buffer_by_loc` dequantizes only the rows asked for (what attention backends call);
    :meth:`get_key_buffer` / :meth:`get_value_buffer` dequantize a whole layer, as the seed's pool does, for
    compatibility.  ``dtype`` is what reads return.

    Stores and reads by location run one Triton launch each (:mod:`kvcore_fp4.kernels`), or the torch
    references of :mod:`kvcore_fp4.formats` with ``kernels="native"``; both write the same bytes.
    """

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
        kernels: str = "auto",
        kv_format: str = "fp4_e2m1",
    ):
        super().__init__(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer, kernels)
        if kv_format not in RECIPES:
            raise ConfigError(f"kv_format={kv_format!r} is not one of {', '.join(RECIPES)}")
        self.kv_format, self.recipe = kv_format, RECIPES[kv_format]
        self.head_num, self.head_dim = head_num, head_dim
        self.v_head_dim = v_head_dim if v_head_dim is not None else head_dim
        r, rows = self.recipe, size + page_size
        r.check_width(self.head_dim, "head_dim")
        r.check_width(self.v_head_dim, "v_head_dim")

        def zeros(*shape, dtype=torch.uint8):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.k_data = zeros(layer_num, rows, head_num, r.data_bytes(self.head_dim))
        self.k_scale = zeros(layer_num, rows, head_num, r.scale_bytes(self.head_dim))
        self.v_data = zeros(layer_num, rows, head_num, r.data_bytes(self.v_head_dim))
        self.v_scale = zeros(layer_num, rows, head_num, r.scale_bytes(self.v_head_dim))
        self.global_scale = torch.ones(layer_num, 1, 2, dtype=torch.float32, device=device) if r.global_scale else None
        self._finalize_allocation()

    # -- buffers ------------------------------------------------------------------------------------------

    def buffers(self) -> dict[str, torch.Tensor]:
        named = {"k_data": self.k_data, "k_scale": self.k_scale, "v_data": self.v_data, "v_scale": self.v_scale}
        if self.global_scale is not None:
            named["global_scale"] = self.global_scale
        return named

    def token_buffers(self) -> dict[str, torch.Tensor]:
        return {name: buf for name, buf in self.buffers().items() if name != "global_scale"}

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

    def _globals(self, local: int) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        if self.global_scale is None:
            return 1.0, 1.0
        return self.global_scale[local, 0, 0], self.global_scale[local, 0, 1]

    # -- writes -------------------------------------------------------------------------------------------

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, k_scale=None,
                      v_scale=None, layer_id_override: int | None = None) -> None:  # fmt: skip
        """Quantize K ``[N, H, Dk]`` and V ``[N, H, Dv]`` (any float dtype) into rows ``loc`` of ``layer``.

        Block-scaled rows carry their own scales: ``k_scale`` / ``v_scale`` must be None (or 1.0)."""
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None and not (isinstance(scale, (int, float)) and scale == 1.0):
                raise ValueError(f"{self.kv_format} rows carry their own block scales; pass {name}=None")
        local = self.local_layer(layer, layer_id_override)
        loc = loc.reshape(-1).long()
        n = loc.numel()
        for what, x, width in (("cache_k", cache_k, self.head_dim), ("cache_v", cache_v, self.v_head_dim)):
            if tuple(x.shape) != (n, self.head_num, width) and tuple(x.shape) != (n, self.head_num * width):
                raise ValueError(f"layer {layer}: {what} must be [N, H, D] = {(n, self.head_num, width)}, got {tuple(x.shape)}")
        if self._use_triton:
            if n:
                kernels.store_kv(self, local, loc, cache_k.reshape(n, self.head_num, self.head_dim),
                                 cache_v.reshape(n, self.head_num, self.v_head_dim))  # fmt: skip
            return
        kg, vg = self._globals(local)
        for data, scales, x, g, width in ((self.k_data, self.k_scale, cache_k, kg, self.head_dim),
                                          (self.v_data, self.v_scale, cache_v, vg, self.v_head_dim)):  # fmt: skip
            codes, block_scales = quantize(x.reshape(n, self.head_num, width), self.recipe, g)
            data[local, loc] = codes
            scales[local, loc] = block_scales

    # -- reads --------------------------------------------------------------------------------------------

    def get_kv_buffer_by_loc(self, layer, loc: torch.Tensor, dst_dtype: torch.dtype | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """K ``[N, H, Dk]`` and V ``[N, H, Dv]`` of rows ``loc``, dequantized to ``dst_dtype`` (default the
        pool's ``dtype``): only those rows are read."""
        local = self.local_layer(layer)
        self._wait_for_layer(local)
        loc = loc.reshape(-1).long()
        kg, vg = self._globals(local)
        dst = dst_dtype or self.dtype
        if self._use_triton:
            k = torch.empty((loc.numel(), self.head_num, self.head_dim), dtype=dst, device=self.k_data.device)
            v = torch.empty((loc.numel(), self.head_num, self.v_head_dim), dtype=dst, device=self.k_data.device)
            kernels.gather_kv(self, local, loc, k, v)
            return k, v
        k = dequantize(self.k_data[local, loc], self.k_scale[local, loc], self.recipe, dst, kg)
        v = dequantize(self.v_data[local, loc], self.v_scale[local, loc], self.recipe, dst, vg)
        return k, v

    def _whole_layer(self, layer_id: int, data: torch.Tensor, scales: torch.Tensor, which: int) -> torch.Tensor:
        local = self.local_layer(layer_id)
        self._wait_for_layer(local)
        return dequantize(data[local], scales[local], self.recipe, self.dtype, self._globals(local)[which])

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """A whole layer's keys dequantized (the seed's accessor; reads every row: prefer
        :meth:`get_kv_buffer_by_loc`)."""
        return self._whole_layer(layer_id, self.k_data, self.k_scale, 0)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """A whole layer's values dequantized (see :meth:`get_key_buffer`)."""
        return self._whole_layer(layer_id, self.v_data, self.v_scale, 1)

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
