"""PagedKVCache(resident_rows=True): every layer's gathered keys and values kept between steps, a step writing only
its new tokens into them (kvcore.kernels.resident_gather).  The tiny models and prompts of test_transformers_cache,
on the Triton path (interpreted on the CPU, compiled on a GPU in compiled runs); every comparison is against what
DynamicCache (or a cache without resident rows) produces in the same process."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason='the transformers integration needs transformers: pip install "kvcore[hf]"')

from test_transformers_cache import RoundTripLayer, generate, on_test_device, paged
from transformers import DynamicCache
from transformers.cache_utils import Cache

import kvcore
from kvcore.integrations.transformers import PagedKVCache, config_overrides
from kvcore.kernels.head_gather import room_for
from kvcore.kernels.resident_gather import ResidentHeadGather


def resident_gather(cache: PagedKVCache) -> ResidentHeadGather:
    (gather,) = cache._gathers.values()
    assert isinstance(gather, ResidentHeadGather)
    return gather


@pytest.mark.parametrize(
    "cache_dtype, scales, layout, new",
    [
        (None, (None, None), "token_major", 70),
        ("float8_e4m3fn", (0.5, 0.25), "token_major", 30),
        (None, (None, None), "page_major", 30),
    ],
    ids=["bf16-past-the-first-room", "e4m3fn-scaled", "bf16-page-major"],
)
def test_resident_rows_keep_every_logit(cache_dtype, scales, layout, new):
    """Greedy generation with resident rows: every step's logits are DynamicCache's, bit for bit (an fp8 cache's
    those of a DynamicCache rounding through fp8 as the pool does).  Attention reads views of the rows; 70 new
    tokens after prompts of 17 outgrow the rows' first room, so they are gathered again into larger ones."""
    model, ids, mask, device = on_test_device(torch.bfloat16)
    k_scale, v_scale = scales
    if cache_dtype is None:
        ref = generate(model, DynamicCache(config=model.config), new, ids, mask)
    else:
        fp8 = getattr(torch, cache_dtype)
        layers = [RoundTripLayer(fp8, k_scale, v_scale) for _ in range(model.config.num_hidden_layers)]
        ref = generate(model, Cache(layers=layers), new, ids, mask)
    cfg = kvcore.load_config(
        *config_overrides(model), "kv_cache.page_size=16", "memory.max_total_tokens=2048", f"hardware.device={device}",
        "hardware.kernels=triton", *([f"kv_cache.dtype={cache_dtype}"] if cache_dtype else []),
        *(["kv_cache.layout=page_major"] if layout == "page_major" else []),
    )  # fmt: skip
    cache = PagedKVCache.from_config(cfg, model=model, k_scale=k_scale, v_scale=v_scale, resident_rows=True)
    out = generate(model, cache, new, ids, mask)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))
    gather, length = resident_gather(cache), cache.get_seq_length()
    assert cache._step.fused and all(gather.rows_held(layer) == length for layer in range(len(cache.layers)))
    width = ids.shape[1]
    grown = length > room_for(width)
    assert grown == (new == 70) and (gather._rows.room > room_for(width)) == grown


def test_resident_rows_after_a_crop_match_a_cache_without_them():
    """A crop (what assisted generation does every step) drops tokens from the rows' end; feeding them again and
    generating on gives the same logits as a cache without resident rows doing the same, and the rows stay."""
    model, ids, mask, device = on_test_device(torch.bfloat16)
    runs = {}
    for resident in (False, True):
        cache = paged(model, page_size=16, kernels="triton", device=device, resident_rows=resident)
        full = generate(model, cache, 30, ids, mask)
        rows = resident_gather(cache)._rows if resident else None
        cache.crop(-9)
        width = ids.shape[1]
        again_ids = full.sequences[:, : width + 21]
        again_mask = torch.cat([mask, torch.ones(ids.shape[0], 21, dtype=mask.dtype, device=device)], dim=1)
        runs[resident] = generate(model, cache, 12, again_ids, again_mask)
        if resident:
            assert resident_gather(cache)._rows is rows, "a crop keeps the rows: the next step writes from its tokens"
    assert torch.equal(runs[True].sequences, runs[False].sequences)
    assert all(torch.equal(a, b) for a, b in zip(runs[True].logits, runs[False].logits))


def test_resident_rows_under_beam_search_and_with_a_freed_row():
    """Beam search reorders the pool's rows every step (the resident rows are gathered again after it); a freed
    row's step stores through the pool (the rows are dropped, the step gathers as without them).  Both give what
    DynamicCache gives."""
    model, ids, mask, device = on_test_device(torch.bfloat16)
    kwargs = {"num_beams": 3, "num_return_sequences": 3}
    ref = generate(model, DynamicCache(config=model.config), 12, ids, mask, **kwargs)
    cache = paged(model, page_size=16, kernels="triton", device=device, max_batch_size=9, resident_rows=True)
    out = generate(model, cache, 12, ids, mask, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    cache.free_all()
    assert cache.available_tokens == cache.capacity_tokens

    ref = generate(model, DynamicCache(config=model.config), 24, ids, mask)
    cache = paged(model, page_size=16, kernels="triton", device=device, resident_rows=True)
    first = generate(model, cache, 12, ids, mask)
    assert resident_gather(cache)._rows is not None
    cache.free(1)
    assert resident_gather(cache)._rows is None, "the batch's rows changed: the resident rows are dropped"
    more_ids = first.sequences
    more_mask = torch.cat([mask, torch.ones(ids.shape[0], 12, dtype=mask.dtype, device=device)], dim=1)
    rest = generate(model, cache, 12, more_ids, more_mask)
    assert torch.equal(rest.sequences[[0, 2]], ref.sequences[[0, 2]])
    assert resident_gather(cache)._rows is None, "steps with a freed row store through the pool"

