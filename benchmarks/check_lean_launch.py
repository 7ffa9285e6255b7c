"""The ``kvlean`` experiment of ``bench_hf_generate.py`` (:class:`LeanPagedKVCache`) launches what kvcore's own
``HeadGather.store_and_gather`` launches: on the CPU (Triton's interpreter), after a prefill and a decode step of a
tiny Llama's shapes have made the plans, every plan's direct launch is replaced by a recorder; a second decode step
then runs through the lean cache, and for each layer after the first the recorded arguments are compared with those
``store_and_gather`` passes for the same inputs (the two fresh outputs' addresses aside).  Batches of 1 and 3, an
fp8 cache, values as a transposed view (as a model's).  Then ``kvreuse`` (:class:`ReusingPagedKVCache`): its output
pair is written again only when nothing holds it (no reference, no view) and the shapes match.

    python benchmarks/check_lean_launch.py
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_hf_generate import LeanPagedKVCache, ReusingPagedKVCache, build_model  # noqa: E402

from kvcore.integrations.transformers import PagedKVCache  # noqa: E402


class _Args:
    small, attn, device = True, "eager", "cpu"


def main() -> None:
    model = build_model(_Args)
    layers = model.config.num_hidden_layers
    heads, dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    for batch, prompt in ((1, 20), (3, 37)):
        cache = LeanPagedKVCache.from_model(model, max_total_tokens=4096, page_size=16, dtype="float8_e4m3fn",
                                            max_batch_size=batch, kernels="triton")  # fmt: skip

        def new_rows(q: int = 1):
            keys = torch.randn(batch, heads, q, dim).to(torch.bfloat16)
            return keys, torch.randn(batch, q, heads, dim).to(torch.bfloat16).transpose(1, 2)

        for layer in range(layers):
            cache.update(*new_rows(prompt), layer)
        for layer in range(layers):
            cache.update(*new_rows(), layer)
        gather = cache._step.gather
        launched: list[tuple] = []
        for plan in gather._store_plans.values():
            plan.entry, plan.raw_stream = (lambda *a: launched.append(a), ("HEAD",)), lambda index: 12345
        keys, values = new_rows()
        own_path, plain = [], PagedKVCache.update
        PagedKVCache.update = lambda self, *a, **k: (own_path.append(1), plain(self, *a, **k))[1]
        try:
            outs = [cache.update(keys, values, layer) for layer in range(layers)]
        finally:
            PagedKVCache.update = plain
        assert len(own_path) == 1, "the layers after the step's first should take the lean path"
        assert len(launched) == layers, launched
        out_at = 3 + 1 + 1 + 2  # the grid, the stream, the head, the layer's K and V addresses
        for layer in range(1, layers):
            reference: list[tuple] = []
            for plan in gather._store_plans.values():
                plan.entry = (lambda *a: reference.append(a), ("HEAD",))
            k_out, v_out = gather.store_and_gather(layer, cache._step.read_locs, keys, values)
            lean, want = list(launched[layer]), list(reference[0])
            assert lean[out_at : out_at + 2] == [outs[layer][0].data_ptr(), outs[layer][1].data_ptr()]
            assert want[out_at : out_at + 2] == [k_out.data_ptr(), v_out.data_ptr()]
            lean[out_at : out_at + 2] = want[out_at : out_at + 2] = ["k_out", "v_out"]
            assert lean == want, (layer, lean, want)
            assert outs[layer][0].shape == k_out.shape and outs[layer][1].shape == v_out.shape
        print(f"batch {batch}, prompt {prompt}: layers 1..{layers - 1} launched as store_and_gather launches "
              f"({len(launched[1])} arguments)")  # fmt: skip
    check_reuse(model)


def check_reuse(model) -> None:
    cache = ReusingPagedKVCache.from_model(model, max_total_tokens=4096, page_size=16, dtype=None, max_batch_size=1,
                                           kernels="triton")  # fmt: skip
    heads, dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    rows = torch.randn(2, 1, heads, 5, dim).to(torch.bfloat16)
    for layer in range(model.config.num_hidden_layers):
        cache.update(rows[0], rows[1], layer)
    shapes = ((1, heads, 5, dim),) * 2

    def ids(pair) -> tuple:
        return id(pair[0]), id(pair[1])

    first = ids(cache._outputs(shapes))
    pair = cache._outputs(shapes)
    assert ids(pair) == first, "a free pair is written again"
    held = pair[0]
    del pair
    pair = cache._outputs(shapes)
    assert id(pair[0]) != id(held), "a pair someone holds is not"
    del held
    view, kept = pair[1].transpose(2, 3), ids(pair)
    del pair
    pair = cache._outputs(shapes)
    assert ids(pair) != kept, "nor one whose memory a view holds"
    kept = ids(pair)
    del pair, view
    assert ids(cache._outputs(shapes)) == kept
    assert cache._outputs(((1, heads, 6, dim),) * 2)[0].shape == (1, heads, 6, dim), "another shape: new tensors"
    print("kvreuse: a pair is written again only when nothing holds it")


if __name__ == "__main__":
    main()
