"""Per-request state pools of hybrid linear-attention models: MambaPool, HybridReqToTokenPool and
HybridLinearKVPool (SGLang's names and keywords)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import attrs
import torch

from kvcore.errors import ConfigError
from kvcore.kernels.kernel_mode import use_triton
from kvcore.pools import (GB, KVCache, ReqToTokenPool, check_memory_saver, check_pool_class, check_post_capture,
                          host_buffer, layer_id_of, unsupported)  # fmt: skip
from kvcore.kernels.row_move import RowMover, move_token_rows_native
from kvcore.token_rows import TokenRows
from kvcore_mha.noop import NoOpMHATokenToKVPool
from kvcore_mha.page_major import PageMajorMHATokenToKVPool
from kvcore_mha.pool import MHATokenToKVPool
from kvcore_mamba.keywords import MORE_SLOTS, check_state_features, state_layer_ids

@attrs.frozen(kw_only=True)
class MambaState:
    """The states of every linear layer: ``conv`` (a list of ``[layers, slots + 1, ...]`` windows) and
    ``temporal`` (``[layers, slots + 1, ...]``), slot 0 padding (SGLang's ``MambaPool.State``)."""

    conv: list[torch.Tensor]
    temporal: torch.Tensor

    def at_layer_idx(self, layer: int):
        """One layer's views (every field indexed by ``layer``, lists element by element)."""
        return type(self)(**{f.name: [t[layer] for t in v] if isinstance(v, list) else v[layer]
                             for f in attrs.fields(type(self)) for v in (getattr(self, f.name),)})  # fmt: skip

    def mem_usage_bytes(self) -> int:
        return sum(sum(t.nbytes for t in v) if isinstance(v, list) else v.nbytes
                   for v in (getattr(self, f.name) for f in attrs.fields(type(self))))  # fmt: skip


@attrs.frozen(kw_only=True)
class SpeculativeMambaState(MambaState):
    """With speculative decoding, also the states after each draft token of every running request:
    ``intermediate_ssm`` ``[layers, spec slots + 1, draft tokens, ...]`` and the convolution windows
    ``intermediate_conv_window`` likewise (SGLang's ``MambaPool.SpeculativeState``)."""

    intermediate_ssm: torch.Tensor
    intermediate_conv_window: list[torch.Tensor]


class MambaPool:
    """Fixed-size states for ``size`` request slots (``1 .. size``; slot 0 is padding) of every linear layer of
    ``cache_params`` (duck-typed: ``.layers``, ``.shape.conv``, ``.shape.temporal``, ``.dtype.conv``,
    ``.dtype.temporal``; :class:`~kvcore_mamba.layout.LinearStateParams` is kvcore's).

    States are zeroed when a slot is allocated.  :meth:`copy_from` (and :meth:`fork_from`) copy slots across all
    layers and all state tensors in one launch of the row move (:mod:`kvcore.kernels.row_move`), or its torch reference.

    :param spec_state_size: running requests whose per-draft-token states are kept when
        ``speculative_num_draft_tokens`` is given (rows ``1 .. spec_state_size``; row 0 padding).
    :param mamba_layer_ids: the global ids of the linear layers kept (``mamba_layer_ids[i]`` is state layer
        ``i``), a subset of ``cache_params.layers``; default all of them.
    :param speculative_eagle_topk: accepted (None or positive): SGLang shares the overlapping convolution windows of
        a linear draft chain (topk 1); kvcore keeps one window per draft token, right for a chain and an EAGLE tree
        alike.
    :param enable_linear_replayssm: only False (ReplaySSM's rings are not kept); True is a ConfigError.
    :param linear_replayssm_cache_len: the ReplaySSM ring length: checked positive, otherwise unused (the ring is
        not allocated with ReplaySSM off, as in SGLang).
    :param envelope_layout: only False (states stacked per layer); True is a ConfigError.
    """

    def __init__(
        self,
        *,
        size: int,
        spec_state_size: int = 0,
        cache_params: Any,
        device: str,
        enable_memory_saver: bool = False,
        speculative_num_draft_tokens: Optional[int] = None,
        mamba_layer_ids: Optional[Sequence[int]] = None,
        speculative_eagle_topk: Optional[int] = None,
        enable_linear_replayssm: bool = False,
        linear_replayssm_cache_len: int = 16,
        envelope_layout: bool = False,
        kernels: str = "auto",
    ):
        check_state_features("MambaPool", speculative_eagle_topk=speculative_eagle_topk,
                             enable_linear_replayssm=enable_linear_replayssm,
                             linear_replayssm_cache_len=linear_replayssm_cache_len, envelope_layout=envelope_layout)  # fmt: skip
        check_memory_saver(enable_memory_saver)
        if speculative_num_draft_tokens is not None and (speculative_num_draft_tokens <= 0 or spec_state_size <= 0):
            raise ValueError(
                f"speculative decoding needs positive speculative_num_draft_tokens and spec_state_size, got "
                f"{speculative_num_draft_tokens} and {spec_state_size}"
            )
        if size <= 0:
            raise ValueError(f"MambaPool needs a positive number of slots, got size={size}")
        self.mamba_layer_ids = state_layer_ids("MambaPool", cache_params, mamba_layer_ids)
        layers = len(self.mamba_layer_ids)
        if layers == 0:
            raise ValueError("cache_params lists no linear-attention layers")
        self.size, self.device, self.num_mamba_layers = size, device, layers
        conv, temporal = self._slot_states(layers, size, cache_params, device)
        self.spec_state_size = spec_state_size if speculative_num_draft_tokens is not None else 0
        if speculative_num_draft_tokens is None:
            self.mamba_cache = MambaState(conv=conv, temporal=temporal)
        else:
            rows, draft = spec_state_size + 1, speculative_num_draft_tokens
            self.mamba_cache = SpeculativeMambaState(
                conv=conv, temporal=temporal,
                intermediate_ssm=torch.zeros((layers, rows, draft, *cache_params.shape.temporal),
                                             dtype=cache_params.dtype.temporal, device=device),
                intermediate_conv_window=[torch.zeros((layers, rows, draft, *shape), dtype=cache_params.dtype.conv,
                                                      device=device) for shape in cache_params.shape.conv],
            )  # fmt: skip
        self._use_triton = use_triton(kernels, device)
        self._movers: list[RowMover] | None = None
        self._device_index = temporal.get_device()  # -1 on the CPU
        self.mem_usage = self.mamba_cache.mem_usage_bytes() / GB
        self.clear()

    def _slot_states(self, layers: int, size: int, cache_params: Any, device: str) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The slot-indexed state tensors: ``conv`` (one ``[layers, slots, *shape]`` per convolution shape) and
        ``temporal``; here ``size + 1`` zeroed slots of their own.  A pool laid over other memory overrides it."""
        conv = [torch.zeros((layers, size + 1, *shape), dtype=cache_params.dtype.conv, device=device)
                for shape in cache_params.shape.conv]  # fmt: skip
        temporal = torch.zeros((layers, size + 1, *cache_params.shape.temporal), dtype=cache_params.dtype.temporal,
                               device=device)  # fmt: skip
        return conv, temporal

    # -- buffers ------------------------------------------------------------------------------------------

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every state tensor by its layout name (``conv``, ``conv1``, ..., ``temporal``, and with speculative
        decoding ``intermediate_conv``, ... and ``intermediate_ssm``)."""
        named = self.slot_buffers()
        cache = self.mamba_cache
        if isinstance(cache, SpeculativeMambaState):
            named.update({(f"intermediate_conv{i}" if i else "intermediate_conv"): c
                          for i, c in enumerate(cache.intermediate_conv_window)})  # fmt: skip
            named["intermediate_ssm"] = cache.intermediate_ssm
        return named

    def slot_buffers(self) -> dict[str, torch.Tensor]:
        """The state tensors indexed by slot (what alloc zeroes and copy_from copies)."""
        named = {(f"conv{i}" if i else "conv"): c for i, c in enumerate(self.mamba_cache.conv)}
        named["temporal"] = self.mamba_cache.temporal
        return named

    def get_speculative_mamba2_params_all_layers(self) -> SpeculativeMambaState:
        if not isinstance(self.mamba_cache, SpeculativeMambaState):
            raise RuntimeError("this MambaPool keeps no speculative states (built without speculative_num_draft_tokens)")
        return self.mamba_cache

    def state_rows(self) -> list[TokenRows]:
        return [TokenRows(t) for t in self.slot_buffers().values()]

    def mamba2_layer_cache(self, layer_id: int) -> MambaState:
        """The states of linear layer ``layer_id`` (its index among the linear layers)."""
        if not 0 <= layer_id < self.num_mamba_layers:
            raise IndexError(f"linear layer index {layer_id} out of range for {self.num_mamba_layers} linear layers")
        return self.mamba_cache.at_layer_idx(layer_id)

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """Per slot-indexed state tensor and layer: (data pointer, bytes, bytes of one slot)."""
        ptrs, lens, items = [], [], []
        for stacked in self.slot_buffers().values():
            for layer in stacked.unbind(0):
                ptrs.append(layer.data_ptr())
                lens.append(layer.nbytes)
                items.append(layer[0].nbytes)
        return ptrs, lens, items

    # -- slots --------------------------------------------------------------------------------------------

    def available_size(self) -> int:
        return int(self.free_slots.numel())

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """``need_size`` slots (int64), their states zeroed; None (nothing taken) when fewer are free."""
        if need_size > self.free_slots.numel():
            return None
        select, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        for stacked in self.slot_buffers().values():
            stacked.index_fill_(1, select, 0)
        return select

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        self.free_slots = torch.cat((self.free_slots, free_index.reshape(-1).to(torch.int64).to(self.free_slots.device)))

    def clear(self) -> None:
        """Zero every state and free every slot but the padding one."""
        for stacked in self.buffers().values():
            stacked.zero_()
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)

    def copy_from(self, src_index: torch.Tensor, dst_index: torch.Tensor) -> None:
        """States of slots ``dst_index[i]`` <- those of ``src_index[i]``, every layer and state tensor, as if all
        sources were read first; one launch per pair of state tensors (one for a DeltaNet's or Mamba2's)."""
        src, dst = self._slots(src_index), self._slots(dst_index)
        if src.numel() != dst.numel():
            raise ValueError(f"copy_from: {src.numel()} sources but {dst.numel()} targets")
        if src.numel() == 0:
            return
        if self._use_triton and self._movers is not None:  # the usual call: movers bound at the first one
            for mover in self._movers:
                mover(dst, src)
            return
        rows = self.state_rows()
        pairs = [(rows[i], rows[i + 1] if i + 1 < len(rows) else None) for i in range(0, len(rows), 2)]
        if not self._use_triton:
            for first, second in pairs:
                move_token_rows_native(first, second, dst, src)
            return
        self._movers = [RowMover(first, second) for first, second in pairs]
        for mover in self._movers:
            mover(dst, src)

    def _slots(self, index: torch.Tensor) -> torch.Tensor:
        """Slot indices as a 1-D int64 tensor on the pool's device (no op for one that already is)."""
        if index.dim() != 1:
            index = index.reshape(-1)
        if index.dtype is not torch.int64 or index.get_device() != self._device_index:
            index = index.to(device=self.device, dtype=torch.int64)
        return index

    def fork_from(self, src_index: torch.Tensor) -> Optional[torch.Tensor]:
        """A new slot holding a copy of slot ``src_index``'s states, or None when no slot is free."""
        dst = self.alloc(1)
        if dst is None:
            return None
        self.copy_from(src_index, dst)
        return dst


class HybridReqToTokenPool(ReqToTokenPool):
    """The request table of a hybrid model, plus each request's state slot(s) in a :class:`MambaPool`.

    Requests are duck-typed objects carrying ``mamba_pool_idx`` (a kept state slot, reused by :meth:`alloc`),
    and with ``enable_mamba_extra_buffer`` ``mamba_ping_pong_track_buffer`` / ``mamba_next_track_idx``.
    ``req_index_to_mamba_index_mapping[r]`` is request slot ``r``'s state slot (row 0, the padding request,
    maps to state slot 0).

    SGLang's constructor keywords (its KV-cache configurator passes all of them):

    :param mamba_layer_ids: the global ids of this rank's linear layers, a subset of ``cache_params.layers``
        (checked: anything else is a :class:`~kvcore.errors.ConfigError`); ``mamba2_layer_cache(mamba_layer_ids[i])``
        is state layer ``i``.  Default all of ``cache_params.layers``.
    :param start_layer: the rank's first layer: a layer-wise load (:meth:`register_layer_transfer_counter`) is
        waited for at ``layer_id - start_layer``; no linear layer may lie below it.
    :param enable_overlap_schedule: the ping-pong track buffers per request with ``enable_mamba_extra_buffer``:
        2 with the overlap schedule, 1 without (SGLang's rule, which kvcore's planner reserves by).  None (kvcore's
        default, for callers that do not say): 2, or 1 under speculative decoding (the older rule).
    :param enable_mamba_extra_buffer_lazy: with the extra buffer and the overlap schedule, hand each new request one
        track slot and leave the other -1 until the engine sets it (:meth:`set_mamba_ping_pong_slot`); frees skip
        the -1.  Without ``enable_mamba_extra_buffer``, or with ``enable_overlap_schedule=False``, it is a
        ConfigError (SGLang's configurator refuses the latter too).
    :param speculative_eagle_topk: accepted (None or positive): the draft states keep one convolution window per
        draft token, right for a draft chain and an EAGLE tree alike (see :class:`MambaPool`).
    :param enable_linear_replayssm: only False; ReplaySSM is a ConfigError.
    :param linear_replayssm_cache_len: checked positive, otherwise unused (no ReplaySSM ring is allocated).
    :param mamba_envelope_layout: only False; the page-major envelope of the states is a ConfigError.
    :param mamba_pool: kvcore's extension: an existing :class:`MambaPool` to use (the one the KV pool was
        built with) instead of building one of ``mamba_size`` slots; it must keep as many layers as
        ``mamba_layer_ids`` names.
    """

    def __init__(
        self,
        *,
        size: int,
        mamba_size: int,
        mamba_spec_state_size: int = 0,
        max_context_len: int,
        device: str,
        enable_memory_saver: bool = False,
        cache_params: Any,
        mamba_layer_ids: Optional[Sequence[int]] = None,
        enable_mamba_extra_buffer: bool = False,
        enable_mamba_extra_buffer_lazy: bool = False,
        speculative_num_draft_tokens: Optional[int] = None,
        speculative_eagle_topk: Optional[int] = None,
        enable_overlap_schedule: Optional[bool] = None,
        start_layer: Optional[int] = None,
        enable_linear_replayssm: bool = False,
        linear_replayssm_cache_len: int = 16,
        mamba_envelope_layout: bool = False,
        mamba_pool: MambaPool | None = None,
        kernels: str = "auto",
    ):
        owner = "HybridReqToTokenPool"
        check_state_features(owner, speculative_eagle_topk=speculative_eagle_topk,
                             enable_linear_replayssm=enable_linear_replayssm,
                             linear_replayssm_cache_len=linear_replayssm_cache_len,
                             envelope_keyword="mamba_envelope_layout", envelope_layout=mamba_envelope_layout)  # fmt: skip
        if enable_mamba_extra_buffer_lazy and not enable_mamba_extra_buffer:
            raise ConfigError(f"{owner}(enable_mamba_extra_buffer_lazy=True): the lazy mode is one of the extra buffer; "
                              f"pass enable_mamba_extra_buffer=True with it, or enable_mamba_extra_buffer_lazy=False")  # fmt: skip
        if enable_mamba_extra_buffer_lazy and enable_overlap_schedule is False:
            raise ConfigError(f"{owner}(enable_mamba_extra_buffer_lazy=True): the lazy extra buffer needs the overlap "
                              f"schedule; pass enable_overlap_schedule=True, or enable_mamba_extra_buffer_lazy=False")  # fmt: skip
        layer_ids = state_layer_ids(owner, cache_params, mamba_layer_ids)
        self.start_layer = start_layer or 0
        below = [i for i in layer_ids if i < self.start_layer]
        if below:
            raise ConfigError(f"{owner}(start_layer={start_layer}): linear layers {below} of mamba_layer_ids lie below "
                              f"the rank's first layer; pass the rank's first global layer id")  # fmt: skip
        if mamba_pool is not None and mamba_pool.num_mamba_layers != len(layer_ids):
            raise ConfigError(f"{owner}(mamba_layer_ids={layer_ids}): the given mamba_pool keeps "
                              f"{mamba_pool.num_mamba_layers} linear layers, not {len(layer_ids)}")  # fmt: skip
        super().__init__(size=size, max_context_len=max_context_len, device=device, enable_memory_saver=enable_memory_saver)
        if enable_overlap_schedule is None:
            self.mamba_ping_pong_track_buffer_size = 2 if speculative_num_draft_tokens is None else 1
        else:
            self.mamba_ping_pong_track_buffer_size = 2 if enable_overlap_schedule else 1
        self.enable_mamba_extra_buffer = enable_mamba_extra_buffer
        self.enable_mamba_extra_buffer_lazy = enable_mamba_extra_buffer_lazy
        self.layer_transfer_counter = None
        self.mamba_pool = mamba_pool or MambaPool(
            size=mamba_size, spec_state_size=mamba_spec_state_size, cache_params=cache_params, device=device,
            speculative_num_draft_tokens=speculative_num_draft_tokens, mamba_layer_ids=layer_ids,
            speculative_eagle_topk=speculative_eagle_topk, kernels=kernels,
        )  # fmt: skip
        self.mamba_map = {layer_id: i for i, layer_id in enumerate(layer_ids)}
        self.req_index_to_mamba_index_mapping = torch.zeros(size + 1, dtype=torch.int32, device=device)
        if enable_mamba_extra_buffer:
            self.req_index_to_mamba_ping_pong_track_buffer_mapping = torch.zeros(
                (size + 1, self.mamba_ping_pong_track_buffer_size), dtype=torch.int32, device=device
            )

    def register_layer_transfer_counter(self, layer_transfer_counter) -> None:
        """Make :meth:`mamba2_layer_cache` wait until a layer's host->device load is done (layer-wise loading)."""
        self.layer_transfer_counter = layer_transfer_counter

    def alloc(self, need_size: int, reqs: Sequence[Any] | None = None) -> list[int] | None:
        """Request slots for ``reqs`` (one each) and their state slots (a request's kept ``mamba_pool_idx`` is
        reused); None when too few request slots are free.

        :raises RuntimeError: naming the keys to change when the state slots run out (nothing is taken then).
        """
        if reqs is None or len(reqs) != need_size:
            raise ValueError(f"HybridReqToTokenPool.alloc needs one request per slot: need_size={need_size}, "
                             f"{0 if reqs is None else len(reqs)} requests")  # fmt: skip
        select = super().alloc(need_size)
        if select is None:
            return None
        taken: list[torch.Tensor] = []
        updates: list[tuple[Any, str, Any]] = []
        mamba_index, track = [], []
        pool = self.mamba_pool
        for req in reqs:
            mid = getattr(req, "mamba_pool_idx", None)
            if mid is None:
                new = pool.alloc(1)
                if new is None:
                    return self._refuse(select, taken, "state slot")
                taken.append(new)
                mid = int(new[0])
                updates.append((req, "mamba_pool_idx", mid))
            mamba_index.append(int(mid))
            if self.enable_mamba_extra_buffer:
                buffers = getattr(req, "mamba_ping_pong_track_buffer", None)
                if buffers is None:
                    size = self.mamba_ping_pong_track_buffer_size
                    new = pool.alloc(1 if self.enable_mamba_extra_buffer_lazy else size)
                    if new is None:
                        return self._refuse(select, taken, "ping-pong track buffer")
                    taken.append(new)
                    buffers = new
                    if new.numel() < size:  # lazy: the other track slots are -1 until the engine sets them
                        buffers = torch.full((size,), -1, dtype=new.dtype, device=new.device)
                        buffers[: new.numel()] = new
                    updates += [(req, "mamba_ping_pong_track_buffer", buffers), (req, "mamba_next_track_idx", 0)]
                track.append([int(b) for b in buffers.tolist()])
        for req, name, value in updates:
            setattr(req, name, value)
        rows = torch.tensor(select, dtype=torch.int64, device=self.device)
        self.req_index_to_mamba_index_mapping[rows] = torch.tensor(mamba_index, dtype=torch.int32, device=self.device)
        if self.enable_mamba_extra_buffer:
            self.req_index_to_mamba_ping_pong_track_buffer_mapping[rows] = torch.tensor(
                track, dtype=torch.int32, device=self.device
            )
        return select

    def _refuse(self, select: list[int], taken: list[torch.Tensor], what: str):
        ReqToTokenPool.free(self, select)
        for slots in taken:
            self.mamba_pool.free(slots)
        raise RuntimeError(
            f"out of hybrid-model state slots: no {what} left for a new request ({self.mamba_pool.size} slots, "
            f"{self.mamba_pool.available_size()} free): {MORE_SLOTS}"
        )

    def get_mamba_indices(self, req_indices: torch.Tensor) -> torch.Tensor:
        return self.req_index_to_mamba_index_mapping[req_indices]

    @property
    def mamba_v2p_table(self) -> Optional[torch.Tensor]:
        """The state pool's virtual -> physical slot table (a unified memory's states), or None when the slots it
        hands out are the physical ones (SGLang's API)."""
        return getattr(self.mamba_pool, "virtual_to_physical", None)

    def translate_mamba_indices(self, mamba_indices: torch.Tensor) -> torch.Tensor:
        """The physical slots of the state ids the table holds (what state kernels, ``copy_from`` and CPU copies
        index): the ids themselves, or their entries in :attr:`mamba_v2p_table` (int32)."""
        table = self.mamba_v2p_table
        return mamba_indices if table is None else table[mamba_indices.long()].to(torch.int32)

    def mamba2_layer_cache(self, layer_id: int) -> MambaState:
        """The states of global layer ``layer_id`` (a linear-attention layer), once a layer-wise load of that layer
        is done (:meth:`register_layer_transfer_counter`)."""
        index = self.mamba_map.get(layer_id)
        if index is None:
            raise IndexError(f"layer {layer_id} keeps no linear-attention state; those layers are {sorted(self.mamba_map)}")
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id - self.start_layer)
        return self.mamba_pool.mamba2_layer_cache(index)

    def get_state_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """The state slots' buffer infos (:meth:`MambaPool.get_contiguous_buf_infos`), for transfer engines."""
        return self.mamba_pool.get_contiguous_buf_infos()

    def get_mamba_ping_pong_other_idx(self, mamba_next_track_idx: int) -> int:
        return 1 - mamba_next_track_idx if self.mamba_ping_pong_track_buffer_size == 2 else mamba_next_track_idx

    def get_mamba_ping_pong_keep_idx(self, req: Any) -> int:
        """Which track slot of ``req`` holds its latest tracked state: ``mamba_next_track_idx`` in the lazy mode
        (no swap after a track), the other one otherwise."""
        if self.enable_mamba_extra_buffer_lazy:
            return req.mamba_next_track_idx
        return self.get_mamba_ping_pong_other_idx(req.mamba_next_track_idx)

    def set_mamba_ping_pong_slot(self, req: Any, idx: int, value) -> None:
        """Set track slot ``idx`` of ``req`` (its ``mamba_ping_pong_track_buffer``, and the table row of its
        ``req_pool_idx``) to state slot ``value``: how the lazy mode's second slot gets filled."""
        req.mamba_ping_pong_track_buffer[idx] = value
        self.req_index_to_mamba_ping_pong_track_buffer_mapping[req.req_pool_idx] = req.mamba_ping_pong_track_buffer.to(
            device=self.device, dtype=torch.int32)  # fmt: skip

    def free(self, free_index, free_mamba_cache: bool = True, mamba_ping_pong_track_buffer_to_keep: int | None = None):
        """Give back request slots; with ``free_mamba_cache`` their state slots too (a chunked prefill keeps
        them), and their ping-pong buffers but ``mamba_ping_pong_track_buffer_to_keep`` (0 or 1)."""
        rows = [free_index] if isinstance(free_index, int) else [int(i) for i in free_index]
        super().free(rows)
        if not free_mamba_cache or not rows:
            return
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self.mamba_pool.free(self.req_index_to_mamba_index_mapping[index].to(torch.int64))
        if self.enable_mamba_extra_buffer:
            track = self.req_index_to_mamba_ping_pong_track_buffer_mapping[index]
            if mamba_ping_pong_track_buffer_to_keep is not None:
                if mamba_ping_pong_track_buffer_to_keep not in (0, 1):
                    raise ValueError(f"mamba_ping_pong_track_buffer_to_keep must be 0 or 1, got {mamba_ping_pong_track_buffer_to_keep}")
                keep = [i for i in range(self.mamba_ping_pong_track_buffer_size) if i != mamba_ping_pong_track_buffer_to_keep]
                track = track[:, keep]
            track = track.reshape(-1)
            if self.enable_mamba_extra_buffer_lazy:  # a lazy request's unset slots are -1 (dropping them reads the
                track = track[track >= 0]  # device: the lazy mode's frees wait for it, the others never do)
            self.mamba_pool.free(track.to(torch.int64))

    def clear(self) -> None:
        super().clear()
        if hasattr(self, "mamba_pool"):
            self.mamba_pool.clear()
            self.req_index_to_mamba_index_mapping.zero_()
            if self.enable_mamba_extra_buffer:
                self.req_index_to_mamba_ping_pong_track_buffer_mapping.zero_()


class HybridLinearKVPool(KVCache):
    """K/V of a hybrid model's full-attention layers only (an MHA pool inside, or an MLA pool with ``use_mla``,
    its latent rows of ``kv_lora_rank + qk_rope_head_dim``), beside the linear layers' states in ``mamba_pool``.
    Layers are this rank's global ids; a linear layer has no K/V, and asking for one is an error that lists the
    attention layers.

    ``buffers()`` names the K/V and the state tensors (the layout declares both); the states are
    :meth:`request_state_buffers`, reported by :meth:`get_state_buf_infos` and not by :meth:`get_kv_size_bytes`
    (the inner pool's answer, as in SGLang).  Moves, CPU offload and buffer infos cover the per-token K/V (the
    inner pool's rows), and CPU offload also copies the states of ``mamba_indices`` when given (SGLang's
    retraction keywords).

    SGLang's constructor keywords:

    :param mamba_pool: the states' :class:`MambaPool`, or None for a pool of the attention layers' K/V alone (no
        state buffers; CPU copies of states are refused).
    :param full_kv_pool_class: the class the attention layers' pool is built with.  Without ``use_mla``:
        kvcore's :class:`~kvcore_mha.MHATokenToKVPool` (the default) or
        :class:`~kvcore_mha.PageMajorMHATokenToKVPool` (SGLang's page-major switch), or a subclass.  With
        ``use_mla`` the latent rows go to kvcore's :class:`~kvcore_mla.pool.MLATokenToKVPool` (or a given
        subclass of it); the MHA class SGLang's configurator passes either way (its ``mha_pool_class``) is
        accepted there and names no choice.  Any other class is a :class:`~kvcore.errors.ConfigError`.
    :param enable_kv_cache_copy: accepted either way: :meth:`move_kv_cache` always exists.
    :param post_capture_active: only False (kvcore allocates the pool when built); True is a ConfigError.
    :param start_layer: the rank's first global layer (default the first full-attention layer).
    :param enable_kvcache_transpose: only False (the older SGLang keyword; a transposed cache is a ConfigError).
    :param full_kv_pool: the attention layers' pool, built by the caller (SGLang's unified memory passes one laid
        over its shared bytes), instead of one of ``full_kv_pool_class``; it must keep one layer per
        ``full_attention_layer_ids``.
    """

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        page_size: int,
        head_num: int,
        head_dim: int,
        full_attention_layer_ids: Sequence[int],
        device: str,
        mamba_pool: Optional[MambaPool],
        enable_memory_saver: bool = False,
        v_head_dim: int | None = None,
        start_layer: int | None = None,
        end_layer: int | None = None,
        kernels: str = "auto",
        use_mla: bool = False,
        kv_lora_rank: int | None = None,
        qk_rope_head_dim: int | None = None,
        enable_kv_cache_copy: bool = False,
        full_kv_pool_class: type | None = None,
        post_capture_active: bool = False,
        enable_kvcache_transpose: bool = False,
        full_kv_pool: KVCache | None = None,
    ):
        check_post_capture("HybridLinearKVPool", post_capture_active)
        if enable_kvcache_transpose:  # the keyword of SGLang's older pools; SGLang refuses True too
            raise unsupported("HybridLinearKVPool", "enable_kvcache_transpose", enable_kvcache_transpose,
                              "a transposed KV cache", "pass enable_kvcache_transpose=False")  # fmt: skip
        full = [int(i) for i in full_attention_layer_ids]
        if not full:
            raise ValueError("HybridLinearKVPool needs at least one full-attention layer")
        start = min(full) if start_layer is None else start_layer
        end = max(full) if end_layer is None else end_layer
        super().__init__(size, page_size, dtype, end - start + 1, device, enable_memory_saver, start, end, kernels)
        self.full_attention_layer_ids = full
        self.full_attention_layer_id_mapping = {gid: i for i, gid in enumerate(full)}
        self.head_num, self.head_dim = head_num, head_dim
        self.v_head_dim = v_head_dim if v_head_dim is not None else head_dim
        self.use_mla = use_mla
        common = dict(size=size, page_size=page_size, dtype=dtype, layer_num=len(full), device=device,
                      enable_memory_saver=enable_memory_saver, kernels=kernels)  # fmt: skip
        if full_kv_pool is not None:  # built by the caller (a unified memory's pool over its shared bytes)
            if full_kv_pool.layer_num != len(full):
                raise ValueError(f"the given full_kv_pool keeps {full_kv_pool.layer_num} layers, not the "
                                 f"{len(full)} of full_attention_layer_ids")  # fmt: skip
            self.full_kv_pool = full_kv_pool
        elif use_mla:
            from kvcore_mla.pool import MLATokenToKVPool

            cls = full_kv_pool_class
            if cls is None or cls is MHATokenToKVPool:  # the configurator's mha_pool_class: no choice for latent rows
                cls = MLATokenToKVPool
            check_pool_class("HybridLinearKVPool", "full_kv_pool_class", cls, (MLATokenToKVPool,))
            if kv_lora_rank is None or qk_rope_head_dim is None:
                raise ValueError("use_mla=True needs kv_lora_rank and qk_rope_head_dim")
            self.full_kv_pool = cls(kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim, **common)
        else:
            cls = full_kv_pool_class or MHATokenToKVPool
            check_pool_class("HybridLinearKVPool", "full_kv_pool_class", cls,
                             (MHATokenToKVPool, PageMajorMHATokenToKVPool), refused=(NoOpMHATokenToKVPool,))  # fmt: skip
            self.full_kv_pool = cls(head_num=head_num, head_dim=head_dim, v_head_dim=v_head_dim, **common)
        self.mamba_pool = mamba_pool
        self._full_names = set(self.full_kv_pool.buffers()) | set(self.full_kv_pool.token_rows())
        self._finalize_allocation()

    def _route(self, layer: Any, layer_id_override: int | None = None) -> int:
        layer_id = layer_id_of(layer) if layer_id_override is None else layer_id_override
        index = self.full_attention_layer_id_mapping.get(layer_id)
        if index is None:
            raise IndexError(
                f"layer {layer_id} has no K/V in this HybridLinearKVPool: it is a linear-attention layer or not on "
                f"this rank; the full-attention layers are {self.full_attention_layer_ids}"
            )
        self._wait_for_layer(layer_id - self.start_layer)
        return index

    def layer_in_buffer(self, name: str, layer: int) -> int | None:
        if name in self._full_names:
            return self.full_attention_layer_id_mapping.get(layer)
        return None

    def buffers(self) -> dict[str, torch.Tensor]:
        return {**self.full_kv_pool.buffers(), **self.request_state_buffers()}

    def request_state_buffers(self) -> dict[str, torch.Tensor]:
        """The linear layers' states (every :class:`MambaPool` buffer); none without a ``mamba_pool``."""
        return {} if self.mamba_pool is None else self.mamba_pool.buffers()

    def token_buffers(self) -> dict[str, torch.Tensor]:
        return self.full_kv_pool.token_buffers()

    def token_rows(self) -> dict[str, TokenRows]:
        return self.full_kv_pool.token_rows()

    def size_groups(self) -> dict[str, int]:
        sizes = {"tokens": self.size}
        if self.mamba_pool is not None:
            sizes["requests"] = self.mamba_pool.size
            if self.mamba_pool.spec_state_size:
                sizes["running_requests"] = self.mamba_pool.spec_state_size
        return sizes

    def get_kv_size_bytes(self):
        """The full-attention pool's answer, as in SGLang: ``(K bytes, V bytes)`` for MHA K/V, one int for MLA
        latent rows.  The states are not K/V: :meth:`get_state_buf_infos` reports them."""
        return self.full_kv_pool.get_kv_size_bytes()

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """The full-attention pool's K/V buffer infos (SGLang's split: the states are :meth:`get_state_buf_infos`)."""
        return self.full_kv_pool.get_contiguous_buf_infos()

    def get_state_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """Per state tensor and linear layer: (data pointer, bytes, bytes of one slot); empty without a
        ``mamba_pool``."""
        return ([], [], []) if self.mamba_pool is None else self.mamba_pool.get_contiguous_buf_infos()

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """The full-attention pool's move (every attention layer's K/V rows; states are per request)."""
        self.full_kv_pool.move_kv_cache(tgt_loc, src_loc)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.full_kv_pool.get_key_buffer(self._route(layer_id))

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.full_kv_pool.get_value_buffer(self._route(layer_id))

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor | None = None,
                      k_scale=None, v_scale=None, layer_id_override: int | None = None) -> None:  # fmt: skip
        index = self._route(layer, layer_id_override)
        self.full_kv_pool.set_kv_buffer(None, loc, cache_k, cache_v, k_scale, v_scale, layer_id_override=index)

    def set_mla_kv_buffer(self, layer, loc: torch.Tensor, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor,
                          layer_id_override: int | None = None) -> None:  # fmt: skip
        """The MLA pool's split store (``use_mla`` only)."""
        self._mla().set_mla_kv_buffer(None, loc, cache_k_nope, cache_k_rope, layer_id_override=self._route(layer, layer_id_override))

    def get_mla_kv_buffer(self, layer, loc: torch.Tensor, dst_dtype: torch.dtype | None = None):
        """The MLA pool's gather (``use_mla`` only)."""
        return self._mla().get_mla_kv_buffer(self._route(layer), loc, dst_dtype)

    def _mla(self):
        if not self.use_mla:
            raise TypeError("this HybridLinearKVPool keeps MHA K/V (use_mla=False): use set_kv_buffer / get_kv_buffer")
        return self.full_kv_pool

    def self_test_write(self, layer: int, loc: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The inner pool's own random write, at the full-attention layer's index there."""
        return self.full_kv_pool.self_test_write(self._route(layer), loc, generator)

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        """K/V rows of tokens ``indices`` and, when ``mamba_indices`` is given, those state slots too."""
        kv = super().get_cpu_copy(indices)
        if mamba_indices is None:
            return kv
        if self.mamba_pool is None:
            raise ValueError("this HybridLinearKVPool keeps no states (built with mamba_pool=None); pass no mamba_indices")
        slots = torch.as_tensor(mamba_indices, device=self.device).long().reshape(-1)
        states = {}
        for name, stacked in self.mamba_pool.slot_buffers().items():
            host = host_buffer((stacked.shape[0], slots.numel(), *stacked.shape[2:]), stacked.dtype)
            host.copy_(stacked.index_select(1, slots))
            states[name] = host
        return {"kv": kv, "mamba": states}

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None) -> None:
        """Write back a :meth:`get_cpu_copy` result (its states at ``mamba_indices``, required when it has them)."""
        if "mamba" not in kv_cache_cpu:
            super().load_cpu_copy(kv_cache_cpu, indices)
            return
        if mamba_indices is None:
            raise ValueError("this CPU copy holds request states: pass mamba_indices= for the slots to load them into")
        super().load_cpu_copy(kv_cache_cpu["kv"], indices)
        slots = torch.as_tensor(mamba_indices, device=self.device).long().reshape(-1)
        for name, stacked in self.mamba_pool.slot_buffers().items():
            stacked.index_copy_(1, slots, kv_cache_cpu["mamba"][name].to(stacked.device))

