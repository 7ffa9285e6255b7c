"""Pool contracts and the family-independent pools.

Two levels, as in SGLang: :class:`ReqToTokenPool` maps a request slot to the token locations it owns;
a :class:`KVCache` (one subclass per attention family, in the plugins) holds the keys/values at those
locations.  Allocators (:mod:`kvcore.allocators`) hand out the locations.

Conventions every pool follows:

* Row 0 (page 0) of every token-indexed buffer is padding: padded tokens of a batch write there, and
  allocators never hand it out.
* ``dtype`` is the cache dtype (what reads return); ``store_dtype`` is the dtype the K/V buffers actually hold:
  ``dtype`` itself, ``torch.uint8`` for fp8 (viewed back as ``dtype`` when read) and for pools whose buffers hold
  codes and scales as bytes (the block-scaled formats).
* A pool stores the layers ``start_layer .. end_layer`` (global ids, inclusive) of its pipeline stage; every
  accessor takes a global layer id, or any object with a ``layer_id`` attribute.
* Each buffer is one stacked tensor ``[layer_num, rows, ...]`` (:meth:`KVCache.buffers`) so kernels reach
  every layer in one launch; per-layer lists (``k_buffer[i]``) are views of it.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from kvcore.kernels.dtypes import storage_dtype
from kvcore.errors import ConfigError
from kvcore.kernels.kernel_mode import use_triton
from kvcore.kernels.row_move import RowMover, move_token_rows_native
from kvcore.token_rows import TokenRows, select_rows

GB = 1 << 30


def check_memory_saver(enable_memory_saver: bool) -> None:
    if enable_memory_saver:
        raise NotImplementedError(
            "enable_memory_saver=True needs torch_memory_saver, which kvcore does not integrate; pass False"
        )


def unsupported(owner: str, keyword: str, value: Any, feature: str, instead: str) -> ConfigError:
    """The error for an SGLang constructor keyword whose value asks for a feature kvcore does not have: one line
    naming the keyword, the value, the feature and what to pass instead (raise it)."""
    return ConfigError(f"{owner}({keyword}={value!r}): {feature} is not supported by kvcore; {instead}")


def check_post_capture(owner: str, post_capture_active: bool) -> None:
    """SGLang's ``post_capture_active``: the pool reserves its address range and backs it with memory only after
    CUDA-graph capture (CUDA VMM), sized to the final token capacity.  kvcore allocates every buffer at
    construction, so only ``False`` (the default) is accepted."""
    if post_capture_active:
        raise unsupported(owner, "post_capture_active", post_capture_active,
                          "backing the KV buffers after CUDA-graph capture (CUDA VMM)",
                          "kvcore allocates the whole pool when it is built: pass post_capture_active=False "
                          "(size the pool before capture)")  # fmt: skip


def check_pool_class(owner: str, keyword: str, cls: Any, accepted: Sequence[type], refused: Sequence[type] = ()
                     ) -> None:  # fmt: skip
    """A sub-pool class given by keyword (SGLang's ``token_to_kv_pool_class`` / ``full_kv_pool_class``) must be one
    of kvcore's pool classes of the family, ``accepted`` (or a subclass), and none of ``refused``."""
    ok = isinstance(cls, type) and issubclass(cls, tuple(accepted)) and not (refused and issubclass(cls, tuple(refused)))
    if not ok:
        name = getattr(cls, "__qualname__", repr(cls))
        names = " or ".join(f"{c.__module__}.{c.__qualname__}" for c in accepted)
        raise ConfigError(f"{owner}({keyword}={name}): kvcore builds its sub-pools only with its own pool classes of "
                          f"this family; pass {names} (or a subclass), or leave {keyword} unset")  # fmt: skip


def layer_id_of(layer: Any) -> int:
    """A layer given as an int, or as an object with ``layer_id`` (an attention module)."""
    if isinstance(layer, int):
        return layer
    layer_id = getattr(layer, "layer_id", None)
    if not isinstance(layer_id, int):
        raise TypeError(f"layer must be an int or have an int .layer_id, got {type(layer).__name__}")
    return layer_id


def gather_outputs(out: Any, shapes: Sequence[tuple[int, ...]], dst_dtype: torch.dtype | None, method: str
                   ) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The caller's outputs of a gather called with ``out=`` (a kvcore extension of the read accessors: an engine
    that keeps its gather buffers passes them and no tensor is allocated per call), checked against the shapes
    the call reads and the requested ``dst_dtype`` (None: any one dtype the accessor supports).  Devices,
    strides and dtypes the kernels cannot write are checked where the kernels are launched."""
    if isinstance(out, tuple | list) and len(out) == len(shapes):  # the checks of a good call, first and cheap
        first = out[0]
        dtype = first.dtype if isinstance(first, torch.Tensor) else None
        for t, shape in zip(out, shapes):
            if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype:
                break
        else:
            if dst_dtype is None or dtype == dst_dtype:
                return tuple(out)
    _raise_for_outputs(out, shapes, dst_dtype, method)


def _raise_for_outputs(out: Any, shapes: Sequence[tuple[int, ...]], dst_dtype: torch.dtype | None, method: str):
    """What is wrong with ``out`` (:func:`gather_outputs` found something)."""
    if not isinstance(out, tuple | list) or len(out) != len(shapes):
        raise ValueError(f"{method}: out must be a tuple of {len(shapes)} tensors, got {type(out).__name__}")
    for i, (t, shape) in enumerate(zip(out, shapes)):
        if not isinstance(t, torch.Tensor) or t.shape != shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{method}: out[{i}] must be a tensor of shape {tuple(shape)}, got {got}")
    want = f" = dst_dtype {dst_dtype}" if dst_dtype is not None else ""
    raise ValueError(f"{method}: out tensors must share one dtype{want}, got {[t.dtype for t in out]}")


def pair_by_layers(rows: Iterable[TokenRows]) -> list[tuple[TokenRows, TokenRows | None]]:
    """``rows`` in the pairs a row move moves together: buffers stacking the same number of layers, two at a time
    (:meth:`KVCache.move_groups`)."""
    by_layers: dict[int, list[TokenRows]] = {}
    for r in rows:
        by_layers.setdefault(r.rows.shape[0], []).append(r)
    return [(group[i], group[i + 1] if i + 1 < len(group) else None)
            for group in by_layers.values() for i in range(0, len(group), 2)]  # fmt: skip


def buf_infos(layers: Sequence[torch.Tensor], rows_per_item: int) -> tuple[list[int], list[int], list[int]]:
    """What transfer engines read of per-layer buffers ``layers`` (rows along dim 0): (data pointers, bytes, bytes
    of one item of ``rows_per_item`` rows), in the order given."""
    return ([t.data_ptr() for t in layers], [t.nbytes for t in layers],
            [t[0].nbytes * rows_per_item for t in layers])  # fmt: skip


def empty_of(empties: dict[torch.dtype, torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty tensor of ``dtype`` on ``device``, made once and kept in ``empties``.  A hot path allocates its new
    outputs as ``empty.new_empty_strided(size, stride)``: the same tensor as ``torch.empty_strided(size, stride,
    dtype=dtype, device=device)``, for less host time (no dtype and device to parse; on an H200 host 0.6 of its
    4.5 us)."""
    empty = empties.get(dtype)
    if empty is None:
        empty = empties[dtype] = torch.empty(0, dtype=dtype, device=device)
    return empty


#: each CUDA device's side stream for the pools' host copies (see KVCache._transfer_stream)
_TRANSFER_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def host_buffer(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor, page-locked (from torch's pinned caching allocator) when CUDA is present,
    so device copies into it run asynchronously at the full pinned rate."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


class ReqToTokenPool:
    """Maps each request slot to the token locations of its sequence (``int32 [size + 1, max_context_len]``).

    Row 0 is padding, as slot 0 of the token pools is: CUDA-graph batches padded with dummy requests point
    them at request slot 0, so their reads and writes land there harmlessly.  ``alloc`` hands out slots
    ``1 .. size`` only, so ``size`` requests stay available.
    """

    def __init__(self, size: int, max_context_len: int, device: str, enable_memory_saver: bool = False):
        check_memory_saver(enable_memory_saver)
        if size <= 0 or max_context_len <= 0:
            raise ValueError(f"size and max_context_len must be positive, got {size}, {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32, device=device)
        self.clear()

    def write(self, indices, values) -> None:
        self.req_to_token[indices] = values

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int) -> list[int] | None:
        """Take ``need_size`` request slots, or return None (and take nothing) when too few are free."""
        if need_size > len(self.free_slots):
            return None
        selected, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return selected

    def free(self, free_index: int | Sequence[int]) -> None:
        if isinstance(free_index, int):
            self.free_slots.append(free_index)
        else:
            self.free_slots.extend(int(i) for i in free_index)

    def clear(self) -> None:
        """Every row of the table but the padding row 0 free (``1 .. size``; a subclass's table may hold more
        rows than ``size``, as :class:`DecodeReqToTokenPool`'s does)."""
        self.free_slots = list(range(1, self.req_to_token.shape[0]))

    @property
    def mem_usage(self) -> float:
        return self.req_to_token.nbytes / GB


class DecodeReqToTokenPool(ReqToTokenPool):
    """The request table of a decode worker under prefill/decode disaggregation (SGLang's class of this name):
    ``pre_alloc_size`` rows beyond ``size``, for requests whose KV is still arriving from a prefill worker, so
    that ``size`` requests can run while others are received.  Rows ``1 .. size + pre_alloc_size`` are handed
    out; row 0 is padding.

    :param pre_alloc_size: the extra rows (``disaggregation.decode_extra_slots``), 0 or more.
    """

    def __init__(self, size: int, max_context_len: int, device: str, enable_memory_saver: bool = False,
                 pre_alloc_size: int = 0):  # fmt: skip
        if pre_alloc_size < 0:
            raise ValueError(f"pre_alloc_size must be 0 or more, got {pre_alloc_size}")
        self.pre_alloc_size = int(pre_alloc_size)
        super().__init__(size + self.pre_alloc_size, max_context_len, device, enable_memory_saver)
        self.size = size  # the running requests; the table holds size + pre_alloc_size rows past the padding one


class KVCache(abc.ABC):
    """Base of every token-to-KV pool: the bookkeeping and the paths shared by all families.

    **What a family provides, in this order** (the MHA, MLA and DSA pools are worked examples):

    1. ``super().__init__(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer,
       end_layer, kernels)``: validates the sizes and layer range, sets ``store_dtype`` and resolves the
       kernels mode (``self.kernels``, and ``self._use_triton`` for every path that has a Triton kernel and a
       torch reference, the shared row move included).  ``store_dtype`` must be the dtype of every buffer that
       holds K/V rows (:meth:`token_buffers` but the :meth:`request_state_buffers`): engines view those
       buffers with it, and the conformance kit checks it.  The base sets the storage dtype of ``dtype``
       (:func:`~kvcore.kernels.dtypes.storage_dtype`: fp8 as ``torch.uint8``, any other dtype as itself); a
       family whose buffers hold something else sets it after ``super().__init__`` (the block-scaled pools
       hold codes and block scales: ``torch.uint8``, as SGLang's FP4 pools say).
    2. Allocate every buffer as one stacked tensor ``[layer_num, rows, ...]``, rows indexed by token
       (``size + page_size`` rows: page 0 is padding) or by page for per-page state.
    3. ``self._finalize_allocation()``, once, after the last buffer exists (it records ``mem_usage``).

    **Methods a family implements:** :meth:`buffers` (every stacked buffer by its layout name, matching the
    backend's :class:`~kvcore.layout.PoolLayout`), :meth:`get_key_buffer`, :meth:`set_kv_buffer` and
    :meth:`self_test_write`.  **Optional:** :meth:`get_value_buffer` (families that keep values; without it
    the pool keeps keys only, and its ``set_kv_buffer`` need not take a ``cache_v``), :meth:`token_buffers` (when some
    buffers are not token-indexed) and :meth:`token_rows` (to add per-token rows that live inside pages).

    **Lossy pools** (quantized caches, whose stored rows are not the values written: the block-scaled pools of
    ``kvcore_fp4``) also state how close a round trip comes, for the conformance kit's lossy check:

    * ``lossy_bound``: a float (attribute or property), the relative RMS error ``||read - written|| /
      ||written||`` a round trip of random values of normal range stays within, per part; a pool without the
      attribute, or with None, is treated as lossless.
    * ``self_test_values(layer, loc, generator) -> {part: tensor}``: writes random values (drawn from
      ``generator``) at tokens ``loc`` of global ``layer`` through the family's own write path, and returns
      them as written, by part (``"k"`` / ``"v"``, ``"nope"`` / ``"rope"``): float tensors ``[len(loc), ...]``
      of the values given to the write, before quantization.
    * ``read_values(layer, loc) -> {part: tensor}``: the same parts of tokens ``loc`` read back through the
      family's own read path (dequantized), of the same shapes.

    Who calls them: :class:`kvcore.testing.BaseLossyTests` (in ``LossyKVCacheConformance``, and in ``kvcore
    check`` for every pool whose ``lossy_bound`` is not None), which compares every part within
    ``lossy_bound`` and checks that nothing else in :meth:`buffers` changed; no engine path does.  The kit's
    byte checks still run on what :meth:`self_test_write` reports (the codes the pool stored).

    **What the base then provides for every family:** :meth:`move_kv_cache` and CPU offload
    (:meth:`get_cpu_copy` / :meth:`load_cpu_copy`) over :meth:`token_rows`, :meth:`get_contiguous_buf_infos`
    over :meth:`token_buffers`, :meth:`get_kv_size_bytes`, layer ids (:meth:`local_layer`, with
    ``layer_id_override``) and layer-wise loading (:meth:`register_layer_transfer_counter`).

    :param kernels: ``auto`` (Triton on CUDA, torch elsewhere), ``triton`` or ``native`` (see
        :mod:`kvcore.kernels.kernel_mode`).
    :raises ValueError: for non-positive sizes, a size that is not whole pages, or a layer range that does not
        span ``layer_num`` layers.
    :raises ConfigError: for a kernels mode the device cannot run.
    """

    #: tokens per device->host transfer chunk in CPU offload.
    cpu_offloading_chunk_size = 8192
    #: SGLang's flag of a pool backed after CUDA-graph capture; never true in kvcore (see :func:`check_post_capture`).
    post_capture_active = False
    #: True when :meth:`set_kv_buffer` does nothing but write the rows of ``get_key_buffer(layer)`` /
    #: ``get_value_buffer(layer)`` at tokens ``loc`` (token rows ``[rows, heads, dim]``, or a paged view's
    #: ``[loc // page_size, loc % page_size]``), converted as the MHA pool converts (as they are in the cache dtype,
    #: else divided by the scale in float32 when given and rounded once): a caller may then write those rows in a
    #: launch of its own (the transformers cache stores and gathers in one).  False unless a pool says so.
    set_kv_buffer_writes_rows = False

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        layer_num: int,
        device: str,
        enable_memory_saver: bool,
        start_layer: int | None = None,
        end_layer: int | None = None,
        kernels: str = "auto",
    ):
        check_memory_saver(enable_memory_saver)
        if size <= 0 or page_size <= 0 or layer_num <= 0:
            raise ValueError(f"size, page_size and layer_num must be positive, got {size}, {page_size}, {layer_num}")
        if size % page_size:
            raise ValueError(f"size={size} is not a whole number of pages of page_size={page_size}; round it down")
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.store_dtype = storage_dtype(dtype)
        self.device = device
        self.layer_num = layer_num
        self.start_layer = start_layer or 0
        self.end_layer = end_layer if end_layer is not None else self.start_layer + layer_num - 1
        if self.end_layer - self.start_layer + 1 != layer_num:
            raise ValueError(
                f"start_layer={self.start_layer}, end_layer={self.end_layer} span "
                f"{self.end_layer - self.start_layer + 1} layers, but layer_num={layer_num}"
            )
        self.kernels = kernels
        self._use_triton = use_triton(kernels, device)
        self._move_groups: list[tuple[TokenRows, TokenRows | None]] | None = None
        self._movers: list[RowMover] | None = None
        self.mem_usage = 0.0
        self.layer_transfer_counter = None

    # -- layers ------------------------------------------------------------------------------------------

    def local_layer(self, layer: Any, layer_id_override: int | None = None) -> int:
        """Index into the stacked buffers for a global layer id (or an object with ``layer_id``).

        ``layer_id_override``, when given, is the global id instead (SGLang's composite pools call their
        sub-pools' writes with ``layer=None`` and the id here)."""
        if layer_id_override is not None:
            layer_id = layer_id_override
        else:  # an int first: this runs on every hot-path call
            layer_id = layer if type(layer) is int else layer_id_of(layer)
        if not self.start_layer <= layer_id <= self.end_layer:
            raise IndexError(
                f"layer {layer_id} is not stored by this {type(self).__name__} "
                f"(it holds layers {self.start_layer}..{self.end_layer})"
            )
        return layer_id - self.start_layer

    def register_layer_transfer_counter(self, layer_transfer_counter) -> None:
        """Make attention-side reads wait until a layer's host->device load is done (layer-wise loading)."""
        self.layer_transfer_counter = layer_transfer_counter

    def _wait_for_layer(self, local_layer: int) -> None:
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(local_layer)

    def _read_layer(self, layer: Any) -> int:
        """:meth:`local_layer` of a read (an accessor of a layer's rows), once a layer-wise load of that layer is
        done (:meth:`register_layer_transfer_counter`)."""
        local = self.local_layer(layer)
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(local)
        return local

    # -- buffers -----------------------------------------------------------------------------------------

    @abc.abstractmethod
    def buffers(self) -> dict[str, torch.Tensor]:
        """Every stacked buffer by its layout name (``{"k": [L, rows, H, D], ...}``)."""

    def size_groups(self) -> dict[str, int]:
        """The size of every size group this pool was built with (its layout's groups: ``{"tokens": size}``,
        plus ``"swa_tokens"`` for a sliding-window sub-pool, ...); the conformance kit checks each buffer
        against its declared layout at these sizes."""
        return {"tokens": self.size}

    def layer_in_buffer(self, name: str, layer: int) -> int | None:
        """Where global ``layer`` sits in the stacked buffer ``name`` (its index along dim 0), or None when that
        buffer does not hold the layer.  Every buffer of a plain pool stacks all its layers
        (``layer - start_layer``); a composite pool whose buffers each stack some of its layers (full and
        sliding-window layers) overrides this."""
        return layer - self.start_layer

    def token_layers(self) -> list[int]:
        """The global layers whose tokens some :meth:`token_rows` buffer keeps (every layer of a plain pool; a
        hybrid pool's linear-attention layers keep none)."""
        names = list(self.token_rows())
        return [layer for layer in range(self.start_layer, self.end_layer + 1)
                if any(self.layer_in_buffer(name, layer) is not None for name in names)]  # fmt: skip

    def token_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers indexed by token location (row = token), as transfer engines see them
        (:meth:`get_contiguous_buf_infos`)."""
        return self.buffers()

    def token_rows(self) -> dict[str, TokenRows]:
        """Every per-token row the pool keeps, by name: what :meth:`move_kv_cache` must move and CPU offload
        copies.  The token buffers themselves by default; a family with page-indexed per-token state (DSA's
        indexer keys) adds views of it."""
        return {name: TokenRows(buf) for name, buf in self.token_buffers().items()}

    def request_state_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers of :meth:`buffers` that hold per-request state rather than K/V (a hybrid model's
        linear-attention states), by layout name: :meth:`get_kv_size_bytes` does not count them (SGLang reports
        them through ``get_state_buf_infos``).  None in a pool of per-token rows."""
        return {}

    def get_kv_size_bytes(self):
        """Bytes of the K/V buffers, all layers, padding included: every buffer but the
        :meth:`request_state_buffers`, as one int.  MHA-shaped pools return SGLang's ``(K bytes, V bytes)``."""
        states = self.request_state_buffers()
        return sum(t.nbytes for name, t in self.buffers().items() if name not in states)

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """Per layer and buffer: (data pointer, bytes, bytes of one page) for transfer engines."""
        return buf_infos([layer for stacked in self.token_buffers().values() for layer in stacked.unbind(0)],
                         self.page_size)

    def _finalize_allocation(self) -> None:
        """Record ``mem_usage``: GiB of the K/V buffers (every buffer but the :meth:`request_state_buffers`, as
        :meth:`get_kv_size_bytes` counts)."""
        states = self.request_state_buffers()
        self.mem_usage = sum(t.nbytes for name, t in self.buffers().items() if name not in states) / GB

    # -- accessors every family provides -----------------------------------------------------------------

    @abc.abstractmethod
    def get_key_buffer(self, layer_id: int) -> torch.Tensor: ...

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """A layer's values; a pool that keeps keys only does not override this."""
        raise NotImplementedError(f"{type(self).__name__} keeps keys only; it has no value buffer")

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    @abc.abstractmethod
    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, *args, **kwargs) -> None:
        """Store the rows of ``loc.numel()`` tokens into ``layer`` (an int, or anything with ``layer_id``),
        converting to the cache dtype; the caller's tensors are never modified.

        Families with values take SGLang's ``(layer, loc, cache_k, cache_v, k_scale=None, v_scale=None,
        layer_id_override=None)``: the scales divide an input whose dtype differs from the cache's and are
        ignored for an input already in it (a family whose rows take no scale refuses them), and
        ``layer=None, layer_id_override=i`` addresses layer ``i``.  A keys-only family may take
        ``(layer, loc, cache_k)``.
        """

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """Move tokens ``src_loc`` to ``tgt_loc`` in every layer of every :meth:`token_rows` buffer, as if all
        sources were read first (overlapping sets are safe; targets must be distinct).

        The overlap-safe row move of :mod:`kvcore.kernels.row_move`, two buffers per launch where they stack the same
        number of layers (:meth:`move_groups`): one launch per pair up to 512 tokens, no host sync.
        ``_use_triton`` (the kernels mode) picks the Triton kernels or the torch reference."""
        if tgt_loc.numel() != src_loc.numel():
            raise ValueError(f"move_kv_cache: {tgt_loc.numel()} targets but {src_loc.numel()} sources")
        if tgt_loc.numel() == 0:
            return
        tgt = tgt_loc if tgt_loc.dim() == 1 else tgt_loc.reshape(-1)
        src = src_loc if src_loc.dim() == 1 else src_loc.reshape(-1)
        if not self._use_triton:
            for first, second in self.move_groups():
                move_token_rows_native(first, second, tgt, src)
            return
        if self._movers is None:
            self._movers = [RowMover(first, second) for first, second in self.move_groups()]
        for mover in self._movers:
            mover(tgt, src)

    def move_groups(self) -> list[tuple[TokenRows, TokenRows | None]]:
        """:meth:`token_rows` in the pairs :meth:`move_kv_cache` moves together: buffers stacking the same
        number of layers, two at a time, whatever order ``token_rows()`` names them in.  Built once (the
        buffers never change after allocation)."""
        if self._move_groups is None:
            self._move_groups = pair_by_layers(self.token_rows().values())
        return self._move_groups

    @abc.abstractmethod
    def self_test_write(self, layer: int, loc: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Write random (never zero) rows at ``loc`` of ``layer`` through this family's own write path.

        Used by ``kvcore up``'s self-check and as the conformance kit's default writer.

        :returns: for every :meth:`token_rows` buffer the write touched, the exact rows (storage dtype,
            ``[len(loc), ...]``) that must now be the rows of tokens ``loc`` in that layer
            (``token_rows()[name].take(loc, layer - start_layer)``).
        """

    # -- CPU offload -------------------------------------------------------------------------------------

    #: bytes per device<->host piece: pieces are gathered on the compute stream and copied on a side
    #: stream, so the gather of one piece overlaps the transfer of the previous one.
    cpu_offloading_piece_bytes = 64 << 20

    def _layer_pieces(self, stacked: torch.Tensor, rows: int) -> range:
        per_layer = max(1, rows * stacked[0, 0].nbytes)
        step = max(1, self.cpu_offloading_piece_bytes // per_layer)
        return range(0, stacked.shape[0], step)

    def _transfer_stream(self):
        """The side stream of the pool's device its host copies run on (one per device, shared by its pools and
        their copies), or None off CUDA."""
        device = torch.device(self.device)
        if device.type != "cuda":
            return None
        stream = _TRANSFER_STREAMS.get(device)
        if stream is None:
            stream = _TRANSFER_STREAMS[device] = torch.cuda.Stream(device)
        return stream

    def get_cpu_copy(self, indices: torch.Tensor, mamba_indices=None, req_pool_index=None) -> dict[str, list[torch.Tensor]]:
        """Copy the rows of tokens ``indices`` of every :meth:`token_rows` buffer (all layers) to host memory,
        in chunks.

        ``mamba_indices`` / ``req_pool_index`` are the keywords SGLang's retraction path passes; they select
        per-request state, which a pool of per-token rows does not keep, so they are accepted and unused here
        (hybrid pools with per-request state override this method).

        :returns: ``{buffer name: [chunk tensors of shape [layer_num, chunk, ...]]}``, page-locked when CUDA
            is present; pass it to :meth:`load_cpu_copy`.
        """
        indices = torch.as_tensor(indices, device=self.device).long()
        chunk = self.cpu_offloading_chunk_size
        side = self._transfer_stream()
        main = torch.cuda.current_stream(self.device) if side is not None else None
        copy: dict[str, list[torch.Tensor]] = {}
        for name, token_rows in self.token_rows().items():
            stacked = token_rows.rows
            parts = []
            for start in range(0, indices.numel(), chunk):
                idx = token_rows.row_of(indices[start : start + chunk])
                host = host_buffer((stacked.shape[0], idx.numel(), *stacked.shape[2:]), stacked.dtype)
                pieces = self._layer_pieces(stacked, idx.numel())
                for first in pieces:
                    last = first + pieces.step
                    rows = select_rows(stacked[first:last], idx)
                    if side is None:
                        host[first:last].copy_(rows)
                        continue
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        host[first:last].copy_(rows, non_blocking=True)
                    rows.record_stream(side)
                parts.append(host)
            copy[name] = parts
        if side is not None:
            side.synchronize()
        return copy

    def load_cpu_copy(
        self, kv_cache_cpu: dict[str, list[torch.Tensor]], indices: torch.Tensor, mamba_indices=None, req_pool_index=None
    ) -> None:
        """Write a :meth:`get_cpu_copy` result back at (possibly different) rows ``indices`` (the extra keywords
        as in :meth:`get_cpu_copy`)."""
        indices = torch.as_tensor(indices, device=self.device).long()
        chunk = self.cpu_offloading_chunk_size
        buffers = self.token_rows()
        if set(kv_cache_cpu) != set(buffers):
            raise ValueError(f"cpu copy holds buffers {sorted(kv_cache_cpu)}, this pool has {sorted(buffers)}")
        side = self._transfer_stream()
        main = torch.cuda.current_stream(self.device) if side is not None else None
        for name, token_rows in buffers.items():
            stacked = token_rows.rows
            for i, start in enumerate(range(0, indices.numel(), chunk)):
                idx = token_rows.row_of(indices[start : start + chunk])
                host = kv_cache_cpu[name][i]
                if host.shape[1] != idx.numel():
                    raise ValueError(
                        f"cpu copy chunk {i} of buffer {name!r} holds {host.shape[1]} rows, indices give {idx.numel()}"
                    )
                pieces = self._layer_pieces(stacked, idx.numel())
                for first in pieces:
                    last = first + pieces.step
                    if side is None:
                        stacked[first:last].index_copy_(1, idx, host[first:last])
                        continue
                    with torch.cuda.stream(side):
                        staged = host[first:last].to(stacked.device, non_blocking=True)
                    main.wait_stream(side)
                    staged.record_stream(main)
                    stacked[first:last].index_copy_(1, idx, staged)
        if side is not None:
            main.synchronize()
