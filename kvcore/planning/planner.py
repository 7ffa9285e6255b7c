"""Memory budget -> pool sizes: the arithmetic of SGLang's KV-cache configurator, on declared layouts only.

Nothing here allocates or touches a device: the inputs are the config, the :class:`~kvcore.layout.PoolLayout`
of every pipeline rank and, when an engine has profiled its device, the free memory it measured.

1. **Budget** (:func:`memory_budget`).  ``pre`` is the device memory free before the model loads (the
   hardware profile's ``memory_gib``, or the profiled value).  Weights per rank (parameters x weight bytes /
   (tp x pp)) are charged unless the caller profiled after loading them.  The runtime slack is
   ``pre x (1 - mem_fraction_static)``.  ``budget = pre - weights - slack``.  ``memory.budget_gib`` replaces
   all of this with an explicit budget.
2. **Per-request state** (layouts with a ``requests`` group: hybrid Mamba / linear attention).  State slots
   are reserved first, by the layout's :class:`~kvcore.layout.RequestStateSizing` (SGLang's
   ``_handle_max_mamba_cache``: explicit, one per running request, or a share of the budget, jointly with
   speculative decoding's per-draft-token states); the tokens get the rest.
3. **Tokens** (:func:`tokens_that_fit`).  The largest token count whose layout bytes (padding rows
   included, so the plan is exact) fit the budget; with a sliding-window group, full and window tokens are
   solved jointly with ``swa_tokens = swa_full_tokens_ratio x tokens``.  The smallest count over pipeline
   ranks wins (each rank may hold a different number of layers).
4. **Cap and page alignment.**  ``memory.max_total_tokens`` caps the count (a warning when the cap is
   larger than what fits); the result is rounded down to whole pages.  A group below the layout's
   ``min_sizes`` (a sliding window plus a page) is an error naming the setting that would reach it.
5. **Requests** (:func:`resolve_max_running_requests`): SGLang's estimate ``tokens / context x 512``
   clamped to [2048, 4096], or the user's value divided over data-parallel workers; never more than half
   the tokens, nor more than the state slots allow.

Every error names the key to change and, where one exists, a value that works.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import attrs

from kvcore.config import EngineConfig
from kvcore.errors import PlanningError
from kvcore.kernels.addresses import shared_by_copies
from kvcore.layout import PoolLayout, RequestStateSizing
from kvcore.planning.unified import UnifiedFigures, unified_figures

logger = logging.getLogger(__name__)

GiB = 1 << 30
REQ_TO_TOKEN_ITEMSIZE = 4  # int32 token indices


@attrs.frozen
class MemoryBudget:
    """Where the KV budget comes from, in bytes."""

    source: str
    pre_model_load_bytes: int
    weight_bytes: int
    slack_bytes: int
    kv_budget_bytes: int


@attrs.frozen
class MemoryPlan:
    """The sizes every pool will get, and how they were derived.  Nothing is allocated."""

    __deepcopy__ = shared_by_copies

    backend: str
    layout: PoolLayout
    budget: MemoryBudget
    page_size: int
    bytes_per_token: int
    max_total_num_tokens: int
    max_running_requests: int
    context_length: int
    sizes: Mapping[str, int] = attrs.field(converter=lambda m: MappingProxyType(dict(m)))
    kv_cache_bytes: int = 0
    req_to_token_bytes: int = 0
    limiting_pp_rank: int = 0
    pp_size: int = 1
    warnings: tuple[str, ...] = ()
    extra_context_len: int = 0
    pre_alloc_size: int = 0
    draft_layout: PoolLayout | None = None
    draft_weight_bytes: int = 0
    unified: UnifiedFigures | None = None

    @property
    def request_context_len(self) -> int:
        """The request table's row length: the model's context plus the headroom drafting and over-allocation
        need (SGLang's ``context_len + get_req_to_token_extra_context_len()``)."""
        return self.context_length + self.extra_context_len

    @property
    def draft_bytes_per_token(self) -> int:
        """Bytes per token of the draft model's pool (0 without speculative decoding)."""
        return 0 if self.draft_layout is None else self.draft_layout.bytes_per_token

    @property
    def draft_kv_cache_bytes(self) -> int:
        """Bytes of the draft model's pool: its layout at the target's tokens (0 without speculative decoding)."""
        return 0 if self.draft_layout is None else self.draft_layout.total_bytes({"tokens": self.sizes["tokens"]})

    @property
    def cell_bytes_per_token(self) -> int:
        """What one token costs the budget: the target's bytes per token plus the draft's (SGLang's cell size
        under speculative decoding)."""
        return self.bytes_per_token + self.draft_bytes_per_token

    @property
    def swa_max_total_num_tokens(self) -> int | None:
        """Tokens of the sliding-window sub-pool (SGLang's name); None without one."""
        return self.sizes.get("swa_tokens")

    @property
    def max_mamba_cache_size(self) -> int | None:
        """Per-request state slots (SGLang's name, for hybrid Mamba / linear-attention models); None without."""
        return self.sizes.get("requests")

    @property
    def derived_sizes(self) -> dict[str, int]:
        """The sizes the layout derives from its groups, by SGLang's names (:attr:`PoolLayout.derived_sizes`)."""
        return {name: self.sizes[group] // divisor for name, (group, divisor) in self.layout.derived_sizes.items()}

    @property
    def full_max_total_num_tokens(self) -> int | None:
        """Tokens of the full-attention side of a hybrid sliding-window pool (SGLang's name; equal to
        ``max_total_num_tokens``); None for a pool without a sliding-window sub-pool."""
        return self.sizes["tokens"] if "swa_tokens" in self.sizes else None


def memory_budget(
    cfg: EngineConfig, *, free_memory_bytes: int | None = None, weights_loaded: bool = False,
    draft_weight_bytes: int = 0,
) -> MemoryBudget:
    """The KV byte budget of one rank.

    :param free_memory_bytes: device memory free before the model loads, as profiled by an engine; default:
        the hardware profile's ``memory_gib``.
    :param weights_loaded: the profile was taken after loading the weights, so they are not charged again.
    :param draft_weight_bytes: a speculative draft model's weights per rank, charged with the target's (as
        SGLang's profile after loading both does).
    :raises PlanningError: when weights and slack leave nothing, naming the value that would fit.
    """
    if cfg.memory.budget_gib is not None:
        budget = int(cfg.memory.budget_gib * GiB)
        return MemoryBudget("memory.budget_gib", budget, 0, 0, budget)

    if free_memory_bytes is None:
        pre = int(cfg.hardware.memory_gib * GiB)
        source = f"hardware profile {cfg.hardware.name} ({cfg.hardware.memory_gib:g} GiB)"
    else:
        pre = int(free_memory_bytes)
        source = f"profiled free memory ({pre / GiB:.2f} GiB)"
    weights = 0 if weights_loaded else cfg.weight_bytes_per_rank + draft_weight_bytes
    mfs = cfg.memory.mem_fraction_static
    slack = int(pre * (1 - mfs))
    available = pre - weights
    rest = available - slack
    if available <= 0 or rest <= 0:
        fixes = _fixes_for_weights(cfg, free_memory_bytes is None, weights_loaded)
        if available <= 0:
            draft = " (with its speculative draft)" if draft_weight_bytes else ""
            raise PlanningError(
                f"model {cfg.model.name}{draft} needs {weights / GiB:.2f} GiB of weights per rank but {source} has "
                f"{pre / GiB:.2f} GiB: {fixes}"
            )
        minimum = 1 - available / pre
        suggested = (math.floor(minimum * 1000) + 1) / 1000  # above the minimum, to 3 decimals
        raise PlanningError(
            f"loaded weights ({weights / GiB:.2f} GiB per rank) leave no memory for the KV cache under "
            f"memory.mem_fraction_static={mfs}: set memory.mem_fraction_static={suggested:.3f} (the minimum viable is "
            f"1 - available/pre = {minimum:.4f}), or {fixes}"
        )
    return MemoryBudget(source, pre, weights, slack, rest)


#: KV memory the suggestions for a model that does not fit leave room for
HEADROOM_BYTES = 1 << 30


def _fixes_for_weights(cfg: EngineConfig, from_profile: bool, weights_loaded: bool) -> str:
    """What makes the weights fit with a GiB of KV cache to spare, as overrides: the smallest tensor-parallel
    size (on GPUs), the device memory the profile would need, or an explicit KV budget."""
    mfs = cfg.memory.mem_fraction_static
    fixes = []
    if cfg.hardware.device != "cpu" and not weights_loaded:
        tp = _smallest_fitting_tp(cfg)
        if tp is not None:
            fixes.append(f"parallel.tp_size={tp}")
    if from_profile:
        weights = 0 if weights_loaded else cfg.weight_bytes_per_rank
        needed = math.ceil((weights + HEADROOM_BYTES) / mfs / GiB * 10) / 10
        fixes.append(f"hardware.memory_gib={needed:g} (the device memory that leaves a GiB for the KV cache)")
    fixes.append("memory.budget_gib=1 (an explicit KV budget in GiB; weights are then not charged)")
    return "set " + ", or ".join(fixes)


def _smallest_fitting_tp(cfg: EngineConfig) -> int | None:
    """The smallest power-of-two tensor-parallel size that splits the model's heads and leaves a GiB of KV
    cache per rank on the hardware profile, or None."""
    m = cfg.model
    pre, mfs = cfg.hardware.memory_gib * GiB, cfg.memory.mem_fraction_static
    weights = cfg.weight_bytes_per_rank * cfg.parallel.tp_size * cfg.parallel.pp_size  # the whole model's
    for tp in (2, 4, 8, 16, 32, 64):
        kv = m.num_key_value_heads
        if m.num_attention_heads % tp or (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            continue
        if weights / (tp * cfg.parallel.pp_size) + HEADROOM_BYTES <= pre * mfs:
            return tp
    return None


def tokens_that_fit(layout: PoolLayout, budget_bytes: int, swa_full_tokens_ratio: float) -> dict[str, int]:
    """The largest sizes whose exact layout bytes fit ``budget_bytes``.

    :returns: ``{"tokens": n}``, plus ``"swa_tokens"`` when the layout has a sliding-window group.
    :raises PlanningError: for size groups the core planner cannot solve on its own.
    """
    unsupported = [g for g in layout.groups if g not in ("tokens", "swa_tokens")]
    if unsupported:
        raise PlanningError(
            f"backend {layout.backend!r} declares buffers sized by {unsupported}; the planner sizes only "
            "'tokens' and 'swa_tokens' groups"
        )
    ratio = swa_full_tokens_ratio if "swa_tokens" in layout.groups else 0.0
    per_token = layout.bytes_per_unit("tokens") + ratio * layout.bytes_per_unit("swa_tokens")
    fixed = layout.total_bytes(_sizes(layout, 0, ratio))
    if per_token <= 0:
        raise PlanningError(f"backend {layout.backend!r} declares no per-token bytes")
    tokens = max(0, int((budget_bytes - fixed) // per_token))
    # Page-granular rows round up and the ratio rounds down, so the estimate may be off by a few tokens either
    # way: settle on the exact largest count whose bytes fit.
    while tokens > 0 and layout.total_bytes(_sizes(layout, tokens, ratio)) > budget_bytes:
        tokens -= 1
    while layout.total_bytes(_sizes(layout, tokens + 1, ratio)) <= budget_bytes:
        tokens += 1
    return _sizes(layout, tokens, ratio)


def _context_warnings(cfg: EngineConfig, tokens: int) -> list[str]:
    """What a plan that fits should still say: KV heads replicated over more tensor-parallel ranks than there are
    heads, and a pool smaller than one request at the model's full context."""
    warnings = []
    heads, tp = cfg.model.num_key_value_heads, cfg.parallel.tp_size
    if tp > heads:
        warnings.append(f"parallel.tp_size={tp} exceeds model.num_key_value_heads={heads}: each KV head is replicated "
                        f"on {tp // heads} ranks (every rank keeps {cfg.kv_heads_per_rank} head), so the cache takes "
                        f"{tp // heads}x the memory of the heads it holds")  # fmt: skip
    if tokens < cfg.model.context_length:
        warnings.append(f"the pool holds {tokens} tokens, fewer than one request at the model's full context "
                        f"(model.context_length={cfg.model.context_length}): such a request cannot be served; give "
                        f"more memory, or lower model.context_length to what you serve")  # fmt: skip
    for message in warnings:
        logger.warning(message)
    return warnings


def resolve_max_running_requests(
    cfg: EngineConfig, max_total_num_tokens: int
) -> tuple[int, list[str]]:
    """SGLang's ``resolve_max_num_reqs``: requests one data-parallel worker serves at once."""
    warnings: list[str] = []
    estimated = int(max_total_num_tokens / cfg.model.context_length * 512)
    estimated = max(min(estimated, 4096), 2048)
    requested = cfg.memory.max_running_requests
    if requested is not None:
        per_worker = requested // cfg.parallel.dp_size
        result = min(per_worker, max_total_num_tokens // 2)
        if per_worker <= 0:
            raise PlanningError(
                f"memory.max_running_requests={requested} leaves {per_worker} requests to each of "
                f"parallel.dp_size={cfg.parallel.dp_size} workers: set memory.max_running_requests to at least "
                f"{cfg.parallel.dp_size}"
            )
        if result < per_worker:
            message = (
                f"memory.max_running_requests reduced from {per_worker} to {result} per data-parallel worker: "
                f"the KV pool holds {max_total_num_tokens} tokens (at most half of them may be requests)"
            )
            logger.warning(message)
            warnings.append(message)
    else:
        result = min(estimated, max_total_num_tokens // 2)
    if result <= 0:
        cap = cfg.memory.max_total_tokens
        fix = (f"set memory.max_total_tokens={cfg.model.context_length} (one request of the model's context)"
               if cap is not None and cap <= 1 else "raise memory.mem_fraction_static or memory.budget_gib")  # fmt: skip
        raise PlanningError(f"the KV pool holds {max_total_num_tokens} tokens, too few for one request: {fix}")
    return result, warnings


def extra_context_len(cfg: EngineConfig) -> int:
    """The request table's headroom beyond the model's context, as SGLang sizes it
    (``get_req_to_token_extra_context_len``): 4 tokens, plus the draft tokens under speculative decoding; with
    pages larger than one token, at least twice what one decode step may allocate plus a page less one token
    (a draft step of ``num_draft_tokens - 1`` chained steps, each of ``eagle_topk`` branches)."""
    spec = cfg.speculative
    if not spec.enabled:
        return 4
    draft, topk, page = spec.num_draft_tokens, spec.eagle_topk, cfg.kv_cache.page_size
    extra = 4 + draft
    if page > 1:
        steps = max(1, draft - 1)
        if topk == 1:
            per_decode = max(steps * topk, draft)
        else:  # each branch may open its own pages
            per_decode = max((page - 1 + steps + page - 1) // page * page * topk, draft)
        extra = max(extra, 2 * per_decode + page - 1)
    return extra


def pre_alloc_size(cfg: EngineConfig) -> int:
    """Request-table rows a decode worker keeps beyond its running requests for requests whose KV is still
    arriving (SGLang's ``disaggregation_decode_extra_slots``): the configured value or, unset, twice a worker's
    share of ``memory.max_running_requests`` when that share is at most 32 (0 for larger shares, or with no
    cap set); 0 outside decode mode."""
    dis = cfg.disaggregation
    if dis.mode != "decode":
        return 0
    if dis.decode_extra_slots is not None:
        return dis.decode_extra_slots
    running = cfg.memory.max_running_requests
    if running is None:
        return 0
    per_worker = max(1, running // cfg.parallel.dp_size)
    return 2 * per_worker if per_worker <= 32 else 0


def with_draft(layout: PoolLayout, draft: PoolLayout | None) -> PoolLayout:
    """``layout`` plus the draft model's token buffers (named ``draft.<name>``): what one token costs when the
    draft's pool holds as many tokens as the target's (SGLang's cell size under speculative decoding)."""
    if draft is None:
        return layout
    extra = [attrs.evolve(b, name=f"draft.{b.name}") for b in draft.buffers if b.sized_by == "tokens"]
    return attrs.evolve(layout, buffers=(*layout.buffers, *extra))


def plan_from_layouts(
    cfg: EngineConfig,
    layouts: Sequence[PoolLayout],
    budget: MemoryBudget,
    draft_layout: PoolLayout | None = None,
) -> MemoryPlan:
    """Size the pools of this rank from the layouts of every pipeline rank (index = pp rank).

    :param draft_layout: under speculative decoding, the draft model's pool layout: its token buffers are
        sized with the target's tokens and charged to the same budget.
    """
    if len(layouts) != cfg.parallel.pp_size:
        raise ValueError(f"expected {cfg.parallel.pp_size} layouts (one per pipeline rank), got {len(layouts)}")
    target = layouts[cfg.parallel.pp_rank]
    layouts = [with_draft(layout, draft_layout) for layout in layouts]
    warnings: list[str] = []
    page_size = cfg.kv_cache.page_size
    ratio = swa_ratio(cfg, target)
    slots, kv_budgets = _request_slots(cfg, layouts, budget.kv_budget_bytes, ratio)
    per_rank = [_tokens_of_rank(cfg, layout, kv_budget, ratio) for layout, kv_budget in zip(layouts, kv_budgets)]
    limiting = min(range(len(per_rank)), key=per_rank.__getitem__)
    tokens = per_rank[limiting]
    layout = layouts[cfg.parallel.pp_rank]

    cap = cfg.memory.max_total_tokens
    capped = tokens if cap is None else min(tokens, cap)
    aligned = capped // page_size * page_size
    if cap is not None and cap > tokens:
        message = (
            f"memory.max_total_tokens={cap} is larger than the {tokens} tokens that fit; using {aligned}"
            + (f" (whole pages of {page_size})" if aligned != tokens else "")
        )
        logger.warning(message)
        warnings.append(message)
    if aligned <= 0 and cap is not None and cap < page_size <= tokens:
        raise PlanningError(
            f"memory.max_total_tokens={cap} is less than one page of kv_cache.page_size={page_size}: set "
            f"memory.max_total_tokens={cfg.model.context_length} (one request of the model's context) or at least "
            f"{page_size}"
        )
    if aligned <= 0 and page_size > cfg.model.context_length:
        raise PlanningError(
            f"kv_cache.page_size={page_size} is larger than the model's whole context (model.context_length="
            f"{cfg.model.context_length} tokens), and the KV budget of {budget.kv_budget_bytes / GiB:.3f} GiB fits "
            f"{capped} tokens, less than one page: use a page of at most the context, e.g. kv_cache.page_size=64"
        )
    if aligned <= 0:
        tokens_only = layout.without("requests").without("running_requests")
        one_request = tokens_only.total_bytes(_sizes(layout, max(page_size, cfg.model.context_length), ratio))
        budget_needed = math.ceil((one_request + budget.kv_budget_bytes - kv_budgets[limiting]) / GiB * 1000) / 1000
        if budget.source == "memory.budget_gib":
            hint = f"set memory.budget_gib={budget_needed:g} (one request of the model's context), "
        else:
            fraction = math.ceil((one_request + budget.weight_bytes) / budget.pre_model_load_bytes * 1000) / 1000
            raise_fraction = (f"set memory.mem_fraction_static={fraction:.3f} (one request of the model's context), or "
                              if fraction <= 1 else "")  # more than the whole memory: no fraction fits  # fmt: skip
            hint = f"{raise_fraction}set memory.budget_gib={budget_needed:g}, "
        raise PlanningError(
            f"the KV budget of {budget.kv_budget_bytes / GiB:.3f} GiB fits {capped} tokens, less than one page of "
            f"kv_cache.page_size={page_size} ({layout.bytes_per_token} bytes per token): "
            f"{hint}or lower kv_cache.page_size, or choose a smaller kv_cache.dtype"
        )
    warnings += _context_warnings(cfg, aligned)
    sizes = _sizes(layout, aligned, ratio)
    if "swa_tokens" in sizes:
        sizes["swa_tokens"] = sizes["swa_tokens"] // page_size * page_size
    _check_min_sizes(cfg, layouts, budget, sizes)
    max_running_requests, request_warnings = resolve_max_running_requests(cfg, aligned)
    warnings.extend(request_warnings)
    pre_alloc = pre_alloc_size(cfg)
    if slots is not None:
        sizes["requests"] = slots
        max_running_requests = _cap_by_state_slots(cfg, layout, slots, max_running_requests, warnings)
        if "running_requests" in layout.groups:
            sizes["running_requests"] = max_running_requests
        sizing = layout.request_state or RequestStateSizing()
        if sizing.per_request_table_row:  # the table's rows as resolved (the reservation may have been larger)
            sizes["requests"] = max_running_requests + pre_alloc + sizing.spare_slots
            unused = sum(b.total_bytes(slots) - b.total_bytes(sizes["requests"]) for b in layout.group("requests"))
            if unused > 0:
                message = (f"the per-request state was reserved for {slots} request slots, SGLang's estimate before the "
                           f"tokens were known, and {sizes['requests']} are kept: {unused / GiB:.2f} GiB of the KV "
                           f"budget stay unused; set memory.max_running_requests={max_running_requests} to give them "
                           "to the tokens")  # fmt: skip
                logger.warning(message)
                warnings.append(message)
        elif pre_alloc:
            sizes["requests"] = _with_pre_allocated(layout, slots, max_running_requests, pre_alloc, warnings)
    extra_context = extra_context_len(cfg)
    table_bytes = req_to_token_bytes(max_running_requests + pre_alloc, cfg.model.context_length + extra_context)
    if table_bytes > budget.kv_budget_bytes:  # SGLang's request table is not in the KV budget: say what it adds
        message = (f"the request table ({table_bytes / GiB:.2f} GiB: {max_running_requests + pre_alloc} requests x "
                   f"{cfg.model.context_length + extra_context} tokens of context) comes on top of the KV budget of "
                   f"{budget.kv_budget_bytes / GiB:.2f} GiB and is larger than it: lower memory.max_running_requests "
                   f"or model.context_length to shrink it")  # fmt: skip
        logger.warning(message)
        warnings.append(message)
    unified = None
    if cfg.memory.unified:
        unified = unified_figures(target, page_size, sizes)
    return MemoryPlan(
        unified=unified,
        backend=target.backend,
        layout=target,
        budget=budget,
        page_size=page_size,
        bytes_per_token=target.bytes_per_token,
        max_total_num_tokens=aligned,
        max_running_requests=max_running_requests,
        context_length=cfg.model.context_length,
        sizes=sizes,
        kv_cache_bytes=target.total_bytes({group: sizes[group] for group in target.groups}) if unified is None else
        unified.memory_bytes + sum(b.total_bytes(sizes["running_requests"]) for b in target.group("running_requests")),
        req_to_token_bytes=table_bytes,
        limiting_pp_rank=limiting,
        pp_size=len(layouts),
        warnings=tuple(warnings),
        extra_context_len=extra_context,
        pre_alloc_size=pre_alloc,
        draft_layout=draft_layout,
    )


def swa_ratio(cfg: EngineConfig, layout: PoolLayout) -> float:
    """Window tokens per full token: ``memory.swa_full_tokens_ratio``, or the family's default when it is unset."""
    ratio = cfg.memory.swa_full_tokens_ratio
    return layout.swa_full_tokens_ratio if ratio is None else ratio


def _tokens_of_rank(cfg: EngineConfig, layout: PoolLayout, kv_budget: int, ratio: float) -> int:
    """The tokens one pipeline rank's layout fits in its budget; for a layout that stores nothing per token (a
    prefill-only pool keeping placeholders), the caps instead: memory does not bound it.

    :raises PlanningError: for a pool that stores nothing and no cap, naming the keys that set one.
    """
    tokens_only = layout.without("requests").without("running_requests")
    if tokens_only.bytes_per_unit("tokens") or tokens_only.bytes_per_unit("swa_tokens"):
        return tokens_that_fit(tokens_only, kv_budget, ratio)["tokens"]
    memory = cfg.memory
    if memory.max_total_tokens is not None:
        return memory.max_total_tokens
    if memory.max_running_requests is not None:
        return memory.max_running_requests * cfg.model.context_length
    raise PlanningError(
        f"backend {layout.backend!r} stores no KV (its buffers add no bytes per token), so memory does not bound its "
        f"capacity: set memory.max_total_tokens (e.g. memory.max_total_tokens={64 * cfg.model.context_length}) or "
        "memory.max_running_requests (tokens are then requests x the model's context)"
    )


def _request_slots(cfg: EngineConfig, layouts: Sequence[PoolLayout], budget_bytes: int, ratio: float
                   ) -> tuple[int | None, list[int]]:
    """SGLang's reservation of per-request state before the KV tokens (``_handle_max_mamba_cache``): the
    state slots every rank keeps (None without a ``requests`` group), and each rank's budget left for tokens.

    Slots come from the layout's :class:`~kvcore.layout.RequestStateSizing`: explicit, or
    ``memory.max_running_requests`` when the family asks for it, or the state's share ``r / (1 + r)`` of the
    budget (shared with the draft tokens' states under speculative decoding); all divided over data-parallel
    workers.  Every rank keeps the fewest slots any rank can afford.  A family whose state follows the request
    table (``per_request_table_row``) keeps one slot per running request plus the table's padding row, the running
    requests estimated as SGLang does from the tokens that would fit without the state when
    ``memory.max_running_requests`` is unset.
    """
    stateful = [layout for layout in layouts if "requests" in layout.groups]
    if not stateful:
        return None, [budget_bytes] * len(layouts)
    first = stateful[0].request_state or RequestStateSizing()
    dp, running = cfg.parallel.dp_size, cfg.memory.max_running_requests
    slots_key, ratio_key, draft_key = (*first.keys, "", "", "")[:3]
    per_request = max(1, first.slots_per_request)
    if first.draft_tokens and running is None:
        raise PlanningError(
            f"speculative decoding ({draft_key}={first.draft_tokens}) keeps states per running request: set "
            "memory.max_running_requests"
        )
    if first.per_request_table_row:
        if running is None:
            tokens = min(tokens_that_fit(layout.without("requests").without("running_requests"), budget_bytes,
                                         ratio)["tokens"] for layout in layouts)  # fmt: skip
            slots = resolve_max_running_requests(cfg, max(tokens, 2))[0] + first.spare_slots
            source = f"{slots - first.spare_slots} running requests estimated from {tokens} tokens"
        else:
            slots = running // dp + first.spare_slots
            source = f"memory.max_running_requests={running}"
    elif first.slots is not None:
        slots = first.slots // dp
        source = f"{slots_key}={first.slots}"
    elif first.from_running_requests and running is not None:
        slots = running // dp
        source = f"memory.max_running_requests={running}"
    else:
        share = budget_bytes * first.memory_ratio / (1 + first.memory_ratio)
        # each slot brings 1 / slots_per_request of a running request's draft-token states along
        slots = min(
            int((share - layout.fixed_bytes("requests") - layout.fixed_bytes("running_requests"))
                // (layout.bytes_per_unit("requests") + layout.bytes_per_unit("running_requests") / per_request))
            for layout in stateful
        )  # fmt: skip
        source = f"{ratio_key}={first.memory_ratio:g} of a {budget_bytes / GiB:.3f} GiB KV budget"
    if first.per_request_table_row or (first.from_running_requests and running is not None):
        drafting = slots - first.spare_slots
    else:
        drafting = min(running // dp, slots // per_request) if running is not None else 0
    state_bytes = [
        sum(b.total_bytes(max(slots, 0)) for b in layout.group("requests"))
        + sum(b.total_bytes(max(drafting, 0)) for b in layout.group("running_requests"))
        for layout in layouts
    ]
    per_slot = max(layout.bytes_per_unit("requests") for layout in stateful)
    if slots <= 0 or any(state >= budget_bytes for state in state_bytes):
        raise PlanningError(
            f"per-request state of {per_slot / 2**20:.2f} MiB per slot leaves no memory for the KV cache or gets "
            f"no slot ({source}: {slots} slots): lower "
            + " or ".join(dict.fromkeys(k for k in (slots_key, "memory.max_running_requests") if k))
            + (f" or {draft_key}" if first.draft_tokens else "")
            + ", raise memory.mem_fraction_static or memory.budget_gib, or use more tensor-parallel ranks "
            "(parallel.tp_size)"
        )
    return slots, [budget_bytes - state for state in state_bytes]


def _with_pre_allocated(layout: PoolLayout, slots: int, requests: int, pre_alloc: int, warnings: list[str]) -> int:
    """The state slots of a decode worker: enough for the running and the pre-allocated requests (SGLang's
    ``HybridMambaDecodeReqToTokenPool`` raises its state pool to ``(requests + pre_alloc) x`` the slots a request
    holds, beyond the budget's share, and says so)."""
    per_request = max(1, (layout.request_state or RequestStateSizing()).slots_per_request)
    needed = (requests + pre_alloc) * per_request
    if needed <= slots:
        return slots
    message = (f"state slots raised from {slots} to {needed} for {requests} running and {pre_alloc} pre-allocated "
               f"requests (disaggregation.decode_extra_slots) at {per_request} slots each: "
               f"{(needed - slots) * layout.bytes_per_unit('requests') / GiB:.3f} GiB beyond the KV budget")  # fmt: skip
    logger.warning(message)
    warnings.append(message)
    return needed


def _cap_by_state_slots(cfg: EngineConfig, layout: PoolLayout, slots: int, requests: int, warnings: list[str]) -> int:
    """``max_running_requests`` no larger than the state slots allow (SGLang's ``resolve_max_num_reqs``)."""
    sizing = layout.request_state or RequestStateSizing()
    per_request = max(1, sizing.slots_per_request)
    capped = min(requests, (slots - sizing.spare_slots) // per_request)
    if capped <= 0:
        raise PlanningError(
            f"{slots} per-request state slots serve no request at {per_request} slots per running request: raise "
            f"{sizing.keys[0] or 'the state slots'}, memory.mem_fraction_static or memory.budget_gib"
        )
    if capped < requests:
        message = (
            f"max_running_requests reduced from {requests} to {capped}: {slots} state slots at {per_request} per "
            "running request"
        )
        logger.warning(message)
        warnings.append(message)
    return capped


def _check_min_sizes(cfg: EngineConfig, layouts: Sequence[PoolLayout], budget: MemoryBudget, sizes: dict[str, int]) -> None:
    """Refuse sizes below a layout's ``min_sizes``, naming the setting that would reach them."""
    layout = layouts[cfg.parallel.pp_rank]
    for group, (minimum, why) in layout.min_sizes.items():
        got = sizes.get(group, 0)
        if got >= minimum:
            continue
        fix = "raise memory.budget_gib or hardware.memory_gib, or lower kv_cache.page_size"
        if group == "swa_tokens":
            ratio = _ratio_reaching(cfg, layouts, budget.kv_budget_bytes, minimum)
            if ratio is not None:
                fix = f"set memory.swa_full_tokens_ratio={ratio:g} (now {swa_ratio(cfg, layout):g}), or {fix}"
        raise PlanningError(
            f"backend {layout.backend!r}: the plan gives {group} = {got}, fewer than the {minimum} one request needs "
            f"({why}): {fix}"
        )


def _ratio_reaching(cfg: EngineConfig, layouts: Sequence[PoolLayout], budget_bytes: int, minimum: int) -> float | None:
    """The smallest ``swa_full_tokens_ratio`` (to 3 decimals) whose plan keeps at least ``minimum`` window
    tokens, or None when no ratio does (raising it shrinks the full tokens below a page first)."""
    page = cfg.kv_cache.page_size

    def split(ratio: float) -> tuple[int, int]:
        tokens = min(tokens_that_fit(layout, budget_bytes, ratio)["tokens"] for layout in layouts)
        if cfg.memory.max_total_tokens is not None:
            tokens = min(tokens, cfg.memory.max_total_tokens)
        tokens = tokens // page * page
        return tokens, int(tokens * ratio) // page * page

    low = high = max(swa_ratio(cfg, layouts[cfg.parallel.pp_rank]), 1e-3)
    while split(high)[1] < minimum:  # window tokens grow with the ratio until the full tokens drop below a page
        low, high = high, high * 2
        if split(high)[0] < page or high > 1e6:
            return None
    while high - low > 5e-4:
        mid = (low + high) / 2
        low, high = (low, mid) if split(mid)[1] >= minimum else (mid, high)
    return math.ceil(high * 1000) / 1000


def req_to_token_bytes(requests: int, context_length: int) -> int:
    """Bytes of the request table: ``requests`` slots plus the padding row 0, ``context_length`` int32 each."""
    return (requests + 1) * context_length * REQ_TO_TOKEN_ITEMSIZE


def _sizes(layout: PoolLayout, tokens: int, ratio: float) -> dict[str, int]:
    sizes = {"tokens": tokens}
    if "swa_tokens" in layout.groups:
        sizes["swa_tokens"] = int(tokens * ratio)
    return sizes
