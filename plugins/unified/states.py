"""A hybrid linear-attention model's per-request states on the high side of a unified memory
(:class:`UnifiedMambaPool`, :class:`UnifiedHybridReqToTokenPool`).

One high unit is one request slot's *envelope*: every linear layer's convolution and temporal states, laid out
by :func:`state_envelope` (each state tensor's layers one after the other, each block on a 16-byte boundary).  The
pool's state tensors are strided views over :meth:`~kvcore_unified.memory.UnifiedMemory.high_memory`: slot ``q``
of ``mamba2_layer_cache(layer).temporal`` is the temporal state in the envelope at high page ``q``.

Engines hold *virtual* slot ids (``1 .. ids``; 0 is the padding slot), as SGLang's unified pool hands out: the
request table stores them, and ``alloc`` / ``free`` / ``fork_from`` deal in them.  What indexes the state
tensors takes *physical* slots, as in SGLang, whose callers translate first: the linear-attention kernels,
``copy_from`` and the KV pool's CPU copies take the slots ``translate_mamba_indices`` of the request table gives (a
gather in ``mamba_v2p_table``; a virtual id not allocated, the padding one included, maps to the padding
envelope).  When the high side compacts, the moved envelopes are copied and their ids remapped before the next
launch reads them; ids stay valid.

An allocation takes units from the shared bytes (so it competes with the full-attention pages) and zeroes their
envelopes.  A free does not wait for the device (the ids reach the host behind the queued work, and go back at
the next query or allocation).  Per-draft-token states of
speculative decoding are kept per running request outside the shared range, as the split pool keeps them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import attrs
import numpy as np
import torch
from kvcore_mamba.pool import HybridReqToTokenPool, MambaPool, state_layer_ids

from kvcore_unified.allocator import HIGH
from kvcore_unified.memory import ALIGN, UnifiedMemory

__all__ = ["StateEnvelope", "state_envelope", "UnifiedMambaPool", "UnifiedHybridReqToTokenPool"]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@attrs.frozen
class StateEnvelope:
    """Where one request slot's states lie in its envelope: state tensor ``i`` (``tensors[i]``, its per-slot shape
    and dtype: the convolution shapes in order, then the temporal state) starts at byte ``blocks[i]``, its
    ``layers`` per-layer states ``layer_bytes[i]`` apart; ``unit_bytes`` is the whole envelope (a multiple of 16
    bytes)."""

    layers: int
    tensors: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    blocks: tuple[int, ...]
    layer_bytes: tuple[int, ...]
    unit_bytes: int


def state_envelope(cache_params: Any, layers: int) -> StateEnvelope:
    """The envelope of ``layers`` linear layers' states of ``cache_params`` (``.shape.conv``, ``.shape.temporal``,
    ``.dtype.conv``, ``.dtype.temporal``, as :class:`~kvcore_mamba.pool.MambaPool` reads them)."""
    shapes = [(tuple(s), cache_params.dtype.conv) for s in cache_params.shape.conv]
    shapes.append((tuple(cache_params.shape.temporal), cache_params.dtype.temporal))
    blocks, layer_bytes, offset = [], [], 0
    for shape, dtype in shapes:
        one = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        blocks.append(offset)
        layer_bytes.append(one)
        offset = _aligned(offset + one * layers)
    return StateEnvelope(layers, tuple(shapes), tuple(blocks), tuple(layer_bytes), offset)


class UnifiedMambaPool(MambaPool):
    """:class:`~kvcore_mamba.pool.MambaPool`'s interface over the high side of ``memory`` (see the module
    docstring); the slots it hands out are virtual ids.

    :param memory: the unified memory; its high unit must be :func:`state_envelope`'s ``unit_bytes`` for these
        layers (this pool registers itself as the mover of the high side).
    :param cache_params: / ``mamba_layer_ids`` / ``spec_state_size`` / ``speculative_num_draft_tokens`` /
        ``speculative_eagle_topk`` / ``kernels``: as :class:`~kvcore_mamba.pool.MambaPool`'s.
    """

    def __init__(self, *, memory: UnifiedMemory, cache_params: Any, device: str, spec_state_size: int = 0,
                 speculative_num_draft_tokens: Optional[int] = None, mamba_layer_ids: Optional[Sequence[int]] = None,
                 speculative_eagle_topk: Optional[int] = None, kernels: str = "auto"):  # fmt: skip
        layers = len(state_layer_ids("UnifiedMambaPool", cache_params, mamba_layer_ids))
        self.envelope = state_envelope(cache_params, layers)
        if memory.high_unit != self.envelope.unit_bytes:
            raise ValueError(f"the unified memory's high unit is {memory.high_unit} bytes, but one slot's states of "
                             f"{layers} linear layers take {self.envelope.unit_bytes}")  # fmt: skip
        self.memory = memory
        self._ends = memory.allocator
        slots = self._ends.ids(HIGH)
        #: virtual slot -> the high page holding its envelope (the padding page when not allocated)
        self._slot_of = torch.full((slots + 1,), memory.padding_page(HIGH), dtype=torch.int64, device=device)
        self._units = memory.high_memory().view(-1, memory.high_unit)
        super().__init__(size=slots, spec_state_size=spec_state_size, cache_params=cache_params, device=device,
                         speculative_num_draft_tokens=speculative_num_draft_tokens, mamba_layer_ids=mamba_layer_ids,
                         speculative_eagle_topk=speculative_eagle_topk, kernels=kernels)  # fmt: skip
        memory.on_move(HIGH, self._move)

    def _slot_states(self, layers: int, size: int, cache_params: Any, device: str):
        """Strided views over the high memory: ``[layers, high_pages + 1, *shape]`` per state tensor."""
        memory, env = self.memory.high_memory(), self.envelope
        views = []
        for (shape, dtype), block, layer_bytes in zip(env.tensors, env.blocks, env.layer_bytes):
            typed = memory.view(dtype)
            inner = torch.empty(shape, dtype=dtype, device="meta").stride()
            item = dtype.itemsize
            views.append(typed.as_strided((layers, self.memory.high_pages + 1, *shape),
                                          (layer_bytes // item, env.unit_bytes // item, *inner),
                                          typed.storage_offset() + block // item))  # fmt: skip
        return views[:-1], views[-1]

    # -- translation -----------------------------------------------------------------------------------------

    @property
    def virtual_to_physical(self) -> torch.Tensor:
        """Virtual slot -> physical slot of the state views (int64, on the pool's device; the padding slot for an
        id not allocated)."""
        return self._slot_of

    def translate(self, virtual_ids: torch.Tensor) -> torch.Tensor:
        """The physical slots of virtual ``virtual_ids`` (int64, their shape): what the state views are indexed by."""
        return self._slot_of[virtual_ids.long()]

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """One buffer, the high memory: (pointer, bytes, one envelope), addressed by physical slot."""
        memory = self.memory.high_memory()
        return [memory.data_ptr()], [memory.nbytes], [self.memory.high_unit]

    # -- slots --------------------------------------------------------------------------------------------

    def available_size(self) -> int:
        """Slots the shared bytes can still give (the full-attention pages take from the same bytes)."""
        self.memory.settle_frees()
        return self._ends.available(HIGH)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """``need_size`` virtual slots (int64 on the device), their envelopes zeroed; None (nothing taken) when the
        shared bytes hold fewer."""
        self.memory.settle_frees()
        ids = self._ends.alloc(HIGH, need_size)
        if ids is None:
            return None
        if not need_size:
            return torch.from_numpy(ids).to(self.device)
        # the virtual slots and their pages in one copy to the device
        both = torch.from_numpy(np.stack([ids, self.memory.page_of(HIGH, self._ends.physical(HIGH, ids))]))
        virtual, pages = both.to(self.device).unbind(0)
        self._slot_of[virtual] = pages
        self._units.index_fill_(0, pages, 0)
        return virtual

    def fork_from(self, src_index: torch.Tensor) -> Optional[torch.Tensor]:
        """A new virtual slot holding a copy of virtual slot ``src_index``'s states, or None when none is free."""
        dst = self.alloc(1)
        if dst is not None:
            self.copy_from(self.translate(src_index), self.translate(dst))
        return dst

    def free(self, free_index: torch.Tensor) -> None:
        """Give back virtual slots (the padding slot, slots not allocated and repeats are ignored).  Does not wait
        for the device: the slots are given back at the next query or allocation of either side
        (:meth:`~kvcore_unified.memory.UnifiedMemory.free_later`)."""
        if free_index.numel() == 0:
            return
        self.memory.free_later(free_index, self._free_slots)

    def _free_slots(self, ids: np.ndarray) -> None:
        """Host virtual slots ``ids`` back to the high side."""
        ids = np.unique(ids)
        ids = ids[(ids > 0) & (ids < self._slot_of.numel())]
        self._ends.free(HIGH, ids)
        if ids.size:
            self._slot_of[torch.from_numpy(ids).to(self.device)] = self.memory.padding_page(HIGH)

    def clear(self) -> None:
        """Free every slot (the padding envelope zeroed)."""
        self.memory.settle_frees()
        self._free_slots(self._ends.virtual(HIGH))
        self._units[self.memory.padding_page(HIGH)].zero_()
        for name, stacked in self.buffers().items():
            if name.startswith("intermediate"):
                stacked.zero_()

    def _move(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Compaction of the high side: copy the envelopes of physical slots ``src`` to ``dst``, remap their ids."""
        moved = torch.from_numpy(self._ends.virtual(HIGH)[src]).to(self.device)
        self.memory.move_units(HIGH, src, dst)
        self._slot_of[moved] = torch.from_numpy(self.memory.page_of(HIGH, dst)).to(self.device)


class UnifiedHybridReqToTokenPool(HybridReqToTokenPool):
    """:class:`~kvcore_mamba.pool.HybridReqToTokenPool` whose states are a :class:`UnifiedMambaPool`'s (SGLang's
    name for it): the request table's state ids are virtual, and the inherited ``translate_mamba_indices`` /
    ``mamba_v2p_table`` give the physical slots through the state pool's table.  ``mamba_pool=`` (the unified
    pool) is required; the other keywords are :class:`~kvcore_mamba.pool.HybridReqToTokenPool`'s."""

    def __init__(self, *, mamba_pool: UnifiedMambaPool, **kwargs: Any):
        if not isinstance(mamba_pool, UnifiedMambaPool):
            raise TypeError(f"UnifiedHybridReqToTokenPool needs a UnifiedMambaPool, got {type(mamba_pool).__name__}")
        kwargs.setdefault("mamba_size", mamba_pool.size)
        super().__init__(mamba_pool=mamba_pool, **kwargs)
