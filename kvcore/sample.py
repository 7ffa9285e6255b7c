"""Random tensors for self-checks and tests: never zero (zeros hide unwritten rows and wrong indexing)."""

from __future__ import annotations

import torch


def random_nonzero(
    shape, dtype: torch.dtype, generator: torch.Generator, scale: float = 1.0, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Normal random values times ``scale``, drawn on the CPU from ``generator`` (so a seed gives the same
    values on every device), exact zeros replaced by one, then converted to ``dtype`` and moved to ``device``."""
    x = torch.randn(shape, generator=generator, dtype=torch.float32) * scale
    x = torch.where(x == 0, torch.ones_like(x), x)
    return x.to(dtype).to(device)
