"""Every hook a kvcore plugin can implement.  This module *is* the plugin API.

A plugin is a module (or object) registered under the ``kvcore`` entry-point group, e.g. in its
``pyproject.toml``::

    [project.entry-points.kvcore]
    acme = "kvcore_acme.plugin"

and implementing any of the hooks below with ``@kvcore.hookimpl``.  Every hook name starts with ``kvcore_``;
a function with that prefix that matches no spec is an error (the manager calls ``check_pending``).

How a pool gets built, in order:

1. ``kvcore_register_backends`` - every plugin lists the backends it offers (:class:`~kvcore.backend.BackendSpec`).
2. The core picks one backend for the request (capabilities, vendor specificity, priority; explainable with
   ``kvcore plugins --explain``).
3. ``kvcore_buffer_layout`` - the buffers that backend will allocate; the planner sizes pools from it.
4. ``kvcore_create_pool``, ``kvcore_create_req_to_token_pool`` (given that pool) and ``kvcore_choose_allocator``
   build the pools, in that order.

The core's own answers to the ``firstresult`` hooks are registered with ``trylast=True``: they call the
record's ``layout`` / ``create_pool`` and pick the token or paged allocator.  A vendor changes any step by
implementing the hook with ``tryfirst=True`` (or plainly) and returning a non-None result for the backends it
cares about, and None for the others.  Hooks are extended by adding arguments; an implementation may accept
fewer arguments than the spec passes.

Outside the build, ``kvcore_bench_cases`` gives ``kvcore bench`` the plugin's hot paths to time (records
:class:`BenchCases`, :class:`BenchPool`, :class:`BenchCase`, defined here).

A plugin module may declare the API version it was written for, ``KVCORE_API_VERSION = "4"`` (a string,
``major[.minor]``).  The manager compares its major with :data:`API_VERSION`'s when it loads the plugin: another
major makes the plugin a failed plugin (stage ``version``, before any of its hooks is registered); a plugin
that declares nothing loads as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import pluggy

if TYPE_CHECKING:
    from kvcore.backend import BackendSpec, PoolRequest
    from kvcore.layout import PoolLayout

PROJECT = "kvcore"

#: The plugin API's version: these hook specs, the records (``BackendSpec``, ``PoolRequest``, ``PoolLayout``),
#: the ``KVCache`` contract and the conformance kit that checks it (``kvcore.testing.KIT_VERSION`` is this
#: value).  Raised when any of them changes incompatibly; 2 added model sections and backend options, the
#: kernels mode as a ``KVCache`` argument, ``layer_id_override`` and SGLang's allocator argument order; 3 made
#: the store checks a capability (``"store"``: a test class that declares its own ``kv_capabilities`` must list
#: it), added buffer layouts (``BackendSpec.layouts``, ``PoolRequest.layout``) and guarantees ``sizes["tokens"]``;
#: 4 moved the core's modules into packages by concern (``kvcore.launch`` -> ``kvcore.kernels.launch``, likewise
#: ``fp8``, ``dtypes``, ``kernel_mode``, ``row_move``, ``free_list``, ``allocator_kernels``; ``kvcore.selection``
#: -> ``kvcore.plugins.selection``; ``kvcore.planner`` -> ``kvcore.planning.planner``; ``kvcore.hf`` ->
#: ``kvcore.config.hf``), added ``kvcore_bench_cases`` and enforces a plugin's ``KVCORE_API_VERSION``.
#: A plugin declares the version it was written for as ``KVCORE_API_VERSION`` (``major[.minor]``); only the
#: major is compared (a minor adds without breaking).
API_VERSION = "4"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def kvcore_register_backends() -> Iterable[BackendSpec]:
    """Return (or yield) the pool backends this plugin provides.

    Called once per plugin when the registry loads.  Each item must be a :class:`kvcore.backend.BackendSpec`;
    anything else makes the plugin fail to load with an error naming it (the other plugins still load).
    Two plugins registering the same backend name is an error naming both.

    :returns: an iterable of ``BackendSpec`` records.
    """


@hookspec(firstresult=True)
def kvcore_buffer_layout(backend: BackendSpec, request: PoolRequest) -> PoolLayout | None:
    """Describe the buffers ``backend`` will allocate for ``request``, without allocating anything.

    The planner sizes the pools from this layout alone (it works on machines without the target device),
    and the conformance kit checks that the built pool allocates exactly these bytes.

    :param backend: the selected backend.
    :param request: the per-rank request (dimensions, dtypes, page size).
    :returns: a :class:`kvcore.layout.PoolLayout`, or None to let the next implementation answer.
        Stops at the first non-None result.  The core's default calls ``backend.layout(request)``.
    """


@hookspec(firstresult=True)
def kvcore_create_pool(
    backend: BackendSpec, request: PoolRequest, layout: PoolLayout, sizes: Mapping[str, int]
) -> Any | None:
    """Allocate the token-to-KV pool (a :class:`kvcore.pools.KVCache`).

    :param sizes: the planned sizes: ``"tokens"`` always (the token capacity, the allocators' index space, even
        for a layout whose buffers are all sized by another group), and every size group of ``layout``
        (``{"tokens": 81920, "swa_tokens": 65536}``, ...).
    :returns: the pool, or None to let the next implementation answer.  Stops at the first non-None
        result.  The core's default calls ``backend.create_pool(request, layout, sizes)``.
    """


@hookspec(firstresult=True)
def kvcore_create_req_to_token_pool(
    backend: BackendSpec, request: PoolRequest, size: int, max_context_len: int, sizes: Mapping[str, int], pool: Any
) -> Any | None:
    """Allocate the request-to-token pool (``size`` request slots of ``max_context_len`` token indices).

    Families with per-request state (hybrid Mamba) return their own pool here, with ``sizes["requests"]``
    state slots (sharing the state the token pool was built with).

    :param sizes: the planned size of every size group (as ``kvcore_create_pool`` gets them).
    :param pool: the token-to-KV pool, built just before.

    :returns: the pool, or None for the next implementation.  Stops at the first non-None result.  The
        core's default returns :class:`kvcore.pools.ReqToTokenPool`.
    """


@hookspec(firstresult=True)
def kvcore_choose_allocator(
    backend: BackendSpec, request: PoolRequest, pool: Any, sizes: Mapping[str, int]
) -> Any | None:
    """Build the allocator that hands out slots of ``pool``.

    :returns: an allocator, or None for the next implementation.  Stops at the first non-None result.
        The core's default returns :class:`kvcore.allocators.TokenToKVPoolAllocator` for page size 1 and
        :class:`kvcore.allocators.PagedTokenToKVPoolAllocator` otherwise.
    """


# -- kvcore bench ---------------------------------------------------------------------------------------------

#: ``BenchCase.written`` of a call that returns new tensors (a gather): its outputs are compared, and its host
#: time is also set beside a bare torch op that allocates (``x.index_select(0, i)``).
GATHER = "gather"
#: ``BenchCase.written`` of a gather into outputs the case made once (``out=``): its outputs are compared.
INTO = "into"
#: ``BenchCase.written`` of a call that writes per-request state: every buffer is compared.  Such a case is
#: timed in CUDA-graph replay only (its device time would stall the host loop), and not at changing sizes.
STATE = "state"


@attrs.frozen(kw_only=True)
class BenchPool:
    """A pool ``kvcore bench`` times, at a real model's size.

    :param name: unique among every plugin's bench pools (a case names it).
    :param make: ``make(kernels) -> pool`` on the CUDA device; called twice, ``"triton"`` (kvcore's path, timed)
        and ``"native"`` (the torch path it is checked against and timed beside).  Called only by ``kvcore bench``.
    :param prepare: ``prepare(pool)``, called on each of the two after ``kvcore bench`` filled every buffer of
        ``pool.buffers()`` with the same random bytes (to set what must not be random, e.g. a per-layer scale).
    """

    name: str
    make: Callable[[str], Any] = attrs.field(validator=attrs.validators.is_callable())
    prepare: Callable[[Any], None] | None = None


@attrs.frozen(kw_only=True)
class BenchCase:
    """One timed call: a row of ``kvcore bench``'s tables.

    :param op: the row's name, unique among every plugin's cases (``"mha set_kv_buffer bf16"``).
    :param pool: the :class:`BenchPool` it calls (one of its :class:`BenchCases`' pools).
    :param call: ``call(pool, inputs) -> fn``: ``fn()`` is the call timed, on the pool with the inputs of N tokens
        (``BenchCases.inputs``).  Made once per pool and N; anything ``fn`` needs beyond the call (outputs of a
        gather ``out=``) is made here, so that ``fn`` allocates only what the method itself returns.
    :param written: what the check compares, after one ``fn()`` on the kvcore pool and one on the torch-path pool:
        ``written(inputs) -> locations`` for a write (the rows of those tokens in every ``token_rows()`` entry),
        :data:`GATHER` or :data:`INTO` (the outputs), :data:`STATE` (every buffer).  A case that differs from the
        torch path stops the run.
    :param bytes_per_token: bytes a call must read + write per token (or slot), where that is plain to count: the
        graph table's share of the device-copy ceiling; None leaves that column empty.
    :param sizes: timed only at these N (a state copy at a few slot counts); None for every N of the run.
    :param move: a move of N // 2 tokens (``tgt, src``): at changing sizes its N is drawn as twice the slots one
        launch moves (:data:`kvcore.kernels.row_move.MOVE_MAX_TOKENS`), not as a token count.
    """

    op: str
    pool: str
    call: Callable[[Any, Any], Callable[[], object]] = attrs.field(validator=attrs.validators.is_callable())
    written: Callable[[Any], Any] | str
    bytes_per_token: int | None = None
    sizes: tuple[int, ...] | None = attrs.field(default=None, converter=lambda v: None if v is None else tuple(v))
    move: bool = False

    def __attrs_post_init__(self) -> None:
        if isinstance(self.written, str) and self.written not in (GATHER, INTO, STATE):
            raise ValueError(f"bench case {self.op!r}: written={self.written!r} is not a function, GATHER, INTO or STATE")
        if not isinstance(self.written, str) and not callable(self.written):
            raise TypeError(f"bench case {self.op!r}: written must be written(inputs) -> locations, or GATHER/INTO/STATE")


@attrs.frozen(kw_only=True)
class BenchCases:
    """A plugin's cases for ``kvcore bench``: its pools, the inputs of N tokens, the calls.

    :param pools: the pools the cases call.
    :param inputs: ``inputs(n, generator) -> object``: whatever the cases' ``call`` and ``written`` read for N
        tokens (random, never zero, on the CUDA device; locations drawn among the pool's tokens past the padding
        page), drawn from ``generator`` (a CPU ``torch.Generator``, seeded per N by ``kvcore bench``).  Made once per
        N for all the cases, and once per call of the changing-size rows.
    :param cases: the timed calls.
    :param plugin: the plugin's name, filled in by ``kvcore bench``.
    """

    pools: tuple[BenchPool, ...] = attrs.field(converter=tuple)
    inputs: Callable[[int, Any], Any] = attrs.field(validator=attrs.validators.is_callable())
    cases: tuple[BenchCase, ...] = attrs.field(converter=tuple)
    plugin: str = ""


@hookspec
def kvcore_bench_cases() -> Iterable[BenchCases]:
    """Return (or yield) this plugin's cases for ``kvcore bench`` (:class:`BenchCases` records).

    Called only by ``kvcore bench`` (and tests), never when the registry loads, so the implementation may import
    the family's pools and kernels; import them inside it (or inside ``BenchPool.make``), not at the plugin
    module's top.  Building the records must not allocate or need a GPU: ``kvcore bench`` calls
    ``BenchPool.make`` and ``BenchCases.inputs`` itself, on the CUDA device.

    ``kvcore bench`` checks every case against the torch path (the same call on the ``"native"`` pool) at every
    N before timing it, then times it in its tables (by default): host time of one eager call (N in 1, 8, 64, 4096), at
    changing N (1..8192, each call a new N), and device time in CUDA-graph replay (N in 1, 8, 64, 256, 32768,
    with ``bytes_per_token`` over the copy ceiling), so a pool holds at least 32768 tokens past its padding page
    (``kvcore.tools.bench.POOL_TOKENS``, 65536, is what the built-in pools hold; ``kvcore.tools.bench.locations``
    and ``rand`` draw inputs among them).  Op names and pool names must be unique over every plugin;
    a record of another type, a duplicate name or a case naming a pool its record lacks stops ``kvcore bench``
    with an error naming the plugin.

    :returns: an iterable of ``BenchCases``; none for a plugin without cases (the hook is optional).
    """
