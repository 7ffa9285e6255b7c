"""A ``transformers`` cache whose keys and values live in a kvcore pool.

:class:`PagedKVCache` is a ``transformers.Cache``: pass it to ``model.generate`` (or to a forward call) and
the model's attention layers store their keys and values through kvcore's MHA pool, in slots handed out by
kvcore's allocator, one :class:`~kvcore.pools.ReqToTokenPool` row per batch row::

    from kvcore.integrations.transformers import PagedKVCache

    cache = PagedKVCache.from_model(model, max_total_tokens=8192, page_size=16, dtype="float8_e4m3fn")
    out = model.generate(**inputs, max_new_tokens=256, do_sample=False, cache=cache)  # past_key_values= before 5.x's rename
    cache.free_all()                       # every slot back to the allocator; the cache takes a new batch

How it works.  A batch row owns a request slot; its tokens' locations are that slot's row of the request
table.  When a forward brings ``q`` new tokens, the first layer to see them gives the rows the locations they
lack: whole pages of ``page_size`` tokens (one slot a page at ``page_size=1``), one allocator call for every
row, each page's locations written to the table at once, so a decode step inside a page allocates nothing.  It
also works out, once for every layer, where the new tokens go and where every token is read from (views of
the request table when the rows sit in consecutive request slots, as a new batch's do).  Every layer then
writes its keys and values there with one ``set_kv_buffer`` (fp8 caches convert on the way, optionally divided
by ``k_scale`` / ``v_scale``) and hands attention the keys and values of all the row's tokens, gathered by
location in one launch and converted back to the model's dtype, as ``[batch, kv_heads, seq, head_dim]`` (or,
with ``contiguous_rows``, strided views of the pool).  On a GPU over kvcore's own K/V pools (whose
``set_kv_buffer_writes_rows`` says the store is a plain row write) the store and the gather are one launch
(:meth:`~kvcore.kernels.head_gather.HeadGather.store_and_gather`): a layer's step is one launch, into the
keys and values the layer before returned once nothing holds them (a decode step's first layer resizes them).
With ``resident_rows`` every layer keeps its gathered keys and values instead and a step writes only its new
tokens into them (attention reads views of them): the step's device work no longer grows with the rows' length.
No forward waits for the device, but when the pool is nearly full (the allocator then counts its free pages
exactly) and, with ``contiguous_rows``, once per batch.
Left padding of prompts of different lengths is stored like any token; the attention mask hides it, exactly as
with ``DynamicCache``.

With a bf16/fp16/fp32 cache in the model's own dtype the tensors attention receives are bit-identical to
``DynamicCache``'s, so greedy generation is token-identical; an fp8 cache rounds every key and value once.

Only full-attention decoder layers are supported (no sliding-window, linear-attention or shared-KV
layers); ``from_model`` checks the model's ``layer_types``.  The cache is not ``torch.compile``-able.

This module needs ``transformers`` (``pip install "kvcore[hf]"``); nothing else in kvcore imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

try:
    from transformers.cache_utils import Cache
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        'kvcore.integrations.transformers needs transformers; install it with: pip install "kvcore[hf]"'
    ) from exc

from kvcore.errors import ConfigError, KVCoreError
from kvcore.integrations.hf_model import SUPPORTED_DTYPES, config_overrides, model_dimensions, pools_for_model
from kvcore.integrations.paged_layer import ForwardStep, PagedKVLayer, run_geometry
from kvcore.kernels.head_gather import HeadGather, take_rows
from kvcore.kernels.kernel_mode import use_triton
from kvcore.kernels.resident_gather import ResidentHeadGather

__all__ = ["SUPPORTED_DTYPES", "KVCacheFullError", "PagedKVCache", "PagedKVLayer", "config_overrides", "model_dimensions"]


class KVCacheFullError(KVCoreError, RuntimeError):
    """The pool (or the request table) has no room for the tokens or rows a forward brings."""


def _unwrap(obj: Any) -> Any:
    """A pool behind kvcore's checked proxy (``hardware.checked``), or the object itself."""
    return getattr(obj, "unchecked", obj)


class PagedKVCache(Cache):
    """A ``transformers.Cache`` over a kvcore MHA pool, its allocator and a request table.

    Build it with :meth:`from_model` (dimensions from the model's config) or :meth:`from_config` (a kvcore
    :class:`~kvcore.config.EngineConfig`, through :func:`kvcore.build_pools`).  One cache serves one batch at
    a time: batch row ``i`` takes a request slot on the first forward; :meth:`free` gives a finished row's
    token slots back (its later tokens, if the batch runs on, are not stored and it reads the padding
    slot); :meth:`free_all` (or ``reset()``) gives everything back and readies the cache for a new batch.

    :param pool: a token-to-KV pool with ``set_kv_buffer`` / ``get_key_buffer`` / ``get_value_buffer``
        (the ``mha`` backend's pool, token-major, or page-major with ``kv_cache.layout=page_major``) holding
        every layer of the model, global ids ``0 .. L-1``.
    :param allocator: its token or paged allocator (rows take whole pages from it with ``alloc``).
    :param req_to_token_pool: the request table (``max_context_len`` bounds a row's tokens).
    :param k_scale: fp8 caches: keys are stored divided by it and multiplied back when read (float32).
    :param v_scale: the same for values.
    :param contiguous_rows: at a batch's first forward, reserve each row one run of slots (the pool's free slots
        over the batch's rows, at most ``max_context_len``, in whole pages: what rows growing in step, as
        ``generate``'s do, can reach anyway) and write every later token there without calling the allocator;
        attention then reads strided views of the pool (no copy) when the cache keeps the model's dtype in
        token-major rows.  Needs the allocator to hand out one contiguous run (checked once per batch: a
        fragmented pool falls back to allocating as rows grow); ``available_tokens`` counts the reserved slots as
        taken.
    :param resident_rows: keep every layer's gathered keys and values from step to step and write only each step's
        new tokens into them (:class:`~kvcore.kernels.resident_gather.ResidentHeadGather`): a decode step's device
        work no longer grows with the rows' length (the gather, like ``DynamicCache``'s ``torch.cat``, reads and
        writes every token of every layer each step).  Costs what ``DynamicCache`` holds, every layer's rows in the
        model's dtype, on top of the pool (an eighth more for growth, at least 64 tokens a row).  Applies where a
        layer's store and read are one launch (a GPU, every row live); a forward that stores otherwise (rows
        freed, a checked pool, the torch path) gathers as without it, and the rows are gathered again afterwards.
    """

    def __init__(
        self,
        pool: Any,
        allocator: Any,
        req_to_token_pool: Any,
        *,
        k_scale: float | None = None,
        v_scale: float | None = None,
        contiguous_rows: bool = False,
        resident_rows: bool = False,
    ):
        start = getattr(pool, "start_layer", 0) or 0
        if start != 0:
            raise ConfigError(
                f"the pool holds layers {start}..{pool.end_layer}; a transformers model runs every layer, so the "
                "pool must hold layers 0..L-1 (parallel.pp_size=1)"
            )
        for method in ("set_kv_buffer", "get_key_buffer", "get_value_buffer"):
            if not callable(getattr(pool, method, None)):
                raise ConfigError(f"{type(pool).__name__} has no {method}(); PagedKVCache needs a K/V pool (attention=mha)")
        if _unwrap(allocator.get_kvcache()) is not _unwrap(pool):  # build_pools may wrap both in checked proxies
            raise ConfigError("the allocator hands out slots of another pool than the one given")
        self.pool = pool
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.k_scale = None if k_scale is None else float(k_scale)
        self.v_scale = None if v_scale is None else float(v_scale)
        self.page_size = int(allocator.page_size)
        self.device = torch.device(pool.device)
        # the gather into attention's layout follows the pool's kernels mode (one launch on a GPU)
        self._triton_gather = use_triton(getattr(_unwrap(pool), "kernels", "auto"), self.device)
        # the store and the gather in one launch: a pool not behind a checking proxy whose set_kv_buffer only writes
        # the rows this cache reads (it then writes them itself, converted as the pool would)
        self._fused_store = self._triton_gather and pool is _unwrap(pool) and bool(
            getattr(pool, "set_kv_buffer_writes_rows", False))  # fmt: skip
        self._initial_available = allocator.available_size()
        self._slots: list[int] = []  # request slot of each batch row; 0 once the row is freed
        self._slot_t = torch.empty((0,), dtype=torch.int64, device=self.device)
        self._live_t = torch.empty((0,), dtype=torch.int64, device=self.device)
        self._live_slots = self._slot_t  # the live rows' request slots
        self._rows: torch.Tensor | None = None  # the batch's rows of the request table, a view (see _set_slots)
        self._allocated = 0  # positions of every live row that have a location: whole pages (or the reserved run)
        self._step: ForwardStep | None = None  # what the current forward's layers share (see _begin_step)
        #: the tokens each layer has stored (``layers[i].seq_len``): one list, which a forward's later layers' update
        #: (the head gather's repeat, see update) reads and writes
        self._lengths = [0] * pool.layer_num
        #: a forward's later layers' update, the head gather's repeat of its first layer's launch, or None (see update)
        self._repeat = None
        # the repeat is also this cache's `update` attribute while it is set, unless a subclass overrides update
        self._update_is_repeat = type(self).update is PagedKVCache.update
        self._layer_buffers: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # each layer's K and V rows
        self._gathers: dict[torch.dtype, HeadGather] = {}  # the read into attention's layout, by its dtype
        self.contiguous_rows = bool(contiguous_rows)
        self.resident_rows = bool(resident_rows)
        self._row_base: int | None = None  # first slot of row 0 while the batch runs on reserved contiguous rows
        self._row_cap = 0  # tokens reserved per row then
        self._row_views: list[tuple] | None = None  # each layer's K and V strides and offsets over the reserved runs
        super().__init__(layers=[PagedKVLayer(self, i) for i in range(pool.layer_num)])

    # -- construction -------------------------------------------------------------------------------------

    @classmethod
    def from_model(
        cls,
        model: Any,
        *,
        max_total_tokens: int,
        page_size: int = 1,
        dtype: Any = None,
        max_batch_size: int = 32,
        max_context_len: int | None = None,
        device: Any = None,
        kernels: str = "auto",
        need_sort: bool = False,
        k_scale: float | None = None,
        v_scale: float | None = None,
        registry: Any = None,
        contiguous_rows: bool = False,
        resident_rows: bool = False,
    ) -> PagedKVCache:
        """A cache sized for ``model`` (a transformers ``PreTrainedModel``, or anything with ``.config``).

        The pools are built by the ``mha`` backend's plugin through the hooks :func:`kvcore.build_pools` calls
        (``kvcore_buffer_layout``, ``kvcore_create_pool``, ``kvcore_create_req_to_token_pool``,
        ``kvcore_choose_allocator``), at exactly the sizes given here (no memory planning).

        :param max_total_tokens: token slots in the pool, over all rows (rounded down to whole pages).
        :param page_size: tokens per page; 1 uses the token allocator, more the paged one.
        :param dtype: cache dtype: ``None``/``"auto"`` (the model's), a ``torch.dtype`` or a kvcore dtype
            name (``bfloat16``, ``float8_e4m3fn``, ...).
        :param max_batch_size: request slots (rows of one batch; beams count as rows).
        :param max_context_len: longest row, prompt padding included (default: the model's
            ``max_position_embeddings``, at most the pool's size).
        :param device: where the pool lives (default: the model's device).
        :param kernels: ``auto`` (Triton on CUDA, torch elsewhere), ``triton`` or ``native``.
        :param need_sort: the core's allocator defers frees and hands out sorted slots (built directly then: the
            allocator hook takes no such argument).
        :param registry: the plugins (default: the installed ones); one of them must register the ``mha`` backend.
        :param contiguous_rows: reserve each row one run of slots per batch and read strided views (see the
            class docstring).
        :param resident_rows: keep every layer's gathered rows between steps (see the class docstring).
        """
        pool, allocator, req_to_token_pool = pools_for_model(
            model, max_total_tokens=max_total_tokens, page_size=page_size, dtype=dtype, max_batch_size=max_batch_size,
            max_context_len=max_context_len, device=device, kernels=kernels, need_sort=need_sort, registry=registry,
        )  # fmt: skip
        return cls(pool, allocator, req_to_token_pool, k_scale=k_scale, v_scale=v_scale, contiguous_rows=contiguous_rows,
                   resident_rows=resident_rows)  # fmt: skip

    @classmethod
    def from_config(
        cls,
        cfg: Any,
        *,
        model: Any = None,
        registry: Any = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        contiguous_rows: bool = False,
        resident_rows: bool = False,
        **build_kwargs: Any,
    ) -> PagedKVCache:
        """A cache from a kvcore :class:`~kvcore.config.EngineConfig`: :func:`kvcore.build_pools` plans and
        allocates the pool, allocator and request table (``kv_cache.dtype``, ``kv_cache.page_size``,
        ``memory.max_total_tokens``, ``memory.max_running_requests`` apply as for an engine).

        :param model: when given, its config must match ``cfg.model`` (layers, KV heads, head width).
        :param build_kwargs: passed to :func:`kvcore.build_pools` (``free_memory_bytes``, ``plan``, ...).
        """
        import kvcore

        if cfg.model.attention != "mha":
            raise ConfigError(f"model.attention={cfg.model.attention!r}: PagedKVCache serves mha (K/V) pools only")
        if model is not None:
            dims = model_dimensions(model.config)
            want = {"layers": cfg.model.num_hidden_layers, "kv_heads": cfg.kv_heads_per_rank, "head_dim": cfg.model.head_dim}
            wrong = [f"{k}: model {dims[k]} vs config {v}" for k, v in want.items() if dims[k] != v]
            if wrong:
                raise ConfigError("the kvcore config does not describe this model (" + "; ".join(wrong) + ")")
        pools = kvcore.build_pools(cfg, registry=registry, **build_kwargs)
        return cls(
            pools.token_to_kv_pool, pools.token_to_kv_pool_allocator, pools.req_to_token_pool,
            k_scale=k_scale, v_scale=v_scale, contiguous_rows=contiguous_rows, resident_rows=resident_rows,
        )

    # -- what callers look at -----------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        """The cache dtype (fp8 is stored as uint8 by the pool)."""
        return self.pool.dtype

    @property
    def available_tokens(self) -> int:
        """Token slots the allocator can still hand out."""
        return self.allocator.available_size()

    @property
    def capacity_tokens(self) -> int:
        """Token slots free when the cache was built (what :meth:`free_all` returns to)."""
        return self._initial_available

    @property
    def batch_size(self) -> int:
        return len(self._slots) if self._slots else -1

    @property
    def live_rows(self) -> list[int]:
        """Batch rows that hold stored tokens (not freed)."""
        return [i for i, slot in enumerate(self._slots) if slot]

    def request_slot(self, batch_index: int) -> int:
        """The request-table row of batch row ``batch_index`` (0 once freed)."""
        return self._slots[batch_index]

    def token_locations(self, batch_index: int) -> torch.Tensor:
        """Pool locations of batch row ``batch_index``'s tokens, oldest first (int64 ``[seq_len]``)."""
        if not self._slots[batch_index]:
            raise ValueError(f"batch row {batch_index} was freed")
        return self._locations(self.get_seq_length())[batch_index]

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(layers={len(self.layers)}, dtype={self.dtype}, page_size={self.page_size}, "
            f"rows={len(self._slots)}, seq_len={self.get_seq_length()}, available_tokens={self.available_tokens})"
        )

    # -- storage ------------------------------------------------------------------------------------------
    #
    # Per forward, the first layer runs _begin_step: a new batch takes its request slots, rows reaching a page they
    # do not hold take whole pages (one allocator call for every row), and the store's and the gather's locations
    # are worked out once (views of the request table when the rows sit in consecutive slots).  Every layer then
    # stores and gathers (one launch on the Triton path; over reserved runs, two strided views).  Nothing reads the
    # device back, except once per batch (contiguous_rows checks its run) and when the pool is nearly full.

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store layer ``layer_idx``'s new keys/values (``[batch, kv_heads, q, head_dim]``) and return those of
        every token so far, ``[batch, kv_heads, seq, head_dim]`` in the dtype of ``key_states`` (transformers'
        per-layer call; the pool stays where it is): a gathered copy (converted from the cache dtype), which a later
        layer's update writes over once nothing holds it, or, with ``contiguous_rows`` over reserved runs and the
        cache in the model's dtype, a strided view of the pool (no copy).  Nothing in it waits for the device.

        A forward's first layer that stores and reads in one launch leaves the head gather's repeat of that launch
        for the later layers, as this cache's ``update`` (an instance attribute over this method, unless a subclass
        overrides it or an ``update`` was set on the cache, a wrapper, which then reaches it through this method):
        one Python call a layer, which launches for a layer not stored yet at this length and hands anything else to
        this method's work (:meth:`_update_layer`).  It also takes the next decode steps' first layer while the kept
        outputs have room for their tokens, taking the rows' next pages when the new tokens pass their last
        (:meth:`_reach`): such a step is one call a layer, the first included.  A first layer it declines, and every
        edit of the rows, drop it."""
        repeat = self._repeat
        if repeat is not None:  # (this method still runs it when a subclass's update calls it)
            return repeat(key_states, value_states, layer_idx)
        return self._update(self.layers[layer_idx], key_states, value_states)

    def _update_layer(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        """:meth:`update` without a repeat: what a repeat declines."""
        return self._update(self.layers[layer_idx], key_states, value_states)

    def _drop_repeat(self) -> None:
        """Drop the later layers' update a forward's first layer left (see :meth:`update`); an ``update`` attribute
        set on the cache by anything else (a wrapper) stays."""
        repeat, self._repeat = self._repeat, None
        if repeat is not None and self.__dict__.get("update") is repeat:
            del self.__dict__["update"]

    def __getstate__(self) -> dict:
        """What a copy (``copy.deepcopy``: a prompt's cache reused) takes: all but the later layers' update, a closure
        over this cache's launches; the copy's pool and gathers launch into its own buffers (see
        :mod:`kvcore.kernels.addresses`)."""
        state = self.__dict__.copy()
        if self._repeat is not None and state.get("update") is self._repeat:
            del state["update"]
        state["_repeat"] = None
        return state

    def _update(self, layer: PagedKVLayer, key_states: torch.Tensor, value_states: torch.Tensor):
        """:meth:`update`, for ``layer``, when it does not repeat the first layer's launch: a forward's first layer,
        and every layer of a forward that may not repeat."""
        if self._repeat is not None:
            self._drop_repeat()
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        layer_id, lengths = layer.layer_id, self._lengths  # (layer.seq_len, without its property's call)
        end = lengths[layer_id] + q
        step = self._step
        if step is None or step.end != end or step.q != q:
            if (step is not None and step.length is not None and end <= self._allocated
                    and end <= self.req_to_token_pool.max_context_len and key_states.shape[0] == len(self._slots)
                    and key_states.dtype is step.gather.out_dtype and key_states.stride(-1) == 1
                    and value_states.stride(-1) == 1):  # fmt: skip
                # the next forward of rows read from the table as they are (a decode's next step), its locations
                # held already: what _begin_step would work out again, but the length
                step.end, step.q, step.length = end, q, end
            else:
                step = self._begin_step(key_states, value_states, end)
        if step.fused:  # the pool's rows written and read in one launch
            lengths[layer_id] = end
            gather, locs, length = step.gather, step.read_locs, step.length
            out = gather.store_and_gather(layer_id, locs, key_states, value_states, length)
            repeat = gather.repeat_for(locs, length)
            if repeat is not None and end > q:  # (a first forward's layers initialize themselves in _update)
                self._repeat = repeat  # the later layers' update (see update)
                if self._update_is_repeat and "update" not in self.__dict__:  # (nothing else set one: a wrapper)
                    self.update = repeat
            return out
        k, v = key_states, value_states
        if step.live is not None:  # some rows freed: only the others store
            k, v = k[step.live], v[step.live]
        if q == 1:  # a decode step: [rows, heads, 1, dim] -> [rows, heads, dim], one view each
            k, v = k.select(2, 0), v.select(2, 0)
        else:  # [rows, heads, q, dim] -> [rows * q, heads, dim], row after row
            k = k.transpose(1, 2).reshape(-1, k.shape[1], k.shape[3])
            v = v.transpose(1, 2).reshape(-1, v.shape[1], v.shape[3])
        self.pool.set_kv_buffer(layer_id, step.write_locs, k, v, self.k_scale, self.v_scale)
        lengths[layer_id] = end
        if step.gather is not None:
            return step.gather(layer_id, step.read_locs)
        k_buf, k_dim, k_stride, k_offset, v_buf, v_dim, v_stride, v_offset = self._row_views[layer_id]
        return (k_buf.as_strided((*step.view_shape, k_dim), k_stride, k_offset),
                v_buf.as_strided((*step.view_shape, v_dim), v_stride, v_offset))  # fmt: skip

    def _begin_batch(self, batch: int) -> None:
        slots = self.req_to_token_pool.alloc(batch)
        if slots is None:
            raise KVCacheFullError(
                f"a batch of {batch} rows needs {batch} request slots, "
                f"{self.req_to_token_pool.available_size()} are free (raise max_batch_size / memory.max_running_requests)"
            )
        self._set_slots([int(s) for s in slots])
        if self.contiguous_rows:
            self._reserve_rows(batch)

    def _reserve_rows(self, batch: int) -> None:
        """Give each row of a new batch its run of slots (see ``contiguous_rows``), or leave the batch to allocate
        as it grows when the allocator's free slots are not one run.  Reads the device (once per batch)."""
        page = self.page_size
        cap = min(self.available_tokens // batch, self.req_to_token_pool.max_context_len) // page * page
        locs = self.allocator.alloc(batch * cap) if cap else None
        if locs is None:  # not a page a row: the rows allocate as they grow (and say so when the pool is full)
            return
        first = int(locs[0])
        if not torch.equal(locs, torch.arange(first, first + batch * cap, device=locs.device, dtype=locs.dtype)):
            self.allocator.free(locs)
            return
        table = self.req_to_token_pool.req_to_token
        table[self._slot_t, :cap] = locs.view(batch, cap).to(table.dtype)
        self._row_base, self._row_cap, self._allocated = first, cap, cap

    def _set_slots(self, slots: list[int]) -> None:
        self._slots = slots
        live = [i for i, s in enumerate(slots) if s]

        def on_device(values: list[int]) -> torch.Tensor:  # copied without waiting for the device
            return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

        self._slot_t = on_device(slots)
        self._live_t = on_device(live)
        self._live_slots = on_device([slots[i] for i in live])
        # every row live in consecutive request slots (what a fresh batch gets): its table rows are one view
        first = slots[0] if slots else 0
        consecutive = slots and len(live) == len(slots) and slots == list(range(first, first + len(slots)))
        self._rows = self.req_to_token_pool.req_to_token[first : first + len(slots)] if consecutive else None
        self._step = None
        self._drop_repeat()
        self._forget_resident_rows()

    def _grow(self, end: int) -> None:
        """Give every live row locations for positions ``self._allocated .. end - 1``: whole pages, taken in one
        ``alloc`` (row after row, each its pages in order; position ``p`` at offset ``p % page_size`` of its page,
        as ``alloc_extend`` / ``alloc_decode`` would place it) and written to the rows' table entries, the rest of
        the last page included, so the next tokens up to the page's end need no allocation."""
        if self._row_base is not None:  # reserved runs: every location is in the table already
            raise KVCacheFullError(
                f"rows of {end} tokens exceed the {self._row_cap} reserved for each of the batch's "
                f"{len(self._slots)} rows (contiguous_rows: the pool's free slots over the rows, at most "
                f"max_context_len={self.req_to_token_pool.max_context_len}); raise max_total_tokens"
            )
        max_len = self.req_to_token_pool.max_context_len
        if end > max_len:
            raise KVCacheFullError(
                f"rows of {end} tokens exceed the request table's max_context_len={max_len} (raise max_context_len)"
            )
        start, missing = self._allocated, self._take_pages(end)
        if missing:
            raise KVCacheFullError(
                f"{len(self._live_slots)} row(s) growing from {start} to {end} tokens need {missing} more token slots "
                f"(in pages of {self.page_size}); {self.available_tokens} are free of {self.capacity_tokens}: "
                "raise max_total_tokens, or free finished rows"
            )

    def _take_pages(self, end: int) -> int:
        """:meth:`_grow`'s allocation and table writes, for rows of at most ``max_context_len`` tokens on pages the
        allocator hands out as they grow: 0, or the slots the allocator did not have (nothing changed then)."""
        start, page, max_len = self._allocated, self.page_size, self.req_to_token_pool.max_context_len
        stop = -(-end // page) * page
        n = len(self._live_slots)
        out = self.allocator.alloc(n * (stop - start))
        if out is None:
            return n * (stop - start)
        cols = min(stop, max_len) - start  # a last page past max_context_len is held, its tail not recorded
        new = out.view(n, stop - start)[:, :cols]
        if self._rows is not None:
            self._rows[:, start : start + cols].copy_(new)
        else:
            table = self.req_to_token_pool.req_to_token
            table[self._live_slots, start : start + cols] = new.to(table.dtype)
        self._allocated = stop
        return 0

    def _begin_step(self, key_states: torch.Tensor, value_states: torch.Tensor, end: int) -> ForwardStep:
        """The first layer of a forward bringing ``key_states`` / ``value_states`` (``[batch, heads, q, dim]``) for
        positions ``end - q .. end - 1``: the batch's slots (a new batch), the rows' locations, and what every
        layer's :meth:`_update` takes from them (kept in ``self._step``)."""
        batch, _, q, _ = key_states.shape
        prefix = end - q
        if not self._slots:
            if prefix:
                raise RuntimeError("PagedKVCache lost its rows mid-sequence (freed during a forward?)")
            self._begin_batch(batch)
        elif batch != len(self._slots):
            raise ValueError(
                f"this cache holds a batch of {len(self._slots)} rows, the forward brings {batch}; "
                "call free_all() before starting another batch"
            )
        if end > self._allocated or end > self.req_to_token_pool.max_context_len:
            self._grow(end)  # (which refuses rows longer than the table's)
        step = ForwardStep(end, q)
        rows = self._rows
        table = self.req_to_token_pool.req_to_token
        if rows is None and len(self._live_slots) != batch:  # some rows freed: they store nothing, read the padding slot
            step.live = self._live_t
        if self._layer_buffers is None:
            self._layer_buffers = [(self.pool.get_key_buffer(i), self.pool.get_value_buffer(i))
                                   for i in range(len(self.layers))]  # fmt: skip
        k_buf = self._layer_buffers[0][0]
        if self._row_base is not None and k_buf.dtype == key_states.dtype and k_buf.dim() == 3:
            if self._row_views is None:
                base, cap = self._row_base, self._row_cap
                self._row_views = [run_geometry(k, base, cap) + run_geometry(v, base, cap)
                                   for k, v in self._layer_buffers]  # fmt: skip
            step.view_shape = (batch, k_buf.shape[1], end)
        else:
            step.gather = self._gather_for(key_states.dtype)
            # one launch stores and reads when the pool's store is a plain row write this cache may make itself
            step.fused = (self._fused_store and step.live is None and key_states.stride(-1) == 1
                          and value_states.stride(-1) == 1)  # fmt: skip
            if not step.fused:  # the pool's rows stored otherwise: resident rows would miss them
                self._forget_resident_rows()
            if rows is None:
                step.read_locs = table[self._slot_t, :end]
            elif step.fused:  # the rows as they are, every step: no view a step, and the launch's last arguments
                step.read_locs, step.length = rows, end
            else:
                step.read_locs = rows[:, :end]
        if not step.fused:  # the store's locations: views of the table when every row is live in consecutive slots
            if rows is not None:
                step.write_locs = rows[:, prefix] if q == 1 else rows[:, prefix:end]
            else:
                step.write_locs = table[self._live_slots, prefix] if q == 1 else table[self._live_slots, prefix:end]
        if not self._triton_gather:  # the torch paths index with int64: converted once here, not in every layer
            step.write_locs = step.write_locs.to(torch.int64)
            if step.read_locs is not None:
                step.read_locs = step.read_locs.to(torch.int64)
        self._step = step
        return step

    def _gather_for(self, dtype: torch.dtype) -> HeadGather:
        gather = self._gathers.get(dtype)
        if gather is None:
            buffers = self._layer_buffers
            k_layers, v_layers = [b[0] for b in buffers], [b[1] for b in buffers]
            if self.resident_rows:
                gather = ResidentHeadGather(k_layers, v_layers, dtype, self.k_scale, self.v_scale,
                                            use_triton=self._triton_gather)  # fmt: skip
            else:
                gather = HeadGather(k_layers, v_layers, dtype, self.k_scale, self.v_scale,
                                    use_triton=self._triton_gather, reuse_outputs=True)  # fmt: skip
            # its repeats serve as the later layers' update, and as the next decode steps' first within the rows' pages
            gather.follow_layers(self._lengths, self._update_layer, self._reach)
            self._gathers[dtype] = gather
        return gather

    def _reach(self, want: int = 0) -> int:
        """Tokens every row may hold with no allocation first: the positions its pages cover, at most the request
        table's width (what a repeat reads when it is made; every other change of these drops the repeat first).
        ``want``: first take the pages that rows of ``want`` tokens need, when they run on pages taken as they grow,
        fit the table and the allocator has the slots (a repeat taking a decode step's first layer past the rows'
        last page; otherwise the full path says what is wrong)."""
        if self._allocated < want <= self.req_to_token_pool.max_context_len and self._row_base is None:
            self._take_pages(want)
        return min(self._allocated, self.req_to_token_pool.max_context_len)

    def _forget_resident_rows(self) -> None:
        """Drop the layers' resident rows (``resident_rows``): the pool's rows changed other than through them."""
        if self.resident_rows:
            for gather in self._gathers.values():
                gather.release()

    def _locations(self, length: int) -> torch.Tensor:
        """``[batch, length]`` int64 locations (freed rows read the padding row: slot 0)."""
        return self.req_to_token_pool.req_to_token[self._slot_t, :length].to(torch.int64)

    def _buffer(self, layer_id: int, which: str) -> torch.Tensor:
        return self.pool.get_key_buffer(layer_id) if which == "k" else self.pool.get_value_buffer(layer_id)

    def _read(self, layer_id: int, which: str, length: int) -> torch.Tensor:
        """What is stored for layer ``layer_id``, in the cache dtype (``layers[i].keys`` / ``.values``)."""
        return take_rows(self._buffer(layer_id, which), self._locations(length)).transpose(1, 2).contiguous()

    # -- giving slots back --------------------------------------------------------------------------------

    def free(self, batch_index: int | Sequence[int]) -> None:
        """Give the token slots and the request slot of finished batch row(s) back.

        The other rows go on as they were.  When no row is left the cache is empty again (as after
        :meth:`free_all`).

        :raises ValueError: for a row that was already freed, or out of range.
        """
        indices = [int(i) for i in batch_index] if isinstance(batch_index, Sequence) else [int(batch_index)]
        for i in indices:
            if not 0 <= i < len(self._slots):
                raise ValueError(f"batch row {i} is out of range for a batch of {len(self._slots)} rows")
            if not self._slots[i]:
                raise ValueError(f"batch row {i} was already freed")
        slots = list(self._slots)
        for i in indices:
            slot = slots[i]
            held = self._row_cap if self._row_base is not None else self._allocated  # a reserved run goes back whole
            if held:
                self.allocator.free(self.req_to_token_pool.req_to_token[slot, :held].to(torch.int64))
            self.req_to_token_pool.free(slot)
            slots[i] = 0
        if any(slots):
            self._set_slots(slots)
        else:
            self._clear_state()

    def free_all(self) -> None:
        """Give every slot back; the cache is empty and takes a new batch on the next forward."""
        live = self.live_rows
        if live:
            self.free(live)
        else:
            self._clear_state()

    def _clear_state(self) -> None:
        self._set_slots([])
        self._allocated = 0
        self._row_base, self._row_cap, self._row_views = None, 0, None
        for gather in self._gathers.values():  # the last outputs kept for reuse go back to torch's allocator
            gather.release()
        for layer in self.layers:
            layer.reset()

    def reset(self) -> None:
        """transformers' reset: the same as :meth:`free_all`."""
        self.free_all()

    # -- transformers' cache edits ------------------------------------------------------------------------

    def crop(self, max_length: int) -> None:
        """Drop trailing tokens: ``max_length < 0`` removes ``-max_length`` of them (transformers 5's
        convention), ``max_length >= 0`` keeps that many (5.0's).  Whole pages past the new end go back to the
        allocator; the rest of the last page stays with its row and is reused as it grows again."""
        current = self.get_seq_length()
        new_len = current + max_length if max_length < 0 else min(max_length, current)
        new_len = max(new_len, 0)
        if new_len >= current:
            return
        for layer in self.layers:
            layer.seq_len = min(layer.seq_len, new_len)
        keep = -(-new_len // self.page_size) * self.page_size  # the last page kept: its tail stays in the table
        if self._row_base is None and self._allocated > keep:  # reserved runs stay whole
            if len(self._live_slots):
                dropped = self.req_to_token_pool.req_to_token[self._live_slots, keep : self._allocated]
                self.allocator.free(dropped.reshape(-1).to(torch.int64))
            self._allocated = keep
        self._step = None
        self._drop_repeat()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` takes the tokens of row ``beam_idx[i]`` (copied into row ``i``'s own slots,
        every layer)."""
        length = self.get_seq_length()
        if not length or not self._slots:
            return
        beam_idx = beam_idx.to(device=self.device, dtype=torch.int64)
        locs = self._locations(length)
        src, dst = locs[beam_idx], locs
        if len(self._live_t) != len(self._slots):
            src, dst = src[self._live_t], dst[self._live_t]
        src, dst = src.reshape(-1), dst.reshape(-1)
        self._forget_resident_rows()
        for layer in self.layers:
            k = take_rows(self.pool.get_key_buffer(layer.layer_id), src)  # copies, so overlapping rows are safe
            v = take_rows(self.pool.get_value_buffer(layer.layer_id), src)
            self.pool.set_kv_buffer(layer.layer_id, dst, k, v)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length():
            raise NotImplementedError("PagedKVCache cannot repeat rows once they hold tokens")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length():
            raise NotImplementedError("PagedKVCache cannot select rows once they hold tokens; free() the others")

    def offload(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        pass

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        pass
