"""Call plans of the block-scaled pools (:mod:`kvcore.kernels.launch`): each call signature is checked and planned once,
and later calls of it, with new data, other layers, rows and addresses, store the torch reference's bytes and
read its values; a call that a check refuses is refused with the same error whatever was planned before it; a
strided view after a contiguous call of the same shape is another signature, planned on its own.  Interpreted
on the CPU; compiled on CUDA with KVCORE_TEST_COMPILED=1."""

from __future__ import annotations

import math
import re

import pytest
import torch

from kvcore.testing.tensors import bits_equal, test_device
from kvcore_fp4 import kernels
from kvcore_fp4.pool import MHATokenToKVPoolFP4, MLATokenToKVPoolFP4

DEVICE = test_device()
HEADS, DK, DV = 2, 64, 32  # whole blocks of every format (16 values, 32 for MXFP8)
RANK, ROPE = 64, 32


def mha_pools(kv_format: str) -> tuple[MHATokenToKVPoolFP4, MHATokenToKVPoolFP4]:
    """The Triton pool and its torch reference."""
    args = dict(size=24, page_size=4, dtype=torch.bfloat16, head_num=HEADS, head_dim=DK, v_head_dim=DV, layer_num=2,
                device=DEVICE, enable_memory_saver=False, kv_format=kv_format)  # fmt: skip
    return MHATokenToKVPoolFP4(kernels="triton", **args), MHATokenToKVPoolFP4(kernels="native", **args)


def mla_pools(kv_format: str) -> tuple[MLATokenToKVPoolFP4, MLATokenToKVPoolFP4]:
    args = dict(size=24, page_size=4, dtype=torch.bfloat16, kv_lora_rank=RANK, qk_rope_head_dim=ROPE, layer_num=2,
                device=DEVICE, enable_memory_saver=False, kv_format=kv_format)  # fmt: skip
    return MLATokenToKVPoolFP4(kernels="triton", **args), MLATokenToKVPoolFP4(kernels="native", **args)


def values(seed: int, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 3).to(dtype).to(DEVICE)


def same_buffers(fast, ref) -> bool:
    return all(bits_equal(buf, ref.buffers()[name]) for name, buf in fast.buffers().items())


def same_reads(got, want) -> bool:
    return len(got) == len(want) and all(bits_equal(g, w) for g, w in zip(got, want))


class RecordingLauncher:
    """Stands in for a pool's :class:`kvcore.kernels.launch.Launcher`: records each launch's key, arguments and the
    tensors behind its pointer arguments, then launches through the real one.  ``direct`` False: plans never
    launch around it."""

    direct = False

    def __init__(self, launcher):
        self.launcher, self.launches, self.args = launcher, [], launcher.args  # (its binding: plans check against it)
        self._stream, self._device_index = launcher._stream, launcher._device_index

    def __call__(self, key, grid_x, grid_y, args, tensors=(), num_warps=4, grid_z=1):
        tensors = tuple(tensors() if callable(tensors) else tensors)
        self.launches.append((key, list(args), tensors))
        self.launcher(key, grid_x, grid_y, args, tensors, num_warps, grid_z)

    @property
    def keys(self) -> list:
        return [key for key, _, _ in self.launches]


def recording(pool) -> RecordingLauncher:
    """Record ``pool``'s launches from now on (before its first call: plans keep the launcher they were made with)."""
    assert not pool._rows._plans
    recorder = pool._rows.launch = RecordingLauncher(pool._rows.launch)
    return recorder


def launches_describe_their_tensors(recorder: RecordingLauncher) -> bool:
    """Whether every recorded launch passed the addresses, strides and row count of the tensors behind it (loc,
    k, v: the last three), and its key names their strides and alignments (a key is ``(gather, k dtype, v dtype,
    k strides, v strides, k alignment, v alignment, loc dtype, loc alignment, ...)``): a plan kept past its
    signature would launch another call's tensors with its own strides, or under its own key."""
    at = {name: i for i, name in enumerate(kernels._rows_kernel.arg_names)}
    assert recorder.launches
    for key, args, tensors in recorder.launches:
        loc, k, v = tensors[-3:]
        passed = (args[at["loc_ptr"]], args[at["loc_stride"]], args[at["n_tokens"]], args[at["k_ptr"]],
                  tuple(args[at["k_sn"] : at["k_sd"] + 1]), args[at["v_ptr"]], tuple(args[at["v_sn"] : at["v_sd"] + 1]))
        behind = (loc.data_ptr(), loc.stride(0), loc.numel(), k.data_ptr(), k.stride(), v.data_ptr(), v.stride())
        named = (k.stride(), v.stride(), k.data_ptr() & 15, v.data_ptr() & 15, loc.data_ptr() & 15)
        if passed != behind or (key[3], key[4], key[5], key[6], key[8]) != named:
            return False
    return True


# -- repeated calls of one signature ------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_format", ["nvfp4", "fp4_e2m1", "mxfp8"])
def test_repeated_calls_of_one_signature_store_and_read_the_references(kv_format):
    """Three rounds of the same signatures (store, allocating read, read into ``out``) with new values, other
    rows and another layer: no new plan after the first round, and every round the reference's bytes and
    values; nvfp4's global scale, changed before the last round, is read by each launch, not planned."""
    fast, ref = mha_pools(kv_format)
    plans = fast._rows._plans
    rounds = [(0, [5, 9, 2]), (1, [7, 3, 20]), (0, [11, 6, 14])]
    for i, (layer, rows) in enumerate(rounds):
        if i == 2 and fast.global_scale is not None:
            for pool in (fast, ref):
                pool.set_kv_global_scale(0, 0.25, 4.0)
        loc = torch.tensor(rows, device=DEVICE)
        k, v = values(10 + i, 3, HEADS, DK), values(20 + i, 3, HEADS, DV)
        for pool in (fast, ref):
            pool.set_kv_buffer(layer, loc, k, v)
        assert same_buffers(fast, ref)
        want = ref.get_kv_buffer_by_loc(layer, loc)
        assert same_reads(fast.get_kv_buffer_by_loc(layer, loc), want)
        out = (torch.full_like(want[0], 7.0), torch.full_like(want[1], 7.0))
        got = fast.get_kv_buffer_by_loc(layer, loc, out=out)
        assert got[0] is out[0] and got[1] is out[1] and same_reads(got, want)
        if i == 0:
            planned = dict(plans)
    assert plans == planned and len(planned) >= 3  # the store's, the allocating read's, the gather's


@pytest.mark.parametrize("kv_format", ["nvfp4", "mxfp8"])
def test_repeated_latent_calls_store_and_read_the_references(kv_format):
    """The MLA pool's planned paths: parts, whole rows (``[N, 1, W]`` and ``[N, W]``), allocating reads and reads
    into ``out``, each signature twice with new values, rows and layers."""
    fast, ref = mla_pools(kv_format)
    plans = fast._rows._plans
    for i, (layer, rows) in enumerate([(1, [3, 17, 8, 21]), (0, [4, 9, 12, 1])]):
        loc = torch.tensor(rows, device=DEVICE)
        nope, rope = values(30 + i, 4, 1, RANK), values(40 + i, 4, 1, ROPE)
        for pool in (fast, ref):
            pool.set_mla_kv_buffer(layer, loc, nope, rope)
        assert same_buffers(fast, ref)
        latent = values(50 + i, 4, 1, RANK + ROPE)
        flat = values(60 + i, 4, RANK + ROPE, dtype=torch.float32)
        for pool in (fast, ref):
            pool.set_kv_buffer(layer, loc, latent, None)
        assert same_buffers(fast, ref)
        want = ref.get_mla_kv_buffer(layer, loc)
        assert same_reads(fast.get_mla_kv_buffer(layer, loc), want)
        for pool in (fast, ref):
            pool.set_kv_buffer(layer, loc.flip(0), flat, None)
        assert same_buffers(fast, ref)
        want = ref.get_mla_kv_buffer(layer, loc, torch.float32)
        out = (torch.zeros_like(want[0]), torch.zeros_like(want[1]))
        assert fast.get_mla_kv_buffer(layer, loc, out=out) is out and same_reads(out, want)
        if i == 0:
            planned = dict(plans)
    assert plans == planned


class OneValueOff:
    """Stands in for the kept empty tensor a pool makes its new outputs from (:func:`kvcore.pools.empty_of`): makes
    them one value past a 16-byte-aligned address."""

    def __init__(self, empty: torch.Tensor):
        self.empty = empty

    def new_empty_strided(self, size, stride) -> torch.Tensor:
        return self.empty.new_empty((math.prod(size) + 8,))[1:].as_strided(size, stride)


def test_a_read_into_new_outputs_less_aligned_than_plans_take_them_is_launched_for_their_alignment():
    """An allocating read's plan takes its new outputs 16-byte aligned and checks it each call: outputs that are
    not (here made so) are read by a launch whose key names their alignment, and still hold the reference's
    values; the aligned calls around them keep their plan."""
    fast, ref = mha_pools("nvfp4")
    recorder = recording(fast)
    loc = torch.tensor([6, 13, 2], device=DEVICE)
    for pool in (fast, ref):
        pool.set_kv_buffer(1, loc, values(1, 3, HEADS, DK), values(2, 3, HEADS, DV))
    want = ref.get_kv_buffer_by_loc(1, loc)
    reads = [fast.get_kv_buffer_by_loc(1, loc)]
    empties = fast._rows._empties
    aligned = empties[torch.bfloat16]
    empties[torch.bfloat16] = OneValueOff(aligned)
    reads.append(fast.get_kv_buffer_by_loc(1, loc))
    empties[torch.bfloat16] = aligned
    reads.append(fast.get_kv_buffer_by_loc(1, loc))
    assert all(same_reads(got, want) for got in reads)
    assert [(out[0].data_ptr() & 15, out[1].data_ptr() & 15) for out in reads] == [(0, 0), (2, 2), (0, 0)]
    gathers = [key for key in recorder.keys if key[0]]
    assert [(key[5], key[6]) for key in gathers] == [(0, 0), (2, 2), (0, 0)]  # the launch keys' alignments
    assert launches_describe_their_tensors(recorder)


# -- refused calls -------------------------------------------------------------------------------------------------


def _refusal(call) -> str:
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


def _refused_alike(make_pool, good, bad, match: str) -> None:
    """``bad`` raises the same ValueError (matching ``match``) on a new pool, after ``good`` on another, and
    again."""
    fresh = _refusal(lambda: bad(make_pool()))
    pool = make_pool()
    good(pool)
    after = [_refusal(lambda: bad(pool)) for _ in range(2)]
    assert after == [fresh, fresh] and re.search(match, fresh), (fresh, after)


LOC = [5, 9, 2]


def _mha():
    return mha_pools("nvfp4")[0]


def _mla():
    return mla_pools("fp4_e2m1")[0]


def _loc():
    return torch.tensor(LOC, device=DEVICE)


def _k(dtype=torch.bfloat16):
    return torch.ones(3, HEADS, DK, dtype=dtype, device=DEVICE)


def _v(dtype=torch.bfloat16, width=DV):
    return torch.ones(3, HEADS, width, dtype=dtype, device=DEVICE)


def _outs(dtype=torch.bfloat16, v_dtype=None, v_rows=3):
    return (torch.empty(3, HEADS, DK, dtype=dtype, device=DEVICE),
            torch.empty(v_rows, HEADS, DV, dtype=v_dtype or dtype, device=DEVICE))  # fmt: skip


_V_SHAPE = (3, HEADS, DV)
MHA_REFUSALS = {
    "store: integer rows": (lambda p: p.set_kv_buffer(0, _loc(), _k(), _v()),
                            lambda p: p.set_kv_buffer(0, _loc(), _k(torch.int32), _v(torch.int32)),
                            "must be float32/float16/bfloat16 to be quantized"),
    "store: V of another width": (lambda p: p.set_kv_buffer(0, _loc(), _k(), _v()),
                                  lambda p: p.set_kv_buffer(0, _loc(), _k(), _v(width=2 * DV)),
                                  re.escape("cache_v must be [N, H, D]")),
    "store: float locations": (lambda p: p.set_kv_buffer(0, _loc(), _k(), _v()),
                               lambda p: p.set_kv_buffer(0, _loc().float(), _k(), _v()),
                               "loc must be an int32/int64 tensor"),
    "read: out of another shape": (lambda p: p.get_kv_buffer_by_loc(0, _loc(), out=_outs()),
                                   lambda p: p.get_kv_buffer_by_loc(0, _loc(), out=_outs(v_rows=2)),
                                   re.escape(f"get_kv_buffer_by_loc: out[1] must be a tensor of shape {_V_SHAPE}")),
    "read: out of two dtypes": (lambda p: p.get_kv_buffer_by_loc(0, _loc(), out=_outs()),
                                lambda p: p.get_kv_buffer_by_loc(0, _loc(), out=_outs(v_dtype=torch.float16)),
                                "get_kv_buffer_by_loc: out tensors must share one dtype"),
    "read: out of an integer dtype": (lambda p: p.get_kv_buffer_by_loc(0, _loc(), out=_outs()),
                                      lambda p: p.get_kv_buffer_by_loc(0, _loc(), out=_outs(torch.int16)),
                                      "outputs must share a float32/float16/bfloat16 dtype"),
    "read: an integer dst_dtype": (lambda p: p.get_kv_buffer_by_loc(0, _loc()),
                                   lambda p: p.get_kv_buffer_by_loc(0, _loc(), torch.int8),
                                   "outputs must share a float32/float16/bfloat16 dtype"),
    "read: out that is not two tensors": (lambda p: p.get_kv_buffer_by_loc(0, _loc(), out=_outs()),
                                          lambda p: p.get_kv_buffer_by_loc(0, _loc(), out=(_outs()[0], None)),
                                          re.escape("get_kv_buffer_by_loc: out[1] must be a tensor")),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(MHA_REFUSALS))
def test_a_refused_call_is_refused_alike_after_a_good_one(case):
    good, bad, match = MHA_REFUSALS[case]
    _refused_alike(_mha, good, bad, match)


def _latent(width=RANK + ROPE, dtype=torch.bfloat16):
    return torch.ones(3, 1, width, dtype=dtype, device=DEVICE)


MLA_REFUSALS = {
    "parts: float64": (lambda p: p.set_mla_kv_buffer(0, _loc(), _latent(RANK), _latent(ROPE)),
                       lambda p: p.set_mla_kv_buffer(0, _loc(), _latent(RANK, torch.float64), _latent(ROPE)),
                       "must be float32/float16/bfloat16 to be quantized"),
    "rows: too wide": (lambda p: p.set_kv_buffer(0, _loc(), _latent(), None),
                       lambda p: p.set_kv_buffer(0, _loc(), _latent(RANK + 2 * ROPE), None),
                       re.escape(f"cache_k_rope must be [N, 1, {ROPE}]")),
    "rows: float64": (lambda p: p.set_kv_buffer(0, _loc(), _latent(), None),
                      lambda p: p.set_kv_buffer(0, _loc(), _latent(dtype=torch.float64), None),
                      "must be float32/float16/bfloat16 to be quantized"),
    "read: out of another shape": (lambda p: p.get_mla_kv_buffer(0, _loc(), out=(_latent(RANK), _latent(ROPE))),
                                   lambda p: p.get_mla_kv_buffer(0, _loc(), out=(_latent(RANK), _latent(RANK))),
                                   re.escape(f"get_mla_kv_buffer: out[1] must be a tensor of shape {(3, 1, ROPE)}")),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(MLA_REFUSALS))
def test_a_refused_latent_call_is_refused_alike_after_a_good_one(case):
    good, bad, match = MLA_REFUSALS[case]
    _refused_alike(_mla, good, bad, match)


def test_a_layer_out_of_range_is_refused_by_the_rows_after_a_planned_call():
    """The layer is read per call, never planned: the kernels' own range check refuses one past the pool's."""
    pool = _mha()
    pool._rows.store(1, _loc(), _k(), _v())
    with pytest.raises(ValueError, match="layer 2 out of range for 2 layers"):
        pool._rows.store(2, _loc(), _k(), _v())
    with pytest.raises(ValueError, match="layer -1 out of range"):
        pool._rows.gather(-1, _loc(), *_outs())


# -- strided views after contiguous calls --------------------------------------------------------------------------


def _views(wide: torch.Tensor, form: str, dk: int, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as views of ``wide`` ``[N, heads, > 2 (dk + dv)]``: value pairs aligned, starting at an odd value,
    or every other value."""
    if form == "pairs":
        return wide[..., :dk], wide[..., dk + 2 : dk + 2 + dv]
    if form == "odd start":
        return wide[..., 1 : dk + 1], wide[..., dk + 3 : dk + 3 + dv]
    return wide[..., : 2 * dk : 2], wide[..., 2 * dk : 2 * (dk + dv) : 2]


@pytest.mark.parametrize("form", ["pairs", "odd start", "every other value"])
@pytest.mark.parametrize("kv_format", ["nvfp4", "mxfp8"])
def test_strided_views_after_contiguous_calls_store_and_read_the_references(kv_format, form):
    """A contiguous store and read of ``N`` rows, then the same shapes as strided views (inputs and outputs; then
    every other value of a longer location tensor): each is another signature with its own plan, stores the
    reference's bytes, reads its values, and launches under a key naming its strides and alignments."""
    fast, ref = mha_pools(kv_format)
    recorder = recording(fast)
    loc = torch.tensor([5, 9, 2, 14], device=DEVICE)
    for pool in (fast, ref):
        pool.set_kv_buffer(0, loc, values(1, 4, HEADS, DK), values(2, 4, HEADS, DV))
    want = ref.get_kv_buffer_by_loc(0, loc)
    assert same_reads(fast.get_kv_buffer_by_loc(0, loc, out=(torch.empty_like(want[0]), torch.empty_like(want[1]))),
                      want)  # fmt: skip
    k, v = _views(values(3, 4, HEADS, 2 * (DK + DV) + 4), form, DK, DV)
    assert not (k.is_contiguous() or v.is_contiguous())
    for pool in (fast, ref):
        pool.set_kv_buffer(0, loc, k, v)
    assert same_buffers(fast, ref)
    want = ref.get_kv_buffer_by_loc(0, loc)
    out = _views(torch.full((4, HEADS, 2 * (DK + DV) + 4), 7.0, dtype=torch.bfloat16, device=DEVICE), form, DK, DV)
    assert fast.get_kv_buffer_by_loc(0, loc, out=out) is out and same_reads(out, want)
    strided_loc = torch.stack((loc, loc.flip(0)), dim=1).flatten()[::2]
    assert strided_loc.stride() == (2,) and torch.equal(strided_loc, loc)
    for pool in (fast, ref):
        pool.set_kv_buffer(0, strided_loc, values(4, 4, HEADS, DK), values(5, 4, HEADS, DV))
    assert same_buffers(fast, ref)
    assert same_reads(fast.get_kv_buffer_by_loc(0, strided_loc), ref.get_kv_buffer_by_loc(0, loc))
    assert len(recorder.keys) == 6 and launches_describe_their_tensors(recorder)


def _moved(t: torch.Tensor, values_off: int) -> torch.Tensor:
    """``t``'s values in a tensor of its shape and contiguous strides at ``values_off`` values past an aligned
    address."""
    base = torch.zeros(t.numel() + values_off, dtype=t.dtype, device=t.device)
    return base[values_off:].view(t.shape).copy_(t)


def _spread(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as every other value of a wider tensor: its shape and alignment, other strides."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    return wide[..., ::2].copy_(t)


#: one property of one tensor changed, everything else as the planned call had it
ONE_CHANGE = {
    "loc's address": (lambda x: _moved(x, 1), 0),
    "loc's stride": (_spread, 0),
    "k's address": (lambda x: _moved(x, 1), 1),
    "k's strides": (_spread, 1),
    "v's address": (lambda x: _moved(x, 1), 2),
    "v's strides": (_spread, 2),
}  # fmt: skip


@pytest.mark.parametrize("change", sorted(ONE_CHANGE))
def test_a_call_unlike_a_planned_one_in_one_property_alone_is_planned_for_it(change):
    """After a planned store and read, the same call with one tensor's address alignment or strides changed
    (locations; K and V, or the outputs): another signature, launched under a key naming the call's own strides
    and alignments, storing the reference's bytes and reading its values."""
    how, which = ONE_CHANGE[change]
    fast, ref = mha_pools("nvfp4")
    recorder = recording(fast)
    loc = torch.tensor([5, 9, 2], device=DEVICE)
    for i in range(2):
        call = [loc, values(10 + i, 3, HEADS, DK), values(20 + i, 3, HEADS, DV)]
        out = [loc, torch.zeros(3, HEADS, DK, device=DEVICE), torch.zeros(3, HEADS, DV, device=DEVICE)]
        if i:
            call[which], out[which] = how(call[which]), how(out[which])
        for pool in (fast, ref):
            pool.set_kv_buffer(1, *call)
        assert same_buffers(fast, ref)
        want = ref.get_kv_buffer_by_loc(1, loc, torch.float32)
        got = fast.get_kv_buffer_by_loc(1, out[0], out=tuple(out[1:]))
        assert same_reads(got, want)
    assert len(recorder.launches) == 4 and launches_describe_their_tensors(recorder)


def test_strided_latent_rows_after_contiguous_ones_store_the_references():
    """Whole latent rows stored contiguous, then one value past an aligned address, as a view of a wider
    projection (at an odd value), as every other value, as ``[N, W]`` rows with a row stride, and in a shape only
    the general path takes (``[N, 2, W / 2]``): the reference's bytes each time, each launched under a key
    naming its strides and alignments."""
    fast, ref = mla_pools("nvfp4")
    recorder = recording(fast)
    loc = torch.tensor([3, 17, 8], device=DEVICE)
    width = RANK + ROPE
    forms = [
        values(1, 3, 1, width),
        _moved(values(6, 3, 1, width), 1),
        values(2, 3, 1, width + 40)[..., 3 : 3 + width],
        values(3, 3, 1, 2 * width)[..., ::2],
        values(4, 3, 2 * width)[:, :width],
        values(5, 3, 2, width // 2),
    ]
    for i, rows in enumerate(forms):
        for pool in (fast, ref):
            pool.set_kv_buffer(1, loc, rows, None)
        assert same_buffers(fast, ref), i
    want = ref.get_mla_kv_buffer(1, loc, torch.float32)
    wide = torch.zeros(3, 1, 2 * width, dtype=torch.float32, device=DEVICE)
    out = (wide[..., 1 : RANK + 1], wide[..., RANK + 3 : RANK + 3 + ROPE])
    assert fast.get_mla_kv_buffer(1, loc, out=out) is out and same_reads(out, want)
    assert len(recorder.keys) == len(forms) + 1 and launches_describe_their_tensors(recorder)
