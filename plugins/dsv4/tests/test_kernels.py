"""Bit-exact tests of DeepSeek-V4's store kernels against their torch references, and of the references against
the format (:mod:`kvcore_dsv4.quantize`), computed independently here.

On a CPU-only machine the Triton kernels run in Triton's interpreter (``-p kvcore.testing`` sets
TRITON_INTERPRET=1).  With KVCORE_TEST_COMPILED=1 on a GPU machine the same tests run the compiled kernels on CUDA
tensors.  Buffers start as random bytes, so every byte a store must not touch (other slots, the scale rows'
padding byte, skipped slots) is checked too.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvcore.kernels import launch
from kvcore.testing.tensors import bits_equal, compiled, poison, randn_nonzero, skip_module_without_device, test_device
from kvcore_dsv4 import kernels
from kvcore_dsv4.quantize import (
    DATA_BYTES,
    NOPE,
    NUM_TILES,
    ROPE,
    SCALE_BYTES,
    SCALE_FLOOR,
    TILE,
    dequantize_latent,
    index_page_bytes,
    latent_page_bytes,
    quantize_index,
    quantize_latent,
    read_index,
    read_latent,
    store_index_native,
    store_latent_native,
)

skip_module_without_device()
COMPILED, DEVICE = compiled(), test_device()

PS, PAGES = 64, 4  # slots per page, pages per buffer (256 slots)
LATENT, DIM = NOPE + ROPE, 128
F8 = torch.float8_e4m3fn


def _e4m3_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.float().to(F8).view(torch.uint8)


def _special_latents(x: torch.Tensor) -> torch.Tensor:
    """float32 ``[n, 512]`` with hard tiles written into its first tokens: an all-zero tile, signed zeros, one huge
    value among small ones, all-negative values, float32 subnormals, values below the 1e-8 floor, a tile whose
    amax is exactly 448 and one whose amax is 1."""
    n = x.shape[0]
    rows = [
        {0: 0.0, 1: "huge", 2: "negative", 3: "subnormal", 4: "below_floor", 5: "448", 6: "one"},
        {0: "signed_zeros", 1: "subnormal_mixed", 3: "huge", 6: 0.0},
        {2: "below_floor", 5: "one"},
    ]
    for i, tiles in enumerate(rows[:n]):
        for t, kind in tiles.items():
            tile = x[i, t * TILE : (t + 1) * TILE]
            if kind == 0.0:
                tile.zero_()
            elif kind == "signed_zeros":
                tile.copy_(torch.tensor([0.0, -0.0]).repeat(TILE // 2))
            elif kind == "huge":
                tile.mul_(0.01)
                tile[7] = 3.0e4
            elif kind == "negative":
                tile.copy_(-tile.abs())
            elif kind == "subnormal":
                tile.copy_(tile.sign() * 1e-39)
            elif kind == "subnormal_mixed":
                tile[::2] = tile[::2].sign() * 3e-40
            elif kind == "below_floor":
                tile.mul_(1e-10)
            elif kind == "448":
                tile.copy_(tile / tile.abs().max() * 400)
                tile[11] = -448.0
            elif kind == "one":
                tile.copy_(tile / tile.abs().max() * 0.9)
                tile[3] = 1.0
    return x


def _latents(n: int, dtype: torch.dtype, gen: torch.Generator, layout: str = "contiguous") -> torch.Tensor:
    """``[n, 512]`` latents of ``dtype`` (tiles of magnitudes 1e-3 .. 1e3, hard tiles in the first tokens) in the
    asked memory layout: contiguous, a strided view of a wider projection, ``[n, 1, 512]``, or transposed."""
    mags = torch.tensor([1e-3, 1.0, 30.0, 1e3, 0.1, 5.0, 2.0e-5, 1.0]).repeat_interleave(TILE)
    x = _special_latents(randn_nonzero((n, LATENT), torch.float32, gen, 3.0, device="cpu") * mags)
    if layout == "strided":
        wide = randn_nonzero((n, LATENT + 88), torch.float32, gen, device="cpu")
        wide[:, 17 : 17 + LATENT] = x
        return wide.to(dtype).to(DEVICE)[:, 17 : 17 + LATENT]
    if layout == "3d":
        return x.to(dtype).to(DEVICE).unsqueeze(1)
    if layout == "transposed":
        return x.t().contiguous().to(dtype).to(DEVICE).t()
    return x.to(dtype).to(DEVICE)


def _keys(n: int, dtype: torch.dtype, gen: torch.Generator, layout: str = "contiguous") -> torch.Tensor:
    mags = torch.exp2(torch.randint(-12, 12, (n, 1), generator=gen).float())
    x = randn_nonzero((n, DIM), torch.float32, gen, 3.0, device="cpu") * mags
    if n > 0:
        x[0] = 0.0  # the zero guard
    if n > 1:
        x[1] = x[1] / x[1].abs().max() * 448  # scale exactly 1
    if n > 2:
        x[2, ::3] = 1e-39  # subnormals among normal values
    if layout == "strided":
        wide = randn_nonzero((n, 3 * DIM), torch.float32, gen, device="cpu")
        wide[:, DIM : 2 * DIM] = x
        return wide.to(dtype).to(DEVICE)[:, DIM : 2 * DIM]
    return x.to(dtype).to(DEVICE)


def _locations(n: int, slots: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """``n`` distinct slots of ``slots``, every fifth one negative (skipped; int32's most negative among them)."""
    loc = torch.randperm(slots, generator=gen)[:n].to(torch.int64)
    skipped = torch.arange(n) % 5 == 2
    loc[skipped] = -1 - torch.arange(int(skipped.sum())) * 7
    if n > 7:
        loc[7] = -(2**31)
    return loc.to(dtype).to(DEVICE)


# ==========================================================================================================
# independent expectations: the bytes a store must leave, computed token by token from the format
# ==========================================================================================================


def _expected_latent_buffer(before, loc, x, page_size):
    """``before`` with each kept token's data row and the 7 scale bytes written at the byte offsets the format
    gives (by hand, per token), the scale rows' padding byte untouched."""
    want = before.clone().cpu()
    codes, rope, scales = (t.cpu() for t in quantize_latent(x.reshape(x.shape[0], LATENT)))
    page_bytes = want.shape[1]
    flat = want.view(-1)
    for i, slot in enumerate(loc.tolist()):
        if slot < 0:
            continue
        page, s = divmod(slot, page_size)
        data = page * page_bytes + s * 576
        flat[data : data + 448] = codes[i]
        flat[data + 448 : data + 576] = rope[i]
        scale = page * page_bytes + page_size * 576 + s * 8
        flat[scale : scale + 7] = scales[i]
    return want.to(before.device)


def _expected_index_buffer(before, loc, x, page_size):
    want = before.clone().cpu()
    codes, scale = (t.cpu() for t in quantize_index(x.reshape(x.shape[0], DIM)))
    page_bytes = want.shape[1]
    flat = want.view(-1)
    for i, slot in enumerate(loc.tolist()):
        if slot < 0:
            continue
        page, s = divmod(slot, page_size)
        flat[page * page_bytes + s * DIM : page * page_bytes + (s + 1) * DIM] = codes[i]
        start = page * page_bytes + page_size * DIM + s * 4
        flat[start : start + 4] = scale[i : i + 1].view(torch.uint8)
    return want.to(before.device)


def _ue8m0_by_hand(tile: np.ndarray) -> int:
    """The scale byte of one tile, in numpy float32 and Python floats: ceil(log2(max(amax, 1e-8) / 448)) + 127."""
    amax = np.float32(np.abs(tile.astype(np.float32)).max())
    s = np.float32(max(amax, np.float32(1e-8))) / np.float32(448.0)
    assert s.dtype == np.float32
    return math.ceil(math.log2(float(s))) + 127


# ==========================================================================================================
# latent rows
# ==========================================================================================================


@pytest.mark.parametrize("n", [1, 3, 17, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_latent_store_is_byte_identical_to_the_reference_and_the_format(n, dtype, loc_dtype):
    gen = torch.Generator().manual_seed(1000 * n + (dtype == torch.float32) * 10 + (loc_dtype == torch.int32))
    layout = ["contiguous", "strided", "3d", "transposed"][n % 4]
    x = _latents(n, dtype, gen, layout)
    x_before = x.clone()
    buf = poison((PAGES, latent_page_bytes(PS)), torch.uint8, gen)
    loc = _locations(n, PAGES * PS, loc_dtype, gen)
    got, ref = buf.clone(), buf.clone()
    kernels.store_latent_triton(got, loc, x, PS)
    store_latent_native(ref, loc, x, PS)
    assert bits_equal(got, ref), f"{(got != ref).sum().item()} bytes differ"
    assert bits_equal(ref, _expected_latent_buffer(buf, loc, x, PS))
    assert bits_equal(x, x_before)  # the input is not modified
    # the padding byte of every scale row is untouched
    scale_rows = got[:, PS * DATA_BYTES : PS * DATA_BYTES + PS * SCALE_BYTES].reshape(PAGES, PS, SCALE_BYTES)
    pads = buf[:, PS * DATA_BYTES : PS * DATA_BYTES + PS * SCALE_BYTES].reshape(PAGES, PS, SCALE_BYTES)
    assert bits_equal(scale_rows[..., 7], pads[..., 7])


def test_latent_reference_follows_the_formula_by_hand():
    """Each scale byte is ceil(log2(max(amax, 1e-8) / 448)) + 127 computed in numpy / Python; each code is
    e4m3fn(x * 2**-e); the rope bytes are the bf16 input bytes; and two tiles by hand: amax 448 -> e = 0, byte 127,
    codes = e4m3fn(x); amax 1 -> e = ceil(log2(1/448)) = -8, byte 119, codes = e4m3fn(256 x)."""
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32):
        x = _latents(5, dtype, gen)
        codes, rope, scales = (t.cpu() for t in quantize_latent(x))
        xf = x.float().cpu()
        for i in range(5):
            for t in range(NUM_TILES):
                tile = xf[i, t * TILE : (t + 1) * TILE]
                byte = _ue8m0_by_hand(tile.numpy())
                assert scales[i, t].item() == byte, (i, t)
                q = tile * 2.0 ** (127 - byte)  # exact in float32 (checked against float64)
                assert torch.equal(q.double(), tile.double() * 2.0 ** (127 - byte))
                assert bits_equal(codes[i, t * TILE : (t + 1) * TILE], _e4m3_bytes(q))
        assert bits_equal(rope, x[:, NOPE:].to(torch.bfloat16).cpu().contiguous().view(torch.uint8))
        # token 0, tile 5: amax exactly 448; tile 6: amax exactly 1; tile 0: zeros (floor: s = fl(1e-8) / 448)
        assert scales[0, 5].item() == 127
        assert bits_equal(codes[0, 5 * TILE : 6 * TILE], _e4m3_bytes(xf[0, 5 * TILE : 6 * TILE]))
        assert scales[0, 6].item() == 119 and math.ceil(math.log2(1 / 448)) == -8
        assert bits_equal(codes[0, 6 * TILE : 7 * TILE], _e4m3_bytes(xf[0, 6 * TILE : 7 * TILE] * 256))
        assert scales[0, 0].item() == 127 + math.ceil(math.log2(float(np.float32(SCALE_FLOOR) / np.float32(448)))) == 92
        assert codes[0, :TILE].eq(0).all() and codes[1, :TILE].tolist() == [0, 0x80] * (TILE // 2)
        assert codes[0, 3 * TILE : 4 * TILE].eq(0).sum() + codes[0, 3 * TILE : 4 * TILE].eq(0x80).sum() == TILE


@pytest.mark.parametrize("k", [-30, -9, -1, 0, 1, 7, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_ue8m0_exponent_at_and_next_to_powers_of_two(k, dtype):
    """amax = 448 * 2**k gives s = 2**k exactly, so e = k; the next representable amax above gives s just above
    2**k, so e = k + 1; the one below, e = k.  Through the kernel and the reference, read from the buffer."""
    at = torch.tensor(448.0 * 2.0**k, dtype=dtype)
    above = torch.nextafter(at, torch.tensor(math.inf, dtype=dtype)) if dtype == torch.float32 else \
        (at.view(torch.int16) + 1).view(torch.bfloat16)  # fmt: skip
    below = torch.nextafter(at, torch.tensor(0.0, dtype=dtype)) if dtype == torch.float32 else \
        (at.view(torch.int16) - 1).view(torch.bfloat16)  # fmt: skip
    gen = torch.Generator().manual_seed(50 + k)
    x = (torch.rand(3, LATENT, generator=gen) * 0.5 * 2.0**k * 448).to(dtype)
    for i, amax in enumerate((at, above, below)):
        x[i, 64 * 2 + 9] = -amax  # tile 2
    want = [127 + k, 128 + k, 127 + k]
    for i, amax in enumerate((at, above, below)):
        s = np.float32(amax.float().item()) / np.float32(448.0)
        assert math.ceil(math.log2(float(s))) + 127 == want[i]
    x = x.to(DEVICE)
    loc = torch.tensor([5, 64, 130], device=DEVICE)
    for store in (kernels.store_latent_triton, store_latent_native):
        buf = poison((PAGES, latent_page_bytes(PS)), torch.uint8, gen)
        store(buf, loc, x, PS)
        for i, slot in enumerate(loc.tolist()):
            page, s = divmod(slot, PS)
            assert buf[page, PS * DATA_BYTES + s * SCALE_BYTES + 2].item() == want[i], (store.__name__, i)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "f32", "f16"])
def test_latent_round_trip(dtype):
    """Every nope value reads back within half an e4m3 step of x * 2**-e (the multiply is exact):
    |x' - x| <= max(2**-4 |x|, 2**-10 2**e); relative RMS error < 0.07 (about 0.03 for normal data); the rope
    reads back as its bf16 rounding, exactly."""
    gen = torch.Generator().manual_seed(7)
    n = 100
    x = _latents(n, dtype, gen, "strided")
    buf = poison((PAGES, latent_page_bytes(PS)), torch.uint8, gen)
    loc = torch.randperm(PAGES * PS, generator=gen)[:n].to(DEVICE)
    kernels.store_latent_triton(buf, loc, x, PS)
    back = read_latent(buf, loc, PS).cpu().double()
    xf = x.float().cpu().double()
    codes, rope, scales = quantize_latent(x)
    assert bits_equal(back.float(), dequantize_latent(codes, rope, scales).cpu())
    e = scales.cpu().double().sub(127).repeat_interleave(TILE, dim=1)
    err = (back[:, :NOPE] - xf[:, :NOPE]).abs()
    bound = torch.maximum(2.0**-4 * xf[:, :NOPE].abs(), 2.0**-10 * torch.exp2(e))
    assert (err <= bound).all(), f"{(err > bound).sum().item()} values past the e4m3 bound"
    rel_rms = (err.pow(2).mean() / xf[:, :NOPE].pow(2).mean()).sqrt().item()
    assert rel_rms < 0.07, rel_rms
    assert bits_equal(back[:, NOPE:].float(), x[:, NOPE:].to(torch.bfloat16).float().cpu())
    # a negative slot reads as zeros
    assert read_latent(buf, torch.tensor([-1, int(loc[0])], device=DEVICE), PS)[0].eq(0).all()


@pytest.mark.parametrize("page_size, pages", [(256, 2), (2, 40)])
def test_latent_store_other_page_sizes(page_size, pages):
    """SGLang's window page (256 slots) and a ratio-128 compressed page (2 slots: 1728 bytes, mostly padding)."""
    gen = torch.Generator().manual_seed(page_size)
    n = 9
    x = _latents(n, torch.bfloat16, gen)
    buf = poison((pages, latent_page_bytes(page_size)), torch.uint8, gen)
    loc = _locations(n, pages * page_size, torch.int64, gen)
    got, ref = buf.clone(), buf.clone()
    kernels.store_latent_triton(got, loc, x, page_size)
    store_latent_native(ref, loc, x, page_size)
    assert bits_equal(got, ref)
    assert bits_equal(ref, _expected_latent_buffer(buf, loc, x, page_size))
    assert latent_page_bytes(256) == 149760 and latent_page_bytes(2) == 1728 and latent_page_bytes(64) == 37440


# ==========================================================================================================
# indexer keys
# ==========================================================================================================


@pytest.mark.parametrize("n", [1, 3, 17, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "f32", "f16"])
def test_index_store_is_byte_identical_to_the_reference_and_the_format(n, dtype):
    gen = torch.Generator().manual_seed(n + 7)
    x = _keys(n, dtype, gen, "strided" if n % 2 else "contiguous")
    buf = poison((PAGES, index_page_bytes(PS)), torch.uint8, gen)
    loc = _locations(n, PAGES * PS, torch.int32 if n % 2 else torch.int64, gen)
    got, ref = buf.clone(), buf.clone()
    kernels.store_index_triton(got, loc, x, PS)
    store_index_native(ref, loc, x, PS)
    assert bits_equal(got, ref), f"{(got != ref).sum().item()} bytes differ"
    assert bits_equal(ref, _expected_index_buffer(buf, loc, x, PS))


def test_index_reference_follows_the_formula_by_hand():
    gen = torch.Generator().manual_seed(4)
    x = _keys(6, torch.float32, gen).cpu()
    codes, scale = quantize_index(x)
    for i in range(6):
        row = x[i].numpy()
        s = np.float32(max(np.float32(np.abs(row).max()), np.float32(1e-8))) / np.float32(448.0)
        inv = np.float32(1.0) / s
        q = np.clip(row * inv, np.float32(-448), np.float32(448))
        assert q.dtype == np.float32 and scale[i].item() == s
        assert bits_equal(codes[i], _e4m3_bytes(torch.from_numpy(q)))
    assert scale[1].item() == 1.0 and bits_equal(codes[1], _e4m3_bytes(x[1]))  # amax 448: scale 1, codes e4m3(x)
    assert scale[0].item() == np.float32(SCALE_FLOOR) / np.float32(448.0) and codes[0].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_index_round_trip(dtype):
    """|x' - x| <= max(2**-4 |x|, 2**-10 s) (1 + 2**-20) + 2**-20 amax (e4m3's half step, and the roundings of the
    reciprocal, the product and the dequantization); relative RMS error < 0.07."""
    gen = torch.Generator().manual_seed(8)
    n = 60
    x = _keys(n, dtype, gen)
    buf = poison((PAGES, index_page_bytes(PS)), torch.uint8, gen)
    loc = torch.randperm(PAGES * PS, generator=gen)[:n].to(DEVICE)
    kernels.store_index_triton(buf, loc, x, PS)
    back = read_index(buf, loc, PS).cpu().double()
    xf = x.float().cpu().double()
    _, scale = quantize_index(x)
    s = scale.cpu().double().unsqueeze(1)
    amax = xf.abs().amax(dim=1, keepdim=True)
    bound = torch.maximum(2.0**-4 * xf.abs(), 2.0**-10 * s) * (1 + 2.0**-20) + 2.0**-20 * amax
    err = (back - xf).abs()
    assert (err <= bound).all(), f"{(err > bound).sum().item()} values past the bound"
    assert (err.pow(2).sum(1) / xf.pow(2).sum(1).clamp(min=1e-300)).sqrt()[1:].max().item() < 0.07
    assert read_index(buf, torch.tensor([-3], device=DEVICE), PS).eq(0).all()


# ==========================================================================================================
# calls: plans, empty calls, refusals
# ==========================================================================================================


def test_layers_of_one_stack_share_a_plan_and_each_call_writes_its_own_buffer():
    gen = torch.Generator().manual_seed(12)
    stacked = poison((3, PAGES, latent_page_bytes(PS)), torch.uint8, gen)
    want = stacked.clone()
    store = kernels.LatentStore()
    for layer, n in ((0, 5), (2, 7), (1, 6), (2, 8)):  # one size class (5..8 tokens)
        x = _latents(n, torch.bfloat16, gen, "strided")
        loc = torch.randperm(PAGES * PS, generator=gen)[:n].to(DEVICE)
        store(stacked[layer], loc, x, PS)
        store_latent_native(want[layer], loc, x, PS)
    assert bits_equal(stacked, want)
    assert len(store._plans) == 1


def test_empty_calls_launch_nothing():
    gen = torch.Generator().manual_seed(13)
    buf = poison((PAGES, latent_page_bytes(PS)), torch.uint8, gen)
    ibuf = poison((PAGES, index_page_bytes(PS)), torch.uint8, gen)
    before, ibefore = buf.clone(), ibuf.clone()
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    for _ in range(2):
        kernels.store_latent_triton(buf, empty, torch.empty(0, LATENT, device=DEVICE), PS)
        store_latent_native(buf, empty, torch.empty(0, LATENT, device=DEVICE), PS)
        kernels.store_index_triton(ibuf, empty, torch.empty(0, DIM, device=DEVICE), PS)
        store_index_native(ibuf, empty, torch.empty(0, DIM, device=DEVICE), PS)
    skipped = torch.tensor([-1, -2], device=DEVICE)  # every slot skipped: a launch that writes nothing
    kernels.store_latent_triton(buf, skipped, _latents(2, torch.float32, gen), PS)
    kernels.store_index_triton(ibuf, skipped, _keys(2, torch.float32, gen), PS)
    assert bits_equal(buf, before) and bits_equal(ibuf, ibefore)


@pytest.mark.parametrize("store", ["triton", "native"])
def test_bad_arguments_are_refused(store):
    latent = kernels.store_latent_triton if store == "triton" else store_latent_native
    index = kernels.store_index_triton if store == "triton" else store_index_native
    gen = torch.Generator().manual_seed(14)
    buf = poison((PAGES, latent_page_bytes(PS)), torch.uint8, gen)
    ibuf = poison((PAGES, index_page_bytes(PS)), torch.uint8, gen)
    loc, x, keys = torch.tensor([1, 2], device=DEVICE), _latents(2, torch.bfloat16, gen), _keys(2, torch.float32, gen)
    latent(buf, loc, x, PS)  # planned
    with pytest.raises(ValueError, match=r"x must be \[2, 512\]"):
        latent(buf, loc, x[:1], PS)  # another count under the same plan
    with pytest.raises(ValueError, match="wrong page_size"):
        latent(buf, loc, x, PS - 1)
    with pytest.raises(ValueError, match="contiguous uint8"):
        latent(buf.view(torch.int16), loc, x, PS)
    with pytest.raises(ValueError, match="contiguous uint8"):
        latent(buf[::2], loc, x, PS)
    with pytest.raises(ValueError, match="1-D int32/int64"):
        latent(buf, loc.float(), x, PS)
    with pytest.raises(ValueError, match="1-D int32/int64"):
        latent(buf, loc.reshape(2, 1), x, PS)
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        latent(buf, loc, x.to(F8), PS)
    with pytest.raises(ValueError, match=r"x must be \[2, 512\]"):
        latent(buf, loc, x[:, :448], PS)
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        latent(buf, loc, x, 0)
    index(ibuf, loc, keys, PS)
    with pytest.raises(ValueError, match=r"x must be \[2, 128\]"):
        index(ibuf, loc, keys[:, :64], PS)
    with pytest.raises(ValueError, match="wrong page_size|x must be"):
        index(ibuf, loc, keys, PS * 2)


# ==========================================================================================================
# the direct launch path, simulated (as tests/test_launch_contract.py does for the other families)
# ==========================================================================================================


class _FakeCompiled:
    def __init__(self, name: str, log: list):
        self.function, self.packed_metadata = f"function {name}", f"metadata {name}"
        self.run = lambda *a: log.append((name, a[:3], a[9:]))


@pytest.mark.skipif(COMPILED, reason="simulates the direct path on the interpreter; compiled runs take the real one")
@pytest.mark.parametrize("which", ["latent", "index"])
def test_a_second_call_launches_directly_what_the_first_dispatched(monkeypatch, which):
    dispatched, direct = [], []
    monkeypatch.delenv("KVCORE_LAUNCH_CHECK", raising=False)
    monkeypatch.setattr(launch, "_direct_on", lambda device: True)
    monkeypatch.setattr(launch, "_RAW_STREAM", lambda index: 7)
    monkeypatch.setattr(launch, "_LAUNCHERS", {})
    dispatch = launch.Launcher._dispatch

    def dispatching(self, grid, args, num_warps):
        dispatch(self, grid, args, num_warps)  # the interpreter runs it
        dispatched.append((self.args.name, grid, [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]))
        return _FakeCompiled(self.args.name, direct)

    monkeypatch.setattr(launch.Launcher, "_dispatch", dispatching)
    gen = torch.Generator().manual_seed(15)
    if which == "latent":
        store, buf, x = kernels.LatentStore(), poison((PAGES, latent_page_bytes(PS)), torch.uint8, gen), \
            _latents(3, torch.float32, gen, "strided")  # fmt: skip
        binding, block = kernels._LATENT_ARGS, kernels._LATENT_BLOCK_N
    else:
        store, buf, x = kernels.IndexStore(), poison((PAGES, index_page_bytes(PS)), torch.uint8, gen), \
            _keys(3, torch.bfloat16, gen, "strided")  # fmt: skip
        binding, block = kernels._INDEX_ARGS, kernels._INDEX_BLOCK_N
    loc = torch.tensor([9, -1, 200], dtype=torch.int32)
    store(buf, loc, x, PS)
    store(buf, loc, x, PS)
    assert len(dispatched) == 1 and len(direct) == 1
    (name, grid, args), (name2, grid2, args2) = dispatched[0], direct[0]
    assert name == name2 == binding.name and grid == grid2 == (-(-3 // min(block, 4)), 1, 1)
    assert len(args2) == binding.count and list(args2) == list(args)
    assert all(type(args2[i]) is int for i in binding.pointer_positions)


# ==========================================================================================================
# CUDA graphs (GPU only)
# ==========================================================================================================


@pytest.mark.gpu
@pytest.mark.skipif(not COMPILED, reason="needs compiled kernels on a CUDA device")
def test_stores_capture_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(21)
    buf = poison((PAGES, latent_page_bytes(PS)), torch.uint8, gen)
    ibuf = poison((PAGES, index_page_bytes(PS)), torch.uint8, gen)
    loc = torch.tensor([64, -1, 127, 128, 255], device=DEVICE)
    x, keys = _latents(5, torch.bfloat16, gen, "strided"), _keys(5, torch.float32, gen)
    want, iwant = buf.clone(), ibuf.clone()
    store_latent_native(want, loc, x, PS)
    store_index_native(iwant, loc, keys, PS)
    kernels.store_latent_triton(buf.clone(), loc, x, PS)  # compile outside the capture
    kernels.store_index_triton(ibuf.clone(), loc, keys, PS)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.store_latent_triton(buf, loc, x, PS)
        kernels.store_index_triton(ibuf, loc, keys, PS)
    graph.replay()
    torch.cuda.synchronize()
    assert bits_equal(buf, want) and bits_equal(ibuf, iwant)
