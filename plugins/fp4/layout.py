"""The block-scaled family's declared buffers; importing this needs no kernels.

An MHA pool of a block-scaled format keeps, per layer and token row, the K and V codes (``k_data`` /
``v_data``: ``[heads, head_dim x value_bits / 8]`` bytes) and their block scales (``k_scale`` / ``v_scale``:
``[heads, head_dim / block]`` bytes); nvfp4 adds a float32 global scale per layer for K and for V
(``global_scale``: ``[layers, 1, 2]``, fixed).
"""

from __future__ import annotations

import torch

from kvcore.backend import PoolRequest
from kvcore.layout import BufferLayout, PoolLayout
from kvcore_fp4.formats import RECIPES, Recipe


def recipe_of(request: PoolRequest) -> Recipe:
    return RECIPES[request.kv_format]


def fp4_mha_layout(*, backend: str, request: PoolRequest) -> PoolLayout:
    recipe = recipe_of(request)
    heads, dk, dv = request.head_num, request.head_dim, request.v_head_dim
    recipe.check_width(dk, "model.head_dim")
    recipe.check_width(dv, "model.v_head_dim")
    common = dict(layers=request.layer_num, dtype=torch.uint8, pad_tokens=request.page_size)
    buffers = [
        BufferLayout(name="k_data", row_shape=(heads, recipe.data_bytes(dk)), **common),
        BufferLayout(name="k_scale", row_shape=(heads, recipe.scale_bytes(dk)), **common),
        BufferLayout(name="v_data", row_shape=(heads, recipe.data_bytes(dv)), **common),
        BufferLayout(name="v_scale", row_shape=(heads, recipe.scale_bytes(dv)), **common),
    ]
    if recipe.global_scale:
        buffers.append(BufferLayout(name="global_scale", layers=request.layer_num, row_shape=(2,), dtype=torch.float32,
                                    fixed_rows=1))  # fmt: skip
    scale = "an e4m3" if recipe.scale_kind == "e4m3" else "a UE8M0"
    note = f"{recipe.name}: {recipe.value_bits}-bit values, {scale} scale per {recipe.block}"
    if recipe.global_scale:
        note += ", a float32 global scale per layer for K and for V"
    return PoolLayout(backend=backend, buffers=buffers, notes=(note,))


def fp4_mla_layout(*, backend: str, request: PoolRequest) -> PoolLayout:
    """The buffers of an :class:`~kvcore_fp4.pool.MLATokenToKVPoolFP4`: latent codes and block scales."""
    recipe = recipe_of(request)
    mla = request.section("mla")
    recipe.check_width(mla.kv_lora_rank, "model.mla.kv_lora_rank")
    recipe.check_width(mla.qk_rope_head_dim, "model.mla.qk_rope_head_dim")
    width = mla.kv_lora_rank + mla.qk_rope_head_dim
    common = dict(layers=request.layer_num, dtype=torch.uint8, pad_tokens=request.page_size)
    buffers = [
        BufferLayout(name="kv_data", row_shape=(1, recipe.data_bytes(width)), **common),
        BufferLayout(name="kv_scale", row_shape=(1, recipe.scale_bytes(width)), **common),
    ]
    if recipe.global_scale:
        buffers.append(BufferLayout(name="global_scale", layers=request.layer_num, row_shape=(2,), dtype=torch.float32,
                                    fixed_rows=1))  # fmt: skip
    note = f"{recipe.name} latent rows: nope and rope quantized apart, a scale per {recipe.block} values"
    return PoolLayout(backend=backend, buffers=buffers, notes=(note,))
