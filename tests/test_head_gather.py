"""The head-major gather (kvcore.kernels.head_gather): the Triton kernel against its torch reference, bit for bit,
on random rows of token-major buffers and page-major views, odd sizes, every conversion it makes."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvcore.kernels import head_gather, launch
from kvcore.kernels.head_gather import (HeadGather, gather_heads_native, gather_heads_triton, room_for,
                                       store_and_gather_native)
from kvcore.kernels.head_gather_kernels import GATHER_ARGS, STORE_GATHER_ARGS
from kvcore.testing.tensors import test_device

DEVICE = test_device()


def random_rows(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    x[..., 0] = 1e-40  # a float32 subnormal: flushed or kept alike by both paths
    return x.to(dtype).to(DEVICE)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


CASES = [
    (torch.bfloat16, torch.bfloat16, None),
    (torch.float32, torch.float32, None),
    (torch.float16, torch.float32, None),
    (torch.bfloat16, torch.float32, None),
    (torch.float32, torch.bfloat16, None),
    (torch.float8_e4m3fn, torch.bfloat16, None),
    (torch.float8_e4m3fn, torch.bfloat16, 0.5),
    (torch.float8_e5m2, torch.float16, 2.0),
]


@pytest.mark.parametrize("src_dtype, out_dtype, scale", CASES)
@pytest.mark.parametrize("heads, dk, dv", [(2, 24, 24), (3, 16, 8)])
def test_token_rows(src_dtype, out_dtype, scale, heads, dk, dv):
    rows = 50
    k = random_rows((rows, heads, dk), src_dtype, 1)
    v = random_rows((rows, heads, dv), src_dtype, 2)
    g = torch.Generator().manual_seed(3)
    locs = torch.randint(0, rows, (3, 37), generator=g).to(DEVICE)
    locs[1, -5:] = 0  # a freed row reads the padding slot
    got = gather_heads_triton(k, v, locs, out_dtype, scale, scale)
    want = gather_heads_native(k, v, locs, out_dtype, scale, scale)
    assert got[0].is_contiguous() and got[0].shape == (3, heads, 37, dk) and got[1].shape == (3, heads, 37, dv)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])


@pytest.mark.parametrize("page", [4, 16])
def test_page_major_views_and_strided_locations(page):
    """A page-major pool's paged view (its page stride spans every layer) and locations that are a slice of a
    request table (row stride past the sequence)."""
    pages, layers, heads, dim = 9, 3, 2, 16
    kv = random_rows((pages, layers, 2, page, heads, dim), torch.bfloat16, 4)
    layer = 1
    k, v = kv[:, layer, 0], kv[:, layer, 1]  # [pages, page, heads, dim] views
    table = torch.randint(page, pages * page, (4, 40), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    locs = table[:, :29]
    got = gather_heads_triton(k, v, locs, torch.bfloat16)
    want = gather_heads_native(k, v, locs, torch.bfloat16)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])
    # the reference itself: row t of batch b, head h is the stored row
    b, t, h = 2, 11, 1
    loc = int(locs[b, t])
    assert torch.equal(got[0][b, h, t], k[loc // page, loc % page, h])


def test_empty_and_refused():
    k = random_rows((8, 2, 16), torch.bfloat16, 6)
    empty = gather_heads_triton(k, k, torch.zeros((2, 0), dtype=torch.int64, device=DEVICE), torch.bfloat16)
    assert empty[0].shape == (2, 2, 0, 16)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        gather_heads_triton(k, k, torch.zeros((1, 1), dtype=torch.int64, device=DEVICE), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="locs \\[batch, seq\\]"):
        gather_heads_triton(k, k, torch.zeros(3, dtype=torch.int64, device=DEVICE), torch.bfloat16)


# -- HeadGather: the same gather planned once for every layer of a pool ------------------------------------------


@pytest.mark.parametrize("src_dtype, out_dtype, scale", CASES)
def test_head_gather_matches_the_reference_on_every_layer(src_dtype, out_dtype, scale):
    """Each layer of stacked token rows, locations of several lengths and dtypes (one plan per kind, the lengths
    read per call), a freed row reading the padding slot."""
    layers, rows, heads, dk, dv = 3, 40, 2, 24, 8
    k = random_rows((layers, rows, heads, dk), src_dtype, 7)
    v = random_rows((layers, rows, heads, dv), src_dtype, 8)
    gather = HeadGather(k.unbind(0), v.unbind(0), out_dtype, scale, scale, use_triton=True)
    g = torch.Generator().manual_seed(9)
    for step, seq in enumerate((13, 1, 37, 14)):
        locs = torch.randint(0, rows, (3, seq), generator=g).to(DEVICE)
        locs[2, :] = 0
        if step % 2:
            locs = locs.to(torch.int32)
        for layer in range(layers):
            got = gather(layer, locs)
            want = gather_heads_native(k[layer], v[layer], locs, out_dtype, scale, scale)
            assert got[0].shape == (3, heads, seq, dk) and got[0].is_contiguous()
            assert same_bits(got[0], want[0]) and same_bits(got[1], want[1]), (step, layer)


def test_head_gather_reads_a_slice_of_a_table_and_page_major_views():
    pages, layers, page, heads, dim = 9, 2, 4, 2, 16
    kv = random_rows((pages, layers, 2, page, heads, dim), torch.bfloat16, 10)
    gather = HeadGather([kv[:, i, 0] for i in range(layers)], [kv[:, i, 1] for i in range(layers)], torch.float32,
                        use_triton=True)  # fmt: skip
    table = torch.randint(page, pages * page, (3, 40), generator=torch.Generator().manual_seed(11)).to(DEVICE)
    for length in (29, 30):
        locs = table[:, :length]  # row stride 40: read per call
        for layer in range(layers):
            got = gather(layer, locs)
            want = gather_heads_native(kv[:, layer, 0], kv[:, layer, 1], locs, torch.float32)
            assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])


def test_head_gather_native_and_refusals():
    k = random_rows((2, 8, 2, 16), torch.bfloat16, 12)
    locs = torch.tensor([[1, 2, 3]], device=DEVICE)
    native = HeadGather(k.unbind(0), k.unbind(0), torch.float32, use_triton=False)
    want = gather_heads_native(k[1], k[1], locs, torch.float32)
    assert all(same_bits(a, b) for a, b in zip(native(1, locs), want))
    gather = HeadGather(k.unbind(0), k.unbind(0), torch.bfloat16, use_triton=True)
    assert gather(0, locs[:, :0])[0].shape == (1, 2, 0, 16)
    with pytest.raises(ValueError, match="token dim packed"):
        gather(0, torch.zeros((4, 2), dtype=torch.int64, device=DEVICE).t())
    with pytest.raises(ValueError, match="int32/int64"):
        gather(0, locs.float())
    with pytest.raises(ValueError, match="laid out unlike layer 0"):
        HeadGather([k[0], k[0, :4]], [k[0], k[1]], torch.bfloat16, use_triton=True)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        HeadGather(k.unbind(0), k.unbind(0), torch.int8, use_triton=True)


# -- store_and_gather: a step's new rows stored and every row gathered, in one launch ---------------------------


def new_rows(batch, heads, q, dim, dtype, seed, transposed=False):
    """New keys/values as a model hands them over: ``[batch, heads, q, dim]`` contiguous, or (``transposed``) a
    view of a ``[batch, q, heads * dim]`` projection."""
    if transposed:
        x = random_rows((batch, q, heads * dim), dtype, seed)
        return x.view(batch, q, heads, dim).transpose(1, 2)
    return random_rows((batch, heads, q, dim), dtype, seed)


def distinct_locations(batch, seq, rows, seed):
    """``[batch, seq]`` distinct locations in ``1 .. rows - 1`` (slot 0 is padding)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(rows - 1, generator=g)[: batch * seq] + 1).view(batch, seq).to(DEVICE)


def tensor_at(address: int, dtype: torch.dtype, shape: tuple, strides: tuple) -> torch.Tensor:
    """The CPU tensor of ``shape`` / ``strides`` (in elements) whose first element is at ``address`` (no copy)."""
    import ctypes

    extent = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))
    memory = (ctypes.c_byte * (extent * dtype.itemsize)).from_address(address)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (frombuffer's note that the buffer is not read-only)
        return torch.frombuffer(memory, dtype=dtype).as_strided(shape, strides)


def direct_store_launches(monkeypatch, gather_of, locs_dtype_of) -> None:
    """Make the store-and-gather launches of the gather ``gather_of()`` returns (made after this call) direct, as an
    engine's are, so that its repeats are made and run.  Compiled: launch checks off (the compiled suite's
    ``KVCORE_LAUNCH_CHECK=1`` sends every launch through Triton's dispatcher, which leaves nothing to repeat), for
    the launchers made from now on; the kernels run for real.  On the CPU: every store plan's direct launch is this
    function's stand-in, which finds the tensors behind the launch's addresses (the layer's rows, the locations, of
    dtype ``locs_dtype_of()``, the new rows, the outputs) and does what the kernel does with them, through the torch
    reference (``store_and_gather_native``)."""
    if DEVICE == "cuda":
        monkeypatch.delenv("KVCORE_LAUNCH_CHECK", raising=False)
        monkeypatch.setattr(launch, "_LAUNCHERS", {})
        return

    def stand_in(gx, gy, gz, stream, head, kp, vp, ko, vo, lp, knp, vnp, seq, old, row_stride, out_len, first_block,
                 *suffix):  # fmt: skip
        gather = gather_of()
        layer = [k.data_ptr() for k in gather.k_layers].index(kp)
        assert gather.v_layers[layer].data_ptr() == vp and first_block == 0 and out_len == seq
        k_out, v_out = gather._spare[:2]
        assert (k_out.data_ptr(), v_out.data_ptr()) == (ko, vo) and k_out.shape == (gy, gather.heads, seq, gather.dk)
        locs = tensor_at(lp, locs_dtype_of(), (gy, seq), (row_stride, 1))
        k_new = tensor_at(knp, gather.out_dtype, (gy, gather.heads, seq - old, gather.dk), (*suffix[0:3], 1))
        v_new = tensor_at(vnp, gather.out_dtype, (gy, gather.heads, seq - old, gather.dv), (*suffix[3:6], 1))
        keys, values = store_and_gather_native(gather.k_layers[layer], gather.v_layers[layer], locs, k_new, v_new,
                                               gather.out_dtype, gather.k_scale, gather.v_scale)  # fmt: skip
        k_out.copy_(keys)
        v_out.copy_(values)

    store_plan = HeadGather._store_plan

    def direct_store_plan(self, *args):
        plan = store_plan(self, *args)
        plan.entry, plan.raw_stream = (stand_in, ("HEAD",)), lambda index: 0
        return plan

    monkeypatch.setattr(HeadGather, "_store_plan", direct_store_plan)


def matches_a_store_then_a_gather(k, v, table, steps, model_dtype, scale, call):
    """``call(step, layer, end, k_new, v_new)`` (it stores and gathers the new rows of every layer of each step of
    ``steps``, ``(rows' length after it, new tokens)``) against the torch reference on copies of the layers ``k`` /
    ``v``: the keys and values returned and the layers' rows equal the reference's, bit for bit."""
    layers, _, heads, dk = k.shape
    dv, batch = v.shape[-1], table.shape[0]
    k_ref, v_ref = k.clone(), v.clone()
    for step, (end, q) in enumerate(steps):
        for layer in range(layers):
            k_new = new_rows(batch, heads, q, dk, model_dtype, 100 * step + layer)
            v_new = new_rows(batch, heads, q, dv, model_dtype, 100 * step + layer + 50, transposed=True)
            got = call(step, layer, end, k_new, v_new)
            want = store_and_gather_native(k_ref[layer], v_ref[layer], table[:, :end], k_new, v_new, model_dtype,
                                           scale, scale)  # fmt: skip
            assert got[0].shape == (batch, heads, end, dk) and got[1].shape == (batch, heads, end, dv)
            assert same_bits(got[0].contiguous(), want[0]) and same_bits(got[1].contiguous(), want[1]), (step, layer)
            assert same_bits(k, k_ref) and same_bits(v, v_ref), (step, layer)  # the same rows stored, no others


@pytest.mark.parametrize("cache_dtype, model_dtype, scale", CASES)
def test_store_and_gather_matches_a_store_then_a_gather(cache_dtype, model_dtype, scale):
    """Every conversion: the cache and the returned keys/values equal, bit for bit, the torch reference's; prefill
    (every token new), decode (one new token) and chunks whose new tokens start inside a token block (of 32 tokens
    here: 4 heads a step, 3 of them real), after blocks of old tokens only."""
    layers, rows, heads, dk, dv, batch = 2, 1000, 3, 24, 8, 3
    k = random_rows((layers, rows, heads, dk), cache_dtype, 20)
    v = random_rows((layers, rows, heads, dv), cache_dtype, 21)
    gather = HeadGather(k.unbind(0), v.unbind(0), model_dtype, scale, scale, use_triton=True)
    table = distinct_locations(batch, 310, rows, 22)

    def call(step, layer, end, k_new, v_new):
        if layer % 2 and step != 4:  # the table's rows and a length, as a decode passes them
            return gather.store_and_gather(layer, table, k_new, v_new, end)
        locs = table[:, :end].to(torch.int32).contiguous() if step == 4 else table[:, :end]
        return gather.store_and_gather(layer, locs, k_new, v_new)

    matches_a_store_then_a_gather(k, v, table, ((37, 37), (38, 1), (170, 132), (300, 129), (301, 1)), model_dtype,
                                  scale, call)  # fmt: skip


@pytest.mark.parametrize("heads_a_step", [1, 2, 4])
@pytest.mark.parametrize("heads", [3, 4])
@pytest.mark.parametrize("cache_dtype, model_dtype, scale", [CASES[0], CASES[6]])
def test_kernels_moving_heads_a_few_at_a_time(monkeypatch, heads_a_step, heads, cache_dtype, model_dtype, scale):
    """Programs that move one head or several per step of their head loop (``_HEADS_PER_TILE``), a count that divides
    the layers' heads or not (the last step's missing heads masked): the gather and the store-and-gather match the
    torch reference bit for bit, prefill, decode and a chunk."""
    monkeypatch.setattr(head_gather, "_HEADS_PER_TILE", heads_a_step)
    monkeypatch.setattr(head_gather, "_TILE_ELEMS", 256)  # token blocks of 8, 4 or 2 tokens: several a row
    layers, rows, dk, dv, batch = 2, 200, 24, 8, 2
    k = random_rows((layers, rows, heads, dk), cache_dtype, 30)
    v = random_rows((layers, rows, heads, dv), cache_dtype, 31)
    table = distinct_locations(batch, 40, rows, 32)
    got = gather_heads_triton(k[1], v[1], table[:, :29], model_dtype, scale, scale)
    want = gather_heads_native(k[1], v[1], table[:, :29], model_dtype, scale, scale)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])
    gather = HeadGather(k.unbind(0), v.unbind(0), model_dtype, scale, scale, use_triton=True)
    for args, constexprs in ((GATHER_ARGS, gather._constexprs), (STORE_GATHER_ARGS, gather._store_constexprs)):
        assert dict(zip(args.constexpr_names, constexprs))["BLOCK_H"] == heads_a_step
    assert gather._block_t == 256 // (32 * heads_a_step)

    def call(step, layer, end, k_new, v_new):
        return gather.store_and_gather(layer, table, k_new, v_new, end)

    matches_a_store_then_a_gather(k, v, table, ((13, 13), (14, 1), (33, 19)), model_dtype, scale, call)


@pytest.mark.parametrize("page", [4, 16])
def test_store_and_gather_into_page_major_views(page):
    """A page-major pool's views (K and V of a page interleaved, the page stride spanning every layer), an fp8 cache
    with scales, locations sliced from a request table."""
    pages, layers, heads, dim, batch = 24, 2, 2, 16, 2
    kv = random_rows((pages, layers, 2, page, heads, dim), torch.float8_e4m3fn, 23)
    ref = kv.clone()
    gather = HeadGather([kv[:, i, 0] for i in range(layers)], [kv[:, i, 1] for i in range(layers)], torch.bfloat16,
                        0.5, 2.0, use_triton=True)  # fmt: skip
    table = torch.randperm(pages * page - page, generator=torch.Generator().manual_seed(24))[: batch * 40] + page
    table = table.view(batch, 40).to(DEVICE)
    for end, q in ((29, 29), (30, 1), (31, 1)):
        for layer in range(layers):
            k_new = new_rows(batch, heads, q, dim, torch.bfloat16, end + layer)
            v_new = new_rows(batch, heads, q, dim, torch.bfloat16, end + layer + 7, transposed=True)
            got = gather.store_and_gather(layer, table[:, :end], k_new, v_new)
            want = store_and_gather_native(ref[:, layer, 0], ref[:, layer, 1], table[:, :end], k_new, v_new,
                                           torch.bfloat16, 0.5, 2.0)  # fmt: skip
            assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])
            assert same_bits(kv, ref)


class CountingPlans(dict):
    """A plan memo that counts its lookups (the full path looks a call's plan up; a call like the last does not)."""

    lookups = 0

    def get(self, *args):
        self.lookups += 1
        return super().get(*args)


@pytest.mark.parametrize("reuse", [False, True])
def test_a_call_like_the_last_launches_what_the_full_path_launches(reuse):
    """``store_and_gather`` launches a call that differs from the last direct launch only in its layer and new rows
    (the same locations object, shapes, strides, dtypes, alignment), or in the length of the same rows of locations
    (another view of them: a decode's next step), without looking its plan up, with the same arguments the full
    path passes (the outputs' addresses aside: fresh or reused tensors); anything else goes the full way.  The
    direct launch replaced by a recorder, so that it runs on the CPU too."""
    layers, rows, heads, dk, dv, batch = 3, 200, 2, 16, 8, 2
    k = random_rows((layers, rows, heads, dk), torch.float8_e4m3fn, 50)
    v = random_rows((layers, rows, heads, dv), torch.float8_e4m3fn, 51)
    gather = HeadGather(k.unbind(0), v.unbind(0), torch.bfloat16, 0.5, 2.0, use_triton=True, reuse_outputs=reuse)
    table = distinct_locations(batch, 30, rows, 52)
    locs = table[:, :21]

    def rows_of(seed, transposed=False, dim=dk):
        return new_rows(batch, heads, 1, dim, torch.bfloat16, seed, transposed)

    for keys_transposed in (False, True):  # the plans made
        gather.store_and_gather(0, locs, rows_of(1, keys_transposed), rows_of(2, True, dv))
    launched = []
    for plan in gather._store_plans.values():
        plan.entry, plan.raw_stream = (lambda *a: launched.append(a), ("HEAD",)), lambda index: 7
    gather._store_plans = plans = CountingPlans(gather._store_plans)

    def launch(layer, new, full, at_locs=locs, length=None):
        """The arguments of layer ``layer``'s launch storing ``new`` (keys, values), and whether it took the full
        path."""
        if full:
            gather._last_launch = gather.repeat = None
        before = plans.lookups
        out = gather.store_and_gather(layer, at_locs, *new, length)
        args = list(launched.pop())
        at = 3 + 1 + 1 + 2  # the grid, the stream, the head, the layer's K and V addresses
        assert args[at : at + 2] == [out[0].data_ptr(), out[1].data_ptr()]
        args[at : at + 2] = ["k_out", "v_out"]
        return args, plans.lookups > before

    launch(0, (rows_of(10), rows_of(11, True, dv)), full=True)
    for layer in (1, 2, 0):
        new = (rows_of(20 + layer), rows_of(30 + layer, True, dv))
        fast, took_full = launch(layer, new, full=False)
        assert not took_full, "a call like the last takes the short way"
        assert fast == launch(layer, new, full=True)[0]
    # the same rows of locations at another length (a decode's next step): the short way, the full way's arguments
    for width in (22, 20):
        longer = table[:, :width]
        new = (rows_of(50 + width), rows_of(60 + width, True, dv))
        fast, took_full = launch(0, new, full=False, at_locs=longer)
        assert not took_full, "the same rows at another length take the short way"
        assert fast == launch(0, new, full=True, at_locs=longer)[0]
        assert not launch(1, new, full=False, at_locs=longer)[1]
    # the table's rows each step, with a length: the short way too, from the first layer of each length on
    for length in (23, 24, 19):
        new = (rows_of(70 + length), rows_of(80 + length, True, dv))
        fast, took_full = launch(0, new, full=False, at_locs=table, length=length)
        assert not took_full, "the same rows object at another length takes the short way"
        assert fast == launch(0, new, full=True, at_locs=table, length=length)[0]
        assert fast == launch(0, new, full=True, at_locs=table[:, :length])[0], "a length reads what a view does"
        assert not launch(2, new, full=False, at_locs=table, length=length)[1]
    # another locations object or other strides: the full way (then the short way for calls like it)
    assert launch(1, (rows_of(40), rows_of(41, True, dv)), full=False, at_locs=locs.clone())[1]
    assert launch(1, (rows_of(40), rows_of(41, True, dv)), full=False)[1]
    assert launch(2, (rows_of(42, True), rows_of(43, True, dv)), full=False)[1]
    assert not launch(0, (rows_of(44, True), rows_of(45, True, dv)), full=False)[1]


def test_a_forward_s_later_layers_repeat_its_first_layer_s_launch():
    """After a forward's first layer (the same rows of locations at a new length), ``repeat(k_new, v_new, layer)``
    launches that call again for another layer and its new rows, with the arguments the full path passes (no plan
    looked up), into the same spare outputs; it declines (None, and ``store_and_gather`` goes its own way) when the
    outputs are still held or the new rows differ in shape, strides or dtype.  ``repeat_for`` hands it out only for
    the locations object and length it repeats; a launch at another length replaces it, ``release`` drops it.  The
    direct launch replaced by a recorder, so that it runs on the CPU too."""
    layers, rows, heads, dk, dv, batch = 3, 200, 2, 16, 8, 2
    k = random_rows((layers, rows, heads, dk), torch.bfloat16, 70)
    v = random_rows((layers, rows, heads, dv), torch.bfloat16, 71)
    gather = HeadGather(k.unbind(0), v.unbind(0), torch.bfloat16, use_triton=True, reuse_outputs=True)
    table = distinct_locations(batch, 40, rows, 72)

    def rows_of(seed, transposed=False, dim=dk, dtype=torch.bfloat16):
        return new_rows(batch, heads, 1, dim, dtype, seed, transposed)

    gather.store_and_gather(0, table, rows_of(1), rows_of(2, True, dv), 20)  # the plan made
    gather.store_and_gather(0, table, rows_of(5, True), rows_of(6, True, dv), 20)  # and one of keys laid out otherwise
    launched = []
    for plan in gather._store_plans.values():  # (stream 0: what the outputs note of the CPU's)
        plan.entry, plan.raw_stream = (lambda *a: launched.append(a), ("HEAD",)), lambda index: 0
    gather._store_plans = plans = CountingPlans(gather._store_plans)
    at = 3 + 1 + 1 + 2  # the grid, the stream, the head, the layer's K and V addresses: then the outputs'

    def launch(layer, new, length, full=False, locs=table):
        """The launch's arguments (the outputs' addresses as names), whether it looked its plan up, the outputs."""
        if full:
            gather._last_launch = gather.repeat = None
        before = plans.lookups
        out = gather.store_and_gather(layer, locs, *new, length)
        args = list(launched.pop())
        assert args[at : at + 2] == [out[0].data_ptr(), out[1].data_ptr()]
        args[at : at + 2] = ["k_out", "v_out"]
        return args, plans.lookups > before, out

    launch(0, (rows_of(3), rows_of(4, True, dv)), 20)  # (a direct launch to repeat)
    for length in (21, 22):  # a decode's first layer: the same rows at one more token
        assert not launch(0, (rows_of(10 + length), rows_of(20 + length, True, dv)), length)[1]
        assert gather.repeat is not None, "a forward's first layer leaves a repeat for the others"
        kept = None
        for layer in (1, 2):
            new = (rows_of(30 + layer), rows_of(40 + layer, True, dv))
            assert gather.repeat_for(table, length) is gather.repeat
            assert gather.repeat(*new, layer) is not None
            args = list(launched.pop())
            args[at : at + 2] = ["k_out", "v_out"]
            assert args == launch(layer, new, length, full=True)[0], "the full path's arguments"
            assert not launch(0, (rows_of(50), rows_of(51, True, dv)), length - 1)[1]  # (back at the step's start)
            assert not launch(0, (rows_of(52), rows_of(53, True, dv)), length)[1]
            fast, took_full, out = launch(layer, new, length)
            assert not took_full and fast == args
            if kept is not None:
                assert (id(out[0]), id(out[1])) == kept, "a repeat writes the spare pair again"
            kept = id(out[0]), id(out[1])
            del out
        new = (rows_of(60), rows_of(61, True, dv))
        held = gather.repeat(*new, 1)
        launched.pop()
        assert gather.repeat(*new, 2) is None, "the outputs are held"
        fast, took_full, out = launch(2, new, length)
        assert (id(out[0]), id(out[1])) != (id(held[0]), id(held[1])), "a held pair is not written again"
        del held, out
        assert gather.repeat is None, "a new spare pair: no repeat of the launches into the last"
        launch(0, (rows_of(62), rows_of(63, True, dv)), length, full=True)
        repeat = gather.repeat
        assert repeat is not None, "the full path's direct launch leaves one too"
        for declined in (
            (rows_of(64, True), rows_of(65, True, dv)),  # other strides
            (rows_of(66, dtype=torch.float16), rows_of(67, True, dv)),  # another dtype
            (new_rows(batch, heads, 2, dk, torch.bfloat16, 68), new[1]),  # two new tokens
            (new[0], new_rows(batch - 1, heads, 1, dv, torch.bfloat16, 69)),  # a row fewer
            (new[0], new[0]),  # one tensor for both (keys' width: not the values')
        ):
            assert repeat(*declined, 1) is None
        for other in ((table.clone(), length), (table, length + 1), (table, float(length)), (table, None)):
            assert gather.repeat_for(*other) is None, "another locations object or length"
        assert gather.repeat_for(table, length) is repeat
        assert not launched
        del repeat  # (a repeat holds the spare tuple it writes: a stale one would keep the pair from being reused)
    # a first layer at another length whose new rows the last launch does not take: the full path launches, and its
    # repeat (for that length) replaces the last one
    launch(0, (rows_of(70, True), rows_of(71, True, dv)), 23)
    assert gather.repeat_for(table, 22) is None and gather.repeat_for(table, 23) is gather.repeat is not None
    assert gather.repeat(rows_of(72, True), rows_of(73, True, dv), 1) is not None
    launched.pop()
    assert gather.repeat(rows_of(74), rows_of(75, True, dv), 1) is None, "the rows of the launch it repeats"
    gather.release()
    assert gather.repeat is None and gather.repeat_for(table, 23) is None


@pytest.mark.parametrize("resident", [False, True], ids=["reused_outputs", "resident_rows"])
def test_a_repeat_that_follows_the_layers_serves_as_a_cache_s_update(resident):
    """After ``follow_layers(lengths, otherwise)`` a repeat is called as transformers calls ``Cache.update``
    (``k_new, v_new, layer``, then arguments it ignores): it launches for a layer whose length is the launch's first
    new token and sets it to the launch's length; a call it declines (the layer stored at this length already, new
    rows laid out otherwise) goes to ``otherwise(k_new, v_new, layer)``, whose result it returns, the length left
    as it was.  Both gathers (reused outputs, resident rows); the direct launch replaced by a recorder."""
    from kvcore.kernels.resident_gather import ResidentHeadGather

    layers, rows, heads, dk, dv, batch = 3, 400, 2, 16, 8, 2
    k = random_rows((layers, rows, heads, dk), torch.bfloat16, 80)
    v = random_rows((layers, rows, heads, dv), torch.bfloat16, 81)
    if resident:
        gather = ResidentHeadGather(k.unbind(0), v.unbind(0), torch.bfloat16, use_triton=True)
    else:
        gather = HeadGather(k.unbind(0), v.unbind(0), torch.bfloat16, use_triton=True, reuse_outputs=True)
    lengths, declined = [0] * layers, []
    gather.follow_layers(lengths, lambda k_new, v_new, layer: declined.append(layer) or "otherwise")
    table = distinct_locations(batch, 40, rows, 82)

    def rows_of(seed, q=1, transposed=False, dim=dk):
        return new_rows(batch, heads, q, dim, torch.bfloat16, seed, transposed)

    for layer in range(layers):  # a prompt and a decode step: their plans made
        gather.store_and_gather(layer, table, rows_of(layer, 20), rows_of(layer + 9, 20, True, dv), 20)
        gather.store_and_gather(layer, table, rows_of(layer + 18), rows_of(layer + 27, 1, True, dv), 21)
    launched = []
    for plan in gather._store_plans.values():  # (stream 0: what the outputs note of the CPU's)
        plan.entry, plan.raw_stream = (lambda *a: launched.append(a), ("HEAD",)), lambda index: 0
    new = (rows_of(30), rows_of(31, transposed=True, dim=dv))
    gather.store_and_gather(0, table, *new, 22)  # a decode step's first layer
    launched.clear()
    repeat = gather.repeat_for(table, 22)
    assert repeat is not None
    lengths[:] = [22, 21, 21]
    out = repeat(*new, 1, {"cache_kwargs": None})
    assert out != "otherwise" and out[0].shape == (batch, heads, 22, dk) and len(launched) == 1
    assert lengths == [22, 22, 21] and not declined
    del out  # (reused outputs: held, the next repeat would decline)
    assert repeat(*new, 1) == "otherwise", "layer 1 is stored at this length already"
    assert repeat(rows_of(32, transposed=True), new[1], 2) == "otherwise", "keys laid out otherwise"
    assert declined == [1, 2] and lengths == [22, 22, 21] and len(launched) == 1
    assert repeat(*new, 2) != "otherwise" and lengths == [22, 22, 22] and len(launched) == 2


@pytest.mark.parametrize("bound", ["reach", "width", "room", "pages"])
def test_a_repeat_with_a_reach_takes_the_next_forwards_first_layer(bound):
    """``follow_layers(lengths, otherwise, reach)``: a repeat of a launch read to a length also takes the next
    forward's first layer (layer 0, once every layer holds the launch's length), with the arguments the full path
    passes at one token more, into the same outputs resized, and from then on repeats the launch at that length; it
    declines layer 0 while the last layer has not stored the length, while the outputs are held, and past the first
    of the reach, the locations' width and the outputs' room.  A first layer past the reach asks ``reach(want)`` to
    extend it first (``pages``: a reach that takes pages of 8 tokens as the rows pass their last; the others' reach
    stays where it is).  The direct launch replaced by a recorder; a gather that follows nothing, over the same rows,
    gives the full path's arguments."""
    layers, rows, heads, dk, dv, batch = 3, 400, 2, 16, 8, 2
    k = random_rows((layers, rows, heads, dk), torch.bfloat16, 90)
    v = random_rows((layers, rows, heads, dv), torch.bfloat16, 91)
    room = room_for(20)  # (the prompt's outputs, 20 tokens a row, are made with room for more)
    width, held, limit = {"reach": (room + 10, 27, 27), "width": (30, 200, 30), "room": (room + 10, 200, room),
                          "pages": (room + 10, 24, room)}[bound]  # fmt: skip
    asked = []

    def reach(want=0):
        nonlocal held
        asked.append(want)
        if bound == "pages" and want > held:
            held = -(-want // 8) * 8
        return held

    table = distinct_locations(batch, width, rows, 92)
    lengths, declined = [0] * layers, []
    followed = HeadGather(k.unbind(0), v.unbind(0), torch.bfloat16, use_triton=True, reuse_outputs=True)
    followed.follow_layers(lengths, lambda k_new, v_new, layer: declined.append((layer, lengths[layer])), reach)
    plain = HeadGather(k.unbind(0), v.unbind(0), torch.bfloat16, use_triton=True, reuse_outputs=True)

    def new_of(end, layer, q=1):
        return (new_rows(batch, heads, q, dk, torch.bfloat16, 10 * end + layer),
                new_rows(batch, heads, q, dv, torch.bfloat16, 10 * end + layer + 5, True))  # fmt: skip

    for gather in (followed, plain):  # a prompt and a decode step: their plans made
        for layer in range(layers):
            gather.store_and_gather(layer, table, *new_of(20, layer, 20), 20)
            gather.store_and_gather(layer, table, *new_of(21, layer), 21)
    launched = []
    for gather in (followed, plain):  # (stream 0: what the outputs note of the CPU's)
        for plan in gather._store_plans.values():
            plan.entry, plan.raw_stream = (lambda *a: launched.append(a), ("HEAD",)), lambda index: 0
        gather._last_launch = gather.repeat = None  # (compiled, the plans' direct launches: the next from the plan)
    asked.clear()  # (compiled, the repeats the plans' first launches made)
    at = 3 + 1 + 1 + 2  # the grid, the stream, the head, the layer's K and V addresses: then the outputs'

    def args_of(out):
        """The last launch's arguments, the outputs' addresses as names."""
        args = list(launched.pop())
        assert args[at : at + 2] == [out[0].data_ptr(), out[1].data_ptr()] and not launched
        args[at : at + 2] = ["k_out", "v_out"]
        return args

    lengths[:] = [21] * layers
    out = followed.store_and_gather(0, table, *new_of(22, 0), 22)  # a decode step's first layer, the full way
    lengths[0] = 22
    del out
    launched.clear()
    repeat = followed.repeat
    assert repeat is not None
    for end in range(22, limit + 1):
        for layer in range(layers) if end > 22 else (1, 2):
            new = new_of(end, layer)
            out = repeat(*new, layer)
            assert out is not None and not declined, (end, layer)
            assert out[0].shape == (batch, heads, end, dk) and out[1].shape == (batch, heads, end, dv)
            assert lengths[layer] == end
            got = args_of(out)
            if layer == 0:
                assert repeat(*new_of(end + 1, 0), 0) is None and declined == [(0, end)], "the last layer is behind"
                declined.clear()
            del out
            want = plain.store_and_gather(layer, table, *new, end)
            assert got == args_of(want), f"the full path's launch at length {end}, layer {layer}"
            del want
        if end == 24:  # the last layer's keys kept: the next first layer is not launched into them
            kept = followed._spare[0]
            assert repeat(*new_of(end + 1, 0), 0) is None and declined == [(0, end)] and not launched
            declined.clear()
            del kept
    assert repeat(*new_of(limit + 1, 0), 0) is None, f"past the {bound}"
    assert declined == [(0, limit)] and lengths == [limit] * layers and not launched
    # read when the repeat was made, then asked to extend at each first layer past it (within the width and room)
    extended = {"reach": [28], "width": [], "room": [], "pages": list(range(25, limit + 1, 8))}[bound]
    assert asked == [0, *extended], "reach(want) asked once a first layer passes the reach"


def test_decode_steps_through_the_repeat_match_a_store_then_a_gather(monkeypatch):
    """A cache's decode on one gather: every layer goes to the repeat when there is one (``gather.repeat``), else
    the full way; the keys and values returned and the rows stored equal the torch reference's, bit for bit, step
    after step.  The repeat takes every later layer and every first layer but those past what a repeat may take (the
    reach, the outputs' room: the first decode step, and then the full way's), once every launch signature has been
    launched (an engine past its first steps).  The reach is extended a page of 8 at a time as the rows pass it, up to
    ``pages`` tokens.  Compiled for real; on the CPU with the launches made direct (:func:`direct_store_launches`)."""
    layers, rows, heads, dk, dv, batch, pages = 2, 500, 2, 16, 8, 2, 88
    k = random_rows((layers, rows, heads, dk), torch.bfloat16, 93)
    v = random_rows((layers, rows, heads, dv), torch.bfloat16, 94)
    k_ref, v_ref = k.clone(), v.clone()
    direct_store_launches(monkeypatch, lambda: gather, lambda: table.dtype)
    gather = HeadGather(k.unbind(0), v.unbind(0), torch.bfloat16, use_triton=True, reuse_outputs=True)
    table = distinct_locations(batch, 100, rows, 95)
    lengths, own_way, held = [0] * layers, [], 0

    def otherwise(k_new, v_new, layer):
        end = lengths[layer] = lengths[layer] + k_new.shape[2]
        own_way.append((layer, end))
        return gather.store_and_gather(layer, table, k_new, v_new, end)

    def reach(want=0):
        nonlocal held
        if held < want <= pages:
            held = -(-want // 8) * 8
        return held

    gather.follow_layers(lengths, otherwise, reach)
    ends = range(20, 100)
    for _ in range(2):  # (the first time, each launch signature's first launch goes through Triton's dispatcher)
        gather.release()
        lengths[:], own_way[:], held = [0] * layers, [], 24
        for end in ends:  # a prompt of 20 tokens, then a token a step
            q = 20 if end == 20 else 1
            for layer in range(layers):
                k_new = new_rows(batch, heads, q, dk, torch.bfloat16, 7 * end + layer)
                v_new = new_rows(batch, heads, q, dv, torch.bfloat16, 7 * end + layer + 3, transposed=True)
                got = (gather.repeat or otherwise)(k_new, v_new, layer)
                want = store_and_gather_native(k_ref[layer], v_ref[layer], table[:, :end], k_new, v_new,
                                               torch.bfloat16)  # fmt: skip
                assert same_bits(got[0], want[0]) and same_bits(got[1], want[1]), (end, layer)
                assert same_bits(k, k_ref) and same_bits(v, v_ref), (end, layer)
                assert lengths[layer] == end
                del got  # (what attention does before the next layer: the outputs may be written again)
    # the prompt's first layer, the first decode step's, the outputs outgrown, past the pages
    outgrown = room_for(20) + 1
    assert outgrown < pages
    assert own_way == [(0, end) for end in (20, 21, outgrown, *range(pages + 1, ends[-1] + 1))]


@pytest.mark.parametrize("use_triton", [False, True])
def test_store_and_gather_refuses_a_length_outside_the_locations(use_triton):
    """``length`` counts a row's first tokens: more than the locations hold, a negative count or a non-int is
    refused with what it must be, on both paths, before anything is stored."""
    k = random_rows((1, 100, 2, 16), torch.bfloat16, 60)
    v = random_rows((1, 100, 2, 8), torch.bfloat16, 61)
    before = k.clone(), v.clone()
    gather = HeadGather(k.unbind(0), v.unbind(0), torch.bfloat16, use_triton=use_triton)
    table = distinct_locations(2, 20, 100, 62)
    k_new, v_new = new_rows(2, 2, 1, 16, torch.bfloat16, 63), new_rows(2, 2, 1, 8, torch.bfloat16, 64)
    gather.store_and_gather(0, table, k_new, v_new, 12)  # (a launch to be like: the short way checks too)
    stored = k.clone(), v.clone()
    assert not (same_bits(stored[0], before[0]) and same_bits(stored[1], before[1]))
    for length in (21, -1, 12.0, True):
        with pytest.raises(ValueError, match=r"length must be an int in 0\.\.20"):
            gather.store_and_gather(0, table, k_new, v_new, length)
        assert same_bits(k, stored[0]) and same_bits(v, stored[1])


MODES = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("store", [False, True])
def test_reused_outputs_are_only_those_nothing_holds(mode, store):
    """``reuse_outputs``: a call writes into the pair a call before returned only once nothing holds it (no
    reference, no view, no detached alias) and the shapes agree; a pair still held keeps its values, and every call
    returns what the torch reference does.  Gathers and store-and-gathers, in grad, no_grad and inference mode."""
    layers, rows, heads, dk, dv, batch = 2, 300, 2, 16, 8, 2
    k = random_rows((layers, rows, heads, dk), torch.bfloat16, 40)
    v = random_rows((layers, rows, heads, dv), torch.bfloat16, 41)
    k_ref, v_ref = k.clone(), v.clone()
    gather = HeadGather(k.unbind(0), v.unbind(0), torch.bfloat16, use_triton=True, reuse_outputs=True)
    table = distinct_locations(batch, 120, rows, 42)
    calls = iter(range(1000))

    def call(layer, end):
        """The layer's keys and values of tokens 0 .. end - 1 (token end - 1 stored first when ``store``),
        checked against the reference."""
        locs = table[:, :end]
        if not store:
            got, want = gather(layer, locs), gather_heads_native(k_ref[layer], v_ref[layer], locs, torch.bfloat16)
        else:
            seed = 100 * next(calls)
            k_new = new_rows(batch, heads, 1, dk, torch.bfloat16, seed)
            v_new = new_rows(batch, heads, 1, dv, torch.bfloat16, seed + 1, transposed=True)
            got = gather.store_and_gather(layer, locs, k_new, v_new)
            want = store_and_gather_native(k_ref[layer], v_ref[layer], locs, k_new, v_new, torch.bfloat16)
        assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])
        return got

    def ids(pair):
        return id(pair[0]), id(pair[1])

    with MODES[mode]():
        end = 40
        kept = ids(call(0, end))  # dropped at once
        pair = call(1, end)
        assert ids(pair) == kept, "a pair nothing holds is written again"
        held, was = pair[0], pair[0].clone()
        del pair
        pair = call(0, end)
        assert id(pair[0]) != id(held) and same_bits(held, was), "a pair held by a reference is left alone"
        del held
        for which, alias in ((1, lambda x: x.transpose(2, 3)), (1, lambda x: x[:, :1]), (1, lambda x: x.detach()),
                             (0, lambda x: x[:, :1])):  # fmt: skip
            other, kept = alias(pair[which]), ids(pair)
            was = other.clone()
            del pair
            pair = call(1, end)
            assert ids(pair) != kept and same_bits(other.contiguous(), was.contiguous()), \
                "a pair whose memory a view or alias holds too"
            del other
        kept = ids(pair)
        del pair
        assert ids(call(0, end)) == kept
        assert ids(call(1, end + 1)) == kept, "a decode's next step: the pair resized in place (room_for)"
        assert ids(call(0, end - 9)) == kept, "fewer tokens: resized too"
        assert ids(call(1, room_for(end) + 1)) != kept, "more tokens than the pair's memory holds: a new pair"


def test_reused_outputs_made_in_inference_mode_are_not_resized_outside_it():
    """torch refuses to resize an inference-mode tensor outside inference mode: a call of another length there gets
    a new pair (and the right values), no error."""
    k = random_rows((2, 100, 2, 16), torch.bfloat16, 45)
    v = random_rows((2, 100, 2, 8), torch.bfloat16, 46)
    gather = HeadGather(k.unbind(0), v.unbind(0), torch.bfloat16, use_triton=True, reuse_outputs=True)
    locs = distinct_locations(2, 40, 100, 47)
    with torch.inference_mode():
        first = gather(0, locs[:, :30])
    assert first[0].is_inference()
    kept = id(first[0])
    del first
    with torch.no_grad():
        got = gather(1, locs[:, :31])
    want = gather_heads_native(k[1], v[1], locs[:, :31], torch.bfloat16)
    assert id(got[0]) != kept and not got[0].is_inference()
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA streams: the compiled suite runs it on the GPU")
def test_reused_outputs_stay_on_their_stream():
    """A pair last written on one stream is not written again from another (whose work is not ordered after the
    reads of the first): that call gets a new pair, and the stream's own next call reuses it."""
    k = random_rows((2, 100, 2, 16), torch.bfloat16, 43)
    gather = HeadGather(k.unbind(0), k.unbind(0), torch.bfloat16, use_triton=True, reuse_outputs=True)
    locs = distinct_locations(2, 30, 100, 44)
    first = gather(0, locs)
    kept = id(first[0])
    del first
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pair = gather(1, locs)
        assert id(pair[0]) != kept, "another stream: a new pair"
        kept = id(pair[0])
        del pair
        pair = gather(1, locs)
        assert id(pair[0]) == kept, "the same stream again: reused"
    torch.cuda.current_stream().wait_stream(side)
    assert same_bits(pair[0], gather_heads_native(k[1], k[1], locs, torch.bfloat16)[0])


def test_store_and_gather_native_stores_what_the_mha_pool_stores():
    """The reference's store is the K/V pool's: the MHA pool's ``set_kv_buffer`` (fp8 with scales, and bf16 into
    float32) writes the same bytes."""
    from kvcore_mha.pool import MHATokenToKVPool

    for cache_dtype, model_dtype, scale in ((torch.float8_e4m3fn, torch.bfloat16, 0.37), (torch.float32, torch.bfloat16, None),
                                            (torch.bfloat16, torch.float32, None)):  # fmt: skip
        pool = MHATokenToKVPool(64, 1, cache_dtype, 2, 16, 1, str(DEVICE), False, kernels="native")
        locs = distinct_locations(2, 5, 64, 25)
        k_new = new_rows(2, 2, 3, 16, model_dtype, 26)
        v_new = new_rows(2, 2, 3, 16, model_dtype, 27, transposed=True)
        pool.set_kv_buffer(0, locs[:, 2:].reshape(-1), k_new.transpose(1, 2).reshape(-1, 2, 16),
                           v_new.transpose(1, 2).reshape(-1, 2, 16), scale, scale)  # fmt: skip
        k, v = torch.zeros_like(pool.get_key_buffer(0)), torch.zeros_like(pool.get_value_buffer(0))
        store_and_gather_native(k, v, locs, k_new, v_new, model_dtype, scale, scale)
        assert same_bits(k, pool.get_key_buffer(0)) and same_bits(v, pool.get_value_buffer(0)), cache_dtype


def test_store_and_gather_refusals_and_edges():
    k = random_rows((2, 40, 2, 16), torch.bfloat16, 28)
    gather = HeadGather(k.unbind(0), k.unbind(0), torch.bfloat16, use_triton=True)
    locs = distinct_locations(2, 6, 40, 29)
    fresh = new_rows(2, 2, 2, 16, torch.bfloat16, 30)
    assert gather.store_and_gather(0, locs[:, :0], fresh[:, :, :0], fresh[:, :, :0])[0].shape == (2, 2, 0, 16)
    with pytest.raises(ValueError, match="at most the 1"):
        gather.store_and_gather(0, locs[:, :1], fresh, fresh)
    with pytest.raises(ValueError, match="must be torch.bfloat16"):
        gather.store_and_gather(0, locs, fresh.float(), fresh.float())
    with pytest.raises(ValueError, match=r"\[batch, heads, q, dim\]"):
        gather.store_and_gather(0, locs, fresh[:1], fresh[:1])
    with pytest.raises(ValueError, match="head dim packed"):
        gather.store_and_gather(0, locs, random_rows((2, 2, 16, 2), torch.bfloat16, 31).transpose(2, 3), fresh)
    native = HeadGather(k.clone().unbind(0), k.clone().unbind(0), torch.bfloat16, use_triton=False)
    got, want = gather.store_and_gather(1, locs, fresh, fresh), native.store_and_gather(1, locs, fresh, fresh)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])
