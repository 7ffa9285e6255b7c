"""kvcore.integrations.transformers.PagedKVCache: transformers' generate running on kvcore pools.

Tiny random-weight Llama and Qwen2 models (fixed seed) generate greedily for a batch of three left-padded
prompts of different lengths, once with transformers' DynamicCache and once with a PagedKVCache; every
comparison is against what DynamicCache produced in the same process, nothing is hard-coded.
"""

from __future__ import annotations

import collections
import functools
import inspect
import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip(
    "transformers", reason='the transformers integration needs transformers: pip install "kvcore[hf]"'
)

from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.cache_utils import Cache, DynamicLayer
from transformers.models.llama.modeling_llama import LlamaModel

import kvcore
from kvcore.errors import ConfigError
from kvcore.integrations.transformers import KVCacheFullError, PagedKVCache, config_overrides
from kvcore.kernels.head_gather import room_for
from kvcore.testing.tensors import addresses_kept

from test_head_gather import direct_store_launches

#: generate's keyword for a cache object: ``cache`` since transformers renamed ``past_key_values``.
CACHE_KW = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"

NEW_TOKENS = 300
PROMPT_LENS = (5, 17, 11)
MODELS = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config)}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models are dominated by per-op overhead: one thread is several times faster than contended ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def tiny_model(kind: str, dtype: torch.dtype, layers: int = 2):
    model_cls, config_cls = MODELS[kind]
    config = config_cls(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return model_cls(config).eval().to(dtype)


@functools.cache
def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of different lengths, left-padded, with their attention mask."""
    gen = torch.Generator().manual_seed(1)
    width = max(PROMPT_LENS)
    ids = torch.zeros(len(PROMPT_LENS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(PROMPT_LENS):
        ids[row, width - n :] = torch.randint(3, 256, (n,), generator=gen)
        mask[row, width - n :] = 1
    return ids, mask


def generate(model, cache, new_tokens: int = NEW_TOKENS, ids=None, mask=None, **kwargs):
    if ids is None:
        ids, mask = prompts()
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
        output_logits=True, **{CACHE_KW: cache}, **kwargs,
    )  # fmt: skip


@functools.cache
def reference(kind: str, dtype: torch.dtype, new_tokens: int = NEW_TOKENS):
    """What transformers' own DynamicCache generates (the cache is returned with the output)."""
    model = tiny_model(kind, dtype)
    cache = DynamicCache(config=model.config)
    return generate(model, cache, new_tokens), cache


def paged(model, **kwargs) -> PagedKVCache:
    kwargs.setdefault("max_total_tokens", 4096)
    return PagedKVCache.from_model(model, **kwargs)


def stored_tokens(seq_len: int, page_size: int, rows: int = len(PROMPT_LENS)) -> int:
    """Slots a batch of ``rows`` rows of ``seq_len`` tokens holds: whole pages per row."""
    return rows * math.ceil(seq_len / page_size) * page_size


# -- token identity ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_greedy_generation_is_token_identical_to_dynamic_cache(kind, dtype, page_size):
    model = tiny_model(kind, dtype)
    ref, _ = reference(kind, dtype)
    cache = paged(model, page_size=page_size)  # the cache dtype follows the model: like with like
    assert cache.dtype == dtype
    start = cache.available_tokens
    out = generate(model, cache)

    assert torch.equal(out.sequences, ref.sequences)
    # not only the argmax: attention saw the same bits, so every logit is the same
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))
    seq_len = prompts()[0].shape[1] + NEW_TOKENS - 1  # the last token is generated, never fed back
    assert cache.get_seq_length() == seq_len
    assert all(cache.get_seq_length(i) == seq_len for i in range(len(cache)))
    assert start - cache.available_tokens == stored_tokens(seq_len, page_size)


def test_past_key_values_keyword_works_too():
    """``past_key_values=cache`` (the name before transformers' rename to ``cache``, still accepted)."""
    model = tiny_model("llama", torch.float32)
    ref, _ = reference("llama", torch.float32, 20)
    ids, mask = prompts()
    cache = paged(model, page_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a deprecation notice on versions that renamed it
        out = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, past_key_values=cache)
    assert torch.equal(out, ref.sequences)
    assert cache.get_seq_length() == ids.shape[1] + 19


def test_the_readme_keyword_takes_the_cache_without_a_warning():
    """README.md passes ``cache=cache``, the name transformers 5.24 and later take (what the ``hf`` extra
    installs): no deprecation warning, the same tokens as DynamicCache."""
    import re

    import transformers
    from packaging.version import Version

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert re.search(r"model\.generate\(.*\bcache=cache\)", readme), "README.md no longer passes cache=cache"
    if Version(transformers.__version__) < Version("5.24"):
        pytest.skip(f"transformers {transformers.__version__} names it past_key_values (tested above)")
    model = tiny_model("llama", torch.float32)
    ref, _ = reference("llama", torch.float32, 20)
    ids, mask = prompts()
    cache = paged(model, page_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, cache=cache)
    assert torch.equal(out, ref.sequences)


# -- fp8 ------------------------------------------------------------------------------------------------------


class ForceTokens(LogitsProcessor):
    """Teacher forcing inside generate: the next token is always ``tokens``' one at that position."""

    def __init__(self, tokens: torch.Tensor, prompt_len: int):
        self.tokens, self.prompt_len = tokens, prompt_len

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, self.tokens[:, input_ids.shape[1], None], 0.0)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_fp8_cache_within_tolerance_of_full_precision(kind, record_property):
    """An e4m3fn cache (bf16 model, pages of 16) against the bf16 DynamicCache run.

    Free-running greedy decoding of a random-weight model drifts once a near-tie flips (its top-2 logit
    margin is ~0.03), so the tolerance is stated on the same contexts: the fp8 cache is fed the reference
    tokens (teacher forcing through generate) and its next-token logits are compared step by step.
    Measured (transformers 5.24, torch 2.13 CPU): top-1 agreement 0.961 (Llama) / 0.977 (Qwen2), max
    |logit difference| 3.0% / 2.5% of the largest |logit|; free-running, 25% / 14% of the 900 tokens match,
    the first difference after 2-35 tokens.  Asserted: agreement >= 0.90, difference <= 6%.
    """
    dtype = torch.bfloat16
    model = tiny_model(kind, dtype)
    ref, _ = reference(kind, dtype)
    cache = paged(model, page_size=16, dtype="float8_e4m3fn")
    assert cache.pool.k_cache.dtype == torch.uint8 and cache.dtype == torch.float8_e4m3fn

    free_run = generate(model, cache)
    width = prompts()[0].shape[1]
    same = (free_run.sequences[:, width:] == ref.sequences[:, width:]).float().mean().item()
    cache.free_all()

    forced = generate(model, cache, logits_processor=LogitsProcessorList([ForceTokens(ref.sequences, width)]))
    assert torch.equal(forced.sequences, ref.sequences)
    ref_logits, fp8_logits = torch.stack(ref.logits).float(), torch.stack(forced.logits).float()
    agreement = (ref_logits.argmax(-1) == fp8_logits.argmax(-1)).float().mean().item()
    rel_diff = ((ref_logits - fp8_logits).abs().max() / ref_logits.abs().max()).item()
    record_property("fp8_free_run_same_tokens", same)
    record_property("fp8_forced_top1_agreement", agreement)
    record_property("fp8_forced_max_rel_logit_diff", rel_diff)
    assert agreement >= 0.90, f"top-1 agreement {agreement:.3f}"
    assert rel_diff <= 0.06, f"max logit difference {rel_diff:.3%} of the largest logit"
    assert 0 < rel_diff, "an fp8 cache that changes nothing was not stored in fp8"


class RoundTripLayer(DynamicLayer):
    """A DynamicLayer that keeps keys/values rounded through ``dtype`` (with an optional scale): what an fp8
    cache should hold, computed by torch alone."""

    def __init__(self, dtype, k_scale=None, v_scale=None):
        super().__init__()
        self.fp8, self.k_scale, self.v_scale = dtype, k_scale, v_scale

    def _round(self, x, scale):
        if scale is None:
            return x.to(self.fp8).to(x.dtype)
        return ((x.float() / scale).to(self.fp8).float() * scale).to(x.dtype)

    def update(self, key_states, value_states, *args, **kwargs):
        return super().update(self._round(key_states, self.k_scale), self._round(value_states, self.v_scale))


@pytest.mark.parametrize(
    "kind, dtype, fp8, page_size, scales",
    [
        ("llama", torch.float32, torch.float8_e4m3fn, 1, (None, None)),
        ("qwen2", torch.bfloat16, torch.float8_e4m3fn, 16, (0.5, 0.25)),
        ("llama", torch.bfloat16, torch.float8_e5m2, 16, (None, None)),
    ],
    ids=["llama-fp32-e4m3fn", "qwen2-bf16-e4m3fn-scaled", "llama-bf16-e5m2"],
)
def test_fp8_cache_equals_an_fp8_rounded_dynamic_cache(kind, dtype, fp8, page_size, scales):
    """The fp8 cache adds nothing beyond rounding each key/value once: a DynamicCache whose entries are
    rounded the same way generates the same tokens with the same logits."""
    model = tiny_model(kind, dtype)
    k_scale, v_scale = scales
    rounded = Cache(layers=[RoundTripLayer(fp8, k_scale, v_scale) for _ in range(model.config.num_hidden_layers)])
    ref = generate(model, rounded, 100)
    out = generate(model, paged(model, page_size=page_size, dtype=fp8, k_scale=k_scale, v_scale=v_scale), 100)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))


# -- storage -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_pool_holds_the_keys_and_values(page_size):
    """Read the rows back from the pool by location: they are DynamicCache's keys and values."""
    model = tiny_model("llama", torch.float32)
    _, ref_cache = reference("llama", torch.float32)
    cache = paged(model, page_size=page_size)
    generate(model, cache)
    seq_len = cache.get_seq_length()
    assert ref_cache.get_seq_length() == seq_len

    all_locs = []
    for row in range(len(PROMPT_LENS)):
        locs = cache.token_locations(row)
        assert locs.shape == (seq_len,)
        all_locs.append(locs)
        assert (locs >= page_size).all(), "a token landed in the padding page"
        if page_size > 1:  # whole pages: position p sits at offset p % page_size of its page
            assert torch.equal(locs % page_size, torch.arange(seq_len) % page_size)
        for layer in range(len(cache)):
            ref_k = ref_cache.layers[layer].keys[row].transpose(0, 1)  # [seq, kv_heads, head_dim]
            ref_v = ref_cache.layers[layer].values[row].transpose(0, 1)
            assert torch.equal(cache.pool.get_key_buffer(layer)[locs], ref_k)
            assert torch.equal(cache.pool.get_value_buffer(layer)[locs], ref_v)
    flat = torch.cat(all_locs)
    assert flat.unique().numel() == flat.numel(), "two tokens share a slot"
    for layer in range(len(cache)):  # the layers' keys/values views read the same rows
        assert torch.equal(cache.layers[layer].keys, ref_cache.layers[layer].keys)
        assert torch.equal(cache.layers[layer].values, ref_cache.layers[layer].values)


# -- freeing ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
def test_freeing_returns_every_slot(page_size):
    model = tiny_model("qwen2", torch.float32)
    ref, _ = reference("qwen2", torch.float32)
    cache = paged(model, page_size=page_size, max_batch_size=4)
    start, start_rows = cache.available_tokens, cache.req_to_token_pool.available_size()
    generate(model, cache)
    seq_len = cache.get_seq_length()
    per_row = stored_tokens(seq_len, page_size, rows=1)
    assert cache.available_tokens == start - 3 * per_row
    assert cache.req_to_token_pool.available_size() == start_rows - 3

    cache.free(1)
    assert cache.available_tokens == start - 2 * per_row
    assert cache.live_rows == [0, 2] and cache.get_seq_length() == seq_len
    with pytest.raises(ValueError, match="already freed"):
        cache.free(1)
    cache.free([0, 2])
    assert cache.available_tokens == start == cache.capacity_tokens
    assert cache.req_to_token_pool.available_size() == start_rows
    assert cache.get_seq_length() == 0

    # empty again: the same cache serves the next batch, exactly as a fresh one would
    out = generate(model, cache)
    assert torch.equal(out.sequences, ref.sequences)
    cache.free_all()
    assert cache.available_tokens == start and cache.get_seq_length() == 0


@pytest.mark.parametrize("checked", [False, True], ids=["plain", "checked"])
def test_freed_row_leaves_the_others_untouched(checked):
    """Free a row halfway, generate on: the other rows continue exactly as without the pause, and only the
    freed row's slots came back.  Under kvcore's checked pool (every write's locations checked, none may
    land in the padding page) the freed row stores nothing."""
    kind, dtype, half = "llama", torch.bfloat16, NEW_TOKENS // 2
    model = tiny_model(kind, dtype)
    ref, _ = reference(kind, dtype)
    if checked:
        cfg = kvcore.load_config(
            *config_overrides(model), "kv_cache.page_size=16", "memory.max_total_tokens=4096", "hardware.checked=true"
        )
        cache = PagedKVCache.from_config(cfg, model=model)
        assert type(cache.pool).__name__ == "CheckedPool"
    else:
        cache = paged(model, page_size=16)
    start = cache.available_tokens
    first = generate(model, cache, half)
    used = start - cache.available_tokens
    cache.free(1)
    assert start - cache.available_tokens == used * 2 // 3

    ids = first.sequences
    mask = torch.cat([prompts()[1], torch.ones(ids.shape[0], half, dtype=torch.long)], dim=1)
    rest = generate(model, cache, NEW_TOKENS - half, ids=ids, mask=mask)
    assert torch.equal(rest.sequences[[0, 2]], ref.sequences[[0, 2]])
    # the freed row stored nothing more: only the two live rows grew
    seq_len = cache.get_seq_length()
    assert start - cache.available_tokens == stored_tokens(seq_len, 16, rows=2)
    cache.free_all()
    assert cache.available_tokens == start


@pytest.mark.parametrize("page_size", [1, 16])
def test_crop_gives_whole_pages_back_and_regrows_identically(page_size):
    model = tiny_model("qwen2", torch.float32)
    cache = paged(model, page_size=page_size)
    start = cache.available_tokens
    full = generate(model, cache, 60)
    seq_len = cache.get_seq_length()
    cache.crop(-20)
    assert cache.get_seq_length() == seq_len - 20 and all(c.get_seq_length() == seq_len - 20 for c in cache.layers)
    assert start - cache.available_tokens == stored_tokens(seq_len - 20, page_size)

    # feed the dropped tokens again: the same continuation, the same slots in use
    width = prompts()[0].shape[1]
    ids = full.sequences[:, : width + 40]
    mask = torch.cat([prompts()[1], torch.ones(ids.shape[0], 40, dtype=torch.long)], dim=1)
    again = generate(model, cache, 20, ids=ids, mask=mask)
    assert torch.equal(again.sequences, full.sequences)
    assert cache.get_seq_length() == seq_len
    assert start - cache.available_tokens == stored_tokens(seq_len, page_size)


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_matches_dynamic_cache(page_size):
    """Prompts fed in chunks of 6: each chunk extends the rows from inside a page (alloc_extend with a
    prefix)."""
    model = tiny_model("llama", torch.float32)
    ref = generate(model, DynamicCache(config=model.config), 30, prefill_chunk_size=6)
    cache = paged(model, page_size=page_size)
    out = generate(model, cache, 30, prefill_chunk_size=6)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))
    assert cache.capacity_tokens - cache.available_tokens == stored_tokens(cache.get_seq_length(), page_size)


def test_beam_search_matches_dynamic_cache():
    """Beam search reorders the cache every step (``reorder_cache``): rows copy each other's tokens."""
    model = tiny_model("llama", torch.float32)
    kwargs = {"num_beams": 3, "num_return_sequences": 3}
    ref = generate(model, DynamicCache(config=model.config), 24, **kwargs)
    cache = paged(model, page_size=16, max_batch_size=9)
    out = generate(model, cache, 24, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    cache.free_all()
    assert cache.available_tokens == cache.capacity_tokens


# -- the per-step path: slots once a page, locations once a step, nothing read back from the device -------------


def long_prompts(rows: int, length: int, short_by: int = 37) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` prompts of ``length`` tokens, left-padded: row 0 is ``short_by`` tokens shorter (one row: none)."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 256, (rows, length), generator=gen)
    mask = torch.ones_like(ids)
    if rows > 1:
        ids[0, :short_by], mask[0, :short_by] = 0, 0
    return ids, mask


@pytest.mark.parametrize("contiguous_rows", [False, True], ids=["paged", "contiguous_rows"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("rows", [1, 2])
def test_a_long_prompt_then_decoding_keeps_every_logit(rows, page_size, contiguous_rows):
    """A 600-token prompt (batch 1, or 2 rows left-padded), then 40 decode steps across page boundaries: the
    logits of every step are DynamicCache's, bit for bit."""
    model = tiny_model("llama", torch.bfloat16)
    ids, mask = long_prompts(rows, 600)
    ref = generate(model, DynamicCache(config=model.config), 40, ids, mask)
    cache = paged(model, page_size=page_size, contiguous_rows=contiguous_rows)
    out = generate(model, cache, 40, ids, mask)
    assert (cache._row_base is not None) == contiguous_rows
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))
    cache.free_all()
    assert cache.available_tokens == cache.capacity_tokens


@pytest.mark.parametrize("rows", [1, 2])
def test_a_long_prompt_in_an_fp8_cache_equals_an_fp8_rounded_dynamic_cache(rows):
    """The same in a scaled e4m3fn cache (gathered and converted, reserved runs or not): the logits of a
    DynamicCache whose keys and values are rounded through fp8 the same way."""
    model = tiny_model("llama", torch.bfloat16)
    ids, mask = long_prompts(rows, 600)
    layers = model.config.num_hidden_layers
    rounded = Cache(layers=[RoundTripLayer(torch.float8_e4m3fn, 0.5, 0.25) for _ in range(layers)])
    ref = generate(model, rounded, 40, ids, mask)
    for contiguous_rows in (False, True):
        cache = paged(model, page_size=16, dtype="float8_e4m3fn", k_scale=0.5, v_scale=0.25,
                      contiguous_rows=contiguous_rows)  # fmt: skip
        out = generate(model, cache, 40, ids, mask)
        assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))


class CountCalls:
    """Counts the calls of some methods of an object (its own attributes shadow them while counting)."""

    def __init__(self, obj, *names):
        self.calls = dict.fromkeys(names, 0)
        for name in names:
            method = getattr(obj, name)

            def counted(*args, name=name, method=method, **kwargs):
                self.calls[name] += 1
                return method(*args, **kwargs)

            setattr(obj, name, counted)


@pytest.mark.parametrize("page_size", [1, 16])
def test_rows_take_whole_pages_once_a_page(page_size):
    """The allocator is called once for every row by the forward that reaches a page the rows do not hold: at
    the prompt, then every ``page_size`` decode steps (every step with one-token pages); the pages are those
    ``alloc_extend`` / ``alloc_decode`` hand out (position ``p`` at offset ``p % page_size``), and the request
    table holds each page's locations from the step that took it."""
    model = tiny_model("llama", torch.float32)
    ref, _ = reference("llama", torch.float32, 60)
    cache = paged(model, page_size=page_size)
    counter = CountCalls(cache.allocator, "alloc", "alloc_extend", "alloc_decode")
    out = generate(model, cache, 60)
    assert torch.equal(out.sequences, ref.sequences)
    width, seq_len = prompts()[0].shape[1], cache.get_seq_length()
    pages = -(-seq_len // page_size)  # whole pages each row holds
    assert counter.calls == {"alloc": 1 + pages - -(-width // page_size), "alloc_extend": 0, "alloc_decode": 0}
    table = cache.req_to_token_pool.req_to_token
    for row in range(len(PROMPT_LENS)):
        held = table[cache.request_slot(row), : pages * page_size].to(torch.int64)
        assert torch.equal(held[:seq_len], cache.token_locations(row))
        assert torch.equal(held // page_size, (held[::page_size] // page_size).repeat_interleave(page_size))
        assert torch.equal(held % page_size, torch.arange(held.numel()) % page_size)
    assert cache.capacity_tokens - cache.available_tokens == stored_tokens(seq_len, page_size)


#: aten ops that wait for the device on a GPU (a value read back, or an output sized by the data)
SYNCING_OPS = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "masked_select", "unique", "_unique2",
               "unique_consecutive", "argwhere"}  # fmt: skip


class RecordOps(TorchDispatchMode):
    """The aten ops of each of a cache's ``update`` calls: ``calls`` holds ``(layer, new tokens, op counts)``."""

    def __init__(self, cache):
        super().__init__()
        self.calls = []
        update = cache.update

        def recorded(key_states, value_states, layer_idx, *args, **kwargs):
            self.ops = collections.Counter()
            with self:
                out = update(key_states, value_states, layer_idx, *args, **kwargs)
            self.calls.append((layer_idx, key_states.shape[-2], self.ops))
            return out

        cache.update = recorded

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("contiguous_rows", [False, True], ids=["paged", "contiguous_rows"])
def test_decode_steps_read_nothing_back_and_later_layers_only_store_and_read(contiguous_rows):
    """No decode step makes an op that waits for the device, and the layers after a step's first make the same
    ops at every step, page boundaries included: the store and the read, nothing of the locations' work."""
    model = tiny_model("llama", torch.float32, layers=3)
    cache = paged(model, page_size=16, contiguous_rows=contiguous_rows)
    recorder = RecordOps(cache)
    generate(model, cache, 40)
    decode = [(layer, ops) for layer, q, ops in recorder.calls if q == 1]
    assert len(decode) == 3 * 39
    for layer, ops in decode:
        assert not SYNCING_OPS & ops.keys(), f"layer {layer} waits for the device: {dict(ops)}"
    later = {tuple(sorted(ops.items())) for layer, ops in decode if layer}
    assert len(later) == 1, f"the layers after the first differ from step to step: {later}"
    assert not {"full", "arange", "cumsum", "_to_copy"} & dict(*later).keys()


def test_scattered_request_slots_read_through_the_table():
    """Rows in request slots that are not one run: their locations are taken from the table by slot (no view
    of it), with the same logits."""
    model = tiny_model("llama", torch.bfloat16)
    ref, _ = reference("llama", torch.bfloat16, 40)
    cache = paged(model, page_size=16)
    free_slots = cache.req_to_token_pool.free_slots
    cache.req_to_token_pool.free_slots = [5, 2, 9] + [s for s in free_slots if s not in (5, 2, 9)]
    out = generate(model, cache, 40)
    assert [cache.request_slot(i) for i in range(3)] == [5, 2, 9] and cache._rows is None
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))
    cache.free_all()
    assert cache.available_tokens == cache.capacity_tokens


def test_a_last_page_past_max_context_len_is_held_and_given_back():
    """``max_context_len`` inside a page: the rows hold the whole last page, the table records it up to
    ``max_context_len``, the rows fill it exactly, one token more is refused, and every slot goes back."""
    model = tiny_model("llama", torch.float32)
    width = prompts()[0].shape[1]
    max_len = width + 30  # 47: inside the third page of 16
    ref, _ = reference("llama", torch.float32, 30)
    cache = paged(model, page_size=16, max_context_len=max_len)
    out = generate(model, cache, 31)  # the 31st token is generated, never stored: the rows end at max_len
    assert torch.equal(out.sequences[:, :-1], ref.sequences)
    assert cache.get_seq_length() == max_len
    assert cache.capacity_tokens - cache.available_tokens == stored_tokens(max_len, 16)
    with pytest.raises(KVCacheFullError, match="max_context_len"):
        generate(model, cache, 2, ids=out.sequences, mask=torch.ones_like(out.sequences))
    cache.free_all()
    assert cache.available_tokens == cache.capacity_tokens


# -- construction and limits -------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [[], ["kv_cache.layout=page_major"]], ids=["token_major", "page_major"])
def test_from_config_builds_through_kvcore(layout):
    model = tiny_model("qwen2", torch.float32)
    ref, _ = reference("qwen2", torch.float32)
    cfg = kvcore.load_config(
        *config_overrides(model), "kv_cache.page_size=16", "memory.max_total_tokens=2048",
        "memory.max_running_requests=4", *layout,
    )  # fmt: skip
    cache = PagedKVCache.from_config(cfg, model=model)
    assert cache.page_size == 16 and cache.capacity_tokens == 2048 and cache.dtype == torch.float32
    # the page-major pool hands out [pages, page_size, heads, dim] views; the token-major one token rows
    assert cache.pool.get_key_buffer(0).dim() == (4 if layout else 3)
    out = generate(model, cache)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))

    other = tiny_model("qwen2", torch.float32, layers=3)
    with pytest.raises(ConfigError, match="layers"):
        PagedKVCache.from_config(cfg, model=other)


def test_from_model_reads_the_model_config():
    model = tiny_model("llama", torch.bfloat16, layers=3)
    cache = PagedKVCache.from_model(model, max_total_tokens=1000, page_size=16, dtype="float8_e5m2")
    assert len(cache) == 3 and cache.pool.layer_num == 3
    assert cache.pool.head_num == 2 and cache.pool.head_dim == 16
    assert cache.dtype == torch.float8_e5m2 and cache.capacity_tokens == 992  # whole pages of 16
    assert cache.get_seq_length() == 0 and not cache.is_compileable
    with pytest.raises(ConfigError, match="dtype"):
        PagedKVCache.from_model(model, max_total_tokens=1024, dtype="int8")


def test_sliding_window_models_are_refused():
    config = Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=32, max_window_layers=0,
    )  # fmt: skip
    if all(t == "full_attention" for t in (getattr(config, "layer_types", None) or ["full_attention"])):
        pytest.skip("this transformers version does not mark Qwen2's sliding layers in layer_types")
    with pytest.raises(ConfigError, match="full-attention"):
        PagedKVCache.from_model(Qwen2ForCausalLM(config), max_total_tokens=256)


def test_running_out_of_slots_raises_and_leaks_nothing():
    model = tiny_model("llama", torch.float32)
    cache = paged(model, max_total_tokens=96, page_size=16)
    with pytest.raises(KVCacheFullError, match="free"):
        generate(model, cache, 40)  # 3 rows need 3 pages each after 17 + 15 tokens: 144 > 96
    cache.free_all()
    assert cache.available_tokens == 96 and cache.req_to_token_pool.available_size() == 32


def test_import_kvcore_loads_no_transformers():
    code = (
        "import sys, kvcore, kvcore.integrations; "
        "assert 'transformers' not in sys.modules, 'kvcore imported transformers'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def on_test_device(dtype: torch.dtype):
    """``(model, ids, mask, device)``: a copy of the tiny Llama and the prompts on the tests' device (the CPU, or the
    GPU in compiled runs), for the Triton path."""
    import copy

    from kvcore.testing.tensors import test_device

    device = test_device()
    model = copy.deepcopy(tiny_model("llama", dtype)).to(device)
    ids, mask = (t.to(device) for t in prompts())
    return model, ids, mask, device


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_one_launch_gather_keeps_every_logit(dtype, page_size):
    """The cache's Triton path (the store, and the gather into attention's [batch, heads, seq, dim] in one launch):
    interpreted on the CPU, compiled on a GPU in compiled runs; the logits are DynamicCache's, bit for bit."""
    model, ids, mask, device = on_test_device(dtype)
    ref = generate(model, DynamicCache(config=model.config), 12, ids, mask)
    cache = paged(model, page_size=page_size, kernels="triton", device=device)
    assert cache._triton_gather
    out = generate(model, cache, 12, ids, mask)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))


@pytest.mark.parametrize(
    "cache_dtype, scales, layout",
    [
        (None, (None, None), "token_major"),
        ("float8_e4m3fn", (0.5, 0.25), "token_major"),
        ("float8_e5m2", (None, None), "page_major"),
        (None, (None, None), "page_major"),
    ],
    ids=["bf16", "e4m3fn-scaled", "e5m2-page-major", "bf16-page-major"],
)
def test_the_store_and_the_gather_in_one_launch_keep_every_logit(cache_dtype, scales, layout):
    """On the Triton path over kvcore's own MHA pools every layer stores its new keys/values and reads all of them
    in one launch (``store_and_gather``, the pool's conversion done in the launch); the logits are a DynamicCache's
    (rounded through fp8 as the pool rounds, for an fp8 cache), and the pool holds what ``set_kv_buffer`` would."""
    model, ids, mask, device = on_test_device(torch.bfloat16)
    k_scale, v_scale = scales
    layers = model.config.num_hidden_layers
    if cache_dtype is None:
        ref = generate(model, DynamicCache(config=model.config), 40, ids, mask)
    else:
        fp8 = getattr(torch, cache_dtype)
        ref = generate(model, Cache(layers=[RoundTripLayer(fp8, k_scale, v_scale) for _ in range(layers)]), 40, ids, mask)
    cfg = kvcore.load_config(
        *config_overrides(model), "kv_cache.page_size=16", "memory.max_total_tokens=2048", f"hardware.device={device}",
        "hardware.kernels=triton", *([f"kv_cache.dtype={cache_dtype}"] if cache_dtype else []),
        *(["kv_cache.layout=page_major"] if layout == "page_major" else []),
    )  # fmt: skip
    cache = PagedKVCache.from_config(cfg, model=model, k_scale=k_scale, v_scale=v_scale)
    assert cache._fused_store and cache.pool.set_kv_buffer_writes_rows
    out = generate(model, cache, 40, ids, mask)
    assert cache._step.fused
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))
    # the pool's rows are what its own store writes: row 1's tokens stored again through set_kv_buffer
    locs = cache.token_locations(1)
    for layer in range(layers):
        k, v = cache.layers[layer].keys[1], cache.layers[layer].values[1]  # [heads, seq, dim], the cache dtype
        before = (cache.pool.get_key_buffer(layer).clone(), cache.pool.get_value_buffer(layer).clone())
        cache.pool.set_kv_buffer(layer, locs, k.transpose(0, 1), v.transpose(0, 1))
        after = (cache.pool.get_key_buffer(layer), cache.pool.get_value_buffer(layer))
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, after))


def test_a_layers_keys_and_values_are_written_over_only_once_dropped():
    """On the one-launch path a layer after a step's first writes into the keys and values the layer before
    returned once nothing holds them (no allocation); a caller that keeps a layer's keys and values, or a view of
    them, keeps what they held while the later layers update."""
    model, _, _, device = on_test_device(torch.bfloat16)
    cache = paged(model, page_size=16, kernels="triton", device=device)
    heads, dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    g = torch.Generator().manual_seed(5)

    def rows(q):
        return [torch.randn(2, heads, q, dim, generator=g).to(device, torch.bfloat16) for _ in range(2)]

    for layer in (0, 1):
        cache.update(*rows(7), layer)
    assert cache._step.fused
    # a decode step whose layer-0 keys and values are kept
    k0, v0 = cache.update(*rows(1), 0)
    kept = (k0.clone(), v0.clone())
    k1, v1 = cache.update(*rows(1), 1)
    assert k1.data_ptr() != k0.data_ptr() and v1.data_ptr() != v0.data_ptr()
    assert torch.equal(k0, kept[0]) and torch.equal(v0, kept[1])
    del k0, v0, k1, v1
    # the next, only a view of layer 0's values kept: not written over either
    k0, v0 = cache.update(*rows(1), 0)
    view, mark = v0[:, :, -1], (id(k0), id(v0))
    was = view.clone()
    del k0, v0
    k1, v1 = cache.update(*rows(1), 1)
    assert (id(k1), id(v1)) != mark and torch.equal(view, was)
    del k1, v1, view
    # the next, nothing kept: layer 1 gets layer 0's tensors, holding its own keys and values
    k0, v0 = cache.update(*rows(1), 0)
    mark = (id(k0), id(v0))
    del k0, v0
    k1, v1 = cache.update(*rows(1), 1)
    assert (id(k1), id(v1)) == mark
    assert torch.equal(k1, cache.layers[1].keys) and torch.equal(v1, cache.layers[1].values)
    del k1, v1
    cache.free_all()  # nothing kept for reuse past the batch
    assert all(gather._spare is None and gather._last_launch is None for gather in cache._gathers.values())


def test_a_decode_steps_first_layer_only_resizes_the_outputs_within_held_pages(monkeypatch):
    """On the one-launch path a decode step whose rows stay within the pages they hold works nothing out again: its
    first layer passes the same table rows with a new length and makes no op but resizing the two outputs (no view
    of the table; an allocation only once they are outgrown, 16 tokens or more apart), and the layers after it none
    of their own; only a forward that takes pages goes through the step's set-up."""
    model, ids, mask, device = on_test_device(torch.bfloat16)
    cache = paged(model, page_size=16, kernels="triton", device=device)
    begins = []
    begin_step = cache._begin_step
    monkeypatch.setattr(cache, "_begin_step", lambda k, v, end: begins.append(end) or begin_step(k, v, end))
    recorder = RecordOps(cache)
    new = 40
    generate(model, cache, new, ids, mask)
    width = ids.shape[1]
    ends = range(width, width + new)  # the forwards: the prompt's, then a decode step each
    assert begins == [end for end in ends if end == width or -(-end // 16) > -(-(end - 1) // 16)]
    layers = model.config.num_hidden_layers
    steps = [recorder.calls[i : i + layers] for i in range(layers, len(recorder.calls), layers)]
    assert len(steps) == new - 1
    grown = []
    for end, step in zip(ends[1:], steps):
        if end in begins:
            continue
        (_, _, first), *later = step
        for _, q, ops in later:  # (under the interpreter the launch makes ops of its own, the same in every layer)
            assert q == 1 and ops == later[0][2], f"layer ops differ at length {end}: {ops} and {later[0][2]}"
        own = first - later[0][2]
        assert not later[0][2] - first
        if own == {"new_empty": 2, "resize_": 2}:  # outputs outgrown: two more, with room for 16 more tokens a row
            grown.append(end)
        else:
            assert own == {"resize_": 2}, f"a decode step's first layer at length {end}: {own}"
    assert len(grown) <= -(-new // 16) and all(b - a >= 16 for a, b in zip(grown, grown[1:])), grown


def test_a_forwards_later_layers_go_straight_to_the_first_layers_repeat(monkeypatch):
    """The cache hands a forward's later layers to the head gather's repeat of its first layer's launch (a direct
    launch on a GPU; here a store-and-gather reference stands in for it, on every device), which it sets as its own
    ``update``: a decode step's first layer goes the cache's own way, every later one straight to the repeat, and the
    logits are DynamicCache's; a prompt's forward repeats nothing (its layers initialize themselves), and a crop or
    free_all leaves nothing to repeat.  The repeat follows the layers' lengths (``follow_layers``): a layer stored
    already at this length goes the cache's own way."""
    from kvcore.kernels.head_gather import HeadGather, store_and_gather_native

    repeated = []

    def repeat_for(gather, locs, length):
        lengths, otherwise, _ = gather._follow

        def repeat(k_new, v_new, layer, *extra, **options):
            if lengths[layer] != length - k_new.shape[2]:
                return otherwise(k_new, v_new, layer)
            repeated.append((layer, length))
            lengths[layer] = length
            return store_and_gather_native(gather.k_layers[layer], gather.v_layers[layer], locs[:, :length], k_new,
                                           v_new, gather.out_dtype, gather.k_scale, gather.v_scale)  # fmt: skip

        return repeat

    monkeypatch.setattr(HeadGather, "repeat_for", repeat_for)
    model, ids, mask, device = on_test_device(torch.bfloat16)
    ref = generate(model, DynamicCache(config=model.config), 10, ids, mask)
    cache = paged(model, page_size=16, kernels="triton", device=device)
    own_way = []
    update = cache._update
    monkeypatch.setattr(cache, "_update", lambda layer, k, v: own_way.append(layer.layer_id) or update(layer, k, v))
    out = generate(model, cache, 10, ids, mask)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))
    layers, width = model.config.num_hidden_layers, ids.shape[1]
    assert repeated == [(layer, end) for end in range(width + 1, width + 10) for layer in range(1, layers)]
    assert own_way == [*range(layers), *[0] * 9], "the prompt's layers, then each decode step's first"
    assert cache._repeat is not None and cache.update is cache._repeat, "the later layers' update, set on the cache"
    assert [layer.seq_len for layer in cache.layers] == [width + 9] * layers
    # a layer called twice in a forward: the second call is not the repeat's (the layer is stored at this length)
    k, v = (torch.zeros(ids.shape[0], cache.pool.head_num, 1, cache.pool.head_dim, dtype=torch.bfloat16, device=device)
            for _ in range(2))  # fmt: skip
    own_way.clear()
    cache.update(k, v, layers - 1)
    assert own_way == [layers - 1] and not [r for r in repeated if r[1] > width + 9]
    cache.crop(-2)
    assert cache._repeat is None and "update" not in vars(cache)
    cache.free_all()
    assert cache._repeat is None and "update" not in vars(cache)


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_steps_within_held_pages_go_to_the_repeat_from_their_first_layer(monkeypatch, page_size):
    """A decode step whose rows stay within the outputs kept for reuse goes to the head gather's repeat from its first
    layer on, a step that takes a page (every step at ``page_size=1``) included: the repeat takes it through the
    cache's reach, which takes the rows' next pages, whole pages as before.  The cache's own way takes the prompt's
    layers, the first decode step's first layer, and the first layer of a step that outgrows the outputs (made with
    room for more tokens a row, :func:`room_for`); the logits are DynamicCache's.  Measured on a cache's second
    generation, once every launch signature has been launched (an engine past its first steps).  Compiled for real;
    on the CPU with the launches made direct (:func:`direct_store_launches`)."""
    model, ids, mask, device = on_test_device(torch.bfloat16)
    new = 60
    ref = generate(model, DynamicCache(config=model.config), new, ids, mask)
    direct_store_launches(monkeypatch, lambda: cache._gathers[torch.bfloat16],
                          lambda: cache.req_to_token_pool.req_to_token.dtype)
    cache = paged(model, page_size=page_size, kernels="triton", device=device)
    generate(model, cache, new, ids, mask)  # (each launch signature's first launch goes through Triton's dispatcher)
    cache.free_all()
    own_way = []
    update = cache._update
    monkeypatch.setattr(cache, "_update", lambda layer, k, v: own_way.append(
        (layer.layer_id, layer.seq_len + k.shape[-2])) or update(layer, k, v))  # fmt: skip
    out = generate(model, cache, new, ids, mask)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))
    layers, width = model.config.num_hidden_layers, ids.shape[1]
    expected, room = [], room_for(width)
    for end in range(width + 1, width + new):  # each decode step's length
        if end == width + 1 or end > room:
            expected.append(end)
            room = room if end <= room else room_for(end)
    assert own_way == [(layer, width) for layer in range(layers)] + [(0, end) for end in expected]
    assert 0 < len(expected) < (new - 1) // 4, "most decode steps went to the repeat from their first layer"
    taken = cache.capacity_tokens - cache.available_tokens
    assert taken == stored_tokens(cache.get_seq_length(), page_size), "whole pages, as the rows grew"


@pytest.mark.parametrize("limit", ["slots", "max_context_len"])
def test_decode_steps_through_the_repeat_end_where_the_pool_or_the_table_does(monkeypatch, limit):
    """The repeat takes a decode step's next page (through the cache's reach) only while the allocator has one and the
    rows fit the request table: a pool out of slots, or rows reaching ``max_context_len`` inside a page, hand the step
    to the cache's own way, which raises :class:`KVCacheFullError` saying what to raise; every slot goes back after.
    Pages of 16, rows of 17 prompt tokens: the third page (position 33) is taken by the repeat, and the step that needs
    a fourth (49, with slots for three pages a row) or passes ``max_context_len`` (48, with 47) is refused.  Compiled
    for real; on the CPU with the launches made direct."""
    model, ids, mask, device = on_test_device(torch.bfloat16)
    direct_store_launches(monkeypatch, lambda: cache._gathers[torch.bfloat16],
                          lambda: cache.req_to_token_pool.req_to_token.dtype)
    rows, width = ids.shape
    assert width == 17
    sizes = {"slots": {"max_total_tokens": rows * 48}, "max_context_len": {"max_context_len": 47}}[limit]
    cache = paged(model, page_size=16, kernels="triton", device=device, **sizes)
    own_way = []
    update = cache._update
    monkeypatch.setattr(cache, "_update", lambda layer, k, v: own_way.append(
        (layer.layer_id, layer.seq_len + k.shape[-2])) or update(layer, k, v))  # fmt: skip
    with pytest.raises(KVCacheFullError, match="free finished rows" if limit == "slots" else "max_context_len"):
        generate(model, cache, 40, ids, mask)
    refused = 49 if limit == "slots" else 48
    assert own_way[-1] == (0, refused) and (0, 33) not in own_way, "the third page taken by the repeat"
    assert cache._allocated == 48, "the fourth page never taken"
    cache.free_all()
    assert cache.available_tokens == cache.capacity_tokens and cache.req_to_token_pool.available_size() >= rows


def test_the_repeat_under_beam_search_and_after_a_crop(monkeypatch):
    """With decode steps going to the repeat from their first layer on: beam search (the rows copy each other's
    tokens every step, between the steps the repeat serves) gives DynamicCache's sequences, and a crop (which drops
    the repeat) then the dropped tokens fed again give the first run's sequences.  Compiled for real; on the CPU with
    the launches made direct."""
    model, ids, mask, device = on_test_device(torch.bfloat16)
    beams = {"num_beams": 3, "num_return_sequences": 3}
    ref = generate(model, DynamicCache(config=model.config), 40, ids, mask, **beams)
    direct_store_launches(monkeypatch, lambda: cache._gathers[torch.bfloat16],
                          lambda: cache.req_to_token_pool.req_to_token.dtype)
    cache = paged(model, page_size=16, kernels="triton", device=device, max_batch_size=9)
    out = generate(model, cache, 40, ids, mask, **beams)
    assert torch.equal(out.sequences, ref.sequences)
    assert cache._repeat is not None, "the steps went to the repeat"
    cache.free_all()
    full = generate(model, cache, 50, ids, mask)
    cache.crop(-20)
    assert cache._repeat is None and cache.get_seq_length() == ids.shape[1] + 29
    width = ids.shape[1]
    again_ids = full.sequences[:, : width + 30]
    again_mask = torch.cat([mask, torch.ones(ids.shape[0], 30, dtype=mask.dtype, device=device)], dim=1)
    again = generate(model, cache, 20, again_ids, again_mask)
    assert torch.equal(again.sequences, full.sequences)


@pytest.mark.parametrize("resident_rows", [False, True], ids=["gathered", "resident_rows"])
def test_a_copy_of_the_cache_stores_in_its_own_pool(resident_rows):
    """``copy.deepcopy`` of a cache between forwards (the prompt-reuse idiom) gives a cache over a pool of its own:
    the copy keeps no address of the original's memory, and neither cache's later forwards write the other's rows
    (the two run in turns on different tokens, and each one's logits are those of a copy of DynamicCache given the
    same)."""
    import copy

    model, ids, mask, device = on_test_device(torch.bfloat16)

    @torch.no_grad()
    def forward(cache, tokens, mask):
        return model(tokens, attention_mask=mask, **{CACHE_KW: cache}).logits[:, -1]

    paged_cache = paged(model, page_size=16, kernels="triton", device=device, resident_rows=resident_rows)
    dynamic = DynamicCache(config=model.config)
    step = torch.full((ids.shape[0], 1), 7, device=device)
    for tokens, width in ((ids, 0), (step, 1)):
        mask = torch.cat([mask, torch.ones_like(mask[:, :width])], dim=1)
        assert torch.equal(forward(paged_cache, tokens, mask), forward(dynamic, tokens, mask))
    pairs = {"original": (paged_cache, dynamic), "copy": (copy.deepcopy(paged_cache), copy.deepcopy(dynamic))}
    kept = addresses_kept(pairs["copy"][0], paged_cache)
    assert not kept, f"the copy keeps addresses of the original's memory, at {kept[:4]}"
    masks = dict.fromkeys(pairs, mask)
    for token in (11, 12):  # the original and the copy in turns, each on its own tokens
        for offset, (name, (kv, ref)) in enumerate(pairs.items()):
            tokens = torch.full_like(step, token + 100 * offset)
            masks[name] = torch.cat([masks[name], torch.ones_like(step)], dim=1)
            assert torch.equal(forward(kv, tokens, masks[name]), forward(ref, tokens, masks[name])), name


def test_a_checked_pool_is_stored_through_set_kv_buffer(monkeypatch):
    """Behind kvcore's checking proxy the cache never writes the pool itself: every layer stores through the proxy's
    ``set_kv_buffer`` (its checks run) and reads with the one-launch gather."""
    model, ids, mask, device = on_test_device(torch.bfloat16)
    ref = generate(model, DynamicCache(config=model.config), 20, ids, mask)
    cfg = kvcore.load_config(
        *config_overrides(model), "kv_cache.page_size=16", "memory.max_total_tokens=2048", f"hardware.device={device}",
        "hardware.kernels=triton", "hardware.checked=true",
    )  # fmt: skip
    cache = PagedKVCache.from_config(cfg, model=model)
    stores = collections.Counter()
    set_kv_buffer = type(cache.pool).set_kv_buffer

    def counted(pool, layer, *args, **kwargs):
        stores[layer] += 1
        return set_kv_buffer(pool, layer, *args, **kwargs)

    monkeypatch.setattr(type(cache.pool), "set_kv_buffer", counted)  # the proxy's own method
    out = generate(model, cache, 20, ids, mask)
    assert not cache._fused_store and not cache._step.fused
    assert stores == {layer: 20 for layer in range(model.config.num_hidden_layers)}  # the prefill and 19 steps
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))


def test_the_one_launch_gather_with_a_freed_row():
    """The Triton path once a row is freed mid-generation: the live rows' new tokens are stored (the step's
    locations taken once for every layer), the freed row reads the padding slot, the others go on exactly."""
    model, ids, mask, device = on_test_device(torch.bfloat16)
    half = NEW_TOKENS // 2
    ref = generate(model, DynamicCache(config=model.config), NEW_TOKENS, ids, mask)
    cache = paged(model, page_size=16, kernels="triton", device=device)
    first = generate(model, cache, half, ids, mask)
    cache.free(1)
    ids = first.sequences
    mask = torch.cat([mask, torch.ones(ids.shape[0], half, dtype=torch.long, device=device)], dim=1)
    rest = generate(model, cache, NEW_TOKENS - half, ids=ids, mask=mask)
    assert torch.equal(rest.sequences[[0, 2]], ref.sequences[[0, 2]])
    assert cache.get_seq_length() == ids.shape[1] + NEW_TOKENS - half - 1


# -- contiguous rows: one reserved run per row, strided views for attention -------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_contiguous_rows_keep_every_logit(kind, dtype, page_size):
    model = tiny_model(kind, dtype)
    ref, _ = reference(kind, dtype)
    cache = paged(model, page_size=page_size, contiguous_rows=True)
    start = cache.available_tokens
    out = generate(model, cache)
    assert cache._row_base is not None  # the views were read, not gathered copies
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))
    cap = min(start // len(PROMPT_LENS), model.config.max_position_embeddings) // page_size * page_size
    assert cache._row_cap == cap and start - cache.available_tokens == cap * len(PROMPT_LENS)  # reserved whole
    row = cache.token_locations(1)
    assert torch.equal(row, row[0] + torch.arange(row.numel()))  # one run per row
    cache.free(0)
    assert start - cache.available_tokens == cap * (len(PROMPT_LENS) - 1)
    cache.free_all()
    assert cache.available_tokens == start


def test_contiguous_rows_fall_back_on_a_fragmented_pool():
    model = tiny_model("llama", torch.float32)
    ref, _ = reference("llama", torch.float32)
    cache = paged(model, page_size=16, contiguous_rows=True)
    hole = cache.allocator.alloc(64)  # slots taken out of the middle of the free list: no single run is left
    rest = cache.allocator.alloc(cache.available_tokens - 64)
    cache.allocator.free(hole)
    cache.allocator.free(rest[: rest.numel() // 2])
    out = generate(model, cache)
    assert cache._row_base is None  # allocated as the rows grew, gathered for attention
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))


def test_contiguous_rows_cap_each_row():
    model = tiny_model("llama", torch.float32)
    cache = paged(model, page_size=16, contiguous_rows=True, max_total_tokens=3 * 64)
    with pytest.raises(KVCacheFullError, match="exceed the 64 reserved for each of the batch's 3 rows"):
        generate(model, cache, new_tokens=80)


def test_contiguous_rows_with_an_fp8_cache_gather_and_convert():
    """A cache in another dtype than the model's cannot be viewed: its reserved rows are gathered and converted,
    as without reservation."""
    model = tiny_model("llama", torch.bfloat16)
    plain = generate(model, paged(model, page_size=16, dtype="float8_e4m3fn"), 20)
    reserved = paged(model, page_size=16, dtype="float8_e4m3fn", contiguous_rows=True)
    out = generate(model, reserved, 20)
    assert reserved._row_base is not None
    assert all(torch.equal(a, b) for a, b in zip(out.logits, plain.logits))
