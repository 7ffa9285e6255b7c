"""Launching Triton kernels with little host time: each compiled specialization is found once through Triton's
JIT dispatcher, then launched directly.

Why: the JIT dispatcher binds every argument, computes its specialization key and looks the kernel up on every
call (about 12 us of host time for a small kernel on an H200 with Triton 3.6, twice a bare torch op); an
engine running without CUDA graphs pays that per layer and per call.  A hot path knows far more cheaply what
can change between its calls, so it names a *launch key* itself and :class:`Launcher` maps each key to the
compiled kernel the dispatcher chose the first time.

The contract of a launch key: two calls with the same key must get the same specialization from Triton.
Triton specializes a kernel on its constexpr values and launch options, the dtype of every tensor, whether a
tensor's address is a multiple of 16, and, for every int not marked ``do_not_specialize``, whether it is 1,
a multiple of 16, and fits in 32 bits.  A key may be finer than that (a miss only costs one dispatcher call),
never coarser.  Hot paths therefore mark the ints that change every call (token counts, layer indices, index
strides) ``do_not_specialize``, and put in the key what is left: dtypes, alignments and the strides whose
divisibility matters for vector loads.  ``KVCORE_LAUNCH_CHECK=1`` (set by the conformance kit in compiled
runs) checks every direct launch against the dispatcher's own choice and raises on a mismatch.

Pointers as addresses: given a tensor, Triton's launcher calls its ``data_ptr()`` and asks the driver whether
the address is a device pointer (about 0.17 us per tensor on an H200); given an int, it takes the address as
is.  A hot path therefore passes the addresses of its pool's own buffers (fixed at creation) and of its inputs
(whose ``data_ptr()`` it reads anyway, for their alignment) as ints, and names the tensors behind them for the
dispatcher, which needs tensors to specialize.  The caller then owns the checks the driver would have made:
every tensor on the pool's device.

Call plans: what a hot path's checks conclude depends only on its arguments' metadata (shapes, strides, dtypes,
devices, the alignment of their addresses), which repeats from call to call: every layer of a forward pass
calls with the same.  A hot path therefore reads that metadata into a *call signature* and keeps, per
signature, a :class:`Plan`: the launch key, tile, warps and the kernel arguments the signature fixes, worked out
by the full checks on the signature's first call.  A later call with the same signature reads its metadata,
finds the plan in one dict lookup and launches; its checks passed on the first call, since everything they read
is in the signature.  A signature must therefore hold every value the checks and the plan read (dtypes,
shapes, strides, devices, ``data_ptr() % 16``), and everything else a call passes must be read per call (the
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

Under Triton's interpreter, and while a Triton launch hook is installed (profilers), every call goes through
the dispatcher.  ``KVCORE_DIRECT_LAUNCH=0`` does the same everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton

from kvcore.kernels.kernel_mode import triton_interpreting

__all__ = ["UNPLANNED", "Launcher", "Plan", "alignment", "cdiv", "direct_launch_enabled", "launcher_for", "remember"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for grids.  Not ``triton.cdiv``: that is a ``@triton.jit`` function, and calling it from
    Python goes through the JIT's own call path (about 2 us of host time)."""
    return -(-a // b)


def direct_launch_enabled() -> bool:
    """False under the interpreter or with ``KVCORE_DIRECT_LAUNCH=0``."""
    return not triton_interpreting() and os.environ.get("KVCORE_DIRECT_LAUNCH", "1") != "0"


def alignment(t: torch.Tensor) -> bool:
    """Whether Triton sees ``t``'s address as 16-byte aligned (part of its specialization)."""
    return t.data_ptr() % 16 == 0


def _hook_active(hook) -> bool:
    """A launch hook that does something: not None, and (Triton >= 3.5 keeps a ``HookChain`` there, empty
    unless a profiler added to it) not an empty chain."""
    return hook is not None and bool(getattr(hook, "calls", True))


_RUNTIME_KNOBS = triton.knobs.runtime if hasattr(triton, "knobs") else None
_HOOK_CHAIN = getattr(triton.knobs, "HookChain", None) if hasattr(triton, "knobs") else None


def _launch_hooks_installed() -> bool:
    if _RUNTIME_KNOBS is None:
        return False
    enter, exit_ = _RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook
    if type(enter) is type(exit_) is _HOOK_CHAIN:  # the usual case, read without a call
        return bool(enter.calls or exit_.calls)
    return _hook_active(enter) or _hook_active(exit_)


#: Triton releases whose compiled launcher's C entry point kvcore calls itself (its argument list was read from
#: that release's ``CudaLauncher``); on others, kvcore calls the launcher object, a stable API of Triton 3.x.
_C_LAUNCH_VERIFIED = ("3.6.",)


def _entry(compiled) -> tuple:
    """``(launch, head)`` of a compiled kernel: the callable and what goes between the stream and the kernel's
    own arguments."""
    run = compiled.run
    direct_c = (
        triton.__version__.startswith(_C_LAUNCH_VERIFIED)
        and getattr(run, "global_scratch_size", 1) == 0
        and getattr(run, "profile_scratch_size", 1) == 0
        and hasattr(run, "launch")
    )
    if direct_c:  # launch(grid, stream, function, coop, pdl, global scratch, profile scratch, metadata, ...)
        head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata,
                None, None, None)  # fmt: skip
        return run.launch, head
    return run, (compiled.function, compiled.packed_metadata, None, None, None)


class Launcher:
    """One ``@triton.jit`` kernel on one device, launched without the dispatcher once a key is known.

    :param kernel: the ``@triton.jit`` function.
    :param device: the device its tensors live on; launches go to that device's current stream.
    :param pointers: names of the kernel's pointer parameters that calls may pass as addresses (ints); each
        call then gives the tensors behind them, in this order, as ``tensors``.
    """

    __slots__ = ("kernel", "direct", "check", "_stream", "_device_index", "_compiled", "_pointer_pos")

    def __init__(self, kernel, device: torch.device | str, pointers: Sequence[str] = ()):
        device = torch.device(device)
        self.kernel = kernel
        self.direct = device.type == "cuda" and direct_launch_enabled() and hasattr(triton, "knobs")
        self.check = os.environ.get("KVCORE_LAUNCH_CHECK") == "1"
        self._device_index = device.index if device.index is not None else (
            torch.cuda.current_device() if self.direct else 0
        )
        self._stream = torch._C._cuda_getCurrentRawStream if self.direct else None
        self._compiled: dict[Any, tuple] = {}
        names = list(kernel.arg_names)
        unknown = [p for p in pointers if p not in names]
        if unknown:
            raise ValueError(f"{kernel.__name__} has no parameters {unknown}")
        self._pointer_pos = tuple(names.index(p) for p in pointers)

    def __call__(self, key: Any, grid_x: int, grid_y: int, args: Sequence[Any],
                 tensors: Sequence[torch.Tensor] | Callable[[], Sequence[torch.Tensor]] = (),
                 num_warps: int = 4, grid_z: int = 1) -> None:  # fmt: skip
        """Launch ``kernel[grid_x, grid_y, grid_z](*args, num_warps=num_warps)``.

        :param key: a launch key (see the module docstring); hashable.
        :param args: every parameter of the kernel in signature order, constexpr values included; the
            ``pointers`` named at construction may be addresses (ints).
        :param tensors: the tensors behind the ``pointers``, in their order (needed when any is an address), or
            a function returning them: it is called only when they are needed (a launch through the
            dispatcher, or a check), so views made only for the dispatcher cost nothing on other calls.
        """
        entry = self._compiled.get(key)
        if entry is not None and not _launch_hooks_installed():
            launch, head, compiled = entry
            if self.check:
                self._check(key, (grid_x, grid_y, grid_z), self._with_tensors(args, tensors), num_warps, compiled)
            launch(grid_x, grid_y, grid_z, self._stream(self._device_index), *head, *args)
            return
        compiled = self.kernel[(grid_x, grid_y, grid_z)](*self._with_tensors(args, tensors), num_warps=num_warps)
        if self.direct and compiled is not None and entry is None:
            self._compiled[key] = (*_entry(compiled), compiled)

    def entry(self, key: Any) -> tuple | None:
        """``(launch, head)`` of ``key``'s compiled kernel, for :class:`Plan` to launch it as ``launch(grid_x,
        grid_y, grid_z, stream, *head, *args)``: once the key has been launched through this launcher directly,
        and unless launches are checked (``KVCORE_LAUNCH_CHECK=1``: every one then goes through :meth:`__call__`);
        None otherwise."""
        if self.check:
            return None
        entry = self._compiled.get(key)
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
    tile and warps, and ``fixed``, whatever else the signature settles that the hot path wants kept (strides,
    constexprs, ...).  Calling it with a call's token count launches the kernel on ``(cdiv(n, block_n), grid_y,
    grid_z)`` programs: directly once :meth:`Launcher.entry` has its compiled kernel, through the
    :class:`Launcher` until then (and always while launches are checked or hooked).

    :param block_n: tokens a program takes along the grid's first axis (1: a program a token).
    :param grid_yz: the grid's other two extents, fixed by the signature.
    :param views: when the dispatcher must see other tensors than a call's own (fp8 tensors as their bytes),
        the function making them from the call's ``tensors``; called only on launches through the dispatcher.
    """

    __slots__ = ("launcher", "key", "block_n", "grid_y", "grid_z", "warps", "fixed", "views", "entry", "_stream",
                 "_device_index")  # fmt: skip

    def __init__(self, launcher: Launcher, key: Any, block_n: int, grid_yz: tuple[int, int], warps: int,
                 fixed: Any = None, views: Callable[..., Sequence[torch.Tensor]] | None = None):  # fmt: skip
        self.launcher, self.key, self.block_n, self.warps, self.fixed = launcher, key, block_n, warps, fixed
        self.grid_y, self.grid_z = grid_yz
        self.views, self.entry = views, None
        self._stream, self._device_index = launcher._stream, launcher._device_index

    def __call__(self, n: int, args: Sequence[Any],
                 tensors: Sequence[torch.Tensor] | Callable[[], Sequence[torch.Tensor]] = ()) -> None:  # fmt: skip
        """Launch for ``n`` tokens (``n >= 1``) with ``args`` (every kernel parameter in signature order, as
        :meth:`Launcher.__call__`) and the ``tensors`` behind its addresses (as :meth:`Launcher.__call__`; passed
        through ``views`` if given)."""
        entry = self.entry
        if entry is not None and not _launch_hooks_installed():
            entry[0](-(-n // self.block_n), self.grid_y, self.grid_z, self._stream(self._device_index), *entry[1],
                     *args)  # fmt: skip
            return
        if self.views is not None:
            tensors = self.views(*tensors)
        self.launcher(self.key, -(-n // self.block_n), self.grid_y, args, tensors, self.warps, self.grid_z)
        if self.launcher.direct:
            self.entry = self.launcher.entry(self.key)


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


def launcher_for(kernel, device: torch.device) -> Launcher:
    """One shared :class:`Launcher` per module-level kernel and device, for kernels whose pointer parameters,
    and only those, are named ``*_ptr`` (a call then passes the tensors behind them, in signature order)."""
    key = (kernel, device)
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        pointers = [name for name in kernel.arg_names if name.endswith("_ptr")]
        launcher = _LAUNCHERS[key] = Launcher(kernel, device, pointers)
    return launcher
