"""kvcore's HiSparseDSATokenToKVPool beside SGLang 0.5.23's own class, on the CPU, on the same inputs.

Run as ``benchmarks/diff_minimax_sglang.py`` is run (SGLang's CPU venv with kvcore installed in it), with Triton
interpreting SGLang's store kernel: ``TRITON_INTERPRET=1 /tmp/sgl-venv/bin/python benchmarks/diff_hisparse_sglang.py``.
SGLang is not a dependency of kvcore.

Both pools are built with the same keywords (bf16 latent rows: SGLang's fp8 DSA store needs its CUDA kernels), the
same logical -> device map registered with each (logical tokens on shuffled device slots), the same latent rows
stored by logical token; then the device buffers, the reads by logical token and the sizes are compared.
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


def main() -> None:
    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False)
    for size, ratio in ((128, 2), (256, 2), (256, 4)):
        differences = run(size, ratio)
        print(f"{size} device slots, ratio {ratio}: {'same' if not differences else 'DIFFERENT: ' + '; '.join(differences)}")


if __name__ == "__main__":
    main()
