"""transformers generation on kvcore's PagedKVCache (as built, and with ``contiguous_rows=True``) beside
DynamicCache, on a GPU: tokens per second of each,
side by side in one process, for batch 1 and 8, prompts of 100 and 4000 tokens, bf16 and fp8 caches.

A random-weight Llama of Llama-3-8B's attention shape (8 layers, 32 heads, 8 KV heads of 128), eager, greedy,
64 new tokens after a warm-up run.  The three caches run in turn, five rounds of one run each (the host's noisy
stretches last seconds: interleaving spreads them over all three); each figure is a cache's best round, the
median beside it.  Before timing, one prefill and one decode step run through each cache and DynamicCache again,
and their logits are compared bit for bit (bf16 caches; an fp8 cache rounds every key and value, which
tests/test_transformers_cache.py checks against an fp8-rounded DynamicCache on the CPU): ``identical`` is whether
kvcore's caches gave DynamicCache's logits, ``dynamic_repeatable`` whether DynamicCache gave its own again.
``generate`` itself is not compared token for token: on a GPU it is not deterministic from run to run at batch 8,
DynamicCache against itself included.

    python benchmarks/bench_hf_generate.py        # results also in $OUT/hf_generate.json (default /tmp)
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvcore.integrations.transformers import PagedKVCache

NEW = 64
ROUNDS = 5


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

            identical = repeatable = None
            if dtype == "bfloat16":  # one prefill and one decode step through each cache: the same logits

                def two_steps(cache):
                    with torch.no_grad():
                        first = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits
                        nxt = first[:, -1:].argmax(-1)
                        mask2 = torch.cat([mask, torch.ones_like(nxt)], 1)
                        return first, model(input_ids=nxt, attention_mask=mask2, past_key_values=cache).logits

                want = two_steps(DynamicCache(config=model.config))
                repeatable = all(map(torch.equal, two_steps(DynamicCache(config=model.config)), want))
                identical = all(all(map(torch.equal, two_steps(paged(contiguous)), want)) for contiguous in (False, True))
            makers = {"dynamic": DynamicCache, "kvcore": paged, "contiguous_rows": lambda: paged(True)}
            for make in makers.values():
                run(make(), 4)  # warm-up: every kernel compiled, every plan made
            times = {name: [] for name in makers}
            for _ in range(ROUNDS):
                for name, make in makers.items():
                    times[name].append(run(make()))
            tok_s = {name: batch * NEW / min(t) for name, t in times.items()}
            median = {name: batch * NEW / statistics.median(t) for name, t in times.items()}
            row = dict(dtype=dtype, batch=batch, prompt=prompt, dynamic_tok_s=tok_s["dynamic"],
                       kvcore_tok_s=tok_s["kvcore"], contiguous_rows_tok_s=tok_s["contiguous_rows"],
                       ratio=tok_s["kvcore"] / tok_s["dynamic"],
                       contiguous_rows_ratio=tok_s["contiguous_rows"] / tok_s["dynamic"],
                       median_tok_s=median, logits_identical=identical, dynamic_repeatable=repeatable)  # fmt: skip
            results.append(row)
            print(f"{dtype:<14} batch {batch} prompt {prompt:>5}: DynamicCache {tok_s['dynamic']:7.1f} tok/s "
                  f"(median {median['dynamic']:7.1f}), PagedKVCache {tok_s['kvcore']:7.1f} ({row['ratio']:.2f}x; "
                  f"median {median['kvcore']:7.1f}), contiguous_rows {tok_s['contiguous_rows']:7.1f} "
                  f"({row['contiguous_rows_ratio']:.2f}x; median {median['contiguous_rows']:7.1f})"
                  + ("" if identical is None else f", logits identical {identical} (DynamicCache repeatable "
                                                  f"{repeatable})"), flush=True)  # fmt: skip
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "hf_generate.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
