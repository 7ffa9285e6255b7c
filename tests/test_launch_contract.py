"""The launch contract (:mod:`kvcore.kernels.launch`), checked on the CPU.

- Every kernel the core and the built-in families launch has an argument list declared by name
  (:class:`~kvcore.kernels.launch.KernelArgs`) that matches its parameters: names, count, order and
  constexpr-ness, read here from the kernels' own signatures.  A parameter added to a kernel without its binding
  fails (at import, and here).
- The launch key holds every constexpr value and the warps: a tuning constant changed between two calls (as a
  test's monkeypatch does) gets a specialization of its own.
- The direct path, simulated (the interpreter dispatches, a stand-in compiled kernel records what a direct launch
  would pass): every hot path's second call of a signature reaches the compiled kernel directly with exactly the
  arguments, in the order, that its first call gave the dispatcher.
- Triton releases: the direct path only on verified ones (or when asked), said once; the pyproject bound admits
  the installed Triton and the verified ones.

What this cannot check is a real compiled launch: the GPU run (``KVCORE_TEST_COMPILED=1``, which sets
``KVCORE_LAUNCH_CHECK=1``) does.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import pkgutil
import re
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import KernelInterface

from kvcore.kernels import launch
from kvcore.kernels.launch import KernelArgs, LaunchContractError
from kvcore.testing.tensors import compiled, test_device

ROOT = Path(__file__).resolve().parents[1]


def _family_packages() -> list[str]:
    """The built-in families' packages, from pyproject.toml's ``kvcore`` entry points."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("[project.entry-points.kvcore]", 1)[1].split("\n[", 1)[0]
    return sorted({m.group(1) for m in re.finditer(r'=\s*"([A-Za-z_][\w]*)\.', section)})


def _kernel_modules() -> list:
    """Every module of :mod:`kvcore.kernels` and of every built-in family (their tests aside), imported."""
    modules = []
    for package in ("kvcore.kernels", *_family_packages()):
        root = importlib.import_module(package)
        modules.append(root)
        for info in pkgutil.walk_packages(root.__path__, package + "."):
            if ".tests" not in info.name:
                modules.append(importlib.import_module(info.name))
    return modules


MODULES = _kernel_modules()


def _signature(kernel) -> list[tuple[str, bool]]:
    """``(name, is constexpr)`` of the kernel's parameters, from its Python signature (independently of
    :func:`kvcore.kernels.launch.kernel_parameters`)."""
    found = []
    for p in inspect.signature(kernel.fn).parameters.values():
        annotation = p.annotation
        text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
        found.append((p.name, "constexpr" in text))
    return found


# -- every binding matches its kernel ----------------------------------------------------------------------------


def test_the_families_are_found():
    assert {"kvcore_mha", "kvcore_mla", "kvcore_dsa", "kvcore_fp4"} <= set(_family_packages())


def test_every_bound_kernel_takes_the_arguments_its_binding_declares():
    bindings = launch.bindings()
    assert len(bindings) >= 17, [b.name for b in bindings]
    for binding in bindings:
        params = _signature(binding.kernel)
        names = [name for name, _ in params]
        assert [*binding.runtime, *binding.constexpr_names] == names, binding.name
        assert binding.count == len(names) and binding.runtime_count == len(binding.runtime), binding.name
        assert not any(dict(params)[n] for n in binding.runtime), f"{binding.name}: a constexpr declared runtime"
        assert all(dict(params)[n] for n in binding.constexpr_names), f"{binding.name}: a runtime declared constexpr"
        assert set(binding.pointers) <= set(binding.runtime), binding.name
        assert binding.pointer_positions == tuple(binding.runtime.index(p) for p in binding.pointers)
        binding.check()  # the binding's own check agrees


def test_every_kernel_of_the_core_and_the_families_has_a_binding():
    """Each module-level ``@triton.jit`` kernel (``*_kernel``: device functions are not launched) of the core's
    kernel modules and the families' is bound, so no launch builds its arguments unchecked."""
    bound = {b.kernel for b in launch.bindings()}
    kernels = {
        f"{module.__name__}.{name}": obj
        for module in MODULES
        for name, obj in vars(module).items()
        if isinstance(obj, KernelInterface) and name.endswith("_kernel") and obj.fn.__module__ == module.__name__
    }
    assert len(kernels) >= 17, sorted(kernels)
    assert not [name for name, kernel in kernels.items() if kernel not in bound]


def test_no_module_that_binds_kernels_is_over_700_lines():
    paths = {Path(inspect.getfile(b.kernel.fn)) for b in launch.bindings()} | {Path(launch.__file__)}
    for path in paths:
        assert len(path.read_text(encoding="utf-8").splitlines()) <= 700, path


class _Params:
    """A stand-in for a kernel whose parameters differ from a real one's: what :func:`kernel_parameters` reads."""

    def __init__(self, name: str, params: list[tuple[str, bool]]):
        self.__name__ = name
        self.params = [type("P", (), {"name": n, "is_constexpr": c})() for n, c in params]
        self.arg_names = [n for n, _ in params]


@pytest.mark.parametrize("change", ["a runtime parameter added", "a constexpr added", "one removed",
                                    "a runtime one made constexpr", "two swapped"])  # fmt: skip
def test_a_kernel_changed_without_its_binding_is_refused(change):
    """Every real binding against its kernel changed in one way: the declaration no longer matches."""
    for binding in launch.bindings():
        params = _signature(binding.kernel)
        if change == "a runtime parameter added":
            params.insert(binding.runtime_count, ("new_arg", False))
        elif change == "a constexpr added":
            params.append(("NEW_CONSTEXPR", True))
        elif change == "one removed":
            del params[binding.runtime_count - 1]
        elif change == "a runtime one made constexpr":
            params[binding.runtime_count - 1] = (params[binding.runtime_count - 1][0], True)
        else:
            params[0], params[1] = params[1], params[0]
        with pytest.raises(LaunchContractError, match=binding.name):
            KernelArgs(_Params(binding.name, params), binding.runtime, binding.constexpr_names, binding.pointers,
                       register=False)  # fmt: skip


@triton.jit
def _add_kernel(dst_ptr, src_ptr, n, BLOCK: tl.constexpr, SCALE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask) * SCALE, mask=mask)


def test_a_binding_names_what_is_wrong():
    with pytest.raises(LaunchContractError, match=r"does not declare: \['n'\]"):
        KernelArgs(_add_kernel, "dst_ptr src_ptr", "BLOCK SCALE", register=False)
    with pytest.raises(LaunchContractError, match="runtime but tl.constexpr in the kernel: \\['BLOCK'\\]"):
        KernelArgs(_add_kernel, "dst_ptr src_ptr n BLOCK", "SCALE", register=False)
    with pytest.raises(LaunchContractError, match="order"):
        KernelArgs(_add_kernel, "src_ptr dst_ptr n", "BLOCK SCALE", register=False)
    with pytest.raises(LaunchContractError, match=r"no parameters \['out_ptr'\]"):
        KernelArgs(_add_kernel, "dst_ptr src_ptr n", "BLOCK SCALE", pointers="out_ptr", register=False)
    with pytest.raises(LaunchContractError, match="constexpr parameters as pointers"):
        KernelArgs(_add_kernel, "dst_ptr src_ptr n", "BLOCK SCALE", pointers="BLOCK", register=False)
    before = len(launch.bindings())
    binding = KernelArgs(_add_kernel, "dst_ptr src_ptr n", "BLOCK SCALE", register=False)
    assert len(launch.bindings()) == before and binding.pointers == ("dst_ptr", "src_ptr")
    assert KernelArgs.of(_add_kernel).runtime == binding.runtime


def test_constexprs_and_runtime_arguments_are_built_by_name():
    binding = KernelArgs(_add_kernel, "dst_ptr src_ptr n", "BLOCK SCALE", register=False)
    assert binding.constexprs(SCALE=2.0, BLOCK=8) == (8, 2.0)
    assert binding.runtime_args(n=5, src_ptr=2, dst_ptr=1) == (1, 2, 5)
    with pytest.raises(TypeError):
        binding.constexprs(BLOCK=8)  # one missing
    with pytest.raises(TypeError):
        binding.constexprs(BLOCK=8, SCALE=1.0, WARPS=4)  # one unknown
    with pytest.raises(TypeError):
        binding.constexprs(8, 1.0)  # by position


def test_a_launch_with_another_argument_count_is_refused():
    """Whenever a launch goes through the dispatcher (under the interpreter: every launch) its count is checked."""
    binding = KernelArgs(_add_kernel, "dst_ptr src_ptr n", "BLOCK SCALE", register=False)
    device = test_device()  # compiled runs launch on the GPU: a first launch of a key goes through the dispatcher
    launcher = launch.Launcher(binding, device)
    src, dst = torch.arange(5, dtype=torch.float32, device=device), torch.zeros(5, device=device)
    with pytest.raises(LaunchContractError, match="takes 5 arguments"):
        launcher("k", 1, 1, (dst, src, 5, 8), num_warps=1)
    launcher("k", 1, 1, (dst, src, 5, *binding.constexprs(BLOCK=8, SCALE=3.0)), num_warps=1)
    assert torch.equal(dst, src * 3)
    plan = launch.Plan(launcher, "k", 8, (1, 1), 1, constexprs=binding.constexprs(BLOCK=8, SCALE=2.0))
    plan(5, (dst, src, 5))
    assert torch.equal(dst, src * 2)
    with pytest.raises(LaunchContractError, match="constexpr values"):
        launch.Plan(launcher, "k", 8, (1, 1), 1, constexprs=(8,))


def test_the_launch_key_holds_the_warps_and_every_constexpr():
    binding = KernelArgs(_add_kernel, "dst_ptr src_ptr n", "BLOCK SCALE", register=False)
    launcher = launch.Launcher(binding, "cpu")
    base = launcher.key_of("k", 4, [1, 2, 3, 8, 1.0])
    assert base == ("k", 4, (8, 1.0))
    assert launcher.key_of("k", 4, (1, 2, 3, 16, 1.0)) != base  # a tile size
    assert launcher.key_of("k", 4, (1, 2, 3, 8, 2.0)) != base
    assert launcher.key_of("k", 8, (1, 2, 3, 8, 1.0)) != base  # the warps
    assert launcher.key_of("k", 4, (9, 9, 9, 8, 1.0)) == base  # runtime values are the caller's to key
    plan = launch.Plan(launcher, "k", 8, (1, 1), 4, constexprs=(8, 1.0))
    assert plan._full_key == base  # what a plan looks its compiled kernel up under: the launcher's own key


# -- the direct path, simulated --------------------------------------------------------------------------------

direct_only = pytest.mark.skipif(compiled(), reason="simulates the direct path on the interpreter; compiled runs "
                                                    "take the real one (KVCORE_LAUNCH_CHECK=1)")  # fmt: skip


class _FakeCompiled:
    """What the direct path reads of a compiled kernel; its launcher object records each launch."""

    def __init__(self, name: str, log: list, c_entry: bool = False):
        self.function, self.packed_metadata = f"function {name}", f"metadata {name}"

        def run(*a):
            log.append((name, a[:3], a[3:9], a[9:]))

        def c_launch(*a):
            log.append((name, a[:3], a[3:13], a[13:]))

        self.run = run
        if c_entry:
            run.launch, run.global_scratch_size, run.profile_scratch_size = c_launch, 0, 0
            run.launch_cooperative_grid, run.launch_pdl = "coop", "pdl"


def _plain(args) -> list:
    return [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]


@pytest.fixture
def direct(monkeypatch):
    """Launchers made from now on launch "directly": the dispatcher (the interpreter) runs each key's first launch
    and hands back a stand-in compiled kernel, which records the later ones.  ``direct["dispatched"]`` and
    ``direct["direct"]``: ``(kernel, grid, head, args)`` of every launch."""
    log = {"dispatched": [], "direct": [], "c_entry": False}
    monkeypatch.delenv("KVCORE_LAUNCH_CHECK", raising=False)
    monkeypatch.setattr(launch, "_direct_on", lambda device: True)
    monkeypatch.setattr(launch, "_RAW_STREAM", lambda index: 7)
    monkeypatch.setattr(launch, "_LAUNCHERS", {})
    dispatch = launch.Launcher._dispatch

    def dispatched(self, grid, args, num_warps):
        dispatch(self, grid, args, num_warps)  # the interpreter runs it
        log["dispatched"].append((self.args.name, grid, num_warps, _plain(args)))
        return _FakeCompiled(self.args.name, log["direct"], log["c_entry"])

    monkeypatch.setattr(launch.Launcher, "_dispatch", dispatched)
    return log


def _same_launches(log, call, binding: KernelArgs | None = None, vary: tuple[str, ...] = ()) -> None:
    """``call()`` twice: the first launches through the dispatcher, the second directly, every launch with the
    same grid and arguments (but those named in ``vary``: another call's outputs, sequence numbers; with no
    ``binding``, every pointer) and the stream and compiled kernel in front."""
    dispatched, direct = len(log["dispatched"]), len(log["direct"])
    call()
    first = log["dispatched"][dispatched:]
    assert first and len(log["direct"]) == direct, "the first call of a signature goes through the dispatcher"
    call()
    assert len(log["dispatched"]) == dispatched + len(first), "a second call of a signature is dispatched again"
    second = log["direct"][direct:]
    assert len(second) == len(first)
    for (name, grid, _, args), (name2, grid2, head, args2) in zip(first, second):
        assert (name2, grid2) == (name, grid)
        assert head[0] == 7 and head[1:3] == (f"function {name}", f"metadata {name}"), head
        b = binding or next(b for b in launch.bindings() if b.name == name)
        skip = {b.index(v) for v in vary} if binding is not None else set(b.pointer_positions)
        assert len(args2) == len(args) == b.count
        assert [(type(x), x) for i, x in enumerate(args2) if i not in skip] == \
               [(type(x), x) for i, x in enumerate(args) if i not in skip], name  # fmt: skip
        assert all(type(args2[i]) is int for i in b.pointer_positions), f"{name}: pointers go as addresses"


def _binding(name: str) -> KernelArgs:
    return next(b for b in launch.bindings() if b.name == name)


@direct_only
@pytest.mark.parametrize("case", ["bf16", "fp8 scaled", "fp8 tensor scales", "fp8 bytes", "index map"])
def test_the_mha_store_launches_directly_what_it_dispatched(direct, case):
    from kvcore_mha.kernels import KVStore

    fp8 = case.startswith("fp8")
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    store = torch.uint8 if fp8 else torch.bfloat16
    k, v = torch.zeros(2, 16, 2, 8, dtype=store), torch.zeros(2, 16, 2, 4, dtype=store)
    kv = KVStore(k, v, cache_dtype)
    loc = torch.tensor([3, 5, 1])
    src = torch.float8_e4m3fn if case == "fp8 bytes" else torch.float32
    ck, cv = torch.randn(3, 2, 8).to(src), torch.randn(3, 2, 4).to(src)
    scales = {"fp8 scaled": (0.5, 2.0), "fp8 tensor scales": (torch.tensor([0.5]), torch.tensor(2.0))}.get(case)
    index_map = torch.arange(16) if case == "index map" else None
    _same_launches(direct, lambda: kv(1, loc, ck, cv, *(scales or (None, None)), index_map=index_map),
                   _binding("_store_kv_kernel"))  # fmt: skip


@direct_only
def test_the_row_store_launches_directly_what_it_dispatched(direct):
    from kvcore_mha.row_store import RowStore

    caches = [torch.zeros(2, 16, 2, 8, dtype=torch.bfloat16), torch.zeros(2, 16, 1, 4, dtype=torch.bfloat16)]
    rows = RowStore(caches, torch.bfloat16)
    loc, a, b = torch.tensor([3, 5]), torch.randn(2, 2, 8), torch.randn(2, 1, 4)
    _same_launches(direct, lambda: rows(1, loc, a, b), _binding("_store_rows_kernel"))


@direct_only
def test_the_head_gather_launches_directly_what_it_dispatched(direct):
    from kvcore.kernels.head_gather import HeadGather

    k = torch.randn(2, 16, 2, 8).to(torch.float8_e4m3fn)
    gather = HeadGather(k.unbind(0), k.unbind(0), torch.bfloat16, 0.5, 2.0, use_triton=True)
    locs = torch.tensor([[3, 5, 1], [2, 0, 0]])
    _same_launches(direct, lambda: gather(1, locs), _binding("_gather_heads_kernel"), vary=("k_out", "v_out"))


@direct_only
@pytest.mark.parametrize("n", [3, 300])  # the row kernel, the tiles
def test_the_latent_rows_launch_directly_what_they_dispatched(direct, n):
    from kvcore_mla.kernels import LatentRows

    rows = LatentRows(torch.zeros(2, 400, 1, 48, dtype=torch.bfloat16), torch.bfloat16)
    loc = torch.randperm(399)[:n] + 1
    nope, rope, whole = torch.randn(n, 1, 32), torch.randn(n, 1, 16), torch.randn(n, 1, 48)
    out_nope, out_rope = torch.empty(n, 1, 32, dtype=torch.bfloat16), torch.empty(n, 1, 16, dtype=torch.bfloat16)
    name = "_mla_row_kernel" if n <= 256 else "_mla_rows_kernel"
    _same_launches(direct, lambda: rows.store(1, loc, nope, rope), _binding(name))
    _same_launches(direct, lambda: rows.store_rows(0, loc, whole), _binding(name))
    _same_launches(direct, lambda: rows.gather(1, loc, out_nope, out_rope), _binding("_mla_rows_kernel"))
    _same_launches(direct, lambda: rows.gather_new(1, loc, torch.float32, 32, 16), _binding("_mla_rows_kernel"),
                   vary=("a_ptr", "b_ptr"))  # new outputs each call (float32: another key than the gather's)


@direct_only
def test_the_dsa_rows_and_indexer_launch_directly_what_they_dispatched(direct):
    from kvcore_dsa.indexer import IndexerPages
    from kvcore_dsa.layout import index_page_bytes_of, scaled_row_bytes
    from kvcore_dsa.scaled_rows import ScaledRows

    scaled = ScaledRows(torch.zeros(2, 20, 1, scaled_row_bytes(256, 64), dtype=torch.uint8), 256, 64)
    loc = torch.tensor([3, 7, 1])
    nope, rope = torch.randn(3, 256), torch.randn(3, 64).to(torch.bfloat16)
    out_nope, out_rope = torch.empty(3, 1, 256), torch.empty(3, 1, 64)
    _same_launches(direct, lambda: scaled.store(1, loc, nope, rope), _binding("_store_dsa_fp8_kernel"))
    _same_launches(direct, lambda: scaled.gather(1, loc, out_nope, out_rope), _binding("_gather_dsa_fp8_kernel"))
    _same_launches(direct, lambda: scaled.gather_new(0, loc, torch.bfloat16), _binding("_gather_dsa_fp8_kernel"),
                   vary=("nope_out", "rope_out"))  # fmt: skip

    pages = IndexerPages(torch.zeros(2, 3, index_page_bytes_of(128, True), dtype=torch.uint8), 128, True)
    keys, scales = torch.randint(0, 255, (3, 128), dtype=torch.uint8), torch.rand(3)
    _same_launches(direct, lambda: pages.set(1, loc, keys, scales), _binding("_set_index_k_kernel"))
    byte_scales = scales.view(torch.uint8).reshape(3, 4)  # the general path: a launch per call, not a plan
    loc32 = loc.to(torch.int32)  # (another key than the planned write's)
    _same_launches(direct, lambda: pages.set(0, loc32, keys, byte_scales), _binding("_set_index_k_kernel"))
    page_indices, k_out, s_out = torch.tensor([1, 0]), torch.empty(70, 128, dtype=torch.uint8), None
    _same_launches(direct, lambda: pages.get(1, 70, page_indices, k_out, s_out), _binding("_get_index_k_kernel"))
    _same_launches(direct, lambda: pages.get_new(1, 70, page_indices, True, True), _binding("_get_index_k_kernel"),
                   vary=("k_out", "s_out"))  # fmt: skip


@direct_only
def test_the_block_scaled_rows_launch_directly_what_they_dispatched(direct):
    from kvcore_fp4.pool import MHATokenToKVPoolFP4

    pool = MHATokenToKVPoolFP4(size=24, page_size=4, dtype=torch.bfloat16, head_num=2, head_dim=32, layer_num=2,
                               device="cpu", enable_memory_saver=False, kv_format="nvfp4", kernels="triton")  # fmt: skip
    loc, k, v = torch.tensor([5, 9, 2]), torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    out = (torch.empty(3, 2, 32, dtype=torch.bfloat16), torch.empty(3, 2, 32, dtype=torch.bfloat16))
    _same_launches(direct, lambda: pool.set_kv_buffer(1, loc, k, v), _binding("_rows_kernel"))
    _same_launches(direct, lambda: pool.get_kv_buffer_by_loc(1, loc, out=out), _binding("_rows_kernel"))


@direct_only
def test_row_moves_launch_directly_what_they_dispatched(direct, monkeypatch):
    from kvcore.kernels import row_move
    from kvcore.token_rows import TokenRows

    k, v = torch.zeros(2, 16, 2, 8, dtype=torch.bfloat16), torch.zeros(2, 16, 4, dtype=torch.float32)
    mover = row_move.RowMover(TokenRows(k), TokenRows(v))
    tgt, src = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([2, 3, 4, 5, 6, 7])
    _same_launches(direct, lambda: mover(tgt, src), _binding("_move_kv_kernel"))
    monkeypatch.setattr(row_move, "MOVE_MAX_TOKENS", 4)  # the large path: flags, scratch (new every call)
    _same_launches(direct, lambda: mover(tgt, src))


@direct_only
def test_the_allocators_launch_directly_what_they_dispatched(direct, monkeypatch):
    from kvcore.kernels import allocator_kernels as K
    from kvcore.kernels import free_list
    from kvcore.kernels.free_list import FreePageList

    pages = FreePageList(12, 4, "cpu", use_triton=True, to_front=True, need_sort=True, sort_each_free=True)
    freed = torch.tensor([4, 9, 5, 12])
    _same_launches(direct, lambda: pages.release(freed), _binding("_release_kernel"), vary=("taken", "bits"))
    step = K.DecodeStep(pages, 4, True)
    seq, last = torch.tensor([5, 6]), torch.tensor([7, 9])
    _same_launches(direct, lambda: step(seq, last, 1), _binding("_alloc_decode_kernel"),
                   vary=("out_ptr", "taken", "bits"))  # fmt: skip
    _same_launches(direct, lambda: K.alloc_pages_triton(pages.source(), 2, 4), _binding("_alloc_pages_kernel"),
                   vary=("out_ptr",))  # fmt: skip
    extend = (torch.tensor([0, 3]), torch.tensor([5, 4]), torch.tensor([-1, 10]))
    _same_launches(direct, lambda: K.alloc_extend_triton(*extend, pages.source(), 4, 6),
                   _binding("_alloc_extend_kernel"), vary=("out_ptr",))  # fmt: skip
    # the allocators' own extend path (a list of another capacity: a key of its own, so dispatched first too)
    extend_step = K.ExtendStep(FreePageList(13, 4, "cpu", use_triton=True, to_front=True, need_sort=False), 4, True)
    _same_launches(direct, lambda: extend_step(*extend, 6), _binding("_alloc_extend_kernel"), vary=("out_ptr",))

    # a tuning constant changed between two calls: another key, so the dispatcher again, never the old kernel
    dispatched = len(direct["dispatched"])
    monkeypatch.setattr(free_list, "_BLOCK", 8)
    pages.release(freed)
    assert len(direct["dispatched"]) == dispatched + 1
    monkeypatch.setattr(K, "_PAGES_BLOCK", 64)
    K.alloc_pages_triton(pages.source(), 2, 4)
    assert len(direct["dispatched"]) == dispatched + 2


@direct_only
def test_on_a_verified_release_the_c_entry_gets_the_launcher_head(direct, monkeypatch):
    """Triton 3.6's C entry point: ``launch(grid, stream, function, coop, pdl, global scratch, profile scratch,
    packed metadata, launch metadata, enter hook, exit hook, *args)`` for a kernel without scratch memory."""
    from kvcore.kernels import row_move
    from kvcore.token_rows import TokenRows

    direct["c_entry"] = True
    monkeypatch.setattr(launch, "_TRITON_VERSION", "3.6.0")
    mover = row_move.RowMover(TokenRows(torch.zeros(2, 16, 8)))
    tgt, src = torch.tensor([1, 2]), torch.tensor([3, 4])
    mover(tgt, src)
    mover(tgt, src)
    (name, grid, head, args), = direct["direct"]
    name_ = "_move_kv_kernel"
    assert name == name_ and head == (7, f"function {name_}", "coop", "pdl", None, None, f"metadata {name_}", None,
                                      None, None)  # fmt: skip
    assert [(type(a), a) for a in args] == [(type(a), a) for a in direct["dispatched"][0][3]]
    assert len(args) == _binding(name_).count


# -- Triton releases -----------------------------------------------------------------------------------------------


@pytest.fixture
def release(monkeypatch):
    """Direct launches as on a GPU (no interpreter), each message said afresh."""
    monkeypatch.setattr(launch, "triton_interpreting", lambda: False)
    monkeypatch.setattr(launch, "_RAW_STREAM", lambda index: 0)
    monkeypatch.setattr(launch, "_SAID", set())
    monkeypatch.delenv("KVCORE_DIRECT_LAUNCH", raising=False)
    return monkeypatch


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvcore.kernels.launch"]


def test_only_verified_releases_launch_directly(release, caplog):
    caplog.set_level(logging.WARNING, logger="kvcore.kernels.launch")
    release.setattr(launch, "_TRITON_VERSION", launch.DIRECT_LAUNCH_VERIFIED[0] + "1")
    assert launch.direct_launch_enabled() and not _said(caplog)
    release.setattr(launch, "_TRITON_VERSION", "3.99.0")
    assert not launch.direct_launch_enabled() and not launch.direct_launch_enabled()
    said = _said(caplog)
    assert len(said) == 1 and "dispatcher" in said[0] and "3.99.0" in said[0]  # once per process
    assert not launch._direct_on(torch.device("cpu"))


def test_an_unverified_release_launches_directly_when_asked_and_says_so(release, caplog):
    caplog.set_level(logging.WARNING, logger="kvcore.kernels.launch")
    release.setattr(launch, "_TRITON_VERSION", "3.99.0")
    release.setenv("KVCORE_DIRECT_LAUNCH", "1")
    assert launch.direct_launch_enabled()
    assert len(_said(caplog)) == 1 and "not verified" in _said(caplog)[0]
    compiled_kernel = _FakeCompiled("k", [], c_entry=True)
    launcher, head = launch._entry(compiled_kernel)
    assert launcher is compiled_kernel.run and head == ("function k", "metadata k", None, None, None)  # never the C one
    release.setenv("KVCORE_DIRECT_LAUNCH", "0")
    assert not launch.direct_launch_enabled()


def test_without_the_apis_it_needs_the_direct_path_is_off(release, caplog):
    caplog.set_level(logging.WARNING, logger="kvcore.kernels.launch")
    release.setattr(launch, "_TRITON_VERSION", launch.DIRECT_LAUNCH_VERIFIED[0] + "0")
    release.setattr(launch, "_RAW_STREAM", None)
    assert not launch.direct_launch_enabled() and len(_said(caplog)) == 1


def test_pyproject_bounds_triton_to_the_releases_kvcore_runs_on():
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    spec = SpecifierSet(re.search(r'"triton([^"]*)"', text).group(1))
    assert any(s.operator in ("<", "<=") for s in spec), "no upper bound on triton"
    assert Version(triton.__version__) in spec
    for verified in launch.DIRECT_LAUNCH_VERIFIED:
        assert Version(verified + "0") in spec
