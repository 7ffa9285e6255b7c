"""Kernel holders that keep their tensors' device addresses, and what a copy of one does.

The hot paths launch with raw addresses (``tensor.data_ptr()``), worked out once when their holder is built.  A
copy made attribute by attribute (``copy.deepcopy``, as a transformers cache's prompt reuse copies a cache and its
pool) gets new tensors but would keep the old addresses: its launches would write the original's memory.  A
:class:`KeepsAddresses` holder names what a copy starts without (:attr:`~KeepsAddresses.not_copied`: what calls keep
for the next one, spare outputs, bound launches) and works its addresses out again from its own tensors once its
state is in place (:meth:`~KeepsAddresses._bind_addresses`, which most holders' ``__init__`` call too).  A copy's
tensors keep their views of one another (``copy.deepcopy`` copies each storage once), and page-locked host tensors
are locked again (:func:`page_locked`).  What holds no buffer (launchers, plans, the frozen planning records) a copy
shares (:func:`shared_by_copies`)."""

from __future__ import annotations

import torch

__all__ = ["KeepsAddresses", "page_locked", "shared_by_copies"]


class KeepsAddresses:
    """A mixin for a class that keeps its tensors' addresses: copies (``copy.deepcopy``, pickling) work them out
    again.  A subclass defines :meth:`_bind_addresses` and lists in :attr:`not_copied` the attributes a copy starts
    as None."""

    #: attributes a copy starts as None: what calls keep for the next one (outputs, bound launches, their addresses)
    not_copied: tuple[str, ...] = ()

    def _bind_addresses(self) -> None:
        """Work out what this object keeps of its own tensors (addresses, page-locked views); called after a copy's
        state is in place, so it reads only this object's attributes."""
        raise NotImplementedError(f"{type(self).__name__} keeps addresses but does not say how to bind them")

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for name in self.not_copied:
            if name in state:
                state[name] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._bind_addresses()


def page_locked(tensor: torch.Tensor, locked: bool) -> torch.Tensor:
    """``tensor``, page-locked when ``locked`` (a copy of a page-locked host tensor is not, and device launches that
    write it asynchronously, or read it, need it to be)."""
    return tensor.pin_memory() if locked and not tensor.is_pinned() else tensor


def shared_by_copies(obj: object, memo: dict) -> object:
    """``copy.deepcopy`` of an object a copy shares, as its ``__deepcopy__``: the object itself.  For what holds no
    buffer and is never changed by a copy's use: kernels' argument lists, launchers and plans (compiled kernels, call
    signatures), and the frozen planning records (a layout, a pool request, a backend spec, a selection, a memory
    plan, whose read-only mappings could not be copied anyway)."""
    return obj
