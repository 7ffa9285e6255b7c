"""Call plans (kvcore.kernels.launch.Plan): a hot path checks and plans a call signature once, then launches from the
plan.  The plan's launch, the memo's bound, and the hot paths that plan: every call of a signature writes and
reads what the torch path does, whatever its data, locations and layer; a call the checks refuse is refused
after good calls of other signatures too.

Pools run their Triton kernels (interpreted on the CPU, compiled on CUDA with KVCORE_TEST_COMPILED=1)."""

from __future__ import annotations

import pytest
import torch

from kvcore.kernels import launch
from kvcore.testing.tensors import bits_equal, test_device
from kvcore_dsa.pool import DSATokenToKVPool
from kvcore_mla.pool import MLATokenToKVPool

DEVICE = test_device()


class _FakeLauncher:
    """What :class:`kvcore.kernels.launch.Plan` uses of a Launcher, recording its calls."""

    direct = True
    _device_index = 0

    def __init__(self, compiled: bool):
        self.calls, self.direct_calls, self.compiled = [], [], compiled

    def _stream(self, device_index):
        return 1000 + device_index

    def __call__(self, key, gx, gy, args, tensors, warps, gz):
        self.calls.append((key, (gx, gy, gz), tuple(args), warps))

    def entry(self, full_key):
        self.asked = full_key
        if not self.compiled:
            return None
        return (lambda *a: self.direct_calls.append(a)), ("function", "metadata")


def test_a_plan_launches_through_its_launcher_until_compiled_then_directly():
    """The grid's first extent is the call's token count over the plan's tokens a program, rounded up."""
    fake = _FakeLauncher(compiled=False)
    plan = launch.Plan(fake, ("key",), 4, (2, 1), 4, fixed=(7,))
    plan(9, (1, 2))
    plan(4, (3, 4))
    assert fake.calls == [(("key",), (3, 2, 1), (1, 2), 4), (("key",), (1, 2, 1), (3, 4), 4)] and not fake.direct_calls
    fake.compiled = True
    plan(1, (5, 6))  # through the launcher once more, which compiles; then the entry is known
    plan(13, (7, 8))
    assert len(fake.calls) == 3
    assert fake.direct_calls == [(4, 2, 1, 1000, "function", "metadata", 7, 8)]


def test_a_plan_adds_its_constexprs_after_the_runtime_arguments_and_keys_on_them():
    """A call passes the runtime arguments only; the plan adds the constexpr values it was made with, and finds its
    compiled kernel under ``(key, warps, constexprs)`` (what :meth:`kvcore.kernels.launch.Launcher.key_of` files
    the kernel under)."""
    fake = _FakeLauncher(compiled=True)
    plan = launch.Plan(fake, ("key",), 2, (1, 1), 4, constexprs=[16, True])
    plan(3, (1, 2))
    assert fake.calls == [(("key",), (2, 1, 1), (1, 2, 16, True), 4)] and fake.asked == (("key",), 4, (16, True))
    plan(5, (3, 4))
    assert fake.direct_calls == [(3, 1, 1, 1000, "function", "metadata", 3, 4, 16, True)]


def test_a_plan_appends_its_tail_then_its_constexprs():
    """Runtime arguments the signature fixes (``tail``) follow the call's own, before the constexpr values, on
    both paths; ``suffix`` is what a hot path appends when it launches the entry itself."""
    fake = _FakeLauncher(compiled=True)
    plan = launch.Plan(fake, ("key",), 1, (1, 1), 4, constexprs=[16], tail=(8, 9))
    assert plan.suffix == (8, 9, 16)
    plan(2, (1,))
    assert fake.calls == [(("key",), (2, 1, 1), (1, 8, 9, 16), 4)] and fake.asked == (("key",), 4, (16,))
    plan(3, (2,))
    assert fake.direct_calls == [(3, 1, 1, 1000, "function", "metadata", 2, 8, 9, 16)]


def test_a_plan_goes_through_its_launcher_while_a_launch_hook_is_installed():
    import triton

    if not hasattr(triton, "knobs") or not hasattr(triton.knobs.runtime.launch_enter_hook, "add"):
        pytest.skip("this Triton keeps no launch-hook chain")
    fake = _FakeLauncher(compiled=True)
    plan = launch.Plan(fake, "k", 1, (1, 1), 1)
    plan(1, ())
    hook = triton.knobs.runtime.launch_enter_hook
    seen = []
    hook.add(seen.append)
    try:
        plan(1, (1,))
    finally:
        hook.remove(seen.append)
    plan(1, (2,))
    assert [c[2] for c in fake.calls] == [(), (1,)] and [c[-1] for c in fake.direct_calls] == [2]


def test_the_plan_memo_forgets_its_oldest_plan_at_its_limit():
    """Never every plan at once: the memo stays full, the oldest plan leaves first, one at a time."""
    plans = {}
    for i in range(launch.PLAN_LIMIT):
        launch.remember(plans, i, i)
    assert len(plans) == launch.PLAN_LIMIT
    assert launch.remember(plans, "one more", 1) == 1
    assert len(plans) == launch.PLAN_LIMIT and 0 not in plans and plans["one more"] == 1
    launch.remember(plans, "two more", 2)
    assert list(plans)[:2] == [2, 3] and list(plans)[-2:] == ["one more", "two more"]


# -- the hot paths ----------------------------------------------------------------------------------------------

RANK, ROPE = 64, 16


def _mla(kernels):
    return MLATokenToKVPool(size=40, page_size=1, dtype=torch.bfloat16, kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
                            layer_num=3, device=DEVICE, enable_memory_saver=False, kernels=kernels)  # fmt: skip


def _dsa(kernels):
    return DSATokenToKVPool(size=128, page_size=64, kv_lora_rank=512, dtype=torch.float8_e4m3fn, qk_rope_head_dim=64,
                            layer_num=2, device=DEVICE, index_head_dim=128, enable_memory_saver=False,
                            kernels=kernels)  # fmt: skip


def _parts(g, n, rank, rope, strided: bool):
    """nope / rope of ``n`` tokens, contiguous or strided views of one wider projection."""
    if strided:
        wide = torch.randn(n, 1, rank + rope + 5, generator=g).to(torch.bfloat16).to(DEVICE)
        return wide[..., :rank], wide[..., rank : rank + rope]
    return (torch.randn(n, 1, rank, generator=g).to(torch.bfloat16).to(DEVICE),
            torch.randn(n, 1, rope, generator=g).to(torch.bfloat16).to(DEVICE))  # fmt: skip


@pytest.mark.parametrize("family", ["mla", "dsa"])
def test_every_call_of_a_signature_stores_and_reads_what_the_torch_path_does(family):
    """Calls repeat one signature (same shapes, strides, dtypes) with new data, locations and layers, and
    switch between contiguous and strided inputs: the caches and the reads stay the torch path's."""
    factory, rank, rope = (_mla, RANK, ROPE) if family == "mla" else (_dsa, 512, 64)
    fast, ref = factory("triton"), factory("native")
    g = torch.Generator().manual_seed(3)
    for step, strided in enumerate([False, False, True, True, False]):
        loc = (torch.randperm(fast.size, generator=g)[:5] + 1).to(DEVICE)
        layer = step % 2
        nope, rope_part = _parts(g, 5, rank, rope, strided)
        for pool in (fast, ref):
            pool.set_mla_kv_buffer(layer, loc, nope, rope_part)
        assert all(bits_equal(a, b) for a, b in zip(fast.buffers().values(), ref.buffers().values())), step
        got, want = fast.get_mla_kv_buffer(layer, loc), ref.get_mla_kv_buffer(layer, loc)
        assert all(bits_equal(a, b) for a, b in zip(got, want)), step
        out = tuple(torch.full_like(w, 3) for w in want)
        got = fast.get_mla_kv_buffer(layer, loc, out=out)
        assert all(bits_equal(a, b) for a, b in zip(got, want)), step


@pytest.mark.parametrize("family", ["mla", "dsa"])
def test_a_refused_call_is_refused_after_good_calls(family):
    factory, rank, rope = (_mla, RANK, ROPE) if family == "mla" else (_dsa, 512, 64)
    pool = factory("triton")
    g = torch.Generator().manual_seed(5)
    loc = torch.tensor([3, 7, 1], device=DEVICE)
    nope, rope_part = _parts(g, 3, rank, rope, False)
    pool.set_mla_kv_buffer(0, loc, nope, rope_part)
    pool.set_mla_kv_buffer(0, loc, nope, rope_part)
    with pytest.raises(ValueError):
        pool.set_mla_kv_buffer(0, loc[:2], nope, rope_part)  # 2 locations, 3 rows
    with pytest.raises(ValueError):
        pool.set_mla_kv_buffer(0, loc.float(), nope, rope_part)
    with pytest.raises(ValueError):
        pool._rows.store(5, loc, nope, rope_part) if family == "mla" else pool._scaled.store(5, loc, nope, rope_part)
    pool.get_mla_kv_buffer(0, loc)
    with pytest.raises(ValueError):
        pool.get_mla_kv_buffer(0, loc.float())


def test_the_indexer_plans_its_writes_and_reads():
    fast, ref = _dsa("triton"), _dsa("native")
    g = torch.Generator().manual_seed(9)
    pages = torch.tensor([1, 0], device=DEVICE)
    for step in range(3):
        loc = (torch.randperm(127, generator=g)[:6] + 1).to(DEVICE)
        keys = torch.randint(0, 256, (6, 128), generator=g, dtype=torch.uint8).to(DEVICE)
        scales = torch.rand(6, generator=g).to(DEVICE)
        for pool in (fast, ref):
            pool.set_index_k_scale_buffer(step % 2, loc, keys, scales)
        got = fast.get_index_k_scale_buffer(step % 2, 70, pages)
        want = ref.get_index_k_scale_buffer(step % 2, 70, pages)
        assert all(bits_equal(a, b) for a, b in zip(got, want)), step
        out = tuple(torch.empty_like(w) for w in want)
        assert all(bits_equal(a, b) for a, b in zip(fast.get_index_k_scale_buffer(step % 2, 70, pages, out=out), want))
    with pytest.raises(ValueError, match="index_k_scale"):
        fast.set_index_k_scale_buffer(0, loc, keys, None)


def test_a_dropped_pool_frees_its_buffers_at_once():
    """Plans live inside a pool's kernels objects and keep checks and views of their own: none may tie the pool
    or its buffers into a reference cycle (a dropped pool's device memory would then wait for the garbage
    collector).  Checked with the collector off, after planned stores and reads of every kind."""
    import gc
    import weakref

    from kvcore_fp4.pool import MHATokenToKVPoolFP4, MLATokenToKVPoolFP4
    from kvcore_mha.page_major import PageMajorMHATokenToKVPool
    from kvcore_mha.pool import MHATokenToKVPool

    common = dict(device=DEVICE, enable_memory_saver=False, kernels="triton")
    factories = {
        "mla": lambda: _mla("triton"),
        "dsa": lambda: _dsa("triton"),
        "mha": lambda: MHATokenToKVPool(size=24, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=16,
                                        layer_num=2, **common),
        "page-major": lambda: PageMajorMHATokenToKVPool(size=24, page_size=4, dtype=torch.bfloat16, head_num=2,
                                                        head_dim=16, layer_num=2, **common),
        "nvfp4": lambda: MHATokenToKVPoolFP4(size=24, page_size=4, dtype=torch.bfloat16, head_num=2, head_dim=32,
                                             layer_num=2, kv_format="nvfp4", **common),
        "fp4 mla": lambda: MLATokenToKVPoolFP4(size=24, page_size=4, dtype=torch.bfloat16, kv_lora_rank=RANK,
                                               qk_rope_head_dim=ROPE, layer_num=2, kv_format="fp4_e2m1", **common),
    }  # fmt: skip
    loc = torch.tensor([1, 2, 3], device=DEVICE)
    gc.collect()
    gc.disable()
    try:
        for name, factory in factories.items():
            pool = factory()
            pool.self_test_write(1, loc, torch.Generator().manual_seed(1))
            pool.self_test_write(1, loc, torch.Generator().manual_seed(2))
            if hasattr(pool, "get_mla_kv_buffer"):
                read = pool.get_mla_kv_buffer(1, loc)
                pool.get_mla_kv_buffer(1, loc, out=read)
            elif hasattr(pool, "get_kv_buffer_by_loc"):
                read = pool.get_kv_buffer_by_loc(1, loc)
                pool.get_kv_buffer_by_loc(1, loc, out=read)
            if name == "dsa":
                pages = torch.tensor([0], device=DEVICE)
                pool.get_index_k_scale_buffer(1, 3, pages, out=pool.get_index_k_scale_buffer(1, 3, pages))
            buffers = [weakref.ref(b) for b in pool.buffers().values()]
            del pool
            assert all(b() is None for b in buffers), f"{name}: a dropped pool's buffers outlive it"
    finally:
        gc.enable()
