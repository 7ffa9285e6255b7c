"""Where a store writes: a bare ``loc`` tensor, or a :class:`KVWriteLoc` that bundles a step's write locations.

An engine that translates its write locations once per step (a pool whose ids are virtual: the unified memory's
pools) passes the translated, *physical* tokens to every layer's store in a :class:`KVWriteLoc` marked
``physical=True``, so that no store looks them up again.  Every builtin pool's store takes the bundle too and reads
its ``loc`` (or ``full_loc``; a window layer its ``swa_loc``; :func:`tokens_of`): on a pool whose ids are physical by
allocation, the two are the same ids.

Pools unwrap with :func:`unwrap_write_loc` and :func:`write_loc_is_physical`; the names are SGLang's.
"""

from __future__ import annotations

from typing import Optional, Union

import attrs
import torch

__all__ = ["KVWriteLoc", "WriteLoc", "full_write_loc", "tokens_of", "unwrap_write_loc", "write_loc_is_physical"]


@attrs.frozen
class KVWriteLoc:
    """A step's write locations for ``set_kv_buffer``.

    :param loc: the tokens written (``out_cache_loc``, or its physical tokens when ``physical``).
    :param swa_loc: a hybrid sliding-window pool's window-side tokens of the same writes (physical when
        ``physical``; None: the pool maps ``loc`` itself).
    :param full_loc: the full-attention side's tokens, in ``loc``'s space (None: ``loc``).
    :param physical: the tokens are physical (a unified pool's ``translate_write_loc`` and, for window layers,
        ``translate_loc_from_full_to_swa`` of this step's locations, taken after its allocations and frees).
    """

    loc: torch.Tensor
    swa_loc: Optional[torch.Tensor] = None
    full_loc: Optional[torch.Tensor] = None
    physical: bool = False


WriteLoc = Union[torch.Tensor, KVWriteLoc]


def unwrap_write_loc(loc_info: WriteLoc) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(loc, swa_loc, full_loc)`` of a :class:`KVWriteLoc`, or ``(loc_info, None, None)`` of a bare tensor."""
    if loc_info.__class__ is KVWriteLoc:
        return loc_info.loc, loc_info.swa_loc, loc_info.full_loc
    return loc_info, None, None


def write_loc_is_physical(loc_info: WriteLoc) -> bool:
    """Whether ``loc_info`` is a :class:`KVWriteLoc` marked physical (a bare tensor is not)."""
    return loc_info.__class__ is KVWriteLoc and loc_info.physical


def full_write_loc(loc_info: WriteLoc) -> tuple[torch.Tensor, bool]:
    """``(tokens, physical)`` a full-attention store writes: a bare tensor as it is (not physical), a
    :class:`KVWriteLoc`'s ``full_loc`` or else its ``loc``, with its mark."""
    return tokens_of(loc_info), write_loc_is_physical(loc_info)


def tokens_of(loc_info: WriteLoc) -> torch.Tensor:
    """The tokens a pool whose ids are physical writes: a bare tensor itself, a :class:`KVWriteLoc`'s ``full_loc``
    or else its ``loc``."""
    if loc_info.__class__ is not KVWriteLoc:
        return loc_info
    return loc_info.loc if loc_info.full_loc is None else loc_info.full_loc
