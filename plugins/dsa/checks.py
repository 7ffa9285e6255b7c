"""Checks of a call's arguments shared by the DSA pool's Triton paths (:mod:`kvcore_dsa.scaled_rows`,
:mod:`kvcore_dsa.indexer`)."""

from __future__ import annotations

import torch

__all__ = ["check_device", "check_loc"]


def check_loc(loc: torch.Tensor) -> int:
    """The number of locations; raises unless ``loc`` is a 1-D int32/int64 tensor."""
    loc_dtype = loc.dtype
    if loc.dim() != 1 or (loc_dtype is not torch.int32 and loc_dtype is not torch.int64):
        raise ValueError(f"loc must be a 1-D int32/int64 tensor, got {loc_dtype} {tuple(loc.shape)}")
    return loc.shape[0]


def check_device(device_index: int, device: torch.device, **tensors: torch.Tensor) -> None:
    """Raises unless every tensor is on the device (hot paths pass addresses, which the driver cannot check)."""
    for name, t in tensors.items():
        if t.get_device() != device_index:
            raise ValueError(f"{name} is on {t.device}, the cache on {device}")
