"""MHATokenToKVPoolFP4: reads by location return the format's round trip of what was stored and read no
other rows; SGLang's whole-layer accessors agree; nvfp4's global scales; the errors."""

from __future__ import annotations

import pytest
import torch

import kvcore.plugins
from kvcore.tools.cli import main
from kvcore.errors import ConfigError
from kvcore_fp4.formats import RECIPES, dequantize, quantize
from kvcore_fp4.pool import MHATokenToKVPoolFP4


def make(kv_format="fp4_e2m1", cls=MHATokenToKVPoolFP4, **kw) -> MHATokenToKVPoolFP4:
    args = dict(size=40, page_size=4, dtype=torch.bfloat16, head_num=2, head_dim=64, layer_num=3, device="cpu",
                enable_memory_saver=False, kernels="native", kv_format=kv_format)  # fmt: skip
    return cls(**{**args, **kw})


def rows(n, seed, width=64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 2, width, generator=g) * 3).to(torch.bfloat16)


@pytest.mark.parametrize("kv_format", sorted(RECIPES))
def test_reads_by_location_return_the_round_trip_of_what_was_stored(kv_format):
    pool = make(kv_format)
    recipe = RECIPES[kv_format]
    loc = torch.tensor([5, 17, 9])
    k, v = rows(3, 1), rows(3, 2)
    pool.set_kv_buffer(2, loc, k, v)
    got_k, got_v = pool.get_kv_buffer_by_loc(2, loc, torch.float32)
    assert torch.equal(got_k, dequantize(*quantize(k, recipe), recipe))
    assert torch.equal(got_v, dequantize(*quantize(v, recipe), recipe))
    assert pool.get_kv_buffer_by_loc(2, loc)[0].dtype == torch.bfloat16
    whole = pool.get_key_buffer(2)
    assert whole.shape == (44, 2, 64) and torch.equal(whole[loc], got_k.to(torch.bfloat16))
    assert int(pool.k_data[1].count_nonzero()) == 0  # other layers untouched


def test_nvfp4_global_scales_are_per_layer_and_per_k_and_v():
    pool = make("nvfp4")
    loc = torch.tensor([3])
    k = rows(1, 3)
    pool.set_kv_buffer(0, loc, k, k)
    before = pool.k_scale[0, 3].clone()
    pool.set_kv_global_scale(0, 0.5, 2.0)
    assert pool.global_scale[0, 0].tolist() == [0.5, 2.0] and pool.global_scale[1, 0].tolist() == [1.0, 1.0]
    pool.set_kv_buffer(0, loc, k, k)
    assert not torch.equal(pool.k_scale[0, 3], before)
    got_k, got_v = pool.get_kv_buffer_by_loc(0, loc, torch.float32)
    recipe = RECIPES["nvfp4"]
    assert torch.equal(got_k, dequantize(*quantize(k, recipe, 0.5), recipe, global_scale=0.5))
    assert torch.equal(got_v, dequantize(*quantize(k, recipe, 2.0), recipe, global_scale=2.0))
    with pytest.raises(ValueError, match="only nvfp4"):
        make("fp4_e2m1").set_kv_global_scale(0, 1.0, 1.0)


def test_errors_name_what_to_change():
    pool = make()
    with pytest.raises(ValueError, match="k_scale=None"):
        pool.set_kv_buffer(0, torch.tensor([1]), rows(1, 0), rows(1, 0), k_scale=0.5)
    with pytest.raises(ValueError, match=r"cache_v must be \[N, H, D\]"):
        pool.set_kv_buffer(0, torch.tensor([1]), rows(1, 0), rows(1, 0, 32))
    with pytest.raises(ValueError, match="not a multiple of mxfp8's block of 32"):
        make("mxfp8", head_dim=48)


@pytest.fixture
def fresh_registry(monkeypatch):
    for var in ("KVCORE_PLUGINS", "KVCORE_DISABLE_PLUGINS", "KVCORE_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(kvcore.plugins.manager, "_REGISTRY", None)


def test_plan_sets_the_dtypes_side_by_side(capsys, fresh_registry):
    assert main(["plan", "model=llama-3-8b", "hardware=h200"]) == 0
    out = capsys.readouterr().out.split("by dtype")[1].splitlines()
    table = {line.split()[0]: line.split()[1:] for line in out[2:] if line.strip()}
    # bytes per token: K and V of 8 heads x 128 x 32 layers, per format (codes + block scales)
    per_value = {"bfloat16": 2, "float8_e4m3fn": 1, "mxfp8": 1 + 1 / 32, "nvfp4": 0.5 + 1 / 16, "fp4_e2m1": 0.5 + 1 / 16}
    for name, per in per_value.items():
        assert int(table[name][0]) == int(2 * 8 * 128 * 32 * per), name
    assert int(table["fp4_e2m1"][1]) > int(table["float8_e4m3fn"][1]) > int(table["bfloat16"][1])


def test_unknown_dtype_names_list_dtypes_and_formats(fresh_registry):
    from kvcore import load_config

    with pytest.raises(ConfigError, match="kv_cache.dtype='int4'.*block formats: fp4_e2m1, mxfp8, nvfp4"):
        load_config("kv_cache.dtype=int4")


def test_the_kits_lossy_check_catches_a_bad_round_trip():
    """The kit's lossy-storage check fails a pool whose reads come back wrong, and one whose writes spill
    outside their rows."""
    from kvcore.testing import LOSSY, BaseLossyTests

    class WrongReads(MHATokenToKVPoolFP4):
        def read_values(self, layer, loc):
            return {name: values * 1.5 for name, values in super().read_values(layer, loc).items()}

    class Spills(MHATokenToKVPoolFP4):
        def self_test_values(self, layer, loc, generator):
            values = super().self_test_values(layer, loc, generator)
            self.k_data[0, -1] ^= 1  # a byte of another row
            return values

    check = BaseLossyTests().test_round_trip_within_the_stated_bound
    check(make(), {LOSSY}, torch.Generator().manual_seed(0), 3)  # a good pool passes
    with pytest.raises(AssertionError, match="exceeds the stated"):
        check(make(cls=WrongReads), {LOSSY}, torch.Generator().manual_seed(0), 3)
    with pytest.raises(AssertionError, match="outside the written rows"):
        check(make(cls=Spills), {LOSSY}, torch.Generator().manual_seed(0), 3)


def test_sglangs_fp4_dtype_selects_block_fp4_read_as_bf16():
    pool = make(dtype=torch.float4_e2m1fn_x2, kv_format="mxfp8")
    assert pool.kv_format == "fp4_e2m1" and pool.dtype == torch.bfloat16
