"""Block and warp sizes of DeepSeek-V4's indexer and latent stores (kvcore_dsv4.kernels) on the GPU: device time of
one store of N random bf16 rows at random slots, per setting, and its share of the copy ceiling (a key reads 256
bytes and writes 132; a latent reads 1024 and writes 584).  ``python benchmarks/tune_dsv4.py``"""

import torch
import triton.testing

import kvcore_dsv4.kernels as K
from kvcore_dsv4.quantize import latent_page_bytes

PAGE = 256


def ceiling_gbs() -> float:
    a = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a))
    return 2 * a.numel() / ms / 1e6


def main() -> None:
    ceil = ceiling_gbs()
    print(f"copy ceiling {ceil:.0f} GB/s")
    for kind, dim, per_token, row in (("index", 128, 388, lambda p: p * 132), ("latent", 512, 1608, latent_page_bytes)):
        page = PAGE // 4
        for n in (256, 32768):
            pages = n // page + 8
            buf = torch.zeros(pages, row(page), dtype=torch.uint8, device="cuda")
            loc = torch.randperm(pages * page - page, device="cuda")[:n] + page
            x = torch.randn(n, dim, device="cuda", dtype=torch.bfloat16)
            for block in (2, 4, 8, 16, 32):
                for warps in (1, 2, 4):
                    setattr(K, f"_{kind.upper()}_BLOCK_N", block)
                    setattr(K, f"_{kind.upper()}_NUM_WARPS", warps)
                    store = K.IndexStore() if kind == "index" else K.LatentStore()
                    fn = lambda: store(buf, loc, x, page)
                    fn()
                    us = triton.testing.do_bench(fn) * 1e3
                    print(f"{kind:6} n={n:6} block {block:2} warps {warps}: {us:8.2f} us  {n * per_token / us / 1e3 / ceil:.2f} of ceiling")


if __name__ == "__main__":
    main()
