"""DeepSeekV4TokenToKVPool: DeepSeek-V4's window latents, compressed latents, indexer keys and compressor states."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from kvcore.pools import KVCache, buf_infos, pair_by_layers, unsupported
from kvcore.sample import random_nonzero
from kvcore.token_rows import TokenRows
from kvcore_dsv4.layout import (COMPRESSED_RATIOS, LATENT_BYTES_PER_TOKEN, LATENT_DATA_BYTES, LATENT_SCALE_BYTES,
                                RATIOS, index_page_bytes, latent_page_bytes, ring_size, state_pad_rows,
                                state_row_width)  # fmt: skip
from kvcore_dsv4.states import CompressStatePool

#: SGLang's name of the only page format kvcore stores (fp8 nope with power-of-two scales, bf16 rope)
KV_LAYOUT = "v4"


def _pages(size: int, page_size: int, global_page_size: int) -> int:
    """Pages of a buffer of ``size`` slots: the size plus the allocator's reserved logical page, in whole pages
    (SGLang's ``_num_dsv4_physical_kv_pages``)."""
    return -(-(size + global_page_size) // page_size)


class DeepSeekV4LayerItem(NamedTuple):
    """Where a layer's compressed storage is: its ratio, its index among that ratio's layers, and the pool."""

    compress_ratio: int
    compress_layer_id: int
    compress_kv_pool: DeepSeekV4SingleKVPool | None


class DeepSeekV4SingleKVPool:
    """Latent pages of one kind (the window, or the compressed latents of one ratio), one ``[pages, page_bytes]``
    uint8 buffer per layer (views of one stacked buffer): SGLang's ``DeepSeekV4SingleKVPool`` of the V4 layout.

    A slot's data row (448 fp8 nope bytes, 64 bf16 rope values) is at ``slot % page_size`` x 576 bytes into its
    page, its scale row (7 power-of-two scale bytes and a padding byte) at ``page_size`` x 576 + ``slot %
    page_size`` x 8.  :meth:`set_key_buffer_fused` quantizes and stores ``[n, 512]`` latents in one launch
    (:mod:`kvcore_dsv4.kernels`; the torch reference with ``use_triton=False``).
    """

    kv_layout = KV_LAYOUT
    #: bytes per slot, as SGLang's attention reads the buffer's format from it
    kv_cache_total_dim = LATENT_BYTES_PER_TOKEN

    def __init__(self, stacked: torch.Tensor, page_size: int, use_triton: bool):
        self.page_size = page_size
        self.stacked = stacked
        self.kv_buffer = list(stacked.unbind(0))
        self.layer_num = len(self.kv_buffer)
        self._use_triton = use_triton
        self._store = None
        self.bytes_per_page_padded = stacked.shape[-1]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id]

    def set_key_buffer_fused(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, freqs_cis=None) -> None:
        """Quantize ``cache_k`` ``[n, 512]`` (rotated latents) into slots ``loc`` (negative slots are skipped)."""
        if freqs_cis is not None:
            raise unsupported("DeepSeekV4SingleKVPool", "freqs_cis", "a tensor", "rotating the rope inside the store "
                              "(the fp4 layouts of DeepSeek-V4.1)", "pass rotated latents and freqs_cis=None")  # fmt: skip
        store = self._store
        if store is None:  # imported on the first store, so building a pool loads no Triton kernel
            if self._use_triton:
                from kvcore_dsv4.kernels import store_latent_triton as store
            else:
                from kvcore_dsv4.quantize import store_latent_native as store
            self._store = store
        store(self.kv_buffer[layer_id], loc, cache_k, self.page_size)

    def read(self, layer_id: int, loc: torch.Tensor) -> torch.Tensor:
        """Dequantized latents of slots ``loc``: float32 ``[n, 512]`` (torch; for checks and offline reads)."""
        from kvcore_dsv4.quantize import read_latent

        return read_latent(self.kv_buffer[layer_id], loc, self.page_size)

    def token_rows(self, index_map: torch.Tensor | None = None) -> dict[str, TokenRows]:
        """Each slot's data row (576-byte rows) and scale row (8-byte rows), as rows of the stacked buffer."""
        layers, pages, page_bytes = self.stacked.shape
        data = self.stacked.view(layers, pages * page_bytes // LATENT_DATA_BYTES, LATENT_DATA_BYTES)
        scales = self.stacked.view(layers, pages * page_bytes // LATENT_SCALE_BYTES, LATENT_SCALE_BYTES)
        return {
            "data": TokenRows(data, self.page_size, page_bytes // LATENT_DATA_BYTES, 0, index_map),
            "scales": TokenRows(scales, self.page_size, page_bytes // LATENT_SCALE_BYTES,
                                self.page_size * LATENT_DATA_BYTES // LATENT_SCALE_BYTES, index_map),  # fmt: skip
        }


class DeepSeekV4IndexerPool:
    """The ratio-4 layers' lightning-indexer keys: per compressed slot 128 fp8 bytes, their float32 scale after the
    page's keys; one ``[pages, page_bytes]`` uint8 buffer per layer (SGLang's ``DeepSeekV4IndexerPool``, fp8)."""

    quant_block_size = 128
    use_fp4_indexer = False

    def __init__(self, stacked: torch.Tensor, page_size: int, index_head_dim: int, use_triton: bool):
        self.page_size = self.index_page_size = page_size
        self.index_head_dim = index_head_dim
        self.stacked = stacked
        self.index_k_with_scale_buffer = list(stacked.unbind(0))
        self._use_triton = use_triton
        self._store = None

    def get_bytes_per_token(self) -> int:
        return self.index_head_dim + self.index_head_dim // self.quant_block_size * 4

    def get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        return self.index_k_with_scale_buffer[layer_id]

    def set_index_fused(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor) -> None:
        """Quantize ``cache_k`` ``[n, index_head_dim]`` (one fp8 scale per key) into slots ``loc``."""
        store = self._store
        if store is None:  # imported on the first store, as the latent pages' is
            if self._use_triton:
                from kvcore_dsv4.kernels import store_index_triton as store
            else:
                from kvcore_dsv4.quantize import store_index_native as store
            self._store = store
        store(self.index_k_with_scale_buffer[layer_id], loc, cache_k, self.page_size)

    def read(self, layer_id: int, loc: torch.Tensor) -> torch.Tensor:
        """Dequantized keys of slots ``loc``: float32 ``[n, index_head_dim]`` (torch)."""
        from kvcore_dsv4.quantize import read_index

        return read_index(self.index_k_with_scale_buffer[layer_id], loc, self.page_size)


class DeepSeekV4TokenToKVPool(KVCache):
    """SGLang's ``DeepSeekV4TokenToKVPool`` (default CUDA path: V4 pages, offline compression), with the
    configurator's constructor keywords.

    * **Window** (every layer): ``swa_size`` latent slots in pages of ``swa_page_size``, addressed by window slot
      (SGLang's ``SWATokenToKVPoolAllocator`` maps full locations to them and registers the map:
      :meth:`register_mapping`).  ``size`` is ``swa_size``, as in SGLang.
    * **Compressed latents** of the ratio-4 and ratio-128 layers: ``c4_size`` / ``c128_size`` slots in pages of
      ``page_size // ratio``; full location ``t`` is compressed slot ``t // ratio``.
    * **Indexer keys** of the ratio-4 layers: ``c128_size * 32`` slots (one per ratio-4 slot), pages of
      ``page_size // 4``.
    * **Compressor states**: ratio 4's attention and indexer states (``c4_state_pool_size`` rows, rings per window
      page), ratio 128's (rings per request slot, ``max(c128_state_pool_size, num_req_slots x ring)`` rows), each
      with the padding of :func:`~kvcore_dsv4.layout.state_pad_rows`: :class:`~kvcore_dsv4.states.CompressStatePool`
      per layer (:meth:`get_attention_compress_states`, :meth:`get_indexer_compress_states`).

    Buffers (stacked over the layers of each kind, as :func:`~kvcore_dsv4.layout.dsv4_layout` declares them):
    ``swa_kv``, ``c4_kv``, ``c128_kv``, ``c4_index``, ``c4_state``, ``c4_index_state``, ``c128_state``.  Transfer
    engines see SGLang's groups: :meth:`get_contiguous_buf_infos` (compressed latents and indexer keys, by full
    page), :meth:`get_state_buf_infos` (window pages and ratio-4 states), :meth:`get_request_state_buf_infos`
    (ratio-128 states).  Moves and CPU offload cover the window's rows (what a full location keeps whole).

    :param end_layer: one past this rank's last layer, as SGLang passes it; ``compression_ratios[start_layer:
        end_layer]`` are this rank's layers' ratios (default: ``layer_num`` layers from ``start_layer``).
    :param num_req_slots: request slots of the ratio-128 rings (default ``max_num_reqs + 1``: the request table's
        rows).
    :param online_mtp_max_draft_tokens: above 0 (speculative decoding) the rings are SGLang's drafting sizes
        (16 and 256 rows).
    :param enable_hisparse: the ratio-4 latents' ``c4_size`` device slots hold the hot ones of the ``c128_size x 32``
        logical slots, every one of which has a pinned host copy (:class:`~kvcore_dsv4.hisparse.HiSparseC4DevicePool`;
        pair the pool with :class:`~kvcore_dsv4.hisparse.DeepSeekV4HiSparseTokenToKVPoolAllocator`).
    :param unified_fp8: / ``kv_source_layers``, ``is_draft_worker``, ``kv_layout``, ``compressed_kv_layout``: only
        their defaults (the V4 pages of a target worker); another value is a :class:`~kvcore.errors.ConfigError`
        naming it.
    """

    #: relative RMS error of a latent's round trip (fp8 e4m3 with power-of-two tile scales)
    lossy_bound = 0.07

    def __init__(
        self,
        max_num_reqs: int,
        swa_size: int,
        c4_size: int,
        c128_size: int,
        c4_state_pool_size: int,
        c128_state_pool_size: int,
        page_size: int,
        swa_page_size: int,
        dtype: torch.dtype,
        c4_state_dtype: torch.dtype | None,
        c128_state_dtype: torch.dtype | None,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        indexer_head_dim: int,
        layer_num: int,
        device: str,
        enable_memory_saver: bool,
        compression_ratios: Sequence[int],
        sliding_window: int = 128,
        start_layer: int | None = None,
        end_layer: int | None = None,
        enable_hisparse: bool = False,
        online_mtp_max_draft_tokens: int = 0,
        num_req_slots: int | None = None,
        unified_fp8: bool | None = None,
        kv_source_layers: Sequence[int] = (),
        full_size: int | None = None,
        is_draft_worker: bool = False,
        kv_layout: Any = KV_LAYOUT,
        compressed_kv_layout: str | None = None,
        kernels: str = "auto",
    ):
        owner = "DeepSeekV4TokenToKVPool"
        for name, value, default, feature in (
            ("unified_fp8", bool(unified_fp8), False, "the unified fp8 latent rings"),
            ("is_draft_worker", is_draft_worker, False, "a draft worker's pool (it shares the target's)"),
            ("kv_source_layers", tuple(kv_source_layers), (), "ratio-1/2 source layers (DeepSeek-V4.1)"),
            ("kv_layout", str(getattr(kv_layout, "value", kv_layout)).lower(), KV_LAYOUT, "another page layout"),
            ("compressed_kv_layout", compressed_kv_layout in (None, "auto", "fp8"), True, "fp4 compressed pages"),
        ):
            if value != default:
                raise unsupported(owner, name, value, feature, f"pass {name}={default!r}")
        if qk_nope_head_dim + qk_rope_head_dim != 512 or qk_rope_head_dim != 64:
            raise ValueError(f"qk_nope_head_dim={qk_nope_head_dim}, qk_rope_head_dim={qk_rope_head_dim}: the V4 pages "
                             "hold 448 nope and 64 rope values")  # fmt: skip
        ratios_all = [int(r) for r in compression_ratios]
        start = start_layer or 0
        end = start + layer_num if end_layer is None else int(end_layer)
        if end - start != layer_num or len(ratios_all) < end:
            raise ValueError(f"layers {start}..{end - 1} (layer_num={layer_num}) need compression_ratios for each; "
                             f"got {len(ratios_all)} entries")  # fmt: skip
        stage = ratios_all[start:end]
        bad = sorted({r for r in stage if r not in RATIOS})
        if bad:
            raise unsupported(owner, "compression_ratios", bad, "compression ratios other than 0, 4 and 128",
                              "DeepSeek-V4's layers have ratios 0, 4 and 128")  # fmt: skip
        if page_size % 128 or page_size % swa_page_size or swa_size % swa_page_size:
            raise ValueError(f"page_size={page_size} must be a multiple of 128 and of swa_page_size={swa_page_size}, "
                             f"and swa_size={swa_size} whole pages of it")  # fmt: skip
        super().__init__(swa_size, swa_page_size, dtype, layer_num, device, enable_memory_saver, start, end - 1, kernels)
        self.store_dtype = torch.uint8
        self.max_num_reqs = max_num_reqs
        self.num_req_slots = num_req_slots if num_req_slots is not None else max_num_reqs + 1
        self.swa_size, self.swa_page_size, self.global_page_size = swa_size, swa_page_size, page_size
        self.c4_size, self.c128_size = c4_size, c128_size
        self.c4_logical_size = c128_size * 32
        self.full_size = full_size if full_size is not None else c128_size * 128
        self.sliding_window = sliding_window
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.indexer_head_dim = qk_nope_head_dim, qk_rope_head_dim, indexer_head_dim
        self.compression_ratios = ratios_all
        self.online_mtp_max_draft_tokens = online_mtp_max_draft_tokens
        self._stage_start, self._stage_end = start, end
        drafting = online_mtp_max_draft_tokens > 0
        self._rings = {r: ring_size(r, drafting) for r in COMPRESSED_RATIOS}
        latent = qk_nope_head_dim + qk_rope_head_dim
        u8 = dict(dtype=torch.uint8, device=device)
        self._buffers: dict[str, torch.Tensor] = {}

        def make(name: str, layers: int, rows: int, width: int, **kw) -> torch.Tensor:
            self._buffers[name] = torch.zeros((layers, rows, width), **kw)
            return self._buffers[name]

        self.swa_kv_pool = DeepSeekV4SingleKVPool(
            make("swa_kv", layer_num, _pages(swa_size, swa_page_size, swa_page_size), latent_page_bytes(swa_page_size), **u8),
            swa_page_size, self._use_triton)  # fmt: skip
        self.kv_pools: dict[int, DeepSeekV4SingleKVPool | None] = {}
        sizes = {4: c4_size, 128: c128_size}
        self.enable_hisparse = bool(enable_hisparse)
        for r in COMPRESSED_RATIOS:
            n = stage.count(r)
            if not n:
                self.kv_pools[r] = None
                continue
            stacked = make(f"c{r}_kv", n, _pages(sizes[r], page_size // r, page_size), latent_page_bytes(page_size // r),
                           **u8)  # fmt: skip
            if r == 4 and self.enable_hisparse:  # c4_size device slots for every logical ratio-4 slot
                from kvcore_dsv4.hisparse import HiSparseC4DevicePool

                self.kv_pools[r] = HiSparseC4DevicePool(stacked, page_size // r, self._use_triton, c4_size,
                                                        self.c4_logical_size, page_size)  # fmt: skip
            else:
                self.kv_pools[r] = DeepSeekV4SingleKVPool(stacked, page_size // r, self._use_triton)
        self.index_pools: dict[int, DeepSeekV4IndexerPool] = {}
        n4, n128 = stage.count(4), stage.count(128)
        state_dtypes = {4: c4_state_dtype or torch.float32, 128: c128_state_dtype or torch.float32}
        states: dict[int, list[CompressStatePool]] = {}
        index_states: list[CompressStatePool] = []
        if n4:
            ring = self._rings[4]
            self.index_pools[4] = DeepSeekV4IndexerPool(
                make("c4_index", n4, _pages(self.c4_logical_size, page_size // 4, page_size),
                     index_page_bytes(page_size // 4, indexer_head_dim), **u8),
                page_size // 4, indexer_head_dim, self._use_triton)  # fmt: skip
            rows = c4_state_pool_size + state_pad_rows(4, ring)
            kw = dict(dtype=state_dtypes[4], device=device)
            states[4] = self._state_pools(make("c4_state", n4, rows, state_row_width(4, latent), **kw), 4)
            index_states = self._state_pools(make("c4_index_state", n4, rows, state_row_width(4, indexer_head_dim), **kw), 4)
        if n128:
            ring = self._rings[128]
            rows = max(c128_state_pool_size, self.num_req_slots * ring) + state_pad_rows(128, ring)
            states[128] = self._state_pools(make("c128_state", n128, rows, state_row_width(128, latent),
                                                 dtype=state_dtypes[128], device=device), 128)  # fmt: skip
        self.c4_kv_pool, self.c128_kv_pool = self.kv_pools.get(4), self.kv_pools.get(128)
        self.c4_indexer_kv_pool = self.index_pools.get(4)
        # layer_mapping / compress_state_pools are indexed by global layer id, as in SGLang
        self.layer_mapping: list[DeepSeekV4LayerItem | None] = [None] * len(ratios_all)
        self.compress_state_pools: list[CompressStatePool | None] = [None] * len(ratios_all)
        self.indexer_compress_state_pools: list[CompressStatePool | None] = [None] * len(ratios_all)
        seen = {0: 0, 4: 0, 128: 0}
        for gid in range(start, end):
            r = ratios_all[gid]
            self.layer_mapping[gid] = DeepSeekV4LayerItem(r, seen[r], self.kv_pools.get(r))
            if r:
                self.compress_state_pools[gid] = states[r][seen[r]]
            if r == 4:
                self.indexer_compress_state_pools[gid] = index_states[seen[r]]
            seen[r] += 1
        self.present_ratios = tuple(r for r in COMPRESSED_RATIOS if self.kv_pools[r] is not None)
        self.full_to_swa_index_mapping: torch.Tensor | None = None
        self._finalize_allocation()

    def _state_pools(self, stacked: torch.Tensor, ratio: int) -> list[CompressStatePool]:
        return [CompressStatePool(layer, self._rings[ratio], ratio, self.swa_page_size) for layer in stacked.unbind(0)]

    # -- sizes, buffers, infos ----------------------------------------------------------------------------

    def buffers(self) -> dict[str, torch.Tensor]:
        return dict(self._buffers)

    def size_groups(self) -> dict[str, int]:
        sizes = {"tokens": self.full_size, "swa_tokens": self.swa_size}
        if "c128_state" in self._buffers:
            sizes["requests"] = self.num_req_slots
        return sizes

    def token_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers transfer engines address by full page, in SGLang's order: per ratio its latents, then its
        indexer keys.  With HiSparse the ratio-4 latents' device pages come first still, as SGLang lists them (its
        decode side of a disaggregated pair skips them and sends the host's copies instead)."""
        names = [n for r in COMPRESSED_RATIOS for n in (f"c{r}_kv", f"c{r}_index") if n in self._buffers]
        return {n: self._buffers[n] for n in names}

    def request_state_buffers(self) -> dict[str, torch.Tensor]:
        return {n: t for n, t in self._buffers.items() if n.endswith("_state")}

    def token_rows(self) -> dict[str, TokenRows]:
        """Each window slot's data and scale rows (behind the full -> window map once one is registered)."""
        rows = self.swa_kv_pool.token_rows(self.full_to_swa_index_mapping)
        return {f"swa_kv.{part}": r for part, r in rows.items()}

    def move_groups(self):
        """The window's rows by window slot (moves translate full locations first: :meth:`move_kv_cache`)."""
        if self._move_groups is None:
            self._move_groups = pair_by_layers(self.swa_kv_pool.token_rows().values())
        return self._move_groups

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """Move the window rows of full locations ``src_loc`` to ``tgt_loc`` (their window slots, once a map is
        registered).  Compressed latents, indexer keys and states belong to blocks of tokens and do not move with
        a token."""
        mapping = self.full_to_swa_index_mapping
        if mapping is not None and tgt_loc.numel() == src_loc.numel():
            tgt_loc, src_loc = mapping[tgt_loc.long()], mapping[src_loc.long()]
        super().move_kv_cache(tgt_loc, src_loc)

    def layer_in_buffer(self, name: str, layer: int) -> int | None:
        if not self.start_layer <= layer <= self.end_layer:
            return None
        if name.startswith("swa_kv"):
            return layer - self.start_layer
        item = self.layer_mapping[layer]
        kind = name.split("_")[0]
        if item is None or kind != f"c{item.compress_ratio}":
            return None
        if name.startswith("c4_index") and item.compress_ratio != 4:
            return None
        return item.compress_layer_id

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """Per layer of the compressed latents and indexer keys (SGLang's order): pointer, bytes, one full page."""
        return buf_infos([layer for stacked in self.token_buffers().values() for layer in stacked.unbind(0)], 1)

    def get_state_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """The window's pages (an item a page), then the ratio-4 attention and indexer states (an item a ring, which
        follows a window page)."""
        infos = buf_infos(self.swa_kv_pool.kv_buffer, 1)
        rings = [p.kv_score_buffer.kv_score for pools in (self.compress_state_pools, self.indexer_compress_state_pools)
                 for p in pools if p is not None and not p.request_scoped]  # fmt: skip
        more = buf_infos(rings, self._rings[4])
        return tuple(a + b for a, b in zip(infos, more))  # type: ignore[return-value]

    def get_request_state_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """The ratio-128 states, an item a ring page of ``ratio`` rows (what one pending block keeps)."""
        rings = [p.kv_score_buffer.kv_score for p in self.compress_state_pools if p is not None and p.request_scoped]
        return buf_infos(rings, 128)

    # -- the window ---------------------------------------------------------------------------------------

    def register_mapping(self, full_to_swa_index_mapping: torch.Tensor) -> None:
        """Use the allocator's full -> window slot map from now on (moves and offload follow it)."""
        self.full_to_swa_index_mapping = full_to_swa_index_mapping
        self._move_groups = self._movers = None

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        if self.full_to_swa_index_mapping is None:
            raise RuntimeError("no full -> window mapping registered; build the pool's SWATokenToKVPoolAllocator")
        return self.full_to_swa_index_mapping[kv_indices]

    def get_ring_size(self, compress_ratio: int) -> int:
        return self._rings[compress_ratio]

    def _swa_layer(self, layer_id: int) -> int:
        local = self.local_layer(layer_id)
        self._wait_for_layer(local)
        return local

    def get_swa_raw_buffer(self, layer_id: int) -> torch.Tensor:
        return self.swa_kv_pool.kv_buffer[self._swa_layer(layer_id)]

    get_swa_key_buffer_radix = get_swa_raw_buffer

    def set_swa_key_buffer_radix_fused(self, layer_id: int, swa_loc: torch.Tensor, cache_k: torch.Tensor) -> None:
        """Quantize and store ``cache_k`` ``[n, 512]`` (normed, rotated latents) at window slots ``swa_loc``."""
        self.swa_kv_pool.set_key_buffer_fused(self.local_layer(layer_id), swa_loc, cache_k)

    def get_swa_key_layout(self) -> str:
        return KV_LAYOUT

    def get_swa_key_page_size(self) -> int:
        return self.swa_page_size

    def get_swa_key_bytes_per_token(self) -> int:
        return LATENT_BYTES_PER_TOKEN

    # -- compressed latents and indexer keys --------------------------------------------------------------

    def _item(self, layer_id: int, want_ratio: int | None = None) -> DeepSeekV4LayerItem:
        self.local_layer(layer_id)
        item = self.layer_mapping[layer_id]
        if item is None or item.compress_ratio == 0 or (want_ratio is not None and item.compress_ratio != want_ratio):
            ratio = None if item is None else item.compress_ratio
            raise ValueError(f"layer {layer_id} has compression ratio {ratio}: it keeps "
                             f"{'no compressed latents' if not want_ratio else 'no indexer keys'} (ratio-4 and "
                             f"ratio-128 layers: {[g for g in range(self._stage_start, self._stage_end) if self.compression_ratios[g]]})")  # fmt: skip
        self._wait_for_layer(layer_id - self.start_layer)
        return item

    def get_extra_key_buffer(self, layer_id: int) -> torch.Tensor:
        _, index, pool = self._item(layer_id)
        return pool.get_key_buffer(index)

    def set_extra_key_buffer_fused(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, freqs_cis=None) -> None:
        """Quantize and store ``cache_k`` ``[n, 512]`` compressed latents at compressed slots ``loc``."""
        _, index, pool = self._item(layer_id)
        pool.set_key_buffer_fused(index, loc, cache_k, freqs_cis)

    def get_extra_key_page_size(self, layer_id: int) -> int:
        return self._item(layer_id).compress_kv_pool.page_size

    def get_extra_key_layout(self, layer_id: int) -> str:
        self._item(layer_id)
        return KV_LAYOUT

    def get_extra_key_bytes_per_token(self, layer_id: int) -> int:
        self._item(layer_id)
        return LATENT_BYTES_PER_TOKEN

    def get_index_k_page_size(self, compress_ratio: int = 4) -> int:
        return self.index_pools[compress_ratio].page_size

    def get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        _, index, _ = self._item(layer_id, 4)
        return self.index_pools[4].get_index_k_with_scale_buffer(index)

    def set_index_k_fused(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor) -> None:
        """Quantize and store indexer keys ``cache_k`` ``[n, index_head_dim]`` at ratio-4 slots ``loc``."""
        _, index, _ = self._item(layer_id, 4)
        self.index_pools[4].set_index_fused(index, loc, cache_k)

    # -- compressor states --------------------------------------------------------------------------------

    def get_attention_compress_states(self, layer_id: int) -> CompressStatePool:
        self._item(layer_id)
        return self.compress_state_pools[layer_id]

    def get_indexer_compress_states(self, layer_id: int) -> CompressStatePool:
        self._item(layer_id, 4)
        return self.indexer_compress_state_pools[layer_id]

    def clear_request_scoped_state(self, req_pool_idx: int) -> None:
        """Empty the ratio-128 rings of request slot ``req_pool_idx`` (a new request starts with no pending block)."""
        ring = self._rings[128]
        for pool in self.compress_state_pools:
            if pool is not None and pool.request_scoped:
                pool.kv_score_buffer[req_pool_idx * ring : (req_pool_idx + 1) * ring].clear()

    # -- the shared contract ------------------------------------------------------------------------------

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """The layer's window pages, as :meth:`get_swa_key_buffer_radix` (SGLang's pool raises here; DeepSeek-V4's
        only per-token rows are the window's)."""
        return self.get_swa_raw_buffer(layer_id)

    def set_kv_buffer(self, layer, loc, cache_k, *args, **kwargs) -> None:
        raise NotImplementedError("DeepSeek-V4 stores latents through set_swa_key_buffer_radix_fused (window) and "
                                  "set_extra_key_buffer_fused (compressed)")  # fmt: skip

    # -- checks -------------------------------------------------------------------------------------------

    def self_test_write(self, layer: int, loc: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Random bf16 latents for tokens ``loc`` of ``layer`` (their window slots); the rows the torch reference
        stores."""
        from kvcore_dsv4.quantize import quantize_latent

        latents = self._random_latents(loc.numel(), generator)
        slots = self._window_slots(loc)
        self.set_swa_key_buffer_radix_fused(layer, slots, latents)
        codes, rope, scales = quantize_latent(latents)
        pad = self.swa_kv_pool.token_rows()["scales"].take(slots, self.local_layer(layer))[:, LATENT_SCALE_BYTES - 1 :]
        return {"swa_kv.data": torch.cat([codes, rope], dim=1), "swa_kv.scales": torch.cat([scales, pad], dim=1)}

    def _window_slots(self, loc: torch.Tensor) -> torch.Tensor:
        """The window slots of tokens ``loc`` as :meth:`token_rows` addresses them (full locations once a map is
        registered, window slots before)."""
        mapping = self.full_to_swa_index_mapping
        return loc if mapping is None else mapping[loc.long()]

    def _random_latents(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return random_nonzero((n, self.qk_nope_head_dim + self.qk_rope_head_dim), torch.bfloat16, generator, 2.0,
                              self.device)  # fmt: skip

    def self_test_values(self, layer: int, loc: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        latents = self._random_latents(loc.numel(), generator)
        self.set_swa_key_buffer_radix_fused(layer, self._window_slots(loc), latents)
        return {"nope": latents[:, : self.qk_nope_head_dim].float(), "rope": latents[:, self.qk_nope_head_dim :].float()}

    def read_values(self, layer: int, loc: torch.Tensor) -> dict[str, torch.Tensor]:
        values = self.swa_kv_pool.read(self.local_layer(layer), self._window_slots(loc))
        return {"nope": values[:, : self.qk_nope_head_dim], "rope": values[:, self.qk_nope_head_dim :]}
