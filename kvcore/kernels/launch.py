"""Launching Triton kernels with little host time: each kernel's argument list is named once and checked against
the kernel (:class:`KernelArgs`), each compiled specialization is found once through Triton's JIT dispatcher,
then launched directly.

Why: the JIT dispatcher binds every argument, computes its specialization key and looks the kernel up on every
call (about 12 us of host time for a small kernel on an H200 with Triton 3.6, twice a bare torch op); an
engine running without CUDA graphs pays that per layer and per call.  A hot path knows far more cheaply what
can change between its calls, so it names a *launch key* itself and :class:`Launcher` maps each key to the
compiled kernel the dispatcher chose the first time.

Argument lists: a hot path passes its kernel's arguments by position (a tuple build per call, nothing more), so
the positions are declared once, by name, in a :class:`KernelArgs` made at import beside the kernel: the
kernel's runtime parameters in the order a call passes them, its ``tl.constexpr`` parameters (which come
last), and the pointer parameters a call may pass as addresses.  The declaration is checked against the
kernel's signature when it is made (names, count, order, constexpr-ness; :exc:`LaunchContractError`), so a
parameter added to a kernel without its binding fails at import, and ``tests/test_launch_contract.py`` checks
every binding of the core and the built-in families.  Constexpr values are built by name
(``binding.constexprs(BLOCK_N=..., ...)``: a function with keyword-only parameters, made once, so no dict per
call), once per plan where a hot path plans.  Every launch is checked for its argument count whenever it goes
through the dispatcher (under the interpreter: every launch).

The contract of a launch key: two calls with the same key must get the same specialization from Triton.
Triton specializes a kernel on its constexpr values and launch options, the dtype of every tensor, whether a
tensor's address is a multiple of 16, and, for every int not marked ``do_not_specialize``, whether it is 1,
a multiple of 16, and fits in 32 bits.  The constexpr values and the warps are added to every key by the
launcher itself (:meth:`Launcher.key_of`: the caller's key, the warps, the constexpr arguments of the call), so
a tuning constant read at call time (a tile size, a block a test monkeypatches) can never reuse another
value's specialization; the caller's key names the rest.  A key may be finer than Triton's (a miss only costs
one dispatcher call), never coarser.  Hot paths therefore mark the ints that change every call (token counts,
layer indices, index strides) ``do_not_specialize``, and put in their key what is left: dtypes, alignments
and the strides whose divisibility matters for vector loads.  Module globals a kernel reads in its body are
not arguments and not in any key (the dispatcher refuses a changed one; a direct launch would not notice):
they must never change; tuning values go to a kernel as constexpr parameters.  ``KVCORE_LAUNCH_CHECK=1`` (set
by the conformance kit in compiled runs) checks every direct launch against the dispatcher's own choice and
raises on a mismatch.

Pointers as addresses: given a tensor, Triton's launcher calls its ``data_ptr()`` and asks the driver whether
the address is a device pointer (about 0.17 us per tensor on an H200); given an int, it takes the address as
is.  A hot path therefore passes the addresses of its pool's own buffers (fixed at creation) and of its inputs
(whose ``data_ptr()`` it reads anyway, for their alignment) as ints, and names the tensors behind them for the
dispatcher, which needs tensors to specialize.  The caller then owns the checks the driver would have made:
every tensor on the pool's device.

Call plans: what a hot path's checks conclude depends only on its arguments' metadata (shapes, strides, dtypes,
devices, the alignment of their addresses), which repeats from call to call: every layer of a forward pass
calls with the same.  A hot path therefore reads that metadata into a *call signature* and keeps, per
signature, a :class:`Plan`: the launch key, tile, warps, the constexpr values and the runtime arguments the
signature fixes, worked out by the full checks on the signature's first call.  A later call with the same
signature reads its metadata, finds the plan in one dict lookup and launches with its runtime arguments (the
plan adds its constexprs); its checks passed on the first call, since everything they read is in the
signature.  A signature must therefore hold every value the checks and the plan read (dtypes, shapes,
strides, devices, ``data_ptr() % 16``), and everything else a call passes must be read per call (the
addresses, the layer).

The token count is not in a signature: an engine's prefill sizes and decode batches change nearly every step,
and a plan per count would be planned again on almost every call.  A signature holds the shapes without their
token dimension and the count's *size class*, ``(n - 1).bit_length() if n else -1``: the exponent of the power of
two the count rounds up to, which is all a plan reads of it (a tile's rows, the warps); 1..8192 tokens are 14
classes.  A call reads its count ``n``,
checks on every call that each token-indexed tensor has ``n`` rows (a call whose counts disagree goes through the
full checks, which refuse it), and passes ``n`` to the plan, which launches ``cdiv(n, block_n)`` programs along
the grid's first axis and gives ``n`` to the kernel as an argument.  :func:`remember` keeps a hot path's plans
bounded, forgetting the oldest one at a time.

Triton releases: a direct launch calls Triton's compiled-kernel launcher itself, an API that is not public and
changes between releases.  It is used only on the releases in :data:`DIRECT_LAUNCH_VERIFIED` (run on a GPU with
the compiled test suite and ``KVCORE_LAUNCH_CHECK=1``); there, for a kernel that needs no scratch memory, the
launcher's C entry point (its argument list read from that release's ``CudaLauncher``,
:data:`_C_LAUNCH_VERIFIED`), else the launcher object (``CompiledKernel.run``).  On any other release every
launch goes through Triton's dispatcher, and kvcore says so once per process (a ``logging`` warning);
``KVCORE_DIRECT_LAUNCH=1`` launches directly there anyway, through ``CompiledKernel.run`` only (also said
once).  ``pyproject.toml`` bounds Triton to the releases the kernels are tested on.  Under Triton's
interpreter, and while a Triton launch hook is installed (profilers), every call goes through the dispatcher (a
repeat of a forward's first launch, :attr:`kvcore.kernels.head_gather.HeadGather.repeat`, follows that launch:
hooks are asked once a forward there); ``KVCORE_DIRECT_LAUNCH=0`` does the same everywhere.
"""

from __future__ import annotations

import inspect
import keyword
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton

from kvcore.kernels.addresses import shared_by_copies
from kvcore.kernels.kernel_mode import triton_interpreting

__all__ = [
    "DIRECT_LAUNCH_VERIFIED",
    "KernelArgs",
    "LaunchContractError",
    "Launcher",
    "Plan",
    "UNPLANNED",
    "alignment",
    "bindings",
    "cdiv",
    "direct_launch_enabled",
    "kernel_parameters",
    "launch_hooks_installed",
    "launcher_for",
    "remember",
]

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for grids.  Not ``triton.cdiv``: that is a ``@triton.jit`` function, and calling it from
    Python goes through the JIT's own call path (about 2 us of host time)."""
    return -(-a // b)


def alignment(t: torch.Tensor) -> bool:
    """Whether Triton sees ``t``'s address as 16-byte aligned (part of its specialization)."""
    return t.data_ptr() % 16 == 0


# ==========================================================================================================
# Argument lists
# ==========================================================================================================


class LaunchContractError(ValueError):
    """A kernel's declared argument list (:class:`KernelArgs`) that differs from its parameters, or a launch with
    another number of arguments than the kernel takes."""


def kernel_parameters(kernel) -> tuple[tuple[str, bool], ...]:
    """``(name, is constexpr)`` of every parameter of a ``@triton.jit`` kernel, in signature order: Triton's own
    reading of a compiled kernel's parameters, and the same reading of the annotations (``"constexpr" in`` the
    annotation's name) under the interpreter, whose kernels keep no parameter records."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return tuple((p.name, bool(p.is_constexpr)) for p in params)
    found = []
    for p in inspect.signature(getattr(kernel, "fn", kernel)).parameters.values():
        annotation = p.annotation
        if annotation is inspect.Parameter.empty:
            text = ""
        elif isinstance(annotation, str):
            text = annotation
        else:
            text = getattr(annotation, "__name__", str(annotation))
        found.append((p.name, "constexpr" in text))
    return tuple(found)


def _names(names: str | Sequence[str]) -> tuple[str, ...]:
    """Names given as one string separated by white space, or a sequence of such strings."""
    return tuple(name for part in ([names] if isinstance(names, str) else names) for name in part.split())


def _keyword_builder(qualname: str, names: tuple[str, ...]) -> Callable[..., tuple]:
    """A function taking ``names`` as keyword-only parameters and returning their values in that order: values
    given by name with no dict per call (Python binds keywords to parameters directly; about 0.17 us for 11
    names), and a missing or unknown name a ``TypeError``."""
    for name in names:
        if not name.isidentifier() or keyword.iskeyword(name):
            raise LaunchContractError(f"{name!r} is not a parameter name")
    if names:
        listed = ", ".join(names)
        namespace: dict[str, Any] = {}
        exec(f"def build(*, {listed}):\n    return ({listed},)\n", namespace)  # noqa: S102 - checked identifiers
        build = namespace["build"]
    else:

        def build() -> tuple:
            return ()

    build.__name__ = build.__qualname__ = qualname
    return build


#: every KernelArgs declared so far, in the order made (module-level bindings register at import)
_BINDINGS: list[KernelArgs] = []


def bindings() -> tuple[KernelArgs, ...]:
    """Every :class:`KernelArgs` declared so far (made at import by the modules that bind kernels): what
    ``tests/test_launch_contract.py`` checks against the kernels."""
    return tuple(_BINDINGS)


class KernelArgs:
    """The argument list of one ``@triton.jit`` kernel as its call sites build it: declared once by name, beside
    the kernel, and checked against the kernel's signature when made (see the module docstring).

    :param kernel: the ``@triton.jit`` function.
    :param runtime: its runtime (not constexpr) parameters in the order a call passes them, which must be the
        signature's: names separated by white space, in one string or a sequence of strings (a call's groups,
        e.g. what it reads per call and what its plan fixes).
    :param constexprs: its ``tl.constexpr`` parameters, in signature order (they come after every runtime one).
    :param pointers: the runtime parameters a call may pass as addresses (ints) instead of tensors, naming the
        tensors behind them for the dispatcher; default: those named ``*_ptr``.
    :param register: keep the binding in :func:`bindings` (module-level bindings do; :meth:`of`'s do not).
    :raises LaunchContractError: when the declaration and the kernel differ in names, count, order or
        constexpr-ness, or a pointer is no runtime parameter.

    ``constexprs(NAME=value, ...)`` returns the constexpr values in signature order, each named once;
    ``runtime_args(name=value, ...)`` does the same for the runtime parameters (for paths that launch rarely,
    and tests; a hot path builds that tuple itself, in :attr:`runtime`'s order).  Both are functions of
    keyword-only parameters (no dict per call): a missing or unknown name is a ``TypeError``.
    """

    __slots__ = ("kernel", "name", "runtime", "constexpr_names", "pointers", "pointer_positions", "runtime_count",
                 "count", "constexprs", "runtime_args")  # fmt: skip

    __deepcopy__ = shared_by_copies

    def __init__(self, kernel, runtime: str | Sequence[str], constexprs: str | Sequence[str] = (),
                 pointers: str | Sequence[str] | None = None, *, register: bool = True):  # fmt: skip
        self.kernel = kernel
        self.name = getattr(kernel, "__name__", repr(kernel))
        self.runtime, self.constexpr_names = _names(runtime), _names(constexprs)
        self.pointers = tuple(n for n in self.runtime if n.endswith("_ptr")) if pointers is None else _names(pointers)
        self.check()
        self.runtime_count = len(self.runtime)
        self.count = self.runtime_count + len(self.constexpr_names)
        self.pointer_positions = tuple(self.runtime.index(p) for p in self.pointers)
        self.constexprs = _keyword_builder(f"{self.name}_constexprs", self.constexpr_names)
        self.runtime_args = _keyword_builder(f"{self.name}_runtime_args", self.runtime)
        if register:
            _BINDINGS.append(self)

    @classmethod
    def of(cls, kernel, pointers: str | Sequence[str] | None = None) -> KernelArgs:
        """The argument list a kernel's own signature gives (its runtime parameters, then its constexprs), not
        registered: for a kernel launched without a declared binding (a vendor's).  ``pointers``: as
        :class:`KernelArgs` (default: the ``*_ptr`` parameters)."""
        params = kernel_parameters(kernel)
        if pointers is not None:
            unknown = [p for p in _names(pointers) if p not in {name for name, _ in params}]
            if unknown:
                raise LaunchContractError(f"{getattr(kernel, '__name__', kernel)} has no parameters {unknown}")
        return cls(kernel, [n for n, c in params if not c], [n for n, c in params if c], pointers, register=False)

    def check(self) -> None:
        """Compare the declaration with the kernel's parameters (names, count, order, constexpr-ness; pointers
        among the runtime parameters); raises :exc:`LaunchContractError` naming every difference."""
        params = kernel_parameters(self.kernel)
        names = tuple(name for name, _ in params)
        constexpr = dict(params)
        declared = self.runtime + self.constexpr_names
        problems = []
        twice = sorted({n for n in declared if declared.count(n) > 1})
        if twice:
            problems.append(f"declared twice: {twice}")
        missing = [n for n in names if n not in declared]
        if missing:
            problems.append(f"parameters the binding does not declare: {missing}")
        unknown = [n for n in declared if n not in constexpr]
        if unknown:
            problems.append(f"declared names that are no parameter: {unknown}")
        wrong = [n for n in self.runtime if constexpr.get(n)]
        if wrong:
            problems.append(f"declared runtime but tl.constexpr in the kernel: {wrong}")
        wrong = [n for n in self.constexpr_names if n in constexpr and not constexpr[n]]
        if wrong:
            problems.append(f"declared constexpr but runtime in the kernel: {wrong}")
        if not problems and declared != names:
            problems.append(f"order: the kernel takes {list(names)}, the binding passes {list(declared)} (constexpr "
                            "parameters must come after every runtime parameter)")  # fmt: skip
        bad = [p for p in self.pointers if p not in self.runtime]
        if bad:
            absent = [p for p in bad if p not in constexpr]
            problems.append(f"has no parameters {absent}" if absent else f"constexpr parameters as pointers: {bad}")
        if problems:
            raise LaunchContractError(f"{self.name}: its KernelArgs and its parameters differ: " + "; ".join(problems))

    def index(self, name: str) -> int:
        """The position of runtime parameter ``name`` in a call's arguments."""
        return self.runtime.index(name)

    def __repr__(self) -> str:
        return f"KernelArgs({self.name}: {self.runtime_count} runtime, {len(self.constexpr_names)} constexpr)"


# ==========================================================================================================
# Triton releases and the direct path
# ==========================================================================================================

#: Triton releases (prefixes of ``triton.__version__``) on which kvcore's direct launch has been run on a GPU and
#: checked (the compiled test suite with ``KVCORE_LAUNCH_CHECK=1``); elsewhere launches go through the dispatcher
#: unless ``KVCORE_DIRECT_LAUNCH=1``
DIRECT_LAUNCH_VERIFIED = ("3.6.",)
#: those whose compiled launcher's C entry point kvcore calls itself (its argument list was read from that
#: release's ``CudaLauncher``); on the others it calls the launcher object, ``CompiledKernel.run``
_C_LAUNCH_VERIFIED = ("3.6.",)
_TRITON_VERSION = triton.__version__
#: torch's query of a device's current raw stream (a private API, used only by direct launches)
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_RUNTIME_KNOBS = triton.knobs.runtime if hasattr(triton, "knobs") else None
_HOOK_CHAIN = getattr(triton.knobs, "HookChain", None) if hasattr(triton, "knobs") else None
_SAID: set[str] = set()


def _say_once(what: str, message: str) -> None:
    """Log ``message`` as a warning, the first time ``what`` is said in this process."""
    if what not in _SAID:
        _SAID.add(what)
        logger.warning(message)


def direct_launch_enabled() -> bool:
    """Whether a launch on a GPU may skip Triton's dispatcher: not under the interpreter, not with
    ``KVCORE_DIRECT_LAUNCH=0``, with Triton's launch-hook knobs and torch's raw-stream query at hand, and on a
    release of :data:`DIRECT_LAUNCH_VERIFIED`, or another with ``KVCORE_DIRECT_LAUNCH=1``.  Says once per process
    (a ``logging`` warning) when a GPU's launches go through the dispatcher for want of a verified release, or
    launch directly on an unverified one."""
    if triton_interpreting():
        return False
    setting = os.environ.get("KVCORE_DIRECT_LAUNCH", "")
    if setting == "0":
        return False
    if _RUNTIME_KNOBS is None or _RAW_STREAM is None:
        _say_once("api", f"kvcore launches its Triton kernels through Triton's dispatcher: Triton "
                         f"{_TRITON_VERSION} has no launch-hook knobs, or torch no raw-stream query, which its "
                         "direct launch needs")  # fmt: skip
        return False
    if _TRITON_VERSION.startswith(DIRECT_LAUNCH_VERIFIED):
        return True
    verified = ", ".join(v + "x" for v in DIRECT_LAUNCH_VERIFIED)
    if setting == "1":
        _say_once("unverified", f"KVCORE_DIRECT_LAUNCH=1: kvcore launches compiled kernels directly through "
                                f"CompiledKernel.run on Triton {_TRITON_VERSION}, a release its direct launch is not "
                                f"verified on (verified: {verified}); run the compiled tests with "
                                "KVCORE_LAUNCH_CHECK=1 before relying on it")  # fmt: skip
        return True
    _say_once("unverified", f"kvcore launches its Triton kernels through Triton's dispatcher (about 12 us of host "
                            f"time a launch): its direct launch is verified on Triton {verified}, this is "
                            f"{_TRITON_VERSION} (KVCORE_DIRECT_LAUNCH=1 launches directly anyway, through "
                            "CompiledKernel.run)")  # fmt: skip
    return False


def _direct_on(device: torch.device) -> bool:
    """Whether launches of tensors on ``device`` skip the dispatcher once compiled."""
    return device.type == "cuda" and direct_launch_enabled()


def _hook_active(hook) -> bool:
    """A launch hook that does something: not None, and (Triton >= 3.5 keeps a ``HookChain`` there, empty
    unless a profiler added to it) not an empty chain."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch_hooks_installed() -> bool:
    """Whether a launch hook (a profiler's) is installed in Triton's knobs: launches then go through Triton's
    dispatcher, which calls it."""
    if _RUNTIME_KNOBS is None:
        return False
    enter, exit_ = _RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook
    if type(enter) is type(exit_) is _HOOK_CHAIN:  # the usual case, read without a call
        return bool(enter.calls or exit_.calls)
    return _hook_active(enter) or _hook_active(exit_)


def _entry(compiled) -> tuple:
    """``(launch, head)`` of a compiled kernel: the callable and what goes between the stream and the kernel's
    own arguments (every parameter, constexprs included, in signature order)."""
    run = compiled.run
    direct_c = (
        _TRITON_VERSION.startswith(_C_LAUNCH_VERIFIED)
        and getattr(run, "global_scratch_size", 1) == 0
        and getattr(run, "profile_scratch_size", 1) == 0
        and hasattr(run, "launch")
    )
    if direct_c:  # launch(grid, stream, function, coop, pdl, global scratch, profile scratch, metadata, ...)
        head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata,
                None, None, None)  # fmt: skip
        return run.launch, head
    # CompiledKernel.run(grid, stream, function, packed metadata, launch metadata, enter hook, exit hook, ...)
    return run, (compiled.function, compiled.packed_metadata, None, None, None)


# ==========================================================================================================
# Launcher and Plan
# ==========================================================================================================


class Launcher:
    """One ``@triton.jit`` kernel on one device, launched without the dispatcher once a key is known.

    :param kernel: the kernel's :class:`KernelArgs`, or the ``@triton.jit`` function itself (its argument list
        then taken from its signature, :meth:`KernelArgs.of`).
    :param device: the device its tensors live on; launches go to that device's current stream.
    :param pointers: with a bare kernel only: names of its pointer parameters that calls may pass as addresses
        (ints); each call then gives the tensors behind them, in this order, as ``tensors``.  A
        :class:`KernelArgs` names its own.
    """

    __slots__ = ("kernel", "args", "direct", "check", "_stream", "_device_index", "_compiled", "_pointer_pos",
                 "_runtime", "_count")  # fmt: skip

    __deepcopy__ = shared_by_copies

    def __init__(self, kernel: KernelArgs | Any, device: torch.device | str, pointers: Sequence[str] = ()):
        if isinstance(kernel, KernelArgs):
            if pointers:
                raise TypeError(f"{kernel.name}'s KernelArgs names its pointers itself")
            binding = kernel
        else:
            binding = KernelArgs.of(kernel, tuple(pointers))
        device = torch.device(device)
        self.args, self.kernel = binding, binding.kernel
        self.direct = _direct_on(device)
        self.check = os.environ.get("KVCORE_LAUNCH_CHECK") == "1"
        self._device_index = device.index if device.index is not None else (
            torch.cuda.current_device() if self.direct and device.type == "cuda" else 0
        )
        self._stream = _RAW_STREAM if self.direct else None
        self._compiled: dict[Any, tuple] = {}
        self._pointer_pos = binding.pointer_positions
        self._runtime, self._count = binding.runtime_count, binding.count

    def key_of(self, key: Any, num_warps: int, args: Sequence[Any]) -> tuple:
        """What a compiled kernel is kept under: the caller's ``key``, the warps and the constexpr values of
        ``args`` (every argument past the runtime ones)."""
        tail = args[self._runtime :]
        return key, num_warps, tail if tail.__class__ is tuple else tuple(tail)

    def __call__(self, key: Any, grid_x: int, grid_y: int, args: Sequence[Any],
                 tensors: Sequence[torch.Tensor] | Callable[[], Sequence[torch.Tensor]] = (),
                 num_warps: int = 4, grid_z: int = 1) -> None:  # fmt: skip
        """Launch ``kernel[grid_x, grid_y, grid_z](*args, num_warps=num_warps)``.

        :param key: the caller's part of the launch key (see the module docstring); hashable.  The launcher adds
            ``num_warps`` and the constexpr values of ``args`` (:meth:`key_of`).
        :param args: every parameter of the kernel in signature order, constexpr values included (the
            binding's runtime order, then its constexprs); the ``pointers`` may be addresses (ints).
        :param tensors: the tensors behind the ``pointers``, in their order (needed when any is an address), or
            a function returning them: it is called only when they are needed (a launch through the
            dispatcher, or a check), so views made only for the dispatcher cost nothing on other calls.
        """
        tail = args[self._runtime :]  # key_of, inlined: this runs on every launch
        full = (key, num_warps, tail if tail.__class__ is tuple else tuple(tail))
        entry = self._compiled.get(full)
        if entry is not None and not launch_hooks_installed():
            launch, head, compiled = entry
            if self.check:
                self._check(key, (grid_x, grid_y, grid_z), self._with_tensors(args, tensors), num_warps, compiled)
            launch(grid_x, grid_y, grid_z, self._stream(self._device_index), *head, *args)
            return
        if len(args) != self._count:
            raise LaunchContractError(f"{self.args.name} takes {self._count} arguments ({self._runtime} runtime), "
                                      f"a launch passed {len(args)}")  # fmt: skip
        compiled = self._dispatch((grid_x, grid_y, grid_z), self._with_tensors(args, tensors), num_warps)
        if self.direct and compiled is not None and entry is None:
            self._compiled[full] = (*_entry(compiled), compiled)

    def _dispatch(self, grid: tuple[int, int, int], args: Sequence[Any], num_warps: int):
        """A launch through Triton's dispatcher; the compiled kernel it chose (None under the interpreter)."""
        return self.kernel[grid](*args, num_warps=num_warps)

    def entry(self, full_key: tuple) -> tuple | None:
        """``(launch, head)`` of the kernel compiled under ``full_key`` (:meth:`key_of`), for :class:`Plan` to launch
        it as ``launch(grid_x, grid_y, grid_z, stream, *head, *args)``: once the key has been launched through
        this launcher directly, and unless launches are checked (``KVCORE_LAUNCH_CHECK=1``: every one then goes
        through :meth:`__call__`); None otherwise."""
        if self.check:
            return None
        entry = self._compiled.get(full_key)
        return None if entry is None else entry[:2]

    def _with_tensors(self, args: Sequence[Any], tensors: Sequence[torch.Tensor]) -> Sequence[Any]:
        if callable(tensors):
            tensors = tensors()
        if not tensors:
            return args
        args = list(args)
        for position, tensor in zip(self._pointer_pos, tensors, strict=True):
            args[position] = tensor
        return args

    def _check(self, key, grid, args, num_warps, compiled) -> None:
        chosen = self.kernel.warmup(*args, grid=grid, num_warps=num_warps)
        chosen = chosen.result() if hasattr(chosen, "result") else chosen
        if chosen is not compiled:
            raise AssertionError(
                f"launch key {key!r} of {self.kernel.__name__} names another specialization than the one Triton "
                "chooses for these arguments: the key misses something Triton specializes on"
            )


class Plan:
    """One call signature of a hot path, worked out once (see the module docstring): a kernel's launch key,
    tile, warps and constexpr values, and ``fixed``, whatever else the signature settles that the hot path wants
    kept (strides, ...).  Calling it with a call's token count and runtime arguments launches the kernel on
    ``(cdiv(n, block_n), grid_y, grid_z)`` programs with the plan's constexprs after the runtime arguments:
    directly once :meth:`Launcher.entry` has its compiled kernel, through the :class:`Launcher` until then (and
    always while launches are checked or hooked).  The key a compiled kernel is found under is ``(key, warps,
    constexprs)``, the launcher's :meth:`~Launcher.key_of` of every launch of the plan.

    :param block_n: tokens a program takes along the grid's first axis (1: a program a token).
    :param grid_yz: the grid's other two extents, fixed by the signature.
    :param views: when the dispatcher must see other tensors than a call's own (fp8 tensors as their bytes),
        the function making them from the call's ``tensors``; called only on launches through the dispatcher.
    :param constexprs: the kernel's constexpr values, in signature order (``binding.constexprs(...)``).
    :param tail: the last runtime arguments, when the signature fixes them (strides, ...): a call then passes the
        ones before them, and the launch appends ``tail`` and the constexprs (:attr:`suffix`, one tuple).

    The hottest paths (a store per layer and step) launch ``plan.entry`` themselves, as :meth:`__call__` does
    (``entry[0](grid_x, grid_y, grid_z, plan.raw_stream(plan.device_index), *entry[1], *args, *plan.suffix)``
    while :func:`launch_hooks_installed` is False), saving a call frame and a tuple; :meth:`__call__` otherwise.
    """

    __slots__ = ("launcher", "key", "block_n", "grid_y", "grid_z", "warps", "fixed", "views", "constexprs", "entry",
                 "suffix", "raw_stream", "device_index", "_full_key")  # fmt: skip

    __deepcopy__ = shared_by_copies

    def __init__(self, launcher: Launcher, key: Any, block_n: int, grid_yz: tuple[int, int], warps: int,
                 fixed: Any = None, views: Callable[..., Sequence[torch.Tensor]] | None = None,
                 constexprs: Sequence[Any] = (), tail: Sequence[Any] = ()):  # fmt: skip
        constexprs = tuple(constexprs)
        binding = getattr(launcher, "args", None)
        if isinstance(binding, KernelArgs) and len(constexprs) != len(binding.constexpr_names):
            raise LaunchContractError(f"{binding.name} takes {len(binding.constexpr_names)} constexpr values, a plan "
                                      f"holds {len(constexprs)}")  # fmt: skip
        self.launcher, self.key, self.block_n, self.warps, self.fixed = launcher, key, block_n, warps, fixed
        self.grid_y, self.grid_z = grid_yz
        self.views, self.entry, self.constexprs = views, None, constexprs
        self.suffix = tuple(tail) + constexprs
        self._full_key = (key, warps, constexprs)
        #: ``raw_stream(device_index)``: the device's current raw stream, a direct launch's fourth argument
        self.raw_stream, self.device_index = launcher._stream, launcher._device_index

    def __call__(self, n: int, args: Sequence[Any],
                 tensors: Sequence[torch.Tensor] | Callable[[], Sequence[torch.Tensor]] = ()) -> None:  # fmt: skip
        """Launch for ``n`` tokens (``n >= 1``) with ``args`` (the kernel's runtime arguments in the binding's
        order, but the plan's ``tail``; the plan adds that and its constexprs) and the ``tensors`` behind its
        addresses (as :meth:`Launcher.__call__`; passed through ``views`` if given)."""
        entry = self.entry
        if entry is not None and not launch_hooks_installed():
            entry[0](-(-n // self.block_n), self.grid_y, self.grid_z, self.raw_stream(self.device_index), *entry[1],
                     *args, *self.suffix)  # fmt: skip
            return
        if self.views is not None:
            tensors = self.views(*tensors)
        self.launcher(self.key, -(-n // self.block_n), self.grid_y, (*args, *self.suffix), tensors, self.warps,
                      self.grid_z)  # fmt: skip
        if self.launcher.direct:
            self.entry = self.launcher.entry(self._full_key)


#: what a hot path's plan memo answers for a signature it has not seen: ``plans.get(signature, UNPLANNED)``
#: (None is the plan of a call with nothing to launch, e.g. no rows)
UNPLANNED = object()

#: the most plans a hot path keeps (one per call signature: its tensors' layouts and the token count's size class)
PLAN_LIMIT = 256


def remember(plans: dict, signature: Any, plan: Any) -> Any:
    """``plans[signature] = plan``, first forgetting the oldest plan when there are :data:`PLAN_LIMIT` (one at a
    time: the plans in use stay, and one forgotten is planned again on its next call); returns ``plan``."""
    if len(plans) >= PLAN_LIMIT:
        del plans[next(iter(plans))]
    plans[signature] = plan
    return plan


_LAUNCHERS: dict[tuple, Launcher] = {}


def launcher_for(kernel: KernelArgs | Any, device: torch.device) -> Launcher:
    """One shared :class:`Launcher` per kernel binding and device (or per module-level kernel and device: its
    pointer parameters, and only those, are then the ones named ``*_ptr``)."""
    key = (kernel, device)
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        binding = kernel if isinstance(kernel, KernelArgs) else KernelArgs.of(kernel)
        launcher = _LAUNCHERS[key] = Launcher(binding, device)
    return launcher
