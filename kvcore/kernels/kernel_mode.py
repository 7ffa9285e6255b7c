"""Which implementation a hot path runs: the Triton kernel or the torch reference.

``hardware.kernels`` in the config takes ``auto``, ``triton`` or ``native``.  ``auto`` picks Triton on a
CUDA device and the torch reference elsewhere.  ``triton`` on a CPU tensor only makes sense under Triton's
interpreter (``TRITON_INTERPRET=1``), which is how the test suite checks every kernel without a GPU.
"""

from __future__ import annotations

import os

import torch

from kvcore.errors import ConfigError

KERNEL_MODES = ("auto", "triton", "native")


def triton_interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(mode: str, device: torch.device | str) -> bool:
    """Resolve a kernel mode for tensors on ``device``.

    :param mode: ``auto``, ``triton`` or ``native``.
    :returns: True when the Triton kernel should run.
    :raises ConfigError: for an unknown mode, or ``triton`` on a CPU device without the interpreter.
    """
    if mode not in KERNEL_MODES:
        raise ConfigError(f"hardware.kernels={mode!r} is not one of {', '.join(KERNEL_MODES)}")
    device_type = torch.device(device).type
    if mode == "native":
        return False
    if mode == "auto":
        return device_type == "cuda"
    if device_type != "cuda" and not triton_interpreting():
        raise ConfigError(
            f"hardware.kernels=triton needs a CUDA device, got {device_type!r}; "
            "use hardware.kernels=native (or auto) on the CPU, or set TRITON_INTERPRET=1 to interpret the kernels"
        )
    return True
