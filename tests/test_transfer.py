"""KV transfers between pools through NIXL (kvcore.transfer), on the CPU: every family's buffers move byte for byte
(whole pages, sliding-window pages through both sides' mappings, request states) and nothing else in the
destination changes; runs of slots coalesce; pools that do not match are refused at connect time naming both sides;
a peer that went away or stalls ends in a TransferError within the timeout; and a peer in another process
(tests/transfer_peer.py) receives a write.

The expected destination comes from the pools' own CPU offload (``get_cpu_copy`` of the source's tokens,
``load_cpu_copy`` into a copy of the destination), which knows every family's rows without the buffer infos the
transfer uses."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvcore.testing.tensors import compiled

try:
    import nixl._api  # noqa: F401
except Exception as exc:  # noqa: BLE001 - any failure to load NIXL's bindings
    pytest.skip(f"NIXL's Python API does not import ({exc}): pip install 'kvcore[nixl]'", allow_module_level=True)
if compiled():
    pytest.skip("transfers between CPU pools: the CPU suite covers them", allow_module_level=True)

import kvcore  # noqa: E402
from kvcore.transfer import KVTransferAgent, TransferError  # noqa: E402

PEER = Path(__file__).with_name("transfer_peer.py")
_spec = importlib.util.spec_from_file_location("transfer_peer", PEER)
peer_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer_module)
fill_random, buffer_bytes = peer_module.fill_random, peer_module.buffer_bytes

MHA = ("memory.max_total_tokens=64",)
MLA = ("model=tiny-mla", "memory.max_total_tokens=64")
DSA = ("model=deepseek-v3.2", "hardware=cpu", "memory.budget_gib=1", "memory.max_total_tokens=128")
SWA = ("model=tiny-swa", "memory.max_total_tokens=128")
MAMBA = ("model=tiny-qwen3-next", "memory.max_total_tokens=64", "kv_cache.options.max_mamba_cache_size=8")
NVFP4 = ("memory.max_total_tokens=64", "kv_cache.dtype=nvfp4")


def build(*overrides: str):
    return kvcore.build_pools(kvcore.load_config(*overrides))


@pytest.fixture
def agents():
    """Make agents with ``agents(name, pool, **kw)``; every one is closed after the test."""
    made = []

    def make(name, pool, **kw):
        made.append(KVTransferAgent(name, pool, **kw))
        return made[-1]

    yield make
    for agent in made:
        agent.close()


def assert_same_buffers(pool, expected: dict[str, torch.Tensor], what: str) -> None:
    for name, got in buffer_bytes(pool).items():
        diff = (got != expected[name]).nonzero()
        assert diff.numel() == 0, f"{what}: buffer {name!r} differs at {diff.numel()} bytes, the first {int(diff[0])}"


def page_tokens(pages: list[int], page: int, partial_last: bool) -> torch.Tensor:
    """Tokens on ``pages`` (the last page's first half only with ``partial_last``)."""
    tokens = []
    for i, p in enumerate(pages):
        n = max(1, page // 2) if partial_last and i == len(pages) - 1 else page
        tokens += range(p * page, p * page + n)
    return torch.tensor(tokens, dtype=torch.int64)


def whole(tokens: torch.Tensor, page: int) -> torch.Tensor:
    """Every token of the pages ``tokens`` are on, page by page in their order."""
    pages = torch.unique_consecutive(torch.div(tokens, page, rounding_mode="floor"))
    return (pages[:, None] * page + torch.arange(page)).reshape(-1)


def expected_destination(overrides, src_pool, dst_bytes, src_tokens, dst_tokens, page, states=None, mapping=None):
    """The destination's bytes after a write, by the pools' CPU offload: a fresh pool holding the destination's
    bytes, loaded with the source's rows of every token of the moved pages (and state slots)."""
    ref = build(*overrides).token_to_kv_pool
    for name, buf in ref.buffers().items():
        buf.view(-1).view(torch.uint8).copy_(dst_bytes[name])
    if mapping is not None:
        ref.register_mapping(mapping.clone())
    src_all, dst_all = whole(src_tokens, page), whole(dst_tokens, page)
    if states is None:
        ref.load_cpu_copy(src_pool.get_cpu_copy(src_all), dst_all)
    else:
        copy = src_pool.get_cpu_copy(src_all, mamba_indices=states[0])
        ref.load_cpu_copy(copy, dst_all, mamba_indices=states[1])
    return buffer_bytes(ref)


CASES = [
    pytest.param(MHA, id="mha-page1"),
    pytest.param((*MHA, "kv_cache.page_size=4"), id="mha-page4"),
    pytest.param((*MHA, "kv_cache.page_size=4", "kv_cache.layout=page_major"), id="mha-page-major-page4"),
    pytest.param(MLA, id="mla-page1"),
    pytest.param((*MLA, "kv_cache.page_size=16"), id="mla-page16"),
    pytest.param(DSA, id="dsa-fp8-page64"),
    pytest.param(MAMBA, id="mamba-hybrid-page1"),
    pytest.param((*MAMBA, "kv_cache.page_size=4"), id="mamba-hybrid-page4"),
    pytest.param(NVFP4, id="nvfp4-page1"),
    pytest.param((*NVFP4, "kv_cache.page_size=4"), id="nvfp4-page4"),
    pytest.param(("model=tiny-mla", "memory.max_total_tokens=64", "kv_cache.dtype=nvfp4"), id="nvfp4-mla-page1"),
]


@pytest.mark.parametrize("overrides", CASES)
def test_write_moves_every_buffer_of_the_pages_and_nothing_else(overrides, agents):
    src_pool, dst_pool = build(*overrides).token_to_kv_pool, build(*overrides).token_to_kv_pool
    fill_random(src_pool, 1)
    fill_random(dst_pool, 2)
    before = buffer_bytes(dst_pool)
    page, pages = src_pool.page_size, src_pool.size // src_pool.page_size
    src_pages, dst_pages = ([1, 2, pages], [pages - 1, pages, 1]) if pages >= 3 else ([1, 2], [2, 1])
    src = page_tokens(src_pages, page, partial_last=True)
    dst = page_tokens(dst_pages, page, partial_last=True)
    hybrid = "requests" in src_pool.size_groups()
    states = (torch.tensor([1, 2, 3]), torch.tensor([6, 7, 2])) if hybrid else None
    expected = expected_destination(overrides, src_pool, before, src, dst, page, states)

    prefill, decode = agents("prefill", src_pool), agents("decode", dst_pool)
    assert prefill.connect(decode.metadata()) == "decode"
    transfer = prefill.write("decode", src, dst)
    transfer.wait()
    if hybrid:
        prefill.write_states("decode", *states).wait()
    assert_same_buffers(dst_pool, expected, f"{overrides} after the write")
    assert transfer.bytes > 0 and any(not torch.equal(expected[k], before[k]) for k in before), "nothing moved"
    # one descriptor per run of consecutive pages per registered buffer: pages (1, 2) -> (P-1, P) are one run
    regions = len(src_pool.get_contiguous_buf_infos()[0])
    if not hybrid and hasattr(src_pool, "get_state_buf_infos"):  # DSA's indexer pages move with the token pages
        regions += len(src_pool.get_state_buf_infos()[0])
    assert transfer.descriptors == 2 * regions


@pytest.mark.parametrize("page", [1, 4])
def test_sliding_window_rows_go_through_both_sides_mappings(page, agents):
    overrides = (*SWA, f"kv_cache.page_size={page}")
    a, b = build(*overrides), build(*overrides)
    src_pool, dst_pool = a.token_to_kv_pool, b.token_to_kv_pool
    b.token_to_kv_pool_allocator.alloc(2 * page)  # shift the destination's full and window slots
    src, dst = a.token_to_kv_pool_allocator.alloc(3 * page), b.token_to_kv_pool_allocator.alloc(3 * page)
    assert not torch.equal(src_pool.translate_loc_from_full_to_swa(src), dst_pool.translate_loc_from_full_to_swa(dst))
    fill_random(src_pool, 3)
    fill_random(dst_pool, 4)
    before = buffer_bytes(dst_pool)
    expected = expected_destination(overrides, src_pool, before, src, dst, page,
                                    mapping=b.token_to_kv_pool_allocator.full_to_swa_index_mapping)  # fmt: skip
    prefill, decode = agents("prefill", src_pool), agents("decode", dst_pool)
    prefill.connect(decode.metadata())
    with pytest.raises(ValueError, match="dst_window_loc"):
        prefill.write("decode", src, dst)
    with pytest.raises(ValueError, match="outside"):
        prefill.write("decode", [10_000], dst[:1], dst_window_loc=decode.window_loc(dst[:1]))
    prefill.write("decode", src, dst, dst_window_loc=decode.window_loc(dst)).wait()
    assert_same_buffers(dst_pool, expected, "after the write")
    for name in ("k", "swa_k", "swa_v"):
        assert not torch.equal(expected[name], before[name]), f"{name} did not change: the test moved nothing"

    # the first page slid out of the source's window: its full rows move, its window rows stay as they were
    a.token_to_kv_pool_allocator.free_swa(src[:page])
    fill_random(src_pool, 5)
    window_before = dst_pool.token_rows()["swa_k"].take(dst[:page]).clone()
    prefill.write("decode", src, dst, dst_window_loc=decode.window_loc(dst)).wait()
    rows = dst_pool.token_rows()
    assert torch.equal(rows["swa_k"].take(dst[:page]).view(torch.uint8), window_before.view(torch.uint8))
    assert torch.equal(rows["k"].take(dst).view(torch.uint8), src_pool.token_rows()["k"].take(src).view(torch.uint8))
    assert torch.equal(rows["swa_v"].take(dst[page:]).view(torch.uint8),
                       src_pool.token_rows()["swa_v"].take(src[page:]).view(torch.uint8))  # fmt: skip


def _shuffled(overrides, first: int, page: int):
    """Pools over a unified memory whose tokens' physical pages differ from their virtual ones: ``first`` pages
    taken, freed under the pages taken after them, and the memory compacted."""
    pools = build(*overrides)
    allocator = pools.token_to_kv_pool_allocator
    gone = allocator.alloc(first * page)
    kept = allocator.alloc(3 * page)
    allocator.free(gone)
    assert pools.token_to_kv_pool.memory.flush() > 0
    return pools, kept


@pytest.mark.parametrize("model", ["tiny-qwen3-next", "tiny-swa"])
def test_unified_pools_move_by_physical_places(model, agents):
    """The source translates its own tokens and state slots; the destination gives its physical places (and holds
    its moves until the data landed); every token's rows and every state arrive, on pages compaction moved."""
    page = 4
    overrides = (f"model={model}", "memory.unified=true", f"kv_cache.page_size={page}", "memory.max_total_tokens=256",
                 "memory.max_running_requests=8")  # fmt: skip
    a, src = _shuffled(overrides, 2, page)
    b, dst = _shuffled(overrides, 5, page)
    src_pool, dst_pool = a.token_to_kv_pool, b.token_to_kv_pool
    fill_random(src_pool, 6)
    fill_random(dst_pool, 7)
    prefill, decode = agents("prefill", src_pool), agents("decode", dst_pool)
    prefill.connect(decode.metadata())
    assert not (decode.physical_loc(dst) == dst.numpy()).all(), "the test moves nothing virtual"
    dst_memory = dst_pool.memory
    dst_memory.hold_moves()  # from handing out its places until the data has landed
    window = {"dst_window_loc": decode.window_loc(dst)} if model == "tiny-swa" else {}
    prefill.write("decode", src, decode.physical_loc(dst), **window).wait()
    assert not src_pool.memory.allocator.moves_held, "the source still holds its moves after the write"
    want, got = src_pool.token_rows(), dst_pool.token_rows()
    assert sorted(want) == sorted(got) == (["k", "swa_k", "swa_v", "v"] if model == "tiny-swa" else ["k", "v"])
    for name in want:
        assert torch.equal(got[name].take(dst).view(torch.uint8), want[name].take(src).view(torch.uint8)), name
    if model == "tiny-qwen3-next":
        src_slots, dst_slots = a.req_to_token_pool.mamba_pool.alloc(2), b.req_to_token_pool.mamba_pool.alloc(2)
        prefill.write_states("decode", src_slots, decode.physical_slots(dst_slots)).wait()
        for layer in a.req_to_token_pool.mamba_map:
            mine, theirs = a.req_to_token_pool.mamba2_layer_cache(layer), b.req_to_token_pool.mamba2_layer_cache(layer)
            ps, pd = a.req_to_token_pool.mamba_pool.translate(src_slots), b.req_to_token_pool.mamba_pool.translate(dst_slots)
            assert torch.equal(theirs.temporal[pd], mine.temporal[ps]) and torch.equal(theirs.conv[0][pd], mine.conv[0][ps])
    hole = b.token_to_kv_pool_allocator.alloc(page)
    b.token_to_kv_pool_allocator.alloc(page)  # a page above it, so that its free leaves a hole below the top
    b.token_to_kv_pool_allocator.free(hole)
    assert dst_memory.flush() == 0, "a held memory moved a unit"
    dst_memory.release_moves()
    assert dst_memory.flush() > 0


def test_runs_of_consecutive_slots_coalesce(agents):
    src_pool, dst_pool = build(*MHA, "hardware.checked=true").token_to_kv_pool, build(*MHA).token_to_kv_pool
    assert type(src_pool).__name__ == "CheckedPool"  # the agent registers the pool it wraps
    fill_random(src_pool, 6)
    prefill, decode = agents("prefill", src_pool), agents("decode", dst_pool)
    prefill.connect(decode.metadata())
    # sorted by source: 3..5 -> 40..42 (one run), 9..10 -> 7..8 (one), 20 -> 30, 21 -> 50 (two): four runs
    src, dst = [20, 3, 4, 5, 9, 10, 21], [30, 40, 41, 42, 7, 8, 50]
    transfer = prefill.write("decode", torch.tensor(src), torch.tensor(dst, dtype=torch.int32))
    transfer.wait()
    layers = src_pool.layer_num
    assert transfer.descriptors == 4 * 2 * layers
    assert transfer.bytes == len(src) * 2 * layers * src_pool.k_cache[0, 0].nbytes
    for name in ("k", "v"):
        rows_src, rows_dst = src_pool.token_rows()[name], dst_pool.token_rows()[name]
        assert torch.equal(rows_dst.take(torch.tensor(dst)).view(torch.uint8),
                           rows_src.take(torch.tensor(src)).view(torch.uint8))  # fmt: skip
    assert prefill.write("decode", [], []).done()  # nothing to move: done at once


def test_notifications_reach_the_destination(agents):
    src_pool, dst_pool = build(*MHA).token_to_kv_pool, build(*MHA).token_to_kv_pool
    prefill, decode = agents("prefill", src_pool), agents("decode", dst_pool)
    prefill.connect(decode.metadata())
    prefill.write("decode", [1, 2], [3, 4], notify=b"done:request-7").wait()
    deadline, got = time.monotonic() + 10, {}
    while not got and time.monotonic() < deadline:
        got = decode.notifications()
    assert got == {"prefill": [b"done:request-7"]}


# -- what connect refuses -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mine, theirs, words", [
    pytest.param(MHA, (*MHA, "kv_cache.page_size=4"), ["page sizes", "page_size=1", "page_size=4"], id="page-size"),
    pytest.param((*MHA, "kv_cache.page_size=4"), (*MHA, "kv_cache.page_size=4", "kv_cache.layout=page_major"),
                 ["layouts", "MHATokenToKVPool (", "PageMajorMHATokenToKVPool ("], id="layout"),
    pytest.param(MHA, (*MHA, "parallel.tp_size=2"), ["head slicing", "2 heads", "1 heads"], id="tp-heads"),
    pytest.param(MHA, (*MHA, "kv_cache.dtype=float8_e4m3fn"), ["dtypes", "bfloat16", "float8_e4m3fn"], id="dtype"),
    pytest.param(MHA, MAMBA, ["layouts", "HybridLinearKVPool[MHATokenToKVPool]"], id="model"),
])  # fmt: skip
def test_connect_refuses_pools_that_do_not_match(mine, theirs, words, agents):
    prefill = agents("prefill", build(*mine).token_to_kv_pool)
    decode = agents("decode", build(*theirs).token_to_kv_pool)
    with pytest.raises(TransferError) as info:
        prefill.connect(decode.metadata())
    for word in ["'prefill'", "'decode'", *words]:
        assert word in str(info.value), f"{word!r} not in: {info.value}"
    assert prefill.peers == []


def test_connect_refuses_other_nvfp4_global_scales_and_foreign_metadata(agents):
    src_pool, dst_pool = build(*NVFP4).token_to_kv_pool, build(*NVFP4).token_to_kv_pool
    dst_pool.set_kv_global_scale(0, 0.5, 0.25)
    prefill, decode = agents("prefill", src_pool), agents("decode", dst_pool)
    with pytest.raises(TransferError, match="global scales"):
        prefill.connect(decode.metadata())
    src_pool.set_kv_global_scale(0, 0.5, 0.25)
    prefill.connect(decode.metadata())
    with pytest.raises(TransferError, match="not the metadata"):
        prefill.connect(b"\x00not json")
    with pytest.raises(TransferError, match="itself"):
        prefill.connect(prefill.metadata())


def test_write_refuses_locations_that_do_not_pair(agents):
    overrides = (*MHA, "kv_cache.page_size=4")
    prefill = agents("prefill", build(*overrides).token_to_kv_pool)
    decode = agents("decode", build(*overrides).token_to_kv_pool)
    with pytest.raises(TransferError, match="not connected"):
        prefill.write("decode", [4], [8])
    prefill.connect(decode.metadata())
    bad = [
        ([4, 5], [8], "2 source locations but 1"),
        ([5], [8], "offset in the page"),
        ([1], [9], "padding"),
        ([4], [400], "outside"),
        ([4, 8], [12, 12], "several"),  # two source pages into one destination page
        (torch.tensor([4.0]), [8], "integers"),
    ]
    for src, dst, words in bad:
        with pytest.raises(ValueError, match=words):
            prefill.write("decode", src, dst)
    with pytest.raises(ValueError, match="no request states"):
        prefill.write_states("decode", [1], [2])
    with pytest.raises(ValueError, match="sliding-window"):
        prefill.window_loc([4])


# -- peers that went away -----------------------------------------------------------------------------------------


def test_a_closed_peer_ends_in_an_error_not_a_hang(agents):
    prefill = agents("prefill", build(*MHA).token_to_kv_pool, timeout_s=5)
    decode = agents("decode", build(*MHA).token_to_kv_pool)
    prefill.connect(decode.metadata())
    prefill.write("decode", [1], [2]).wait()
    decode.close()
    # The close reaches the writer's NIXL agent asynchronously: a write racing it may still land in this process's
    # memory, which outlives the closed agent here (not so in a peer process that is gone).  Within the timeout,
    # writes must end in a TransferError, never hang.
    start = time.monotonic()
    with pytest.raises(TransferError):
        while time.monotonic() - start < 5:
            prefill.write("decode", [1, 2], [2, 3]).wait()
            time.sleep(0.05)
    assert time.monotonic() - start < 5 + 2
    with pytest.raises(TransferError, match="closed"):
        decode.metadata()


def start_peer(tmp_path, name, seed, *args, env=None):
    process = subprocess.Popen([sys.executable, str(PEER), str(tmp_path), name, str(seed), *args],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)  # fmt: skip
    metadata, deadline = tmp_path / f"{name}.md", time.monotonic() + 60
    while not metadata.exists():
        if process.poll() is not None and not metadata.exists():
            log = process.stderr.read().decode()[-2000:]
            pytest.fail(f"the peer exited ({process.returncode}) before writing its metadata: {log}")
        assert time.monotonic() < deadline, "the peer wrote no metadata within 60 s"
        time.sleep(0.05)
    return process, metadata.read_bytes()


def test_metadata_of_an_agent_whose_process_exited_ends_in_an_error(tmp_path, agents):
    process, metadata = start_peer(tmp_path, "decode", 0, "--exit", *MHA)
    assert process.wait(timeout=60) == 0
    prefill = agents("prefill", build(*MHA).token_to_kv_pool, timeout_s=5)
    start = time.monotonic()
    with pytest.raises(TransferError):
        prefill.connect(metadata)  # NIXL cannot reach it; were it to, the write below must fail
        prefill.write("decode", [1], [2]).wait()
    assert time.monotonic() - start < 5 + 5


def test_a_stalled_peer_times_out(tmp_path, agents, monkeypatch):
    # TCP needs the target to take part (shared-memory transports could finish a write into a stopped process)
    monkeypatch.setenv("UCX_TLS", "tcp")
    process, metadata = start_peer(tmp_path, "decode", 0, *MHA, env={**os.environ, "UCX_TLS": "tcp"})
    try:
        prefill = agents("prefill", build(*MHA).token_to_kv_pool, timeout_s=1.5)
        prefill.connect(metadata)
        os.kill(process.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(TransferError, match="not done after 1.5 s"):
            prefill.write("decode", list(range(1, 33)), list(range(1, 33))).wait()
        assert time.monotonic() - start < 1.5 + 3
    finally:
        process.kill()
        process.wait(timeout=30)


def test_a_peer_in_another_process_receives_the_write(tmp_path, agents):
    overrides = (*MHA, "kv_cache.page_size=4")
    process, metadata = start_peer(tmp_path, "decode", 7, *overrides)
    try:
        src_pool = build(*overrides).token_to_kv_pool
        fill_random(src_pool, 8)
        src, dst = torch.arange(4, 14), torch.arange(40, 50)
        prefill = agents("prefill", src_pool)
        prefill.connect(metadata)
        prefill.write("decode", src, dst, notify=b"done").wait()
        assert process.wait(timeout=60) == 0, process.stderr.read().decode()[-2000:]
    finally:
        process.kill()
    received = torch.load(tmp_path / "decode.pt")
    mirror = build(*overrides).token_to_kv_pool
    fill_random(mirror, 7)  # what the peer's pool held before the write
    expected = expected_destination(overrides, src_pool, buffer_bytes(mirror), src, dst, 4)
    for name, got in received.items():
        assert torch.equal(got, expected[name]), f"buffer {name!r} of the peer's pool"


def test_the_readme_disaggregation_example_is_the_example_file_and_runs(capsys):
    """README.md's disaggregation example is examples/disaggregation.py verbatim, and it prints what the README
    says it prints (the KV of 37 tokens of every layer moved, identical)."""
    import runpy

    from readme_examples import ROOT, shown_example

    section = shown_example("### Speculative decoding and disaggregation", "disaggregation.py")
    runpy.run_path(str(ROOT / "examples" / "disaggregation.py"), run_name="__main__")
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed.endswith("identical True") and f"`{printed}`" in section
