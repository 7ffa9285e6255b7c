"""kvcore's DeepSeekV4TokenToKVPool beside SGLang 0.5.23's own class, on the CPU, on the same inputs.

Run in SGLang's CPU venv with kvcore installed in it (as ``benchmarks/diff_minimax_sglang.py`` is run), Triton
interpreting SGLang's store kernels: ``TRITON_INTERPRET=1 /tmp/sgl-venv/bin/python benchmarks/diff_dsv4_sglang.py``.
SGLang is not a dependency of kvcore.

Both pools are built with the configurator's keywords (fp8 V4 pages, float32 states); then compared:

* every buffer's shape and dtype (window pages, compressed pages, indexer pages, the compressor states), the layer
  mapping, ring sizes and the transfer engines' buffer infos (lengths and item sizes);
* the window, ratio-4 and indexer stores of the same bf16 rows at the same locations (the ratio-128 pages, two
  slots a page, crash SGLang's Triton store under the interpreter, so they are compared by shape only; kvcore's
  store is one kernel for every page size).  SGLang's CUDA store is a JIT module; its Triton store (the one its HIP build runs) runs here under the interpreter, whose float -> fp8
  casts round some values wrongly (triton-lang/triton#8322: 127 becomes 64, ties go away from even).  So the scale
  bytes, the rope bytes and every untouched byte must be equal, kvcore's fp8 codes must be the exact quotients
  rounded to nearest even (what the GPU's cast gives), and the share of codes where SGLang's agree is printed.
"""

from __future__ import annotations

import torch
from sglang.kernels.ops.kvcache.triton_store_cache import triton_fused_store_cache
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool as TheirPool
from sglang.srt.runtime_context import get_parallel, publish
from sglang.srt.server_args import ServerArgs

from kvcore_dsv4.pool import DeepSeekV4TokenToKVPool as OurPool

PAGE = 256


def build(pool_class, full: int, swa: int, slots: int, ratios: list[int], **extra):
    extra = {"enable_hisparse": False, "c4_size": full // 4, **extra}
    return pool_class(max_num_reqs=slots - 1, num_req_slots=slots, swa_size=swa,
                      c128_size=full // 128, c4_state_pool_size=swa // PAGE * 8, c128_state_pool_size=slots * 128,
                      page_size=PAGE, swa_page_size=PAGE, sliding_window=128, dtype=torch.float8_e4m3fn,
                      c4_state_dtype=torch.float32, c128_state_dtype=torch.float32, qk_nope_head_dim=448,
                      qk_rope_head_dim=64, indexer_head_dim=128, layer_num=len(ratios), device="cpu",
                      enable_memory_saver=False, compression_ratios=ratios, start_layer=0, end_layer=len(ratios),
                      online_mtp_max_draft_tokens=0, **extra)  # fmt: skip


def their_buffers(p) -> dict[str, list[torch.Tensor]]:
    states = [s for s in p.compress_state_pools if s is not None]
    return {
        "swa_kv": p.swa_kv_pool.kv_buffer,
        **{f"c{r}_kv": pool.kv_buffer for r, pool in p.kv_pools.items() if pool is not None},
        "c4_index": p.index_pools[4].index_k_with_scale_buffer if 4 in p.index_pools else [],
        "c4_state": [s.kv_score_buffer.kv_score for s in states if s.ratio == 4],
        "c4_index_state": [s.kv_score_buffer.kv_score for s in p.indexer_compress_state_pools if s is not None],
        "c128_state": [s.kv_score_buffer.kv_score for s in states if s.ratio == 128],
    }


AGREED = [0, 0]  # fp8 codes compared, and those where SGLang's interpreted code is kvcore's


def codes_differ_only_by_rounding(ours: torch.Tensor, theirs: torch.Tensor, exact: torch.Tensor) -> bool:
    """kvcore's codes are the exact quotients rounded to nearest even (torch's own cast); where SGLang's interpreted
    codes differ, the interpreter's cast is at fault (it maps 127 to 64, ties away from even): counted in
    :data:`AGREED`, not failed."""
    AGREED[0] += ours.numel()
    AGREED[1] += int((ours == theirs).sum())
    return torch.equal(ours, exact.to(torch.float8_e4m3fn).view(torch.uint8))


def compare_latents(buf_ours, buf_theirs, before, loc, x, page) -> list[str]:
    """Bytes of a latent store at ``loc``: scales and rope equal, codes by :func:`codes_differ_only_by_rounding`."""
    problems = []
    page_bytes = buf_ours.shape[1]
    flat_o, flat_t, flat_b = buf_ours.reshape(-1), buf_theirs.reshape(-1), before.reshape(-1)
    touched = torch.zeros_like(flat_o, dtype=torch.bool)
    for i, t in enumerate(loc.tolist()):
        base = (t // page) * page_bytes + (t % page) * 576
        sbase = (t // page) * page_bytes + page * 576 + (t % page) * 8
        scales_o, scales_t = flat_o[sbase : sbase + 7], flat_t[sbase : sbase + 7]
        if not torch.equal(scales_o, scales_t):
            problems.append(f"token {t}: scale bytes {scales_o.tolist()} vs {scales_t.tolist()}")
            continue
        exponents = scales_o.int() - 127
        exact = (x[i, :448].float().reshape(7, 64) * torch.exp2(-exponents.float())[:, None]).reshape(-1)
        if not codes_differ_only_by_rounding(flat_o[base : base + 448], flat_t[base : base + 448], exact):
            problems.append(f"token {t}: fp8 codes are not the exact quotients rounded to nearest even")
        if not torch.equal(flat_o[base + 448 : base + 576], flat_t[base + 448 : base + 576]):
            problems.append(f"token {t}: rope bytes")
        touched[base : base + 576] = True
        touched[sbase : sbase + 7] = True
    if not torch.equal(flat_o[~touched], flat_b[~touched]) or not torch.equal(flat_t[~touched], flat_b[~touched]):
        problems.append("bytes outside the written rows changed")
    return problems


def compare_index(buf_ours, buf_theirs, loc, keys, page) -> list[str]:
    problems = []
    page_bytes = buf_ours.shape[1]
    for i, t in enumerate(loc.tolist()):
        base, sbase = (t // page) * page_bytes + (t % page) * 128, (t // page) * page_bytes + page * 128 + (t % page) * 4
        o, th = buf_ours.reshape(-1), buf_theirs.reshape(-1)
        if not torch.equal(o[sbase : sbase + 4], th[sbase : sbase + 4]):
            problems.append(f"slot {t}: index scale")
            continue
        scale = o[sbase : sbase + 4].view(torch.float32)
        exact = keys[i].float() * (1.0 / scale)
        if not codes_differ_only_by_rounding(o[base : base + 128], th[base : base + 128], exact):
            problems.append(f"slot {t}: index codes are not the quotients rounded to nearest even")
    return problems


def run(full: int, swa: int, slots: int, ratios: list[int]) -> list[str]:
    theirs, ours = build(TheirPool, full, swa, slots, ratios), build(OurPool, full, swa, slots, ratios, kernels="native")
    problems = []
    mine = ours.buffers()
    for name, layers in their_buffers(theirs).items():
        if not layers and name not in mine:
            continue
        got = list(mine[name].unbind(0)) if name in mine else []
        if [(tuple(t.shape), t.dtype) for t in got] != [(tuple(t.shape), t.dtype) for t in layers]:
            problems.append(f"{name}: {[tuple(t.shape) for t in got]} vs {[tuple(t.shape) for t in layers]}")
    if [tuple(m[:2]) if m else None for m in ours.layer_mapping] != [tuple(m[:2]) if m else None for m in theirs.layer_mapping]:
        problems.append("layer_mapping")
    for r in (4, 128):
        if ours.get_ring_size(r) != theirs.get_ring_size(r):
            problems.append(f"ring size {r}")
    for what in ("get_contiguous_buf_infos", "get_state_buf_infos", "get_request_state_buf_infos"):
        a, b = getattr(ours, what)(), getattr(theirs, what)()
        if (a[1], a[2]) != (b[1], b[2]):
            problems.append(f"{what}: lengths/items {a[1:]} vs {b[1:]}")
    gen = torch.Generator().manual_seed(full + swa)
    x = (torch.randn(48, 512, generator=gen) * 2).to(torch.bfloat16)
    keys = (torch.randn(48, 128, generator=gen) * 2).to(torch.bfloat16)
    for name, buf_t, layer, size, page, setter in (
        ("window", theirs.swa_kv_pool.kv_buffer[0], 0, swa, PAGE, lambda loc: ours.set_swa_key_buffer_radix_fused(0, loc, x)),
        ("c4", theirs.kv_pools[4].kv_buffer[0], 1, full // 4, PAGE // 4, lambda loc: ours.set_extra_key_buffer_fused(1, loc, x)),
    ):  # fmt: skip
        loc = torch.randperm(size, generator=gen)[:48] + page
        before = buf_t.clone()
        triton_fused_store_cache(x, buf_t, loc, page_size=page, type="flashmla")
        setter(loc)
        buf_o = ours.get_swa_raw_buffer(0) if name == "window" else ours.get_extra_key_buffer(layer)
        problems += [f"{name}: {p}" for p in compare_latents(buf_o, buf_t, before, loc, x, page)]
    loc = torch.randperm(full // 4, generator=gen)[:48] + PAGE // 4
    buf_t = theirs.index_pools[4].index_k_with_scale_buffer[0]
    triton_fused_store_cache(keys, buf_t, loc, page_size=PAGE // 4, type="indexer")
    ours.set_index_k_fused(1, loc, keys)
    problems += [f"indexer: {p}" for p in compare_index(ours.get_index_k_with_scale_buffer(1), buf_t, loc, keys, PAGE // 4)]
    return problems


def run_hisparse(full: int, swa: int, slots: int, ratios: list[int], ratio: int) -> list[str]:
    """HiSparse: both pools built with ``enable_hisparse=True`` (``c4_size`` = full // (4 x ratio)), each paired with
    its own window allocator wrapped in the HiSparse allocator; the same extensions, decode steps, frees and a
    device buffer on both, compared call by call (locations, the logical -> device map, free sizes)."""
    from sglang.srt.mem_cache.allocator.hisparse import DeepSeekV4HiSparseTokenToKVPoolAllocator as TheirAlloc
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator as TheirSWA

    from kvcore_dsv4.hisparse import DeepSeekV4HiSparseTokenToKVPoolAllocator as OurAlloc
    from kvcore_swa import SWATokenToKVPoolAllocator as OurSWA

    c4 = full // (4 * ratio)
    pools = {"theirs": build(TheirPool, full, swa, slots, ratios, enable_hisparse=True, c4_size=c4),
             "ours": build(OurPool, full, swa, slots, ratios, enable_hisparse=True, c4_size=c4, kernels="native")}  # fmt: skip
    allocs = {"theirs": TheirAlloc(TheirSWA(full, swa, PAGE, torch.float8_e4m3fn, "cpu", pools["theirs"], False)),
              "ours": OurAlloc(OurSWA(full, swa, PAGE, torch.float8_e4m3fn, "cpu", pools["ours"], False))}  # fmt: skip
    problems = []
    a, b = pools["ours"].buffers()["c4_kv"], pools["theirs"].kv_pools[4].kv_buffer
    if [tuple(a.shape[1:])] * a.shape[0] != [tuple(t.shape) for t in b]:
        problems.append(f"c4_kv device pages {tuple(a.shape)} vs {[tuple(t.shape) for t in b]}")
    ours_infos, their_infos = (pools[s].get_contiguous_buf_infos() for s in ("ours", "theirs"))
    if ours_infos[1:] != their_infos[1:]:  # the device pages first: SGLang's decode side skips them by count
        problems.append(f"get_contiguous_buf_infos: lengths/items {ours_infos[1:]} vs {their_infos[1:]}")

    def both(what, call):
        got = {side: call(alloc) for side, alloc in allocs.items()}
        o, t = got["ours"], got["theirs"]
        same = (o is None and t is None) or (o is not None and t is not None and torch.equal(o.long(), t.long()))
        if not same:
            problems.append(f"{what}: {o} vs {t}")
        m_o, m_t = (allocs[s].full_to_hisparse_device_index_mapping for s in ("ours", "theirs"))
        if not torch.equal(m_o, m_t):
            problems.append(f"{what}: the logical -> device maps differ")
        for q in ("available_size", "full_available_size", "swa_available_size"):
            if getattr(allocs["ours"], q)() != getattr(allocs["theirs"], q)():
                problems.append(f"{what}: {q} {getattr(allocs['ours'], q)()} vs {getattr(allocs['theirs'], q)()}")
        return o

    def extend(prefix, seq, last):
        p, q, l = torch.tensor(prefix), torch.tensor(seq), torch.tensor(last)
        return lambda al: al.alloc_extend(p, p, q, q, l, int((q - p).sum()))

    first = both("prefill of 300 and 700", extend([0, 0], [300, 700], [-1, -1]))
    r0, r1 = first[:300].tolist(), first[300:].tolist()
    more = both("extend by 100 and 40", extend([300, 700], [400, 740], [r0[-1], r1[-1]]))
    r0, r1 = r0 + more[:100].tolist(), r1 + more[100:].tolist()
    for step in range(3):
        seq = torch.tensor([len(r0) + 1, len(r1) + 1])
        last = torch.tensor([r0[-1], r1[-1]])
        out = both(f"decode {step}", lambda al: al.alloc_decode(seq, seq, last))
        r0.append(int(out[0]))
        r1.append(int(out[1]))
    compressed = pools["ours"].c4_kv_pool.translate_loc_from_full_to_compressed(torch.tensor(r1))
    page = PAGE // 4
    both("device buffer of 2 pages", lambda al: al.alloc_device_buffer(compressed, 2 * page))
    both("free of the first request", lambda al: al.free(torch.tensor(r0)) or torch.tensor([0]))
    both("free of the second", lambda al: al.free(torch.tensor(r1)) or torch.tensor([0]))
    return problems


def main() -> None:
    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False)
    publish(ServerArgs(model_path="dummy", device="cpu"), role="test")
    for full, swa, slots, ratios, ratio in ((8192, 2048, 4, [0, 4, 128, 4, 128, 0], 2), (16384, 2048, 3, [4, 128, 4], 4)):
        problems = run_hisparse(full, swa, slots, ratios, ratio)
        print(f"HiSparse (host_to_device_ratio {ratio}), {full} tokens, window {swa}, ratios {ratios}: "
              + ("same" if not problems else "DIFFERENT: " + "; ".join(problems[:6])))  # fmt: skip
    for full, swa, slots, ratios in ((2048, 512, 4, [0, 4, 128, 4, 128, 0]), (4096, 1024, 3, [4, 4, 128, 0, 128, 4]),
                                     (1024, 256, 2, [0, 4, 128])):  # fmt: skip
        problems = run(full, swa, slots, ratios)
        print(f"{full} tokens, window {swa}, {slots} request slots, ratios {ratios}: "
              + ("same" if not problems else "DIFFERENT: " + "; ".join(problems[:6])))  # fmt: skip
    print(f"fp8 codes where SGLang's interpreted store agrees: {AGREED[1]} of {AGREED[0]} "
          f"({AGREED[1] / max(1, AGREED[0]):.1%}; the rest is the interpreter's cast)")


if __name__ == "__main__":
    main()
