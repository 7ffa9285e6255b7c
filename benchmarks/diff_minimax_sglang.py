"""kvcore's MiniMaxSparseKVPool beside SGLang 0.5.23's own class, on the CPU, on the same inputs.

Run in a venv where SGLang's pools import on the CPU (``../shared/bench/sglang_venv.sh``) with kvcore installed
there (``pip install --no-deps -e .``): ``/tmp/sgl-venv/bin/python benchmarks/diff_minimax_sglang.py``.  SGLang is
not a dependency of kvcore; this script is run by hand and its result recorded in RESULTS.md.

Both pools are built with the same constructor keywords (a rank's slice of dense, sparse and keys-only-index
layers, pages of 1 and 4, bf16 and fp8 index rows); the same random main K/V and index rows are stored through each
one's methods; then every read (main K/V, index K/V, index keys) is compared byte for byte, with the sizes SGLang
reports (``get_kv_size_bytes``, every buffer-info method's bytes and item bytes).
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool as TheirPool

from kvcore_minimax_sparse.pool import MiniMaxSparseKVPool as OurPool

DENSE, SPARSE, KEYS_ONLY = [0, 1, 4], [2, 3, 5, 6, 7], [3, 7]


def raw(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def run(page_size: int, index_dtype: torch.dtype, start: int, end: int) -> list[str]:
    kw = dict(size=16 * page_size, page_size=page_size, dtype=torch.bfloat16, head_num=2, head_dim=16, idx_head_dim=8,
              dense_layer_ids=DENSE, sparse_layer_ids=SPARSE, device="cpu", disable_value_sparse_layer_ids=KEYS_ONLY,
              index_dtype=index_dtype, start_layer=start, end_layer=end)  # fmt: skip
    theirs, ours = TheirPool(**kw), OurPool(**kw, kernels="native")
    gen = torch.Generator().manual_seed(page_size)
    loc = torch.randperm(16 * page_size, generator=gen)[:11] + page_size
    differences = []
    for layer in range(start, end):
        k, v = (torch.randn((11, 2, 16), generator=gen).to(torch.bfloat16) for _ in range(2))
        ik, iv = (torch.randn((11, 1, 8), generator=gen).to(torch.bfloat16) for _ in range(2))
        for pool in (theirs, ours):
            pool.set_kv_buffer(_Layer(layer), loc, k, v)
            if layer in SPARSE and layer in KEYS_ONLY:
                pool.set_index_k_buffer(_Layer(layer), loc, ik)
            elif layer in SPARSE:
                pool.set_index_kv_buffer(_Layer(layer), loc, ik, iv)
        reads = {"k": lambda p: p.get_key_buffer(layer), "v": lambda p: p.get_value_buffer(layer)}
        if layer in SPARSE:
            reads["index_k"] = lambda p: p.get_index_k_buffer(layer)
        if layer in SPARSE and layer not in KEYS_ONLY:
            reads["index_kv"] = lambda p: torch.cat(p.get_index_kv_buffer(layer), dim=-1)
        for name, read in reads.items():
            a, b = read(theirs), read(ours)
            if a.shape != b.shape or not torch.equal(raw(a), raw(b)):
                differences.append(f"layer {layer} {name}: {tuple(a.shape)} vs {tuple(b.shape)}")
    if theirs.get_kv_size_bytes() != ours.get_kv_size_bytes():
        differences.append(f"get_kv_size_bytes {theirs.get_kv_size_bytes()} vs {ours.get_kv_size_bytes()}")
    for infos in ("get_contiguous_buf_infos", "get_sparse_kv_buf_infos", "get_dense_kv_state_buf_infos",
                  "get_index_k_state_buf_infos"):
        a, b = getattr(theirs, infos)(), getattr(ours, infos)()
        if (a[1], a[2]) != (b[1], b[2]):
            differences.append(f"{infos}: bytes {a[1]} / items {a[2]} vs {b[1]} / {b[2]}")
    return differences


class _Layer:
    """What SGLang's pools read of a layer (``layer_id``)."""

    def __init__(self, layer_id: int):
        self.layer_id = layer_id


def main() -> None:
    cases = 0
    for page_size in (1, 4):
        for index_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            for start, end in ((0, 8), (2, 6)):  # the whole model, and a pipeline stage of it
                differences = run(page_size, index_dtype, start, end)
                cases += 1
                status = "same" if not differences else "DIFFERENT: " + "; ".join(differences)
                print(f"page {page_size}, index {str(index_dtype).removeprefix('torch.')}, layers {start}..{end - 1}: "
                      f"{status}")  # fmt: skip
    print(f"{cases} cases")


if __name__ == "__main__":
    main()
