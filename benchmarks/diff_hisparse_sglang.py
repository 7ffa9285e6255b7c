"""kvcore's HiSparseDSATokenToKVPool beside SGLang 0.5.23's own class, on the CPU, on the same inputs.

Run as ``benchmarks/diff_minimax_sglang.py`` is run (SGLang's CPU venv with kvcore installed in it), with Triton
interpreting SGLang's store kernel: ``TRITON_INTERPRET=1 /tmp/sgl-venv/bin/python benchmarks/diff_hisparse_sglang.py``.
SGLang is not a dependency of kvcore.

Both pools are built with the same keywords (bf16 latent rows: SGLang's fp8 DSA store needs its CUDA kernels), the
same logical -> device map registered with each (logical tokens on shuffled device slots), the same latent rows
stored by logical token; then the device buffers, the reads by logical token and the sizes are compared.  Then both
``HiSparseTokenToKVPoolAllocator`` classes are driven through the same calls and compared call by call.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool as TheirPool
from sglang.srt.runtime_context import get_parallel

from kvcore_dsa.hisparse import HiSparseDSATokenToKVPool as OurPool


class _Layer:
    def __init__(self, layer_id: int):
        self.layer_id = layer_id


def run(size: int, ratio: int) -> list[str]:
    kw = dict(size=size, page_size=64, kv_lora_rank=512, dtype=torch.bfloat16, qk_rope_head_dim=64, layer_num=3,
              device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=576,
              host_to_device_ratio=ratio)  # fmt: skip
    theirs, ours = TheirPool(**kw), OurPool(**kw, kernels="native")
    gen = torch.Generator().manual_seed(size + ratio)
    logical = size * ratio
    mapping = torch.zeros(logical + 64 + 1, dtype=torch.int64)
    mapping[-1] = -1
    hot = torch.randperm(logical, generator=gen)[: size // 2] + 64  # half the device's worth of tokens hot
    mapping[hot] = torch.randperm(size, generator=gen)[: hot.numel()] + 64
    theirs.register_mapping(mapping.clone())
    ours.register_mapping(mapping.clone())
    differences = []
    for layer in range(3):
        nope = torch.randn((hot.numel(), 1, 512), generator=gen).to(torch.bfloat16)
        rope = torch.randn((hot.numel(), 1, 64), generator=gen).to(torch.bfloat16)
        theirs.set_mla_kv_buffer(_Layer(layer), hot, nope, rope)
        ours.set_mla_kv_buffer(layer, hot, nope, rope)
        if not torch.equal(theirs.kv_buffer[layer], ours.kv_cache[layer]):
            differences.append(f"layer {layer}: device latent rows")
        a, b = theirs.get_mla_kv_buffer(_Layer(layer), hot), ours.get_mla_kv_buffer(layer, hot)
        if not all(torch.equal(x, y) for x, y in zip(a, b)):
            differences.append(f"layer {layer}: get_mla_kv_buffer by logical token")
    if theirs.get_kv_size_bytes() != sum(b.nbytes for b in ours.buffers().values()):
        differences.append(f"bytes {theirs.get_kv_size_bytes()} vs {sum(b.nbytes for b in ours.buffers().values())}")
    return differences


def run_allocator(size: int, ratio: int) -> list[str]:
    """Both allocators (``HiSparseTokenToKVPoolAllocator``) over pools of ``size`` device slots: the same prefills,
    extensions, decode steps, device buffers (fewer and more slots than a request holds), cold tokens and frees,
    compared call by call (locations, the logical -> device map, free sizes)."""
    from sglang.srt.mem_cache.allocator.hisparse import HiSparseTokenToKVPoolAllocator as TheirAlloc

    from kvcore_dsa.hisparse import HiSparseTokenToKVPoolAllocator as OurAlloc

    kw = dict(size=size, page_size=64, kv_lora_rank=512, dtype=torch.bfloat16, qk_rope_head_dim=64, layer_num=1,
              device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=576,
              host_to_device_ratio=ratio)  # fmt: skip
    allocs = {"theirs": TheirAlloc(size, 64, torch.bfloat16, "cpu", TheirPool(**kw), False, host_to_device_ratio=ratio),
              "ours": OurAlloc(size, 64, torch.bfloat16, "cpu", OurPool(**kw, kernels="native"), False,
                               host_to_device_ratio=ratio, kernels="native")}  # fmt: skip
    differences = []

    def both(what, call):
        got = {side: call(alloc) for side, alloc in allocs.items()}
        o, t = got["ours"], got["theirs"]
        if not ((o is None and t is None) or (o is not None and t is not None and torch.equal(o.long(), t.long()))):
            differences.append(f"{what}: {o} vs {t}")
        if not torch.equal(*(allocs[s].full_to_hisparse_device_index_mapping for s in ("ours", "theirs"))):
            differences.append(f"{what}: the logical -> device maps differ")
        sizes = [(a.available_size(), a.logical_attn_allocator.available_size(), a.hisparse_attn_allocator.available_size())
                 for a in (allocs["ours"], allocs["theirs"])]  # fmt: skip
        if sizes[0] != sizes[1]:
            differences.append(f"{what}: free sizes {sizes[0]} vs {sizes[1]}")
        return o

    def extend(prefix, seq, last):
        p, q, l = torch.tensor(prefix), torch.tensor(seq), torch.tensor(last)
        return lambda a: a.alloc_extend(p, p, q, q, l, int((q - p).sum()))

    first = both("prefill of 70 and 130", extend([0, 0], [70, 130], [-1, -1]))
    r0, r1 = first[:70].tolist(), first[70:].tolist()
    more = both("extend by 20 and 3", extend([70, 130], [90, 133], [r0[-1], r1[-1]]))
    r0, r1 = r0 + more[:20].tolist(), r1 + more[20:].tolist()
    for step in range(3):
        seq, last = torch.tensor([len(r0) + 1, len(r1) + 1]), torch.tensor([r0[-1], r1[-1]])
        out = both(f"decode {step}", lambda a: a.alloc_decode(seq, seq, last))
        r0.append(int(out[0]))
        r1.append(int(out[1]))
    both("device buffer of 2 pages for 93 held", lambda a: a.alloc_device_buffer(torch.tensor(r0), 128))
    both("device buffer of 1 page for 136 held", lambda a: a.alloc_device_buffer(torch.tensor(r1), 64))
    third = both("prefill of 10", extend([0], [10], [-1]))
    both("cold", lambda a: a.free_hisparse(third) or torch.tensor([0]))
    for rid, locs in enumerate((r0, r1, third.tolist())):
        both(f"free of request {rid}", lambda a: a.free(torch.tensor(locs)) or torch.tensor([0]))
    return differences


def main() -> None:
    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False)
    for size, ratio in ((128, 2), (256, 2), (256, 4)):
        differences = run(size, ratio)
        print(f"{size} device slots, ratio {ratio}: {'same' if not differences else 'DIFFERENT: ' + '; '.join(differences)}")
    for size, ratio in ((512, 2), (1024, 4)):
        differences = run_allocator(size, ratio)
        print(f"allocators, {size} device slots, ratio {ratio}: "
              + ("same" if not differences else "DIFFERENT: " + "; ".join(differences[:6])))  # fmt: skip


if __name__ == "__main__":
    main()
