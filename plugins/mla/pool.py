"""MLA token-to-KV pool: one latent row per token and layer (compressed KV, then the rope key)."""

from __future__ import annotations

import torch

from kvcore.pools import KVCache, KVWriteLoc, WriteLoc, gather_outputs, tokens_of
from kvcore.sample import random_nonzero
from kvcore_mla.kernels import LatentRows
from kvcore_mla.layout import mla_row_dim


def _latent_output_check(kv_lora_rank: int, qk_rope_head_dim: int):
    """The check of :meth:`MLATokenToKVPool.get_mla_kv_buffer`'s ``out`` tensors that its rows run once per call
    signature (``check(loc, nope, rope)``).  A function of the dimensions alone: kept in the rows' plans, a method of
    the pool would tie the pool, and its buffers, into a reference cycle freed only by the garbage collector."""

    def check(loc: torch.Tensor, nope: torch.Tensor, rope: torch.Tensor) -> None:
        n = loc.shape[0] if loc.dim() == 1 else loc.numel()
        shapes = ((n, 1, kv_lora_rank), (n, 1, qk_rope_head_dim))
        gather_outputs((nope, rope), shapes, None, "get_mla_kv_buffer")

    return check


class MLATokenToKVPool(KVCache):
    """Latent KV rows of multi-head latent attention layers (DeepSeek-V2/V3), SGLang's ``MLATokenToKVPool``.

    ``kv_cache`` is one stacked tensor ``[layer_num, size + page_size, 1, kv_cache_dim]`` of the storage dtype
    (fp8 as uint8); ``kv_buffer[i]`` is the view of local layer ``i``.  A row holds ``kv_lora_rank`` compressed
    KV values ("nope"), then ``qk_rope_head_dim`` rope key values: the key is the whole row, the value its
    first ``kv_lora_rank`` columns.  Row 0 (the first page) is padding.

    Subclassing (DSA pools): the constructor, :meth:`set_mla_kv_buffer`, :meth:`get_mla_kv_buffer`,
    :meth:`set_kv_buffer`, :meth:`buffers` and :meth:`token_buffers` are stable, and so are the two hooks a
    subclass overrides: ``_create_buffers()`` (allocate its own row format) and ``_read_into(...)`` (its read into
    caller buffers).  ``kv_cache_dim`` widens the
    row for a family's own row format (e.g. fp8 values + scales + bf16 rope); :meth:`buffers` of a subclass
    adds its own buffers to ``super().buffers()``.  The kernels (:mod:`kvcore_mla.kernels`) also copy raw
    bytes (``cache_dtype=torch.uint8``) into such rows.

    :param size: token slots (whole pages), padding page excluded.
    :param dtype: the cache dtype: bfloat16, float16, float32, float8_e4m3fn or float8_e5m2.
    :param kv_cache_dim: row width in storage elements; default ``kv_lora_rank + qk_rope_head_dim``.
    :param kernels: ``auto`` (Triton on CUDA), ``triton`` or ``native`` (torch reference).
    """

    #: True only for a DSA pool whose rows are fp8 with per-tile scales (SGLang's name; composite pools read it).
    dsa_kv_cache_store_fp8 = False

    @property
    def nsa_kv_cache_store_fp8(self) -> bool:
        """SGLang's earlier name of :attr:`dsa_kv_cache_store_fp8`."""
        return self.dsa_kv_cache_store_fp8

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str,
        enable_memory_saver: bool,
        start_layer: int | None = None,
        end_layer: int | None = None,
        kv_cache_dim: int | None = None,
        kernels: str = "auto",
    ):
        super().__init__(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer, kernels)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_cache_dim = mla_row_dim(kv_lora_rank, qk_rope_head_dim, kv_cache_dim)
        self._create_buffers()
        self._finalize_allocation()

    def _stacked_layers(self) -> int:
        """How many layers the stacked buffers hold: ``layer_num`` (a pool that keeps a share of its layers, DSA's
        layer split, says how many it keeps)."""
        return self.layer_num

    def _create_buffers(self) -> None:
        """Allocate the latent rows; a subclass adds its own buffers after ``super()._create_buffers()``."""
        rows = self.size + self.page_size
        self.kv_cache = torch.zeros(
            (self._stacked_layers(), rows, 1, self.kv_cache_dim), dtype=self.store_dtype, device=self.device
        )
        self.kv_buffer = list(self.kv_cache.unbind(0))
        self._rows = LatentRows(self.kv_cache, self.dtype, self._use_triton)
        self._out_check = _latent_output_check(self.kv_lora_rank, self.qk_rope_head_dim)

    # -- layout and sizes --------------------------------------------------------------------------------

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"kv": self.kv_cache}

    # -- reads -------------------------------------------------------------------------------------------

    def _layer_rows(self, layer_id) -> torch.Tensor:
        local = self._read_layer(layer_id)
        return self.kv_buffer[local]

    def _as_dtype(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.view(self.dtype) if self.store_dtype != self.dtype else rows

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """The whole latent rows ``[size + page_size, 1, kv_cache_dim]`` of a layer, as ``dtype``."""
        return self._as_dtype(self._layer_rows(layer_id))

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The first ``kv_lora_rank`` columns of a layer's rows (a view), as ``dtype``."""
        return self._as_dtype(self._layer_rows(layer_id)[..., : self.kv_lora_rank])

    def get_mla_kv_buffer(
        self, layer, loc: torch.Tensor, dst_dtype: torch.dtype | None = None, *, out=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather the rows ``loc`` of ``layer`` (an int or anything with ``layer_id``) as two new tensors.

        :param dst_dtype: dtype of the results (default: the cache dtype).  Float destinations receive
            ``row.to(dst_dtype)``; fp8 caches decode exactly.
        :param out: kvcore extension: ``(cache_k_nope, cache_k_rope)`` tensors of the shapes below (any
            strides, one dtype, which ``dst_dtype`` may name) to gather into instead of allocating; returned.
        :returns: ``(cache_k_nope [N, 1, kv_lora_rank], cache_k_rope [N, 1, qk_rope_head_dim])``, read in one
            launch.
        """
        local = self._read_layer(layer)
        rows = self._rows
        if loc.__class__ is KVWriteLoc:
            rows, loc = self._rows_at(loc)
        loc = loc if loc.dim() == 1 else loc.reshape(-1)
        if out is None:
            return rows.gather_new(local, loc, dst_dtype or self.dtype, self.kv_lora_rank, self.qk_rope_head_dim)
        return self._read_into(rows, local, loc, out, dst_dtype)

    def _rows_at(self, loc_info: KVWriteLoc):
        """(the rows' stores and gathers, the tokens) of a :class:`~kvcore.pools.KVWriteLoc`: this pool's
        tokens are physical, so its ``full_loc`` or ``loc`` through the usual rows (a page-major pool with virtual
        pages tells them apart)."""
        return self._rows, tokens_of(loc_info)

    def _read_into(self, rows, local: int, loc: torch.Tensor, out, dst_dtype: torch.dtype | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """:meth:`get_mla_kv_buffer` with ``out``, through ``rows`` (:class:`~kvcore_mla.kernels.LatentRows`, or a
        family's rows with the same ``gather(local, loc, nope, rope, check=None)``).  The usual call (a tuple of
        two tensors, no ``dst_dtype``) has its outputs checked once per call signature."""
        if dst_dtype is None and type(out) is tuple and len(out) == 2:
            try:
                rows.gather(local, loc, *out, check=self._out_check)
            except AttributeError:  # an output that is no tensor: the method's own error
                self._latent_outputs(loc.shape[0], out, dst_dtype)
                raise
            return out
        nope, rope = self._latent_outputs(loc.shape[0], out, dst_dtype)
        rows.gather(local, loc, nope, rope)
        return nope, rope

    def _latent_outputs(self, n: int, out, dst_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``out`` of :meth:`get_mla_kv_buffer`, checked for ``n`` rows (:func:`kvcore.pools.gather_outputs`)."""
        shapes = ((n, 1, self.kv_lora_rank), (n, 1, self.qk_rope_head_dim))
        return gather_outputs(out, shapes, dst_dtype, "get_mla_kv_buffer")

    # -- writes ------------------------------------------------------------------------------------------

    def set_kv_buffer(
        self,
        layer,
        loc: WriteLoc,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor | None = None,
        k_scale=None,
        v_scale=None,
        layer_id_override: int | None = None,
    ) -> None:
        """Store already concatenated latent rows ``cache_k`` ``[N, 1, kv_lora_rank + qk_rope_head_dim]`` (or
        ``[N, ...]`` of that width) at ``loc``, converted to the cache dtype.

        ``cache_v`` is ignored (the value is a prefix of the key row), as in SGLang.  MLA rows are stored
        unscaled: ``k_scale`` / ``v_scale`` must be None.  ``layer_id_override`` replaces ``layer`` (which may
        then be None).  ``loc`` may be a :class:`~kvcore.pools.KVWriteLoc`.  The inputs are never modified.
        """
        if k_scale is not None or v_scale is not None:
            raise ValueError("MLATokenToKVPool stores latent rows unscaled; pass k_scale=None and v_scale=None")
        local = self.local_layer(layer, layer_id_override)
        store = self._rows
        if loc.__class__ is KVWriteLoc:
            store, loc = self._rows_at(loc)
        width = self.kv_lora_rank + self.qk_rope_head_dim
        if cache_k.shape[-1] != width or cache_k.numel() != loc.numel() * width:
            raise ValueError(
                f"layer {self.start_layer + local}: cache_k {tuple(cache_k.shape)} is not {loc.numel()} rows of "
                f"kv_lora_rank + qk_rope_head_dim = {width}"
            )
        rows = cache_k if cache_k.dim() in (2, 3) else cache_k.reshape(-1, width)
        store.store_rows(local, loc if loc.dim() == 1 else loc.reshape(-1), rows)

    def set_mla_kv_buffer(
        self,
        layer,
        loc: WriteLoc,
        cache_k_nope: torch.Tensor,
        cache_k_rope: torch.Tensor,
        layer_id_override: int | None = None,
    ) -> None:
        """Store the two parts of the latent rows of ``loc.numel()`` tokens in one launch, no concatenation.

        :param layer: a global layer id, or anything with ``layer_id`` (or None with ``layer_id_override``).
        :param loc: ``[N]`` int32/int64 token slots, or a :class:`~kvcore.pools.KVWriteLoc` of them.
        :param cache_k_nope: ``[N, 1, kv_lora_rank]`` (any strides, e.g. a split of a bigger projection).
        :param cache_k_rope: ``[N, 1, qk_rope_head_dim]`` (any strides).
        :param layer_id_override: the global layer id, replacing ``layer``.
        Both are converted to the cache dtype exactly as ``x.to(dtype)`` (fp8 encoded bit-exactly); the inputs
        are never modified.
        """
        local = self.local_layer(layer, layer_id_override)
        store = self._rows
        if loc.__class__ is KVWriteLoc:
            store, loc = self._rows_at(loc)
        if cache_k_nope.shape[-1] != self.kv_lora_rank or cache_k_rope.shape[-1] != self.qk_rope_head_dim:
            raise ValueError(
                f"layer {self.start_layer + local}: cache_k_nope {tuple(cache_k_nope.shape)} / cache_k_rope "
                f"{tuple(cache_k_rope.shape)} must end in kv_lora_rank = {self.kv_lora_rank} / qk_rope_head_dim = "
                f"{self.qk_rope_head_dim}"
            )
        store.store(local, loc if loc.dim() == 1 else loc.reshape(-1), cache_k_nope, cache_k_rope)

    def self_test_write(self, layer: int, loc: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Random rows through :meth:`set_mla_kv_buffer`, from nope/rope views of one wider projection (from
        bf16 for fp8 caches, so the encoder runs)."""
        source_dtype = torch.bfloat16 if self.dtype.itemsize == 1 else self.dtype
        r, p = self.kv_lora_rank, self.qk_rope_head_dim
        n = loc.numel()
        values = random_nonzero((n, 1, r + p + 3), source_dtype, generator, 2.0, self.device)
        nope, rope = values[..., :r], values[..., r : r + p]  # strided views, as a model's split produces
        local = self.local_layer(layer)
        expected = self.kv_cache[local, loc.long()].clone()
        self.set_mla_kv_buffer(layer, loc, nope, rope)
        expected[..., : r + p] = values[..., : r + p].to(self.dtype).view(self.store_dtype)
        return {"kv": expected}
