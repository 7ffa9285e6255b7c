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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

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
#: it), added buffer layouts (``BackendSpec.layouts``, ``PoolRequest.layout``) and guarantees ``sizes["tokens"]``.
API_VERSION = "3"

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
