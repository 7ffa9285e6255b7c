"""The public entry points: config -> request -> backend -> plan -> pools."""

from __future__ import annotations

import logging

import attrs
import torch

from kvcore.backend import BackendSpec, EngineMode, PoolRequest
from kvcore.config import EngineConfig, ModelConfig, loading
from kvcore.errors import ConfigError, PluginError
from kvcore.layout import PoolLayout
from kvcore.planning.planner import MemoryPlan, memory_budget, plan_from_layouts, pre_alloc_size
from kvcore.plugins import Registry, get_registry
from kvcore.plugins.selection import Selection, select_backend

logger = logging.getLogger(__name__)


def load_config(*overrides: str, path=None, registry: Registry | None = None) -> EngineConfig:
    """Compose and validate an :class:`~kvcore.config.EngineConfig` from ``group=option`` choices
    (``model=llama-3-8b``) and dotlist overrides (``kv_cache.page_size=16``) over the engine YAML at ``path``
    (default: the ``engine.yaml`` shipped with kvcore); see :mod:`kvcore.config.loading`.

    :param registry: the plugins whose model sections and block formats the config may use (default: the
        installed plugins).
    :raises ConfigError: naming the full key path of whatever is wrong.
    """
    return loading.load_config(*overrides, path=path, registry=registry or get_registry())


def engine_mode(cfg: EngineConfig, *, is_draft_worker: bool = False) -> EngineMode:
    """The engine's disaggregation, speculative-decoding and unified-memory settings, as pools and allocators read
    them."""
    spec = cfg.speculative
    return EngineMode(
        disaggregation=cfg.disaggregation.mode,
        pre_alloc_size=pre_alloc_size(cfg),
        speculative=spec.algorithm,
        num_draft_tokens=spec.num_draft_tokens if spec.enabled else 0,
        eagle_topk=spec.eagle_topk,
        is_draft_worker=is_draft_worker,
        unified_memory=cfg.memory.unified,
    )


def draft_config(cfg: EngineConfig, *, registry: Registry | None = None) -> EngineConfig | None:
    """The config of speculative decoding's draft worker, or None without one: the target's config with the
    draft's model (``speculative.draft_model``, a shipped model or ``hf:PATH``; for ``nextn`` the target's own
    ``num_nextn_predict_layers`` multi-token-prediction layers, of the target's dimensions), on one pipeline
    stage.  A nextn draft's weights are estimated as the target's mean per layer (a DeepSeek-V3 MTP layer is
    one MoE decoder layer plus a projection; its checkpoint's 685B count them, the 671B of the model file
    does not).

    :raises ConfigError: naming ``speculative.draft_model`` when the draft model cannot be read.
    """
    spec = cfg.speculative
    if not spec.enabled:
        return None
    model = cfg.model
    if spec.algorithm == "nextn":
        layers = model.num_nextn_predict_layers
        # an MTP layer is a full-attention layer, also in a hybrid linear-attention model
        attention = {"mamba": "mha", "mamba_mla": "mla"}.get(model.attention, model.attention)
        draft = attrs.evolve(
            model, name=f"{model.name}-mtp", attention=attention, num_hidden_layers=layers, num_nextn_predict_layers=None,
            num_parameters=model.num_parameters * layers // model.num_hidden_layers,
            weight_bytes=None if model.weight_bytes is None else model.weight_bytes * layers // model.num_hidden_layers,
        )  # fmt: skip
    else:
        try:
            draft = loading.load_model(spec.draft_model, registry=registry or get_registry())
        except ConfigError as exc:
            raise ConfigError(f"speculative.draft_model={spec.draft_model!r}: {exc}") from None
    # the draft's pool keeps every layer of its own (no stages, no layer split)
    return attrs.evolve(cfg, model=draft, parallel=attrs.evolve(cfg.parallel, pp_size=1, pp_rank=0, cp_size=1, cp_rank=0))


def _core_request(cfg: EngineConfig, pp_rank: int | None = None, *, is_draft_worker: bool = False) -> PoolRequest:
    """What the core knows of the request: every shared field, the raw ``kv_cache.options`` and every model
    section the config holds.  Selection works on this; the chosen backend then resolves it."""
    if pp_rank is not None:
        cfg = attrs.evolve(cfg, parallel=attrs.evolve(cfg.parallel, pp_rank=pp_rank))
    start, end = cfg.layer_range
    model = cfg.model
    return PoolRequest(
        attention=model.attention,
        kv_dtype=cfg.kv_dtype,
        model_dtype=cfg.model_dtype,
        device=cfg.hardware.device,
        vendor=cfg.hardware.vendor,
        page_size=cfg.kv_cache.page_size,
        layer_num=end - start,
        start_layer=start,
        end_layer=end - 1,
        head_num=cfg.kv_heads_per_rank,
        head_dim=model.head_dim,
        v_head_dim=model.v_head_dim or model.head_dim,
        kernels=cfg.hardware.kernels,
        backend=cfg.kv_cache.backend,
        model_name=model.name,
        tp_size=cfg.parallel.tp_size,
        cp_size=cfg.parallel.cp_size,
        cp_rank=cfg.parallel.cp_rank,
        kv_format=cfg.kv_format,
        layout=cfg.kv_cache.layout,
        options=cfg.kv_cache.options,
        sections={name: getattr(model, name) for name in _section_names(type(model))},
        mode=engine_mode(cfg, is_draft_worker=is_draft_worker),
    )


def _section_names(model_type: type) -> tuple[str, ...]:
    """The plugin-declared sections of a (possibly extended) model schema."""
    shared = {f.name for f in attrs.fields(ModelConfig)}
    return tuple(f.name for f in attrs.fields(model_type) if f.name not in shared)


def make_request(cfg: EngineConfig, pp_rank: int | None = None, *, registry: Registry | None = None) -> PoolRequest:
    """The per-rank :class:`PoolRequest` for ``cfg`` (``pp_rank`` defaults to ``parallel.pp_rank``), as the
    selected backend reads it (:meth:`BackendSpec.resolve`: its model sections and options validated).

    :raises SelectionError: when no backend serves ``cfg``.
    :raises ConfigError: naming the model section or option to fix.
    """
    request = _core_request(cfg, pp_rank)
    return select_backend(registry or get_registry(), request).backend.resolve(request)


def select(cfg: EngineConfig, registry: Registry | None = None) -> Selection:
    """Which backend serves ``cfg``, with the reasons for every registered backend."""
    return select_backend(registry or get_registry(), _core_request(cfg))


def buffer_layout(backend: BackendSpec, registry: Registry, request: PoolRequest) -> PoolLayout:
    """The layout ``backend`` declares for ``request``, through the ``kvcore_buffer_layout`` hook.

    :raises PluginError: naming the plugin when the answer is not a :class:`~kvcore.layout.PoolLayout`.
    """
    layout = registry.hook.kvcore_buffer_layout(backend=backend, request=request)
    if not isinstance(layout, PoolLayout):
        raise PluginError(
            f"plugin {backend.plugin!r}: the buffer layout of backend {backend.name!r} "
            f"is {type(layout).__name__}, expected kvcore.layout.PoolLayout"
        )
    return layout


def plan_memory(
    cfg: EngineConfig,
    *,
    registry: Registry | None = None,
    free_memory_bytes: int | None = None,
    weights_loaded: bool = False,
) -> MemoryPlan:
    """Size every pool for ``cfg`` without allocating anything.

    :param free_memory_bytes: free device memory an engine profiled before loading the model (default: the
        hardware profile's memory).
    :param weights_loaded: the profile was taken after the weights loaded; do not charge them again.
    """
    registry = registry or get_registry()
    selection = select_backend(registry, _core_request(cfg))
    return _plan(cfg, registry, selection, free_memory_bytes, weights_loaded, _draft(cfg, registry))


def _plan(cfg: EngineConfig, registry: Registry, selection: Selection, free_memory_bytes: int | None,
          weights_loaded: bool, draft: _Draft | None) -> MemoryPlan:  # fmt: skip
    """:func:`plan_memory` with the backend already selected (``selection``, of ``cfg``'s core request) and the
    draft worker resolved (:func:`_draft`): the layout of every pipeline rank, then the sizes."""
    layouts = []
    for rank in range(cfg.parallel.pp_size):
        request = selection.backend.resolve(_core_request(cfg, pp_rank=rank))
        layouts.append(buffer_layout(selection.backend, registry, request))
    draft_layout = None if draft is None else buffer_layout(draft.backend, registry, draft.request)
    draft_weights = 0 if draft is None else draft.cfg.weight_bytes_per_rank
    budget = memory_budget(cfg, free_memory_bytes=free_memory_bytes, weights_loaded=weights_loaded,
                           draft_weight_bytes=draft_weights)  # fmt: skip
    plan = plan_from_layouts(cfg, layouts, budget, draft_layout)
    return attrs.evolve(plan, draft_weight_bytes=0 if weights_loaded else draft_weights)


@attrs.frozen
class _Draft:
    """The draft worker's config, backend selection and resolved request."""

    cfg: EngineConfig
    selection: Selection
    request: PoolRequest

    @property
    def backend(self) -> BackendSpec:
        return self.selection.backend


def _draft(cfg: EngineConfig, registry: Registry) -> _Draft | None:
    """The draft worker of ``cfg`` (None without speculative decoding)."""
    draft_cfg = draft_config(cfg, registry=registry)
    if draft_cfg is None:
        return None
    core = _core_request(draft_cfg, is_draft_worker=True)
    selection = select_backend(registry, core)
    return _Draft(draft_cfg, selection, selection.backend.resolve(core))


@attrs.frozen(eq=False)
class Pools:
    """What an engine needs: the two pools, the allocator, and the plan they were sized from."""

    req_to_token_pool: object
    token_to_kv_pool: object
    token_to_kv_pool_allocator: object
    plan: MemoryPlan
    selection: Selection
    #: speculative decoding's draft worker: its ``req_to_token_pool`` and ``token_to_kv_pool_allocator`` are the
    #: target's own objects, its ``token_to_kv_pool`` holds the draft model's layers at the target's token count
    #: (its ``plan`` is the target's); None without speculative decoding
    draft: Pools | None = None


def check_device_visible(cfg: EngineConfig) -> None:
    """Raise unless the device ``cfg`` allocates on is there: a CUDA profile on a machine without a visible GPU is
    one :class:`ConfigError` line, before anything is planned or allocated."""
    if cfg.hardware.device == "cuda" and not torch.cuda.is_available():
        profile = "" if cfg.hardware.name == "cpu" else ", or choose a CPU profile (hardware=cpu)"
        raise ConfigError(
            f"no CUDA device is visible, and this config allocates on CUDA (hardware={cfg.hardware.name}, "
            f"hardware.device=cuda): set hardware.device=cpu{profile}, or size the pools without a device with "
            "`kvcore plan`"
        )


def check_buildable(cfg: EngineConfig) -> None:
    """Raise one :class:`ConfigError` line for a config kvcore can plan but not build: ``memory.unified=true`` with
    a speculative draft (its pool would need token ids of the target's unified memory, which it does not share)."""
    if cfg.memory.unified and cfg.speculative.enabled:
        raise ConfigError(f"memory.unified=true with speculative.algorithm={cfg.speculative.algorithm}: the draft "
                          "model's pool does not share the target's unified memory, so kvcore does not build it; set "
                          "speculative.algorithm=none, or memory.unified=false for the split pools")  # fmt: skip


def build_pools(
    cfg: EngineConfig,
    *,
    registry: Registry | None = None,
    plan: MemoryPlan | None = None,
    free_memory_bytes: int | None = None,
    weights_loaded: bool = False,
    group=None,
) -> Pools:
    """Plan (unless ``plan`` is given) and allocate the pools for this rank.

    Inside an initialised ``torch.distributed`` process group (``group``, default the world) of more than one
    rank, this is collective (:mod:`kvcore.planning.distributed`): each rank takes its pipeline stage from its rank, plans
    from its own ``free_memory_bytes``, and every planned size is the minimum over the ranks.  A ``plan`` given
    by the caller is used as it is (agree it first with :func:`kvcore.planning.distributed.agree`).
    """
    from kvcore.planning import distributed

    registry = registry or get_registry()
    selection = None  # selected once, here, and passed to the planning below
    collective = distributed.active(group)
    if collective:
        cfg, _ = distributed.rank_config(cfg, group)
        if group is None:
            distributed.init_context_parallel(cfg)
    draft = _draft(cfg, registry)  # resolved once, for the plan and the draft's pool
    if collective and plan is None:
        selection = select_backend(registry, _core_request(cfg))
        plan = distributed.agree(_plan(cfg, registry, selection, free_memory_bytes, weights_loaded, draft), group)
    check_device_visible(cfg)
    check_buildable(cfg)
    core = _core_request(cfg)
    if selection is None:
        selection = select_backend(registry, core)
    request = selection.backend.resolve(core)
    if plan is None:
        plan = _plan(cfg, registry, selection, free_memory_bytes, weights_loaded, draft)
    hook = registry.hook
    token_to_kv_pool = hook.kvcore_create_pool(
        backend=selection.backend, request=request, layout=plan.layout, sizes=plan.sizes
    )
    req_to_token_pool = hook.kvcore_create_req_to_token_pool(
        backend=selection.backend, request=request, size=plan.max_running_requests, max_context_len=plan.request_context_len,
        sizes=plan.sizes, pool=token_to_kv_pool,
    )
    allocator = hook.kvcore_choose_allocator(
        backend=selection.backend, request=request, pool=token_to_kv_pool, sizes=plan.sizes
    )
    for what, value in (("pool", token_to_kv_pool), ("allocator", allocator), ("request pool", req_to_token_pool)):
        if value is None:
            raise PluginError(f"no plugin created the {what} for backend {selection.backend.name!r}")
    from kvcore.checked import CheckedAllocator, CheckedPool, checked_enabled

    checked = checked_enabled(cfg)
    if checked:
        token_to_kv_pool, allocator = CheckedPool(token_to_kv_pool), CheckedAllocator(allocator)
    draft_pools = None
    if draft is not None:
        draft_pool = hook.kvcore_create_pool(backend=draft.backend, request=draft.request, layout=plan.draft_layout,
                                             sizes={"tokens": plan.sizes["tokens"]})  # fmt: skip
        if draft_pool is None:
            raise PluginError(f"no plugin created the draft pool for backend {draft.backend.name!r}")
        if checked:
            draft_pool = CheckedPool(draft_pool)
        draft_pools = Pools(req_to_token_pool, draft_pool, allocator, plan, draft.selection)
    return Pools(req_to_token_pool, token_to_kv_pool, allocator, plan, selection, draft_pools)
