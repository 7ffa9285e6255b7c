"""DSA token-to-KV pool (DeepSeek sparse attention, DeepSeek-V3.2): MLA latent rows plus the indexer's key pages."""

from __future__ import annotations

import torch

from kvcore.errors import ConfigError
from kvcore.pools import buf_infos, gather_outputs, tokens_of
from kvcore.sample import random_nonzero
from kvcore.token_rows import TokenRows
from kvcore_dsa import kernels
from kvcore_dsa.kernels import IndexerPages, ScaledRows
from kvcore_dsa.layout import (
    INDEX_PAGE_SIZE,
    INDEX_SCALE_BYTES,
    QUANT_BLOCK_SIZE,
    ROPE_STORAGE_DTYPE,
    calculate_mla_kv_cache_dim,
    check_dsa_dims,
    index_page_bytes,
    index_pages,
    resolve_index_dtype,
    uses_scaled_fp8,
)
from kvcore_mla.pool import MLATokenToKVPool


def _index_output_check(key_bytes: int):
    """The check of :meth:`DSATokenToKVPool.get_index_k_scale_buffer`'s ``out`` (given whole, or as its two
    tensors: ``check(seq_len, *out)``), which the indexer runs once per call signature; returns the outputs.  A
    function of the key width alone, not a method: kept in the indexer's plans, a method would tie the pool into a
    reference cycle."""

    def check(seq_len: int, *out) -> tuple[torch.Tensor, torch.Tensor]:
        shapes = ((seq_len, key_bytes), (seq_len, INDEX_SCALE_BYTES))
        return gather_outputs(out[0] if len(out) == 1 else out, shapes, torch.uint8, "get_index_k_scale_buffer")

    return check


class DSATokenToKVPool(MLATokenToKVPool):
    """SGLang's ``DSATokenToKVPool`` (formerly ``NSATokenToKVPool``, kept as an alias): an MLA pool whose fp8 rows carry per-tile scales, plus the indexer's keys.

    Buffers (formats in :mod:`kvcore_dsa.layout`):

    * ``kv`` — ``kv_cache [layer_num, size + page_size, 1, kv_cache_dim]``, token-indexed.  With a
      ``float8_e4m3fn`` cache a row is 656 bytes (fp8 nope, float32 tile scales, bf16 rope) written by a fused
      quantize-and-store kernel and read back by a dequantizing gather; with any other dtype it is the plain
      MLA row (576 values) and every MLA accessor behaves as in :class:`~kvcore_mla.pool.MLATokenToKVPool`.
    * ``index_k`` — ``index_k_with_scale_cache [layer_num, pages, page_bytes]`` uint8, page-indexed: page
      ``p`` holds the indexer keys of tokens ``64 p .. 64 p + 63`` (8448 bytes with fp8 keys and float32
      scales, 16384 with bf16 keys).  ``index_k_with_scale_buffer[i]`` is local layer ``i``'s view.

    What covers which buffer:

    * :meth:`token_rows` holds every per-token row: ``kv``, and the indexer's ``index_k`` (each token's key,
      a 128-byte row of the pages seen as such rows) and, for fp8 keys, ``index_k_scale`` (its 4-byte
      scale).  :meth:`move_kv_cache` and CPU offload (:meth:`get_cpu_copy` / :meth:`load_cpu_copy`) carry
      all of them: a moved or reloaded token keeps its indexer key.
    * :meth:`token_buffers` (and so :meth:`get_contiguous_buf_infos`) is ``{"kv"}``; transfer engines reach
      the page-indexed indexer through :meth:`get_state_buf_infos`, as in SGLang.
    * :meth:`buffers` (and so ``get_kv_size_bytes``, ``mem_usage``) counts both.

    :param index_head_dim: the indexer key width; must be 128.
    :param kv_cache_dim: SGLang's configurator passes the row width it computed (its
        ``calculate_mla_kv_cache_dim``); kvcore computes the same from the dtype and checks a given value against
        it: 656 bytes for a float8_e4m3fn cache (scaled rows), ``kv_lora_rank + qk_rope_head_dim`` otherwise.  A
        different value (576 for an fp8 cache: the raw rows SGLang keeps for its trtllm and HIP tilelang/aiter
        DSA backends) is a :class:`~kvcore.errors.ConfigError`.
    :param index_dtype: the indexer's keys: ``None``/``torch.float8_e4m3fn``/``"fp8"`` (default, with float32
        scales) or ``torch.bfloat16``/``"bfloat16"`` (no scales).
    :param kernels: ``auto`` (Triton on CUDA), ``triton`` or ``native`` (torch reference).
    :raises kvcore.errors.ConfigError: page size other than 64, kv_lora_rank not a multiple of 128,
        index_head_dim other than 128.
    """

    quant_block_size = QUANT_BLOCK_SIZE
    index_k_with_scale_buffer_dtype = torch.uint8
    rope_storage_dtype = ROPE_STORAGE_DTYPE

    def __init__(
        self,
        size: int,
        page_size: int,
        kv_lora_rank: int,
        dtype: torch.dtype,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str,
        index_head_dim: int,
        enable_memory_saver: bool,
        start_layer: int | None = None,
        end_layer: int | None = None,
        kernels: str = "auto",
        index_dtype=None,
        kv_cache_dim: int | None = None,
    ):
        check_dsa_dims(page_size=page_size, kv_lora_rank=kv_lora_rank, index_head_dim=index_head_dim)
        row = calculate_mla_kv_cache_dim(kv_lora_rank, qk_rope_head_dim, dtype, is_dsa=True)
        if kv_cache_dim is not None and kv_cache_dim != row:
            scaled = uses_scaled_fp8(dtype)
            kept = "scaled fp8 rows (fp8 nope, float32 tile scales, bf16 rope)" if scaled else "plain latent rows"
            raise ConfigError(
                f"DSATokenToKVPool(kv_cache_dim={kv_cache_dim}): a {dtype} DSA cache keeps {kept} of {row} elements "
                f"(kv_lora_rank={kv_lora_rank}, qk_rope_head_dim={qk_rope_head_dim}); kvcore has no other row format "
                f"(such as the raw fp8 rows of the trtllm and HIP tilelang/aiter backends): pass kv_cache_dim={row} "
                f"or leave it unset"
            )
        self.index_head_dim = index_head_dim
        self.index_k_dtype = resolve_index_dtype(index_dtype)
        self.dsa_kv_cache_store_fp8 = uses_scaled_fp8(dtype)
        super().__init__(
            size, page_size, dtype, kv_lora_rank, qk_rope_head_dim, layer_num, device, enable_memory_saver,
            start_layer, end_layer, kv_cache_dim=row, kernels=kernels,
        )  # fmt: skip

    def _index_tokens(self) -> int:
        """The tokens the indexer's pages cover: the pool's (HiSparse's cover every token the host keeps)."""
        return self.size

    def _create_buffers(self) -> None:
        """The MLA latent rows, then the indexer's pages (the MLA constructor finalizes the allocation)."""
        super()._create_buffers()
        self._index_has_scale = self.index_k_dtype == torch.float8_e4m3fn
        self._index_key_bytes = self.index_head_dim * (1 if self._index_has_scale else self.index_k_dtype.itemsize)
        self.index_k_with_scale_cache = torch.zeros(
            (self._stacked_layers(), index_pages(self._index_tokens(), self.page_size),
             index_page_bytes(self.index_k_dtype, self.index_head_dim)),
            dtype=self.index_k_with_scale_buffer_dtype,
            device=self.device,
        )
        self.index_k_with_scale_buffer = list(self.index_k_with_scale_cache.unbind(0))
        if self.dsa_kv_cache_store_fp8:
            self._scaled = ScaledRows(self.kv_cache, self.kv_lora_rank, self.qk_rope_head_dim, self._use_triton)
        self._index_out_check = _index_output_check(self._index_key_bytes)
        self._indexer = IndexerPages(self.index_k_with_scale_cache, self._index_key_bytes, self._index_has_scale,
                                     self._use_triton)  # fmt: skip

    # -- layout and sizes --------------------------------------------------------------------------------

    def buffers(self) -> dict[str, torch.Tensor]:
        """``{"kv": latent rows, "index_k": indexer pages}``."""
        return {**super().buffers(), "index_k": self.index_k_with_scale_cache}

    def token_buffers(self) -> dict[str, torch.Tensor]:
        """Only the token-indexed latent rows; the indexer is page-indexed (see the class docstring)."""
        return {"kv": self.kv_cache}

    def token_rows(self) -> dict[str, TokenRows]:
        """``kv`` rows, and the indexer's per-token key (and scale) rows inside its pages."""
        rows = {"kv": TokenRows(self.kv_cache)}
        index = self.index_k_with_scale_cache
        layers, pages, page_bytes = index.shape
        key_bytes = self._index_key_bytes
        rows["index_k"] = TokenRows(index.view(layers, pages * page_bytes // key_bytes, key_bytes),
                                    INDEX_PAGE_SIZE, page_bytes // key_bytes)  # fmt: skip
        if self._index_has_scale:
            rows["index_k_scale"] = TokenRows(
                index.view(layers, pages * page_bytes // INDEX_SCALE_BYTES, INDEX_SCALE_BYTES),
                INDEX_PAGE_SIZE, page_bytes // INDEX_SCALE_BYTES, INDEX_PAGE_SIZE * key_bytes // INDEX_SCALE_BYTES,
            )  # fmt: skip
        return rows

    def get_state_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """Per layer of the indexer: (data pointer, bytes, bytes of one page), for transfer engines."""
        return buf_infos(self.index_k_with_scale_buffer, 1)  # a row of the buffer is a page

    # -- latent rows -------------------------------------------------------------------------------------

    def set_mla_kv_buffer(
        self,
        layer,
        loc: torch.Tensor,
        cache_k_nope: torch.Tensor,
        cache_k_rope: torch.Tensor,
        layer_id_override: int | None = None,
    ) -> None:
        """Store the latent rows of ``loc.numel()`` tokens from their two parts, in one launch.

        fp8 cache: quantize-and-store; the row is byte-identical to
        :func:`kvcore_dsa.kernels.quantize_concatenated` of ``cat(nope, rope)``.  Other dtypes: the MLA store.

        :param cache_k_nope: ``[N, 1, kv_lora_rank]`` or ``[N, kv_lora_rank]`` float32/float16/bfloat16, any
            strides.
        :param cache_k_rope: ``[N, 1, qk_rope_head_dim]`` or ``[N, qk_rope_head_dim]``, likewise.
        """
        if not self.dsa_kv_cache_store_fp8:
            return super().set_mla_kv_buffer(layer, loc, cache_k_nope, cache_k_rope, layer_id_override)
        local = self.local_layer(layer, layer_id_override)
        loc = tokens_of(loc)
        self._scaled.store(local, loc if loc.dim() == 1 else loc.reshape(-1), cache_k_nope, cache_k_rope)

    def set_kv_buffer(
        self,
        layer,
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor | None = None,
        k_scale=None,
        v_scale=None,
        layer_id_override: int | None = None,
    ) -> None:
        """Store concatenated latent rows ``cache_k`` (``cache_v`` is ignored, as in MLA; ``layer_id_override``
        replaces ``layer``).

        fp8 cache: float rows ``[N, 1, kv_lora_rank + qk_rope_head_dim]`` (or ``[N, 576]``) are quantized
        exactly like :meth:`set_mla_kv_buffer`; rows already in the 656-byte format (uint8 or float8_e4m3fn,
        e.g. from a transfer) are copied as bytes.  Rows carry their own scales, so ``k_scale`` / ``v_scale``
        must be None.  Other dtypes: the MLA store.
        """
        if not self.dsa_kv_cache_store_fp8:
            return super().set_kv_buffer(layer, loc, cache_k, cache_v, k_scale, v_scale, layer_id_override)
        if k_scale is not None or v_scale is not None:
            raise ValueError("DSA fp8 rows carry per-tile scales; pass k_scale=None and v_scale=None")
        local = self.local_layer(layer, layer_id_override)
        loc = tokens_of(loc)
        loc = loc.reshape(-1)
        n = loc.numel()
        if cache_k.dtype in (torch.uint8, torch.float8_e4m3fn) and cache_k.shape[-1] == self.kv_cache_dim:
            rows = cache_k.reshape(n, 1, self.kv_cache_dim).view(torch.uint8)
            self.kv_cache[local, loc.long()] = rows
            return
        width = self.kv_lora_rank + self.qk_rope_head_dim
        if cache_k.shape[-1] != width or cache_k.numel() != n * width:
            raise ValueError(
                f"layer {self.start_layer + local}: cache_k {tuple(cache_k.shape)} is not {n} rows of kv_lora_rank + "
                f"qk_rope_head_dim = {width} values (or of {self.kv_cache_dim} quantized bytes)"
            )
        rows = cache_k.reshape(n, width)
        self._scaled.store(local, loc, rows[:, : self.kv_lora_rank], rows[:, self.kv_lora_rank :])

    def get_mla_kv_buffer(
        self, layer, loc: torch.Tensor, dst_dtype: torch.dtype | None = None, *, out=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather (and, for fp8, dequantize) the rows ``loc`` of ``layer``; only those rows are read.

        :param dst_dtype: float32, float16 or bfloat16 for an fp8 cache (default bfloat16, the rope's storage
            dtype: dequantizing to fp8 would be meaningless); any MLA destination otherwise.
        :param out: kvcore extension: ``(cache_k_nope, cache_k_rope)`` to gather into instead of allocating (for
            an fp8 cache contiguous, of one float dtype); returned.
        :returns: ``(cache_k_nope [N, 1, kv_lora_rank], cache_k_rope [N, 1, qk_rope_head_dim])``: the nope
            values ``float32(fp8) * scale`` and the stored bf16 rope, converted to ``dst_dtype``.
        """
        if not self.dsa_kv_cache_store_fp8:
            return super().get_mla_kv_buffer(layer, loc, dst_dtype, out=out)
        local = self._read_layer(layer)
        loc = tokens_of(loc)
        loc = loc if loc.dim() == 1 else loc.reshape(-1)
        if out is None:
            return self._scaled.gather_new(local, loc, dst_dtype or ROPE_STORAGE_DTYPE)
        return self._read_into(self._scaled, local, loc, out, dst_dtype)

    # -- indexer -----------------------------------------------------------------------------------------

    def get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        """One layer's indexer pages ``[pages, page_bytes]`` uint8 (waits for a layer-wise load)."""
        local = self._read_layer(layer_id)
        return self.index_k_with_scale_buffer[local]

    def set_index_k_scale_buffer(
        self, layer_id: int, loc: torch.Tensor, index_k: torch.Tensor, index_k_scale: torch.Tensor | None = None
    ) -> None:
        """Write the indexer keys of tokens ``loc``: token ``loc`` is slot ``loc % 64`` of page ``loc // 64``.

        :param index_k: fp8 indexer: ``[N, 128]`` float8_e4m3fn or uint8 bytes; bf16 indexer: ``[N, 128]``
            bfloat16 (other floats are converted first).  Any token stride.
        :param index_k_scale: fp8 indexer: ``[N]`` float32 (or ``[N, 4]`` uint8 holding them); bf16: None.
        """
        local = self.local_layer(layer_id)
        loc = tokens_of(loc)
        loc = loc if loc.dim() == 1 else loc.reshape(-1)
        if index_k.shape[-1] != self.index_head_dim:
            raise ValueError(f"index_k {tuple(index_k.shape)} must end in index_head_dim = {self.index_head_dim}")
        if self._index_has_scale:
            if index_k.dtype not in (torch.float8_e4m3fn, torch.uint8):
                raise ValueError(f"the fp8 indexer stores float8_e4m3fn keys (or their uint8 bytes), got {index_k.dtype}")
            if index_k_scale is None:
                raise ValueError("the fp8 indexer needs index_k_scale (one float32 per token)")
        else:
            if index_k_scale is not None:
                raise ValueError("the bf16 indexer keeps no scales; pass index_k_scale=None")
            if index_k.dtype != torch.bfloat16:
                index_k = index_k.to(torch.bfloat16)
        self._indexer.set(local, loc, index_k, index_k_scale)

    def _index_get(self, layer_id: int, seq_len: int, page_indices: torch.Tensor, want_k: bool, want_s: bool,
                   out=None):  # fmt: skip
        local = self._read_layer(layer_id)
        if want_s and not self._index_has_scale:
            raise ValueError("the bf16 indexer (kv_cache.options.index_dtype=bfloat16) keeps no scales")
        seq_len = seq_len if type(seq_len) is int else int(seq_len)
        page_indices = page_indices if page_indices.dim() == 1 else page_indices.reshape(-1)
        if out is not None:  # the fp8 indexer's keys and scales (want_k and want_s), checked once per signature
            if type(out) is not tuple or len(out) != 2:
                out = self._index_out_check(seq_len, out)
            self._indexer.get(local, seq_len, page_indices, *out, check=self._index_out_check)
            return out
        k_out, s_out = self._indexer.get_new(local, seq_len, page_indices, want_k, want_s)
        if k_out is not None and not self._index_has_scale:
            k_out = k_out.view(self.index_k_dtype)
        return k_out, s_out

    def get_index_k_continuous(self, layer_id: int, seq_len: int, page_indices: torch.Tensor) -> torch.Tensor:
        """A sequence's indexer keys in token order: ``[seq_len, 128]`` uint8 fp8 bytes (bf16 indexer: bfloat16).

        Token ``i`` lives in page ``page_indices[i // 64]`` at slot ``i % 64``.
        """
        return self._index_get(layer_id, seq_len, page_indices, True, False)[0]

    def get_index_k_scale_continuous(self, layer_id: int, seq_len: int, page_indices: torch.Tensor) -> torch.Tensor:
        """A sequence's indexer scales in token order: ``[seq_len, 4]`` uint8 (float32 bytes); fp8 indexer only."""
        return self._index_get(layer_id, seq_len, page_indices, False, True)[1]

    def get_index_k_scale_buffer(
        self, layer_id: int, seq_len: int, page_indices: torch.Tensor, *, out=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and scales together, in one launch: ``([seq_len, 128] uint8, [seq_len, 4] uint8)``.

        :param out: kvcore extension: those two tensors (contiguous uint8) to read into instead of allocating;
            returned."""
        return self._index_get(layer_id, seq_len, page_indices, True, True, out)

    # -- self-check --------------------------------------------------------------------------------------

    def self_test_write(self, layer: int, loc: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Random latent rows through :meth:`set_mla_kv_buffer` and random indexer keys through
        :meth:`set_index_k_scale_buffer`.

        :returns: the expected rows of every :meth:`token_rows` buffer: ``kv`` (for fp8 from the torch
            reference :func:`~kvcore_dsa.kernels.quantize_concatenated`), ``index_k`` (the key bytes) and, for
            fp8 keys, ``index_k_scale`` (the float32 scale bytes).
        """
        if self.dsa_kv_cache_store_fp8:
            r, p = self.kv_lora_rank, self.qk_rope_head_dim
            values = random_nonzero((loc.numel(), 1, r + p + 3), torch.bfloat16, generator, 2.0, self.device)
            nope, rope = values[..., :r], values[..., r : r + p]  # strided views of one projection
            self.set_mla_kv_buffer(layer, loc, nope, rope)
            expected = {"kv": kernels.quantize_concatenated(values[..., : r + p], r)}
        else:
            expected = super().self_test_write(layer, loc, generator)
        n = loc.numel()
        keys = random_nonzero((n, self.index_head_dim), self.index_k_dtype, generator, 2.0, self.device)
        if self._index_has_scale:
            scales = (torch.rand(n, generator=generator) + 0.01).to(self.device)
            self.set_index_k_scale_buffer(layer, loc, keys, scales)
            expected["index_k_scale"] = scales.view(torch.uint8).reshape(n, INDEX_SCALE_BYTES)
        else:
            self.set_index_k_scale_buffer(layer, loc, keys)
        expected["index_k"] = keys.view(torch.uint8)
        return expected


#: SGLang's earlier name for the DSA pool (NSA = native sparse attention, as DeepSeek sparse attention was first
#: called there).
NSATokenToKVPool = DSATokenToKVPool
