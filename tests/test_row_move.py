"""Bit-exact tests of the family-independent row move (``kvcore.kernels.row_move``) against torch's gather-then-scatter.

Interpreted on the CPU by default; compiled on CUDA with KVCORE_TEST_COMPILED=1.
"""

from __future__ import annotations

import pytest
import torch

from kvcore.kernels import row_move
from kvcore.token_rows import TokenRows

from kvcore.testing.tensors import bits_equal as _bits_equal
from kvcore.testing.tensors import compiled, skip_module_without_device, test_device
from kvcore.testing.tensors import poison as _poison

skip_module_without_device()
COMPILED, DEVICE = compiled(), test_device()


# ==========================================================================================================
# move_kv_cache
# ==========================================================================================================


def _check_move(k_cache, v_cache, tgt, src):
    orig_k, orig_v = k_cache.clone(), v_cache.clone()
    tgt_t = torch.as_tensor(tgt).to(DEVICE) if not isinstance(tgt, torch.Tensor) else tgt
    src_t = torch.as_tensor(src).to(DEVICE) if not isinstance(src, torch.Tensor) else src
    # Expected: buf[:, tgt] = buf[:, src] with every source read first.
    want_k, want_v = orig_k.clone(), orig_v.clone()
    want_k[:, tgt_t.long()] = orig_k[:, src_t.long()].clone()
    want_v[:, tgt_t.long()] = orig_v[:, src_t.long()].clone()

    ref_k, ref_v = orig_k.clone(), orig_v.clone()
    row_move.move_rows_native(ref_k, ref_v, tgt_t, src_t)
    assert _bits_equal(ref_k, want_k) and _bits_equal(ref_v, want_v)

    row_move.move_rows_triton(k_cache, v_cache, tgt_t, src_t)
    assert _bits_equal(k_cache, want_k)
    assert _bits_equal(v_cache, want_v)


# (K row shape, V row shape, storage dtype)
MOVE_LAYOUTS = [
    ((3, 72), (3, 40), torch.bfloat16),  # Dv != Dk, int32 words
    ((1, 8), (1, 8), torch.uint8),  # fp8 cache, 8-byte rows
    ((2, 3), (1, 5), torch.float16),  # 12- and 10-byte rows: int32 / int16 words
    ((1, 3), (1, 5), torch.uint8),  # 3- and 5-byte rows: byte words
    ((4, 16), (4, 16), torch.float32),
]

MOVE_PATTERNS = {
    "shift_down": ([4, 5, 6], [5, 6, 7]),  # compaction
    "shift_up": ([5, 6, 7], [4, 5, 6]),
    "swap_pairs": ([3, 4, 10, 11], [4, 3, 11, 10]),
    "three_cycle": ([2, 9, 5], [9, 5, 2]),
    "identity": ([7, 8, 1], [7, 8, 1]),
    "disjoint": ([20, 21, 22, 23, 24], [1, 3, 5, 7, 9]),
    "single": ([12], [30]),
    "long_chain_odd": (list(range(1, 34)), list(range(2, 35))),
}


@pytest.mark.parametrize("layout", MOVE_LAYOUTS, ids=lambda l: f"{l[2]}-{l[0]}-{l[1]}".replace("torch.", ""))
@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_move_kv_cache_patterns(layout, num_layers):
    (hk, dk), (hv, dv), dtype = layout
    gen = torch.Generator().manual_seed(num_layers)
    for name, (tgt, src) in MOVE_PATTERNS.items():
        k_cache = _poison((num_layers, 40, hk, dk), dtype, gen)
        v_cache = _poison((num_layers, 40, hv, dv), dtype, gen)
        for idx_dtype in (torch.int64, torch.int32):
            _check_move(
                k_cache, v_cache, torch.tensor(tgt, dtype=idx_dtype, device=DEVICE),
                torch.tensor(src, dtype=idx_dtype, device=DEVICE),
            )  # fmt: skip


@pytest.mark.parametrize("n", [1, 7, 33, 255, 1000])
def test_move_kv_cache_random_permutations(n):
    # Targets are a random subset; sources a random permutation of them (cycles of every length) plus
    # outside rows, so targets and sources overlap heavily.
    gen = torch.Generator().manual_seed(n)
    rows = 2 * n + 10
    k_cache = _poison((2, rows, 2, 8), torch.bfloat16, gen)
    v_cache = _poison((2, rows, 1, 24), torch.bfloat16, gen)
    tgt = torch.randperm(rows, generator=gen)[:n]
    pool = torch.cat([tgt, torch.randperm(rows, generator=gen)[: n // 3]]).unique()
    src = pool[torch.randperm(pool.numel(), generator=gen)[:n]]
    _check_move(k_cache, v_cache, tgt.to(DEVICE), src.to(DEVICE))


def test_move_kv_cache_strided_locs():
    gen = torch.Generator().manual_seed(11)
    k_cache = _poison((2, 30, 1, 16), torch.float16, gen)
    v_cache = _poison((2, 30, 1, 16), torch.float16, gen)
    pairs = torch.tensor([[5, 6], [6, 7], [7, 8], [20, 1]], device=DEVICE)  # columns are strided views
    _check_move(k_cache, v_cache, pairs[:, 0], pairs[:, 1])


def test_move_kv_cache_largest_single_launch_and_fallback():
    gen = torch.Generator().manual_seed(12)
    for n in (row_move.MOVE_MAX_TOKENS, row_move.MOVE_MAX_TOKENS + 1):
        rows = n + 8
        k_cache = _poison((2, rows, 1, 8), torch.uint8, gen)
        v_cache = _poison((2, rows, 1, 12), torch.bfloat16, gen)
        tgt = torch.arange(n) + 1
        src = torch.arange(n) + 2  # compaction by one row over the whole pool
        _check_move(k_cache, v_cache, tgt.to(DEVICE), src.to(DEVICE, torch.int32))


@pytest.mark.skipif(not COMPILED, reason="locations on another device than the buffers need buffers on a GPU")
@pytest.mark.parametrize("n", [8, row_move.MOVE_MAX_TOKENS + 1])
def test_locations_on_another_device_are_refused(n):
    """Moves launch with addresses, which the driver does not check: CPU locations for GPU buffers must raise,
    on both paths, before anything is launched."""
    k_cache = torch.zeros((2, n + 8, 1, 8), dtype=torch.uint8, device=DEVICE)
    v_cache = torch.zeros((2, n + 8, 1, 8), dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="must be on"):
        row_move.move_rows_triton(k_cache, v_cache, torch.arange(n) + 1, torch.arange(n) + 2)


def test_move_kv_cache_fallback_layer_groups(monkeypatch):
    # Force the gather/scatter fallback with a scratch of one layer, so it runs layer group by group.
    monkeypatch.setattr(row_move, "MOVE_MAX_TOKENS", 4)
    gen = torch.Generator().manual_seed(14)
    n, rows = 37, 60
    k_cache = _poison((3, rows, 3, 24), torch.float16, gen)
    v_cache = _poison((3, rows, 1, 5), torch.uint8, gen)
    monkeypatch.setattr(row_move, "MOVE_SCRATCH_BYTES", n * 3 * 24 * 2)
    tgt = torch.randperm(rows, generator=gen)[:n]
    src = tgt[torch.randperm(n, generator=gen)]  # a permutation of the targets: cycles everywhere
    _check_move(k_cache, v_cache, tgt.to(DEVICE), src.to(DEVICE))
    _check_move(k_cache, v_cache, torch.arange(1, n + 1, device=DEVICE), torch.arange(2, n + 2, device=DEVICE))


@pytest.mark.parametrize(
    "tgt, src, hazard",
    [
        ([1, 2, 3], [7, 8, 9], 0),  # disjoint
        ([1, 2, 3], [1, 2, 3], 0),  # every target is its own source
        ([4, 5, 6], [5, 6, 7], 1),  # compaction: 5 and 6 are read and written
        ([1, 2], [2, 1], 1),  # swap
        ([3, 9], [3, 3], 0),  # one source copied twice, one of them onto itself
    ],
)
def test_overlap_flag(tgt, src, hazard):
    flag = row_move._flag_overlaps(12, torch.tensor(tgt, device=DEVICE), torch.tensor(src, device=DEVICE, dtype=torch.int32))
    assert int(flag.item()) == hazard


@pytest.mark.parametrize("pattern", ["disjoint", "self", "shift", "permutation"])
def test_move_kv_cache_large_path_picks_copy_or_scratch_on_device(monkeypatch, pattern):
    # Above MOVE_MAX_TOKENS the device flags overlap: disjoint / self moves take the one-pass row copy,
    # overlapping ones the gather/scatter; both must equal torch's gather-then-scatter.
    monkeypatch.setattr(row_move, "MOVE_MAX_TOKENS", 4)
    gen = torch.Generator().manual_seed(15)
    n, rows = 29, 80
    k_cache = _poison((3, rows, 2, 12), torch.bfloat16, gen)
    v_cache = _poison((3, rows, 1, 6), torch.float32, gen)
    perm = torch.randperm(rows - 1, generator=gen) + 1
    tgt = perm[:n]
    src = {
        "disjoint": perm[n : 2 * n],
        "self": tgt.clone(),
        "shift": torch.cat([perm[1:n], perm[n : n + 1]]),
        "permutation": tgt[torch.randperm(n, generator=gen)],
    }[pattern]
    _check_move(k_cache, v_cache, tgt.to(DEVICE), src.to(DEVICE))


def test_move_kv_cache_empty_is_noop():
    gen = torch.Generator().manual_seed(13)
    k_cache = _poison((2, 10, 1, 8), torch.bfloat16, gen)
    v_cache = _poison((2, 10, 1, 8), torch.bfloat16, gen)
    before = (k_cache.clone(), v_cache.clone())
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    row_move.move_rows_triton(k_cache, v_cache, empty, empty)
    assert _bits_equal(k_cache, before[0]) and _bits_equal(v_cache, before[1])


@pytest.mark.parametrize("n", [1, 2, 3, 16, 100, 1024, 2047, 2048])
@pytest.mark.parametrize("row_bytes", [8, 16, 144, 2048, 8192])
def test_move_plan_bounds(n, row_bytes):
    n_pad, tile = row_move._move_plan(n, row_bytes, row_bytes // 2)
    assert n_pad >= n and n_pad & (n_pad - 1) == 0
    assert tile & (tile - 1) == 0
    assert n_pad * tile <= row_move.MOVE_MAX_TILE_BYTES
    assert tile >= min(row_move.MOVE_MIN_TILE_BYTES, row_bytes)




@pytest.mark.parametrize("limit", [512, 4], ids=["one-launch", "flagged"])
@pytest.mark.parametrize("pattern", ["shift_down", "three_cycle", "disjoint", "long_chain_odd"])
def test_single_buffer_move(monkeypatch, limit, pattern):
    # A pool with one buffer (MLA's latent rows) passes None as the second.
    monkeypatch.setattr(row_move, "MOVE_MAX_TOKENS", limit)
    gen = torch.Generator().manual_seed(16)
    buf = _poison((3, 40, 1, 36), torch.bfloat16, gen)
    tgt, src = (torch.tensor(v, device=DEVICE) for v in MOVE_PATTERNS[pattern])
    want = buf.clone()
    want[:, tgt] = buf[:, src].clone()
    ref = buf.clone()
    row_move.move_rows_native(ref, None, tgt, src)
    row_move.move_rows_triton(buf, None, tgt, src)
    assert _bits_equal(ref, want) and _bits_equal(buf, want)


# ==========================================================================================================
# per-token rows inside pages (TokenRows): e.g. an indexer page of 4 keys then their scales
# ==========================================================================================================


def _paged_expected(pages: torch.Tensor, tokens_per_page: int, first: int, tgt, src) -> torch.Tensor:
    """``pages`` [L, P, rows_per_page, W]: token ``t`` is row ``first + t % tokens_per_page`` of page
    ``t // tokens_per_page``.  Every source read first, then written at its target; written out token by
    token in Python so it does not share the addressing under test."""
    want = pages.clone()
    for t, s in zip(tgt, src):
        want[:, t // tokens_per_page, first + t % tokens_per_page] = pages[:, s // tokens_per_page, first + s % tokens_per_page]
    return want


@pytest.mark.parametrize("limit", [512, 4], ids=["one-launch", "flagged"])
@pytest.mark.parametrize("pattern", ["shift_down", "three_cycle", "swap_pairs", "disjoint", "long_chain_odd"])
def test_token_rows_in_pages_move_with_their_tokens(monkeypatch, limit, pattern):
    """Two buffers with different page geometries (keys: 4 tokens in pages of 6 rows of 8 bytes from row 0;
    scales: 4 tokens in pages of 12 rows of 4 bytes from row 8) and an identity one, moved together."""
    monkeypatch.setattr(row_move, "MOVE_MAX_TOKENS", limit)
    gen = torch.Generator().manual_seed(17)
    tokens_per_page, num_pages, layers = 4, 10, 3
    index = _poison((layers, num_pages, 48), torch.uint8, gen)  # one page: 4 x 8 key bytes + 4 x 4 scale bytes
    latent = _poison((layers, num_pages * tokens_per_page, 1, 12), torch.bfloat16, gen)
    tgt_list, src_list = MOVE_PATTERNS[pattern]
    tgt, src = (torch.tensor(v, device=DEVICE) for v in (tgt_list, src_list))
    want_index = index.clone()
    want_index.view(layers, num_pages, 6, 8).copy_(
        _paged_expected(index.view(layers, num_pages, 6, 8), tokens_per_page, 0, tgt_list, src_list))
    want_index.view(layers, num_pages, 12, 4).copy_(
        _paged_expected(want_index.view(layers, num_pages, 12, 4), tokens_per_page, 8, tgt_list, src_list))
    want_latent = latent.clone()
    want_latent[:, tgt] = latent[:, src].clone()
    for move in (row_move.move_token_rows_native, row_move.move_token_rows_triton):
        got_index, got_latent = index.clone(), latent.clone()
        got_keys = TokenRows(got_index.view(layers, num_pages * 6, 8), tokens_per_page, 6, 0)
        got_scales = TokenRows(got_index.view(layers, num_pages * 12, 4), tokens_per_page, 12, 8)
        move(TokenRows(got_latent), got_keys, tgt, src)
        move(got_scales, None, tgt, src)
        assert _bits_equal(got_latent, want_latent), move.__name__
        assert _bits_equal(got_index, want_index), move.__name__


def test_token_rows_buffers_must_stack_the_same_layers():
    a = TokenRows(torch.zeros(2, 8, 4, device=DEVICE))
    b = TokenRows(torch.zeros(3, 8, 4, device=DEVICE))
    loc = torch.tensor([1], device=DEVICE)
    with pytest.raises(ValueError, match="same layers"):
        row_move.move_token_rows_triton(a, b, loc, loc)
