"""DSA's layer split (SGLang's ``LayerSplitDSATokenToKVPool``): a context-parallel group of prefill ranks shares one
DSA model's KV and indexer layers, each rank storing a contiguous share of them (``layer_shard_range``) plus one
*scratch* layer, and a read of any layer fetches it from its owner.

Why: under context parallelism every rank of the group runs every layer on its share of a prompt's tokens, but the
KV each needs is the same; keeping each layer once per group instead of once per rank gives each rank about
``layer_shard_size`` times the tokens for the same memory.

How reads work: the ranks run the same layers in the same order (SPMD), so a read of layer ``X`` is a collective:
its owner broadcasts its rows of ``X`` (latent rows and indexer pages) over the group, the other ranks receive them
into their scratch layer, and every rank then reads ``X`` (the owner from its own layer).  The scratch keeps the
last layer received until a write to that layer, a move or a CPU reload, so reading one layer's latent rows and
indexer pages costs one broadcast of each.  Writes to a layer another rank owns are dropped (its owner writes it).
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore.errors import ConfigError
from kvcore.pools import buf_infos, layer_id_of
from kvcore_dsa.pool import DSATokenToKVPool

__all__ = ["LayerSplitDSATokenToKVPool", "layer_owner", "layer_shard_range", "stacked_layers"]


def layer_shard_range(rank: int, shard_size: int, total_layers: int) -> tuple[int, int]:
    """The local layers ``[start, end)`` shard ``rank`` of ``shard_size`` owns: contiguous, as even as can be, the
    first ``total_layers % shard_size`` shards one more."""
    base, extra = divmod(total_layers, shard_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def layer_owner(local_layer: int, shard_size: int, total_layers: int) -> int:
    """The shard that owns local layer ``local_layer``."""
    for rank in range(shard_size):
        start, end = layer_shard_range(rank, shard_size, total_layers)
        if start <= local_layer < end:
            return rank
    raise ValueError(f"local layer {local_layer} is not one of {total_layers} layers")


def stacked_layers(rank: int, shard_size: int, total_layers: int) -> int:
    """What the stacked buffers of shard ``rank`` hold: its own layers, and the scratch layer (when there are
    others' layers to receive)."""
    start, end = layer_shard_range(rank, shard_size, total_layers)
    return end - start + (1 if shard_size > 1 else 0)


class LayerSplitDSATokenToKVPool(DSATokenToKVPool):
    """:class:`~kvcore_dsa.pool.DSATokenToKVPool` of which this rank stores layers ``layer_shard_start ..
    layer_shard_start + owned - 1`` (global ids) and one scratch layer (see the module docstring); SGLang's keywords.

    Buffers: ``kv`` and ``index_k`` stack the owned layers then the scratch (``kv_buffer`` / ``index_k_with_scale_
    buffer`` list them in that order, not by global layer).  :meth:`token_layers` and :meth:`layer_in_buffer` name
    the owned layers; the buffer infos for transfer engines cover them alone (the scratch is this rank's own).
    Reads of any layer (:meth:`get_key_buffer`, :meth:`get_mla_kv_buffer`, the indexer's reads) are collective over
    the group when another rank may need them; without a group (one process) only owned layers can be read.

    :param layer_shard_rank: this rank's shard (its context-parallel rank).
    :param layer_shard_size: how many ranks share the layers; more than 1.
    :param layer_shard_group: the ``torch.distributed`` process group of the shards, whose group ranks are the shard
        ranks (kvcore's extension; SGLang uses its attention CP group).  Default: the group
        :func:`kvcore.planning.distributed.context_parallel_group` holds (``kvcore.build_pools`` under torchrun makes
        it), looked up at the first read; none there, one process.
    :raises ConfigError: for a shard size under 2, or a rank outside it.
    """

    def __init__(self, *args: Any, layer_shard_rank: int, layer_shard_size: int, layer_shard_group: Any = None,
                 **kwargs: Any):  # fmt: skip
        if layer_shard_size is None or layer_shard_size < 2 or not 0 <= layer_shard_rank < layer_shard_size:
            raise ConfigError(f"LayerSplitDSATokenToKVPool(layer_shard_rank={layer_shard_rank}, layer_shard_size="
                              f"{layer_shard_size}): the layers are split over 2 or more ranks, this one among them; "
                              "with one rank build a DSATokenToKVPool")  # fmt: skip
        self.layer_shard_rank, self.layer_shard_size = int(layer_shard_rank), int(layer_shard_size)
        self.layer_shard_enabled = True
        self._group = layer_shard_group
        self._scratch_layer: int | None = None  # the global layer the scratch slot holds now (every rank the same)
        super().__init__(*args, **kwargs)
        start, end = layer_shard_range(self.layer_shard_rank, self.layer_shard_size, self.layer_num)
        self.layer_shard_start = self.start_layer + start  # SGLang's name: the first global layer owned
        #: global layer -> its slot in the stacked buffers (owned layers); the scratch slot comes after them
        self._slots = {self.start_layer + local: local - start for local in range(start, end)}
        self._scratch = end - start

    def _stacked_layers(self) -> int:
        return stacked_layers(self.layer_shard_rank, self.layer_shard_size, self.layer_num)

    # -- which layer is where -----------------------------------------------------------------------------

    def _is_layer_owned(self, layer_id: int) -> bool:
        return layer_id in self._slots

    def _global(self, layer: Any, layer_id_override: int | None = None) -> int:
        layer_id = layer_id_override if layer_id_override is not None else (
            layer if type(layer) is int else layer_id_of(layer))  # fmt: skip
        if not self.start_layer <= layer_id <= self.end_layer:
            raise IndexError(f"layer {layer_id} is not stored by this {type(self).__name__} (it holds layers "
                             f"{self.start_layer}..{self.end_layer})")  # fmt: skip
        return layer_id

    def local_layer(self, layer: Any, layer_id_override: int | None = None) -> int:
        """The slot of an owned layer in the stacked buffers.

        :raises IndexError: for a layer another shard owns (its writes are dropped before this; its reads go
            through the scratch)."""
        layer_id = self._global(layer, layer_id_override)
        slot = self._slots.get(layer_id)
        if slot is None:
            owner = layer_owner(layer_id - self.start_layer, self.layer_shard_size, self.layer_num)
            raise IndexError(f"layer {layer_id} is stored by layer shard {owner}; this one (shard "
                             f"{self.layer_shard_rank}) stores layers {self._owned_range()}")  # fmt: skip
        return slot

    def _owned_range(self) -> str:
        return f"{self.layer_shard_start}..{self.layer_shard_start + len(self._slots) - 1}"

    def layer_in_buffer(self, name: str, layer: int) -> int | None:
        return self._slots.get(layer)

    # -- reads: collective over the shards ----------------------------------------------------------------

    def _read_layer(self, layer: Any) -> int:
        """The slot holding ``layer``'s rows once every shard has them: its own, or the scratch after its owner
        broadcast it (unless the scratch holds it already)."""
        layer_id = self._global(layer)
        slot = self._slots.get(layer_id)
        group = self._shard_group()
        if group is None:
            if slot is None:
                owner = layer_owner(layer_id - self.start_layer, self.layer_shard_size, self.layer_num)
                raise RuntimeError(f"layer {layer_id} is stored by layer shard {owner}: reading it needs the shards' "
                                   "torch.distributed group (start the ranks with torchrun, or pass "
                                   "layer_shard_group=)")  # fmt: skip
        elif self._scratch_layer != layer_id:
            self._receive(layer_id, slot, group)
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id - self.start_layer)
        return self._scratch if slot is None else slot

    def _shard_group(self):
        if self._group is None:
            from kvcore.planning.distributed import context_parallel_group

            self._group = context_parallel_group()
            if self._group is not None and torch.distributed.get_rank(self._group) != self.layer_shard_rank:
                raise ConfigError(f"the context-parallel group ranks this process {torch.distributed.get_rank(self._group)}"
                                  f", but the pool was built for layer shard {self.layer_shard_rank}")  # fmt: skip
        return self._group

    def _receive(self, layer_id: int, slot: int | None, group) -> None:
        """Every stacked buffer's rows of ``layer_id`` from its owner into the other shards' scratch slot."""
        owner = layer_owner(layer_id - self.start_layer, self.layer_shard_size, self.layer_num)
        source = torch.distributed.get_global_rank(group, owner)
        for stacked in self.buffers().values():
            torch.distributed.broadcast(stacked[self._scratch if slot is None else slot], src=source, group=group)
        self._scratch_layer = layer_id

    def prefetch_kv_buffer(self, layer_id: int, layer_transfer_counter: Any = None, layer_transfer_idx: Any = None
                           ) -> None:  # fmt: skip
        """SGLang's: fetch ``layer_id``'s rows ahead of its attention (here at once, on the current stream)."""
        self._read_layer(layer_id)

    def get_broadcastable_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        """SGLang's name for the indexer pages of any layer: :meth:`get_index_k_with_scale_buffer`."""
        return self.get_index_k_with_scale_buffer(layer_id)

    def invalidate_index_buffer_for_layer(self, layer_id: int) -> None:
        """Forget the scratch copy of ``layer_id`` (every shard must call it alike)."""
        if self._scratch_layer == layer_id:
            self._scratch_layer = None

    # -- writes: owned layers only ------------------------------------------------------------------------

    def _drops(self, layer: Any, layer_id_override: int | None = None) -> bool:
        """Whether a write to ``layer`` is dropped (another shard owns it); the scratch copy of it goes stale."""
        layer_id = self._global(layer, layer_id_override)
        self.invalidate_index_buffer_for_layer(layer_id)
        return layer_id not in self._slots

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope, cache_k_rope, layer_id_override: int | None = None) -> None:
        if not self._drops(layer, layer_id_override):
            super().set_mla_kv_buffer(layer, loc, cache_k_nope, cache_k_rope, layer_id_override)

    def set_kv_buffer(self, layer, loc, cache_k, cache_v=None, k_scale=None, v_scale=None,
                      layer_id_override: int | None = None) -> None:  # fmt: skip
        if not self._drops(layer, layer_id_override):
            super().set_kv_buffer(layer, loc, cache_k, cache_v, k_scale, v_scale, layer_id_override)

    def set_index_k_scale_buffer(self, layer_id: int, loc, index_k, index_k_scale) -> None:
        if not self._drops(layer_id):
            super().set_index_k_scale_buffer(layer_id, loc, index_k, index_k_scale)

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        self._scratch_layer = None
        super().move_kv_cache(tgt_loc, src_loc)

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None) -> None:
        self._scratch_layer = None
        super().load_cpu_copy(kv_cache_cpu, indices, mamba_indices, req_pool_index)

    # -- transfer engines: the owned layers --------------------------------------------------------------

    def token_buffers(self) -> dict[str, torch.Tensor]:
        """The owned layers of the latent rows (what :meth:`get_contiguous_buf_infos` reports, per layer)."""
        return {"kv": self.kv_cache[: self._scratch]}

    def get_state_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """Per owned layer: the indexer pages."""
        return buf_infos(self.index_k_with_scale_buffer[: self._scratch], 1)
