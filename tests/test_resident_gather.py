"""The resident head gather (kvcore.kernels.resident_gather): every layer's gathered rows kept between calls, a call
writing only the tokens they lack.  Against the torch reference of a store then a full gather, bit for bit, on the
Triton path (interpreted on the CPU, compiled on a GPU) and the torch path."""

from __future__ import annotations

import pytest
import torch

from kvcore.kernels.head_gather import gather_heads_native, room_for
from kvcore.kernels.resident_gather import ResidentHeadGather
from kvcore.testing.tensors import test_device
from test_head_gather import (CASES, CountingPlans, distinct_locations, matches_a_store_then_a_gather, new_rows,
                              random_rows, same_bits)  # fmt: skip

DEVICE = test_device()
#: (rows' length after the call, new tokens): a prefill, decode steps, a chunk starting inside a token block, a
#: step back (a crop) and on, then rows past the first room (gathered again into new rows)
STEPS = ((37, 37), (38, 1), (170, 132), (300, 129), (301, 1), (302, 1), (290, 3), (291, 1), (420, 129), (421, 1))


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("cache_dtype, model_dtype, scale", CASES)
def test_every_call_returns_what_a_store_then_a_full_gather_returns(cache_dtype, model_dtype, scale, use_triton):
    """Every conversion, the table's rows with a length (a decode's call) and views of them of the call's width: the
    views returned hold, bit for bit, what the reference gathers, the pool what it stores."""
    layers, rows, heads, dk, dv, batch = 2, 1400, 3, 24, 8, 3
    k = random_rows((layers, rows, heads, dk), cache_dtype, 20)
    v = random_rows((layers, rows, heads, dv), cache_dtype, 21)
    gather = ResidentHeadGather(k.unbind(0), v.unbind(0), model_dtype, scale, scale, use_triton=use_triton)
    table = distinct_locations(batch, 450, rows, 22)

    def call(step, layer, end, k_new, v_new):
        got = gather.store_and_gather(layer, table, k_new, v_new, end)
        assert gather.rows_held(layer) == end
        return got

    matches_a_store_then_a_gather(k, v, table, STEPS, model_dtype, scale, call)
    assert gather._rows.room == room_for(420), "rows past their room are gathered into new ones"


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
def test_a_call_writes_only_the_tokens_the_rows_lack(use_triton):
    """A decode step writes its new token's block (the Triton path: from the token block holding the first token
    the rows lack; the torch path: from that token) and leaves the rows' other tokens as they are: tokens spoiled
    before it read back spoiled.  Locations at another address hold nothing: every token is written again."""
    layers, rows, heads, dim, batch = 1, 1000, 2, 16, 2
    k = random_rows((layers, rows, heads, dim), torch.bfloat16, 30)
    v = random_rows((layers, rows, heads, dim), torch.bfloat16, 31)
    gather = ResidentHeadGather(k.unbind(0), v.unbind(0), torch.bfloat16, use_triton=use_triton)
    table = distinct_locations(batch, 400, rows, 32)
    gather.store_and_gather(0, table, *(new_rows(batch, heads, 300, dim, torch.bfloat16, s) for s in (1, 2)), 300)
    written_from = (300 // gather._block_t) * gather._block_t if use_triton else 300
    assert 0 < written_from <= 300, "the test's rows span more than one token block"
    gather._rows.k[0, :, :, :written_from] = float("nan")  # spoiled where the next call must not write
    k_out, v_out = gather.store_and_gather(0, table, *(new_rows(batch, heads, 1, dim, torch.bfloat16, s)
                                                        for s in (3, 4)), 301)  # fmt: skip
    assert k_out[:, :, :written_from].isnan().all() and not k_out[:, :, written_from:].isnan().any()
    assert not v_out.isnan().any()
    want = gather_heads_native(k[0], v[0], table[:, :301], torch.bfloat16)
    # another locations tensor of the same rows but another address: every token gathered again
    k_out, _ = gather.store_and_gather(0, table.clone(), *(new_rows(batch, heads, 1, dim, torch.bfloat16, s)
                                                           for s in (5, 6)), 302)  # fmt: skip
    assert same_bits(k_out[:, :, :301].contiguous(), want[0])


def test_new_rows_for_another_batch_and_after_release():
    """Another batch size, or ``release()``, drops the resident rows: the next call gathers every token into new
    ones; views handed out before keep their memory."""
    rows, heads, dim = 400, 2, 16
    k = random_rows((1, rows, heads, dim), torch.bfloat16, 40)
    v = random_rows((1, rows, heads, dim), torch.bfloat16, 41)
    gather = ResidentHeadGather(k.unbind(0), v.unbind(0), torch.bfloat16, use_triton=True)
    table = distinct_locations(3, 50, rows, 42)
    kept = gather.store_and_gather(0, table, *(new_rows(3, heads, 20, dim, torch.bfloat16, s) for s in (1, 2)), 20)
    first = gather._rows
    snapshot = kept[0].clone()
    gather.store_and_gather(0, table[:2], *(new_rows(2, heads, 1, dim, torch.bfloat16, s) for s in (3, 4)), 21)
    assert gather._rows is not first and gather._rows.batch == 2
    assert torch.equal(kept[0], snapshot), "the old rows stay with the views that hold them"
    gather.release()
    assert gather._rows is None and gather.rows_held(0) == 0 and gather.repeat is None


def test_refused_calls_say_why_and_a_call_without_new_tokens_gathers():
    rows, heads, dim = 200, 2, 16
    k = random_rows((1, rows, heads, dim), torch.bfloat16, 45)
    v = random_rows((1, rows, heads, dim), torch.bfloat16, 46)
    gather = ResidentHeadGather(k.unbind(0), v.unbind(0), torch.bfloat16, use_triton=True)
    table = distinct_locations(2, 30, rows, 47)
    with pytest.raises(ValueError, match="k_new must be"):
        gather.store_and_gather(0, table, new_rows(2, 3, 1, dim, torch.bfloat16, 1),
                                new_rows(2, heads, 1, dim, torch.bfloat16, 2), 10)  # fmt: skip
    with pytest.raises(ValueError, match="same number of new tokens"):
        gather.store_and_gather(0, table, new_rows(2, heads, 11, dim, torch.bfloat16, 1),
                                new_rows(2, heads, 11, dim, torch.bfloat16, 2), 10)  # fmt: skip
    with pytest.raises(ValueError, match="length must be"):
        gather.store_and_gather(0, table, new_rows(2, heads, 1, dim, torch.bfloat16, 1),
                                new_rows(2, heads, 1, dim, torch.bfloat16, 2), 31)  # fmt: skip
    with pytest.raises(ValueError, match=r"locs must be \[batch, seq\]"):
        gather.store_and_gather(0, table[0], new_rows(2, heads, 1, dim, torch.bfloat16, 1),
                                new_rows(2, heads, 1, dim, torch.bfloat16, 2))  # fmt: skip
    empty = table[:0]
    k_out, v_out = gather.store_and_gather(0, empty, new_rows(0, heads, 1, dim, torch.bfloat16, 1),
                                           new_rows(0, heads, 1, dim, torch.bfloat16, 2))  # fmt: skip
    assert k_out.shape == (0, heads, 30, dim) and v_out.shape == (0, heads, 30, dim)


def test_a_forward_s_later_layers_repeat_its_first_layer_s_launch():
    """After a forward's first layer, ``repeat(k_new, v_new, layer)`` launches that call again for another layer
    with the arguments the full path passes (that layer's pool and resident rows, its new rows; no plan looked up)
    and returns views of that layer's rows (the first layer made every layer's); it declines (None) when the
    layer's rows hold fewer tokens than the launch leaves unwritten, the new rows differ in layout, or the rows were
    replaced.  ``repeat_for`` hands it out for the locations object and length it repeats only.  The direct launch
    replaced by a recorder, so that it runs on the CPU too (the kernel's own results are the test above's)."""
    layers, rows, heads, dk, dv, batch = 3, 800, 2, 16, 8, 2
    k = random_rows((layers, rows, heads, dk), torch.bfloat16, 70)
    v = random_rows((layers, rows, heads, dv), torch.bfloat16, 71)
    gather = ResidentHeadGather(k.unbind(0), v.unbind(0), torch.bfloat16, use_triton=True)
    table = distinct_locations(batch, 350, rows, 72)

    def rows_of(seed, q=1, transposed=False, dim=dk):
        return new_rows(batch, heads, q, dim, torch.bfloat16, seed, transposed)

    for layer in range(layers):  # a prefill and a decode step (their plans made)
        gather.store_and_gather(layer, table, rows_of(layer, 300), rows_of(layer + 9, 300, True, dv), 300)
        gather.store_and_gather(layer, table, rows_of(layer + 18), rows_of(layer + 27, transposed=True, dim=dv), 301)
    launched = []
    for plan in gather._store_plans.values():
        plan.entry, plan.raw_stream = (lambda *a: launched.append(a), ("HEAD",)), lambda index: 0
    gather._store_plans = plans = CountingPlans(gather._store_plans)
    at = 3 + 1 + 1  # the grid, the stream, the head: then the layer's K and V addresses and its rows'
    block = gather._block_t

    def launch(layer, new, length, full=False):
        """The launch's arguments, whether it looked its plan up, the views returned (``full``: with no repeat and
        no binding of the last launch, so the plan is looked up)."""
        if full:
            gather.repeat = gather._bound = None
        before = plans.lookups
        out = gather.store_and_gather(layer, table, *new, length)
        return list(launched.pop()), plans.lookups > before, out

    rows_before = gather._rows
    for length in (302, 303):
        new = (rows_of(10 + length), rows_of(20 + length, transposed=True, dim=dv))
        args, took_full, _ = launch(0, new, length)
        assert took_full == (length == 302), "a first layer like the last launch's binds no plan again"
        assert gather.repeat_for(table, length) is gather.repeat is not None
        assert args[0] == -(-length // block) - (length - 1) // block == 1, "the blocks from the first the rows lack"
        gather._rows.valid[0] = length - 1
        assert launch(0, new, length, full=True)[0] == args, "the full path's arguments"
        for layer in (1, 2):
            new = (rows_of(30 + layer), rows_of(40 + layer, transposed=True, dim=dv))
            out = gather.repeat(*new, layer)
            fast = list(launched.pop())
            assert fast[at : at + 4] == [*gather._addresses[layer], *gather._rows.addresses[layer]]
            assert out[0].data_ptr() == gather._rows.addresses[layer][0] and out[0].shape == (batch, heads, length, dk)
            assert out[1].data_ptr() == gather._rows.addresses[layer][1] and out[1].shape == (batch, heads, length, dv)
            views = gather._rows.all_views(length)
            assert out[0] is views[0][layer] and out[1] is views[1][layer], "the views the first layer made for all"
            gather._rows.valid[layer] = length - 1  # (as the repeat found it)
            full, took_full, again = launch(layer, new, length, full=True)
            assert took_full and full == fast, "the full path's arguments"
            assert again[0].stride() == out[0].stride() and again[0].data_ptr() == out[0].data_ptr()
    assert gather._rows is rows_before, "a decode inside the rows' room keeps them"
    repeat = gather.repeat
    new = (rows_of(60), rows_of(61, transposed=True, dim=dv))
    for declined in (
        (rows_of(62, transposed=True), new[1]),  # other strides
        (new[0].float(), new[1]),  # another dtype
        (rows_of(63, q=2), rows_of(64, q=2, dim=dv)),  # two new tokens
        (new[0], new[0]),  # one tensor for both
    ):
        assert repeat(*declined, 1) is None
    gather._rows.valid[2] = 100  # rows of layer 2 that lack tokens the launch does not write
    assert repeat(*new, 2) is None
    for other in ((table.clone(), 303), (table, 304), (table, None)):
        assert gather.repeat_for(*other) is None, "another locations object or length"
    assert not launched
    gather.release()
    assert repeat(*new, 1) is None, "the rows it writes are gone"
    assert gather.repeat_for(table, 303) is None
