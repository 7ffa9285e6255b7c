"""The block-scaled store and gather kernels against the torch references, bit for bit: every format, odd
head widths, strided inputs, zero and tiny blocks, every output dtype.  Interpreted on the CPU; compiled on
CUDA with KVCORE_TEST_COMPILED=1."""

from __future__ import annotations

import pytest
import torch

from kvcore.testing.tensors import bits_equal, test_device
from kvcore_fp4.formats import E2M1_BOUNDS, RECIPES, dequantize, quantize
from kvcore_fp4.pool import MHATokenToKVPoolFP4

DEVICE = test_device()


def pools(kv_format, head_dim, v_head_dim):
    args = dict(size=24, page_size=4, dtype=torch.bfloat16, head_num=3, head_dim=head_dim, v_head_dim=v_head_dim,
                layer_num=2, device=DEVICE, enable_memory_saver=False, kv_format=kv_format)  # fmt: skip
    return MHATokenToKVPoolFP4(kernels="triton", **args), MHATokenToKVPoolFP4(kernels="native", **args)


def inputs(n, head_dim, v_head_dim, seed, dtype=torch.bfloat16):
    """K and V as strided views of one projection, with a zero block, a tiny block and large values."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, 3, head_dim + v_head_dim + 8, generator=g) * 4
    qkv[0, 0, :32] = 0
    qkv[1, 1, :32] *= 1e-30
    qkv[-1, 2, :16] *= 1e4
    qkv = qkv.to(dtype).to(DEVICE)
    return qkv[..., :head_dim], qkv[..., head_dim : head_dim + v_head_dim]


WIDTHS = {"fp4_e2m1": (48, 32), "nvfp4": (64, 16), "mxfp8": (96, 32)}


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("kv_format", sorted(RECIPES))
def test_store_writes_the_reference_bytes(kv_format, src_dtype):
    dk, dv = WIDTHS[kv_format]
    fast, ref = pools(kv_format, dk, dv)
    if fast.global_scale is not None:
        for p in (fast, ref):
            p.set_kv_global_scale(1, 0.03125, 3.0)
    k, v = inputs(7, dk, dv, 1, src_dtype)
    loc = torch.tensor([5, 27, 9, 4, 13, 22, 8], device=DEVICE)
    for p in (fast, ref):
        p.set_kv_buffer(1, loc, k, v)
    for name, buf in fast.buffers().items():
        assert bits_equal(buf, ref.buffers()[name]), name
    # and those bytes are the format's codes
    recipe = RECIPES[kv_format]
    g = 0.03125 if recipe.global_scale else 1.0
    data, scales = quantize(k, recipe, g)
    assert bits_equal(fast.k_data[1, loc], data) and bits_equal(fast.k_scale[1, loc], scales)


def _e2m1_edge_values(dtype: torch.dtype) -> torch.Tensor:
    """Values of ``dtype`` on and one ulp either side of every e2m1 rounding bound and of 1.0 and 2.0 (where
    the encoder's lines cross), 6.0 and the value below it, both signs, and both zeros: all within [-6, 6]."""
    points = torch.tensor([*E2M1_BOUNDS, 1.0, 2.0], dtype=dtype)
    up, down = torch.full_like(points, float("inf")), torch.zeros_like(points)
    edges = torch.cat((points, torch.nextafter(points, up), torch.nextafter(points, down)))
    six = torch.tensor([6.0], dtype=dtype)
    edges = torch.cat((edges, six, torch.nextafter(six, torch.zeros(1, dtype=dtype))))
    zero = torch.zeros(1, dtype=dtype)
    return torch.cat((edges, -edges, zero, -zero))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_e2m1_store_encodes_each_bound_and_its_neighbours_as_the_reference(dtype):
    """Every value lands exactly on the e2m1 scale (each block's amax is 6.0, so its scale is 1): the codes
    written are the encoder's alone, checked against the reference's seven-bound rule, from each input dtype
    (each reads its value pairs and sign bits its own way; -0.0 is code 8); then magnitudes past 6, which the
    block's scale brings back into range (saturation is reached through nvfp4's clamped scales, in its own
    tests)."""
    dk, dv = WIDTHS["fp4_e2m1"]
    fast, ref = pools("fp4_e2m1", dk, dv)
    values = _e2m1_edge_values(dtype)
    n = -(-values.numel() // 15)
    rows = torch.zeros(n * 15, dtype=dtype)
    rows[: values.numel()] = values
    blocks = torch.cat((torch.full((n, 1), 6.0, dtype=dtype), rows.view(n, 15)), dim=1)  # [n, 16]: amax 6 in each
    k = blocks.repeat(1, 3 * dk // 16).view(n, 3, dk).to(DEVICE)
    v = blocks.repeat(1, 3 * dv // 16).view(n, 3, dv).flip(-1).to(DEVICE)  # the 6.0 at a block's other end
    loc = torch.arange(1, n + 1, device=DEVICE)
    for p in (fast, ref):
        p.set_kv_buffer(0, loc, k, v)
    assert fast.k_scale[0, loc].eq(127).all() and fast.v_scale[0, loc].eq(127).all()  # scale 1: exponent 0
    for name, buf in fast.buffers().items():
        assert bits_equal(buf, ref.buffers()[name]), name
    assert bits_equal(fast.k_data[0, loc], quantize(k, RECIPES["fp4_e2m1"])[0])  # from the float32 values
    negative_zero = (k == 0) & torch.signbit(k)
    assert bool(negative_zero.any())
    codes = fast.k_data[0, loc].to(torch.int32)
    assert bool(((torch.stack((codes & 15, codes >> 4), -1).flatten(-2) == 8) | ~negative_zero).all())
    big = torch.zeros(1, 3, dk, dtype=dtype)
    big[0, 0, :4] = torch.tensor([7.5, 6e4, -6e4, 3.0])  # large magnitudes in one block (finite in f16)
    for p in (fast, ref):
        p.set_kv_buffer(1, loc[:1], big.to(DEVICE), torch.zeros(1, 3, dv, device=DEVICE))
    assert bits_equal(fast.k_data[1, loc[:1]], ref.k_data[1, loc[:1]])


def _kv_views(wide, form, dk, dv):
    """K and V ``[N, 3, dk]`` / ``[N, 3, dv]`` as views of ``wide``: contiguous heads with aligned value pairs,
    contiguous heads starting at an odd value, or every other value."""
    if form == "pairs":
        return wide[..., :dk], wide[..., dk + 2 : dk + 2 + dv]
    if form == "odd start":
        return wide[..., 1 : dk + 1], wide[..., dk + 3 : dk + 3 + dv]
    return wide[..., : 2 * dk : 2], wide[..., 2 * dk : 2 * (dk + dv) : 2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("form", ["pairs", "odd start", "every other value"])
@pytest.mark.parametrize("kv_format", ["fp4_e2m1", "nvfp4"])
def test_4bit_rows_move_values_in_pairs_or_one_by_one(kv_format, form, dtype):
    """The 4-bit kernels read (store) or write (gather) a contiguous head whose value pairs are aligned as one
    word per pair, and any other head value by value; each form stores the reference's bytes and reads back
    the reference's values."""
    dk, dv = WIDTHS[kv_format]
    fast, ref = pools(kv_format, dk, dv)
    g = torch.Generator().manual_seed(11)
    k, v = _kv_views((torch.randn(5, 3, 2 * (dk + dv) + 4, generator=g) * 4).to(dtype).to(DEVICE), form, dk, dv)
    assert k.shape[-1] == dk and v.shape[-1] == dv
    assert fast._rows._pairs_of(k, v) == (form == "pairs")
    loc = torch.tensor([7, 3, 20, 11, 16], device=DEVICE)
    for p in (fast, ref):
        p.set_kv_buffer(0, loc, k, v)
    for name, buf in fast.buffers().items():
        assert bits_equal(buf, ref.buffers()[name]), name
    read = torch.tensor([16, 0, 3, 7], device=DEVICE)
    out_k, out_v = _kv_views(torch.full((4, 3, 2 * (dk + dv) + 4), 7.0, dtype=dtype, device=DEVICE), form, dk, dv)
    fast._rows.gather(0, read, out_k, out_v)
    want_k, want_v = ref.get_kv_buffer_by_loc(0, read, dtype)
    assert bits_equal(out_k, want_k) and bits_equal(out_v, want_v)


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("kv_format", sorted(RECIPES))
def test_gather_reads_the_reference_values(kv_format, dst_dtype):
    dk, dv = WIDTHS[kv_format]
    fast, ref = pools(kv_format, dk, dv)
    k, v = inputs(6, dk, dv, 2)
    loc = torch.tensor([5, 27, 9, 4, 13, 22], device=DEVICE)
    for p in (fast, ref):
        p.set_kv_buffer(0, loc, k, v)
    read = torch.tensor([9, 27, 9, 0], device=DEVICE)  # a row twice and the padding row
    got, want = fast.get_kv_buffer_by_loc(0, read, dst_dtype), ref.get_kv_buffer_by_loc(0, read, dst_dtype)
    assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])
    recipe = RECIPES[kv_format]
    assert bits_equal(want[0], dequantize(ref.k_data[0, read], ref.k_scale[0, read], recipe, dst_dtype))


def test_empty_store_and_read():
    fast, _ = pools("fp4_e2m1", 48, 32)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    fast.set_kv_buffer(0, empty, torch.empty(0, 3, 48, device=DEVICE), torch.empty(0, 3, 32, device=DEVICE))
    k, v = fast.get_kv_buffer_by_loc(0, empty)
    assert k.shape == (0, 3, 48) and v.shape == (0, 3, 32)
    assert int(fast.k_data.count_nonzero()) == 0


@pytest.mark.parametrize("kernels", ["triton", "native"])
def test_other_input_forms_store_and_read_the_same_rows(kernels):
    """int32 and 2-D locations, and K / V as ``[N, H * D]``, store the bytes and read the values of the usual
    call (1-D int64 locations, ``[N, H, D]`` rows) in both paths; MLA parts as ``[N, W]`` likewise."""
    from kvcore_fp4.pool import MLATokenToKVPoolFP4

    args = dict(size=24, page_size=4, dtype=torch.bfloat16, head_num=3, head_dim=64, layer_num=1, device=DEVICE,
                enable_memory_saver=False, kv_format="nvfp4")  # fmt: skip
    usual, other = MHATokenToKVPoolFP4(kernels=kernels, **args), MHATokenToKVPoolFP4(kernels=kernels, **args)
    k, v = inputs(4, 64, 64, 6)
    k, v = k.contiguous(), v.contiguous()
    loc = torch.tensor([5, 27, 9, 4], device=DEVICE)
    usual.set_kv_buffer(0, loc, k, v)
    other.set_kv_buffer(0, loc.to(torch.int32).reshape(2, 2), k.reshape(4, -1), v.reshape(4, -1))
    for name, buf in usual.buffers().items():
        assert bits_equal(buf, other.buffers()[name]), name
    got, want = other.get_kv_buffer_by_loc(0, loc.to(torch.int32).reshape(2, 2)), usual.get_kv_buffer_by_loc(0, loc)
    assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])
    with pytest.raises(ValueError, match="int32/int64"):
        usual.set_kv_buffer(0, loc.float(), k, v)

    margs = dict(size=24, page_size=4, dtype=torch.bfloat16, kv_lora_rank=64, qk_rope_head_dim=32, layer_num=1,
                 device=DEVICE, enable_memory_saver=False, kv_format="mxfp8", kernels=kernels)  # fmt: skip
    usual, other = MLATokenToKVPoolFP4(**margs), MLATokenToKVPoolFP4(**margs)
    nope, rope = k[:, :1, :64].contiguous(), v[:, :1, :32].contiguous()
    usual.set_mla_kv_buffer(0, loc, nope, rope)
    other.set_mla_kv_buffer(0, loc.to(torch.int32), nope.reshape(4, 64), rope.reshape(4, 32))
    assert bits_equal(usual.kv_data, other.kv_data) and bits_equal(usual.kv_scale, other.kv_scale)
    with pytest.raises(ValueError, match=r"cache_k_rope must be \[N, 1, 32\]"):
        usual.set_mla_kv_buffer(0, loc, nope, rope[:3])


@pytest.mark.parametrize("kv_format", sorted(RECIPES))
def test_mla_rows_store_and_read_like_the_reference(kv_format):
    from kvcore_fp4.pool import MLATokenToKVPoolFP4

    args = dict(size=16, page_size=4, dtype=torch.bfloat16, kv_lora_rank=96, qk_rope_head_dim=32, layer_num=2,
                device=DEVICE, enable_memory_saver=False, kv_format=kv_format)  # fmt: skip
    fast, ref = MLATokenToKVPoolFP4(kernels="triton", **args), MLATokenToKVPoolFP4(kernels="native", **args)
    g = torch.Generator().manual_seed(4)
    proj = (torch.randn(5, 1, 140, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    nope, rope = proj[..., :96], proj[..., 100:132]  # strided views of one projection
    loc = torch.tensor([3, 17, 8, 11, 4], device=DEVICE)
    for p in (fast, ref):
        p.set_mla_kv_buffer(1, loc, nope, rope)
    assert bits_equal(fast.kv_data, ref.kv_data) and bits_equal(fast.kv_scale, ref.kv_scale)
    got, want = fast.get_mla_kv_buffer(1, loc, torch.float32), ref.get_mla_kv_buffer(1, loc, torch.float32)
    assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])
    recipe = RECIPES[kv_format]
    assert bits_equal(want[1], dequantize(*quantize(rope, recipe), recipe))  # rope quantized on its own
    assert bits_equal(fast.get_key_buffer(1)[loc], torch.cat(fast.get_mla_kv_buffer(1, loc), -1))


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("kv_format", ["fp4_e2m1", "nvfp4"])
def test_gather_keeps_the_sign_of_zero(kv_format, dst_dtype):
    """Code 8 (a small negative value rounded to zero) reads back as -0.0, as the reference decodes it: built
    from the sign bit, never as ``-magnitude`` (which compiled Triton 3.6 turns into ``0 - 0 = +0``; the
    interpreter of a newer Triton negates correctly, so only compiled runs on such a Triton catch that)."""
    fast, ref = pools(kv_format, 32, 16)
    k = torch.zeros(2, 3, 32)
    k[:, :, 0] = 6.0
    k[:, :, 1:16] = -0.05  # -> code 8
    k[:, :, 16:] = -1e-3  # a block of its own: its own scale, no code 8
    v = -k[..., :16]
    loc = torch.tensor([3, 7], device=DEVICE)
    for p in (fast, ref):
        p.set_kv_buffer(0, loc, k.to(DEVICE), v.to(DEVICE))
    assert bool(((fast.k_data[0, loc] & 0x0F) == 8).any() | ((fast.k_data[0, loc] >> 4) == 8).any())
    got, want = fast.get_kv_buffer_by_loc(0, loc, dst_dtype), ref.get_kv_buffer_by_loc(0, loc, dst_dtype)
    assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])
    assert torch.signbit(want[0][:, :, 1]).all() and (want[0][:, :, 1] == 0).all()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the largest steps overflow, as meant
@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kv_format", ["fp4_e2m1", "nvfp4"])
def test_gather_decodes_every_code_byte_under_every_scale_byte(kv_format, dst_dtype):
    """Every data byte (both nibbles: all 16 codes each) and every scale byte (UE8M0 0..254: 2**-127, a
    subnormal, to 2**127; every e4m3 byte but the two NaNs) read back as the reference decodes them.  The
    kernel builds a code's value from its bits as a float32 subnormal times 2**126, then one product with the
    step, so this covers every path through it, overflow to inf included."""
    fast, ref = pools(kv_format, 32, 32)
    rows = fast.k_data.shape[1]
    data = (torch.arange(rows * 3 * 16) % 256).to(torch.uint8).reshape(rows, 3, 16)
    g = torch.Generator().manual_seed(3)
    if kv_format == "fp4_e2m1":
        kinds = torch.arange(255)  # 255 would be 2**128
    else:
        kinds = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F])
        for p in (fast, ref):
            p.set_kv_global_scale(0, 3e-3, 2e35)  # V: steps up to 9e37, 6 of the largest overflow
    per_part = rows * 3 * 2  # rows x heads x blocks
    assert len(kinds) <= 2 * per_part
    fill = kinds[torch.randint(len(kinds), (2 * per_part - len(kinds),), generator=g)]
    scales = torch.cat((kinds[torch.randperm(len(kinds), generator=g)], fill)).to(torch.uint8).reshape(2, rows, 3, 2)
    for p in (fast, ref):
        p.k_data[0], p.v_data[0] = data.to(DEVICE), data.flip(0).to(DEVICE)
        p.k_scale[0], p.v_scale[0] = scales[0].to(DEVICE), scales[1].to(DEVICE)
    loc = torch.randperm(rows, generator=g).to(DEVICE)
    got, want = fast.get_kv_buffer_by_loc(0, loc, dst_dtype), ref.get_kv_buffer_by_loc(0, loc, dst_dtype)
    assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])
    values = torch.cat((want[0].flatten(), want[1].flatten())).float()
    assert torch.isinf(values).any() and (values == 0).logical_and(torch.signbit(values)).any()


@pytest.mark.parametrize("kv_format", ["fp4_e2m1", "mxfp8"])
def test_block_exponents_at_their_edges(kv_format):
    """Blocks whose largest magnitude sits on and one ulp either side of where the exponent steps (``m x 2**k``
    with ``m`` = 1.5 for e2m1, whose kernel finds ``ceil(log2(amax / 6))`` from the bits without dividing; 1.0
    for e4m3), across the float32 range: normal, the ``k = -125`` edge where the reference's quotient is
    subnormal, subnormal blocks, and the largest finite magnitude."""
    fast, ref = pools(kv_format, 32, 32)
    m = 1.5 if kv_format == "fp4_e2m1" else 1.0
    exps = torch.tensor([-149, -130, -127, -126, -125, -124, -100, -1, 0, 1, 2, 60, 126, 127])
    centre = torch.ldexp(torch.full(exps.shape, m), exps)
    peaks = torch.cat((centre, torch.nextafter(centre, torch.tensor(0.0)), torch.nextafter(centre, torch.tensor(1e39))))
    peaks = peaks[torch.isfinite(peaks) & (peaks > 0)]
    k = torch.zeros(peaks.numel(), 3, 32)
    k[:, :, 0] = peaks[:, None]
    k[:, :, 5] = -peaks[:, None] / 3
    scales = set()
    for rows in torch.arange(peaks.numel()).split(20):  # the pool holds 27 rows
        loc = torch.arange(1, rows.numel() + 1, device=DEVICE)
        for p in (fast, ref):
            p.set_kv_buffer(0, loc, k[rows].to(DEVICE), k[rows].to(DEVICE))
        for name, buf in fast.buffers().items():
            assert bits_equal(buf, ref.buffers()[name]), name
        scales.update(fast.k_scale[0, loc].flatten().tolist())
    assert len(scales) >= 12 and 0 in scales  # the exponents spread, the smallest among them


@pytest.mark.parametrize("kv_format", ["fp4_e2m1", "mxfp8"])
def test_tiny_blocks_read_through_the_subnormal_scale(kv_format):
    """Blocks below 6 x 2**-126 get UE8M0 byte 0: 2**-127, a float32 subnormal; their values read back as
    products with it (subnormal themselves), not as zeros."""
    fast, ref = pools(kv_format, 32, 32)
    g = torch.Generator().manual_seed(5)
    k = torch.randn(3, 3, 32, generator=g) * 1e-38
    k[1] *= 1e-2  # subnormal inputs
    loc = torch.tensor([1, 9, 4], device=DEVICE)
    for p in (fast, ref):
        p.set_kv_buffer(0, loc, k.to(DEVICE), k.to(DEVICE))
    for name, buf in fast.buffers().items():
        assert bits_equal(buf, ref.buffers()[name]), name
    assert int((fast.k_scale[0, loc] == 0).sum()) > 0
    got, want = fast.get_kv_buffer_by_loc(0, loc, torch.float32), ref.get_kv_buffer_by_loc(0, loc, torch.float32)
    assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])
    assert int((want[0] != 0).sum()) > 0


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # amax / 6 / g past float32: inf, as meant
@pytest.mark.parametrize("saturate", [True, False], ids=["saturating-torch", "nan-torch"])
@pytest.mark.parametrize("scales", [(-5.99e-12, -4.9e-13), (1e-36, 3e30), (-3e38, 7e37), (2e-40, -3.0)],
                         ids=["negative", "tiny-huge", "huge", "subnormal"])
def test_nvfp4_store_with_any_global_scale(scales, saturate, monkeypatch):
    """Whatever finite nonzero float32 a global scale holds (the conformance kit fills it with random bytes:
    negative, tiny, huge; a zero one makes 0/0 of zero blocks, NaN, outside the contract), the kernel writes the
    reference's bytes, on a torch whose e4m3 cast saturates and on one that makes NaN of overflow (torch <=
    2.11): block scales are clamped to [-448, 448] on both sides before encoding."""
    import kvcore.kernels.fp8

    monkeypatch.setattr(kvcore.kernels.fp8, "torch_e4m3fn_saturates", lambda: saturate)
    fast, ref = pools("nvfp4", 64, 16)
    for p in (fast, ref):
        p.global_scale[1, 0] = torch.tensor(scales, dtype=torch.float32, device=DEVICE)
    k, v = inputs(7, 64, 16, 3)
    loc = torch.tensor([5, 27, 9, 4, 13, 22, 8], device=DEVICE)
    for p in (fast, ref):
        p.set_kv_buffer(1, loc, k, v)
    for name, buf in fast.buffers().items():
        assert bits_equal(buf, ref.buffers()[name]), name
    got, want = fast.get_kv_buffer_by_loc(1, loc, torch.float32), ref.get_kv_buffer_by_loc(1, loc, torch.float32)
    assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])


@pytest.mark.parametrize("kv_format", sorted(RECIPES))
def test_the_large_token_tile_matches_the_reference(kv_format, monkeypatch):
    """From ``LARGE_FROM`` tokens on the kernels take ``LARGE_TILES`` tokens a program (per recipe and
    value width); lowered here so an interpreted run reaches those tiles (and a ragged last tile) at a small
    size."""
    import kvcore_fp4.kernels as kernels

    monkeypatch.setattr(kernels, "LARGE_FROM", 8)
    dk, dv = WIDTHS[kv_format]
    fast, ref = pools(kv_format, dk, dv)
    n = max(tile[0] for tile in kernels.LARGE_TILES.values()) + 5
    k, v = inputs(n, dk, dv, 7)
    loc = torch.randperm(24, device=DEVICE)[: min(n, 23)] + 1
    k, v = k[: loc.numel()], v[: loc.numel()]
    for p in (fast, ref):
        p.set_kv_buffer(1, loc, k, v)
    for name, buf in fast.buffers().items():
        assert bits_equal(buf, ref.buffers()[name]), name
    read = torch.cat((loc, loc.flip(0)))  # more rows than one large tile
    got, want = fast.get_kv_buffer_by_loc(1, read, torch.float32), ref.get_kv_buffer_by_loc(1, read, torch.float32)
    assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("form", ["pairs", "odd start", "every other value"])
@pytest.mark.parametrize("kv_format", sorted(RECIPES))
def test_whole_row_programs_match_the_reference(kv_format, form, dtype, monkeypatch):
    """A tile may take every head of its tokens in one program (``LARGE_TILES``' third field: whole cache
    rows, the heads' blocks one axis); forced here at every size, for every input form, it stores the
    reference's bytes and reads back the reference's values, into outputs of the same forms."""
    import kvcore_fp4.kernels as kernels

    monkeypatch.setattr(kernels, "LARGE_FROM", 1)
    monkeypatch.setattr(kernels, "LARGE_TILES", {key: (2, 1, True) for key in kernels.LARGE_TILES})
    dk, dv = WIDTHS[kv_format]
    fast, ref = pools(kv_format, dk, dv)
    g = torch.Generator().manual_seed(13)
    k, v = _kv_views((torch.randn(5, 3, 2 * (dk + dv) + 4, generator=g) * 4).to(dtype).to(DEVICE), form, dk, dv)
    loc = torch.tensor([7, 3, 20, 11, 16], device=DEVICE)
    for p in (fast, ref):
        p.set_kv_buffer(0, loc, k, v)
    for name, buf in fast.buffers().items():
        assert bits_equal(buf, ref.buffers()[name]), name
    read = torch.tensor([16, 0, 3, 7, 20], device=DEVICE)
    out_k, out_v = _kv_views(torch.full((5, 3, 2 * (dk + dv) + 4), 7.0, dtype=dtype, device=DEVICE), form, dk, dv)
    fast._rows.gather(0, read, out_k, out_v)
    want_k, want_v = ref.get_kv_buffer_by_loc(0, read, dtype)
    assert bits_equal(out_k, want_k) and bits_equal(out_v, want_v)
