"""transformers generation on kvcore's PagedKVCache (as built, and with ``contiguous_rows=True``) beside
DynamicCache, on a GPU: tokens per second of each,
side by side in one process, for batch 1 and 8, prompts of 100 and 4000 tokens, bf16 and fp8 caches.

A random-weight Llama of Llama-3-8B's attention shape (8 layers, 32 heads, 8 KV heads of 128), eager, greedy,
64 new tokens after a warm-up run; each figure is the best of three runs.  Before timing, one prefill and one
decode step run through both caches and their logits are compared bit for bit (bf16 caches; an fp8 cache rounds
every key and value, which tests/test_transformers_cache.py checks against an fp8-rounded DynamicCache on the
CPU).  ``generate`` itself is not compared token for token: on a GPU it is not deterministic from run to run at
batch 8, DynamicCache against itself included.

    python benchmarks/bench_hf_generate.py        # results also in $OUT/hf_generate.json (default /tmp)
"""

from __future__ import annotations

import json
import os
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvcore.integrations.transformers import PagedKVCache

NEW = 64


def main() -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=8192, num_hidden_layers=8, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=32000, max_position_embeddings=8192)  # fmt: skip
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    results = []
    for dtype in ("bfloat16", "float8_e4m3fn"):
        for batch, prompt in ((1, 100), (8, 100), (1, 4000), (8, 4000)):
            ids = torch.randint(1, 32000, (batch, prompt), device="cuda")
            mask = torch.ones_like(ids)

            def paged(contiguous_rows=False):
                return PagedKVCache.from_model(model, max_total_tokens=batch * (prompt + NEW + 64), page_size=16,
                                               dtype=dtype, max_batch_size=batch, contiguous_rows=contiguous_rows)  # fmt: skip

            def run(cache, new=NEW) -> float:
                torch.cuda.synchronize()
                start = time.perf_counter()
                with torch.no_grad():
                    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                   do_sample=False, past_key_values=cache, pad_token_id=0)  # fmt: skip
                torch.cuda.synchronize()
                return time.perf_counter() - start

            identical = None
            if dtype == "bfloat16":  # one prefill and one decode step, both caches: the same logits
                with torch.no_grad():
                    identical = True
                    for contiguous in (False, True):
                        a, b = DynamicCache(config=model.config), paged(contiguous)
                        la = model(input_ids=ids, attention_mask=mask, past_key_values=a).logits
                        lb = model(input_ids=ids, attention_mask=mask, past_key_values=b).logits
                        nxt = la[:, -1:].argmax(-1)
                        mask2 = torch.cat([mask, torch.ones_like(nxt)], 1)
                        la2 = model(input_ids=nxt, attention_mask=mask2, past_key_values=a).logits
                        lb2 = model(input_ids=nxt, attention_mask=mask2, past_key_values=b).logits
                        identical &= bool(torch.equal(la, lb) and torch.equal(la2, lb2))
            run(DynamicCache(), 4)
            run(paged(), 4)
            run(paged(True), 4)
            dynamic = min(run(DynamicCache()) for _ in range(3))
            kvcore_s = min(run(paged()) for _ in range(3))
            rows_s = min(run(paged(True)) for _ in range(3))
            row = dict(dtype=dtype, batch=batch, prompt=prompt, dynamic_tok_s=batch * NEW / dynamic,
                       kvcore_tok_s=batch * NEW / kvcore_s, contiguous_rows_tok_s=batch * NEW / rows_s,
                       ratio=dynamic / kvcore_s, contiguous_rows_ratio=dynamic / rows_s, logits_identical=identical)  # fmt: skip
            results.append(row)
            print(f"{dtype:<14} batch {batch} prompt {prompt:>5}: DynamicCache {row['dynamic_tok_s']:8.1f} tok/s, "
                  f"PagedKVCache {row['kvcore_tok_s']:8.1f} ({row['ratio']:.2f}x), contiguous_rows "
                  f"{row['contiguous_rows_tok_s']:8.1f} ({row['contiguous_rows_ratio']:.2f}x)"
                  + ("" if identical is None else f", logits identical {identical}"), flush=True)  # fmt: skip
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "hf_generate.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
