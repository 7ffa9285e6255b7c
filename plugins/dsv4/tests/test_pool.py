"""The DeepSeek-V4 backend: the conformance kit on its window rows, SGLang's constructor call, the compressed and
indexer stores against the torch reference, the compressor states, buffer infos, the plan against a hand
computation from SGLang's formulas, the allocator pairing and ``kvcore up``."""

import math

import pytest
import torch

from kvcore import load_config, plan_memory
from kvcore.errors import ConfigError
from kvcore.testing import LossyKVCacheConformance, Variant
from kvcore.testing.tensors import randn_nonzero, test_device
from kvcore.tools.cli import main

CONFIG = ["model=tiny-deepseek-v4"]
RATIOS = [0, 4, 128, 4, 128, 0]  # tiny-deepseek-v4's layers
PAGE = 256


class TestDeepSeekV4Conformance(LossyKVCacheConformance):
    """The window latents are the rows a full location keeps whole: moved, offloaded and checked by the kit."""

    backend = "dsv4"
    config = [*CONFIG, f"model.deepseek_v4.compress_ratios={RATIOS * 2}"]  # layers 5.. for the offset test
    variants = [Variant("float8_e4m3fn", "triton", 128), Variant("float8_e4m3fn", "native", 256)]

    @pytest.fixture
    def kv_pool_size(self, kv_page_size):
        return 3 * kv_page_size

    @pytest.fixture
    def kv_pool_factory(self, kv_request, kv_backend_spec, kv_registry):
        """The backend's own pool, with few request slots (each holds 128 state rows per ratio-128 layer)."""
        import attrs

        from kvcore.api import buffer_layout

        def make(size, page_size, start_layer):
            request = attrs.evolve(kv_request, page_size=page_size, start_layer=start_layer,
                                   end_layer=start_layer + kv_request.layer_num - 1)  # fmt: skip
            layout = buffer_layout(kv_backend_spec, kv_registry, request)
            sizes = {"tokens": 4 * size, "swa_tokens": size, "requests": 3}
            return kv_registry.hook.kvcore_create_pool(backend=kv_backend_spec, request=request, layout=layout,
                                                       sizes=sizes)  # fmt: skip

        return make


def sglang_call(**overrides):
    """The configurator's DeepSeekV4TokenToKVPool call, keyword for keyword (sizes as its DSV4 sizing gives them
    for 2048 full tokens, a window of 512 and 3 running requests)."""
    from kvcore_dsv4 import DeepSeekV4TokenToKVPool

    full, swa = 2048, 512
    kw = dict(max_num_reqs=3, num_req_slots=4, swa_size=swa, c4_size=full // 4, c128_size=full // 128,
              c4_state_pool_size=swa // PAGE * 8, c128_state_pool_size=4 * 128, page_size=PAGE, swa_page_size=PAGE,
              sliding_window=128, dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
              c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128,
              layer_num=6, device=test_device(), enable_memory_saver=False, compression_ratios=RATIOS + [0],
              start_layer=0, end_layer=6, enable_hisparse=False, online_mtp_max_draft_tokens=0)  # fmt: skip
    kw.update(overrides)
    return DeepSeekV4TokenToKVPool(**kw)


def latent_page(slots: int) -> int:
    """SGLang's V4 page: 584 bytes a slot (576 data, 8 scale), padded to a multiple of 576."""
    return math.ceil(slots * 584 / 576) * 576


def test_the_configurators_call_allocates_sglangs_buffers():
    pool = sglang_call()
    buffers = pool.buffers()
    # pages: the size plus one logical page of 256 tokens, in the buffer's own pages
    assert buffers["swa_kv"].shape == (6, 512 // 256 + 1, latent_page(256))
    assert buffers["c4_kv"].shape == (2, (512 + 256) // 64, latent_page(64))
    assert buffers["c128_kv"].shape == (2, (16 + 256) // 2, latent_page(2))
    assert buffers["c4_index"].shape == (2, (16 * 32 + 256) // 64, 64 * (128 + 4))
    # states: the rings plus ring + 1 rows rounded up to the ratio; kv and score (twice for ratio 4)
    assert buffers["c4_state"].shape == (2, 16 + 12, 2 * 2 * 512) and buffers["c4_state"].dtype == torch.float32
    assert buffers["c4_index_state"].shape == (2, 16 + 12, 2 * 2 * 128)
    assert buffers["c128_state"].shape == (2, 4 * 128 + 256, 2 * 512)
    assert pool.size == 512 and pool.size_groups() == {"tokens": 2048, "swa_tokens": 512, "requests": 4}
    assert [pool.layer_mapping[i][:2] for i in range(6)] == [(0, 0), (4, 0), (128, 0), (4, 1), (128, 1), (0, 1)]
    assert pool.get_ring_size(4) == 8 and pool.get_ring_size(128) == 128
    assert pool.get_extra_key_page_size(1) == 64 and pool.get_extra_key_page_size(2) == 2
    assert pool.get_index_k_page_size() == 64 and pool.get_swa_key_bytes_per_token() == 584
    drafting = sglang_call(online_mtp_max_draft_tokens=3, c4_state_pool_size=2 * 16)
    assert drafting.get_ring_size(4) == 16 and drafting.buffers()["c128_state"].shape[1] == 4 * 256 + 384


@pytest.mark.parametrize("keyword, value", [("unified_fp8", True), ("kv_layout", "v41"), ("compressed_kv_layout", "fp4")])
def test_refused_keywords_name_themselves(keyword, value):
    with pytest.raises(ConfigError, match=keyword):
        sglang_call(**{keyword: value})


def test_ratio_one_layers_are_refused():
    with pytest.raises(ConfigError, match="compression_ratios"):
        sglang_call(compression_ratios=[0, 1, 128, 4, 128, 0])


@pytest.mark.parametrize("kernels", ["triton", "native"])
def test_stores_equal_the_torch_reference_and_read_back(kernels):
    """Window, compressed and indexer stores write the reference's bytes (and nothing else) and read back within
    fp8's error; the layer routes to its own buffer."""
    from kvcore_dsv4.quantize import read_index, read_latent, store_index_native, store_latent_native

    pool = sglang_call(kernels=kernels)
    gen = torch.Generator().manual_seed(0)
    for buf in pool.buffers().values():
        buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape, generator=gen, dtype=torch.uint8))
    before = {n: b.clone() for n, b in pool.buffers().items()}
    n = 7
    x = randn_nonzero((n, 512), torch.bfloat16, gen, 2.0, test_device())
    keys = randn_nonzero((n, 128), torch.bfloat16, gen, 2.0, test_device())
    window = torch.tensor([256, 300, 511, 700, 767, 258, 600], device=test_device())
    c4 = torch.tensor([64, 65, 100, 511, 575, 300, 66], device=test_device())
    c128 = torch.tensor([2, 3, 17, 4, 9, 10, 11], device=test_device())
    pool.set_swa_key_buffer_radix_fused(5, window, x)
    pool.set_extra_key_buffer_fused(3, c4, x)
    pool.set_extra_key_buffer_fused(4, c128, x)
    pool.set_index_k_fused(3, c4, keys)
    expected = {n: b.clone() for n, b in before.items()}
    store_latent_native(expected["swa_kv"][5], window, x, 256)
    store_latent_native(expected["c4_kv"][1], c4, x, 64)
    store_latent_native(expected["c128_kv"][1], c128, x, 2)
    store_index_native(expected["c4_index"][1], c4, keys, 64)
    for name, buf in pool.buffers().items():
        assert torch.equal(buf.view(torch.uint8).cpu(), expected[name].view(torch.uint8).cpu()), name
    for got in (read_latent(pool.get_swa_key_buffer_radix(5), window, 256), read_latent(pool.get_extra_key_buffer(3), c4, 64),
                read_latent(pool.get_extra_key_buffer(4), c128, 2)):  # fmt: skip
        assert ((got.cpu() - x.float().cpu()).norm() / x.float().norm()).item() < 0.07
    got = read_index(pool.get_index_k_with_scale_buffer(3), c4, 64)
    assert ((got.cpu() - keys.float().cpu()).norm() / keys.float().norm()).item() < 0.07


def test_a_layer_without_compressed_storage_says_which_have_it():
    pool = sglang_call()
    with pytest.raises(ValueError, match=r"layer 0 has compression ratio 0.*\[1, 2, 3, 4\]"):
        pool.get_extra_key_buffer(0)
    with pytest.raises(ValueError, match="layer 2 has compression ratio 128"):
        pool.set_index_k_fused(2, torch.tensor([1]), torch.zeros(1, 128))
    with pytest.raises(NotImplementedError, match="set_swa_key_buffer_radix_fused"):
        pool.set_kv_buffer(0, torch.tensor([1]), torch.zeros(1, 512))


def test_compressor_states_address_rings_and_keep_the_empty_row():
    from kvcore_dsv4.states import KVAndScore

    pool = sglang_call()
    c4, c128 = pool.get_attention_compress_states(1), pool.get_attention_compress_states(2)
    assert pool.get_indexer_compress_states(1).kv_score_buffer.shape[-1] == 2 * 2 * 128
    swa_loc = torch.tensor([0, 5, 256 + 9, 511, -1], device=test_device())
    # ring of window page p: rows 8p .. 8p + 7, position within it the slot modulo 8
    assert c4.translate_from_swa_loc_to_state_loc(swa_loc.clone()).tolist() == [0, 5, 8 + 1, 8 + 7, -1]
    rows = c128.translate_from_req_position_to_state_loc(torch.tensor([0, 2, 3], device=test_device()),
                                                        torch.tensor([5, 130, -1], device=test_device()))  # fmt: skip
    assert rows.tolist() == [5, 2 * 128 + 2, -1]
    value = KVAndScore.from_kv_score(kv=torch.ones(3, 512, device=test_device()),
                                     score=torch.full((3, 512), 2.0, device=test_device()))  # fmt: skip
    c128.set_state_by_state_loc(rows, value)  # the third row lands on the empty row, which is cleared again
    got = c128.get_state_by_state_loc(rows)
    assert torch.equal(got.kv[:2].cpu(), torch.ones(2, 512)) and torch.equal(got.score[:2].cpu(), torch.full((2, 512), 2.0))
    assert torch.all(got.kv[2] == 0) and torch.all(got.score[2] == float("-inf"))
    assert c128.transfer_indices(2, 130) == [2 * 1 + (129 % 128) // 128] and c128.transfer_indices(2, 256) == []
    pool.clear_request_scoped_state(2)
    assert torch.all(c128.kv_score_buffer.score[2 * 128 : 3 * 128] == float("-inf"))


def test_buffer_infos_follow_sglangs_groups():
    pool = sglang_call()
    b = pool.buffers()
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    order = [b["c4_kv"][0], b["c4_kv"][1], b["c4_index"][0], b["c4_index"][1], b["c128_kv"][0], b["c128_kv"][1]]
    assert ptrs == [t.data_ptr() for t in order] and lens == [t.nbytes for t in order]
    assert items == [t[0].nbytes for t in order]  # one full page (256 tokens) of each
    ptrs, lens, items = pool.get_state_buf_infos()
    assert len(ptrs) == 6 + 2 + 2 and items[:6] == [latent_page(256)] * 6
    assert items[6:] == [8 * 2 * 2 * 512 * 4] * 2 + [8 * 2 * 2 * 128 * 4] * 2  # a ring of 8 rows follows a page
    ptrs, lens, items = pool.get_request_state_buf_infos()
    assert ptrs == [b["c128_state"][i].data_ptr() for i in range(2)] and items == [128 * 2 * 512 * 4] * 2


def hand_bytes(full: int, swa: int, slots: int, ratios=RATIOS, page=PAGE) -> int:
    """What SGLang's pool allocates for these sizes, from its formulas (module docstring of kvcore_dsv4.layout)."""
    n4, n128 = ratios.count(4), ratios.count(128)
    window = len(ratios) * (swa // page + 1) * latent_page(page)
    c4 = n4 * (full // page + 4) * latent_page(page // 4)
    c128 = n128 * (full // page + 128) * latent_page(page // 128)
    index = n4 * (full // page + 4) * (page // 4) * 132
    c4_states = n4 * (swa // page * 8 + 12) * (2048 + 512) * 4
    c128_states = n128 * (slots * 128 + 256) * 1024 * 4
    return window + c4 + c128 + index + c4_states + c128_states


def test_plan_is_exact_to_the_byte_by_hand():
    """SGLang's DeepSeek-V4 split: window tokens 0.1 of the full tokens in whole pages, c4 = tokens // 4,
    c128 = tokens // 128, the ratio-128 rings per request slot (running requests + 1); the largest page count
    that fits."""
    budget = 0.02
    plan = plan_memory(load_config(*CONFIG, "hardware=cpu", f"memory.budget_gib={budget}",
                                   "memory.max_running_requests=3"))  # fmt: skip
    full, swa, slots = plan.sizes["tokens"], plan.sizes["swa_tokens"], plan.sizes["requests"]
    assert slots == 4 and swa == int(full * 0.1) // PAGE * PAGE and full % PAGE == 0
    assert plan.kv_cache_bytes == hand_bytes(full, swa, slots)
    limit = int(budget * 2**30)
    assert hand_bytes(full, swa, slots) <= limit < hand_bytes(full + PAGE, int((full + PAGE) * 0.1) // PAGE * PAGE, slots)
    explicit = plan_memory(load_config(*CONFIG, "hardware=cpu", f"memory.budget_gib={budget}",
                                       "memory.max_running_requests=3", "memory.swa_full_tokens_ratio=0.5"))  # fmt: skip
    assert explicit.sizes["swa_tokens"] == int(explicit.sizes["tokens"] * 0.5) // PAGE * PAGE


def test_request_slots_follow_sglangs_estimate_when_unset():
    """Unset max_running_requests: SGLang estimates them from the tokens that fit beside no ratio-128 state
    (tokens / context x 512, clamped to [2048, 4096], at most half the tokens) and keeps one slot more: here
    millions of tokens over a 4096-token context, so 4096 requests and 4097 slots of 2 x 128 rings of 4 KiB rows."""
    plan = plan_memory(load_config(*CONFIG, "hardware=cpu", "memory.budget_gib=8", "memory.max_running_requests=null"))
    slots = plan.sizes["requests"]
    assert slots == 4096 + 1 and plan.max_running_requests == 4096
    state = 2 * (slots * 128 + 256) * 1024 * 4
    assert plan.kv_cache_bytes == hand_bytes(plan.sizes["tokens"], plan.sizes["swa_tokens"], slots)
    assert plan.kv_cache_bytes - state <= int(8 * 2**30) - state


def test_the_plan_names_compressed_token_counts(capsys):
    assert main(["plan", *CONFIG, "hardware=cpu", "memory.budget_gib=0.05", "memory.max_running_requests=2"]) == 0
    out = capsys.readouterr().out
    plan = plan_memory(load_config(*CONFIG, "hardware=cpu", "memory.budget_gib=0.05", "memory.max_running_requests=2"))
    full = plan.sizes["tokens"]
    assert f"c4_max_total_num_tokens = {full // 4}" in out and f"c128_max_total_num_tokens = {full // 128}" in out


def test_up_is_ready_on_the_cpu(capsys):
    assert main(["up", *CONFIG, "hardware=cpu", "memory.budget_gib=0.05", "memory.max_running_requests=2"]) == 0
    out = capsys.readouterr().out
    assert "DeepSeekV4TokenToKVPool, SWATokenToKVPoolAllocator" in out and "kvcore up: ready" in out


def test_the_allocator_maps_full_locations_to_window_slots():
    from kvcore import build_pools

    pools = build_pools(load_config(*CONFIG, "hardware=cpu", "memory.budget_gib=0.05", "memory.max_running_requests=2"))
    pool, allocator = pools.token_to_kv_pool, pools.token_to_kv_pool_allocator
    full = allocator.alloc(2 * PAGE)
    swa = pool.translate_loc_from_full_to_swa(full)
    assert swa.min().item() >= PAGE and len(set(swa.tolist())) == 2 * PAGE
    latents = randn_nonzero((2 * PAGE, 512), torch.bfloat16, torch.Generator().manual_seed(1), 2.0, "cpu")
    pool.set_swa_key_buffer_radix_fused(0, swa, latents)
    from kvcore_dsv4.quantize import read_latent

    got = read_latent(pool.get_swa_key_buffer_radix(0), swa, PAGE)
    assert ((got - latents.float()).norm() / latents.float().norm()).item() < 0.07
    assert torch.equal(pool.token_rows()["swa_kv.data"].take(full, 0), pool.swa_kv_pool.token_rows()["data"].take(swa, 0))


def test_the_self_test_writes_translate_full_locations_once_mapped():
    """With the allocator's map registered, the kit's writers address full locations (as token_rows does): a full
    location whose window slot differs is written at its window slot."""
    pool = sglang_call(kernels="native")
    mapping = torch.zeros(2048 + PAGE, dtype=torch.int64, device=test_device())
    full = torch.tensor([300, 301, 1000], device=test_device())
    mapping[full] = torch.tensor([700, 260, 511], device=test_device())
    pool.register_mapping(mapping)
    expected = pool.self_test_write(3, full, torch.Generator().manual_seed(2))
    rows = pool.token_rows()
    for name, want in expected.items():
        assert torch.equal(rows[name].take(full, 3).cpu(), want.cpu()), name
    assert torch.equal(rows["swa_kv.data"].take(full, 3), pool.swa_kv_pool.token_rows()["data"].take(mapping[full], 3))
