"""kvcore's conformance kit, for anyone implementing a pool backend.

Load it as a pytest plugin (``pytest -p kvcore.testing``) and subclass the mixins in your test file; see
:mod:`kvcore.testing.suite`.  The kit is public API, versioned with the hook specs (:data:`KIT_VERSION` is
:data:`kvcore.hookspecs.API_VERSION`).

Loading the plugin sets ``TRITON_INTERPRET=1`` (unless ``KVCORE_TEST_COMPILED=1`` asks for compiled kernels
on a GPU), so Triton kernels run on the CPU in the interpreter with no conftest of yours; it must load before
your kernels are imported, which ``-p kvcore.testing`` does.

The pools under test come from your backend itself: give ``kv_backend`` (its registered name) and
``kv_config`` (config overrides of a small model it serves), and the kit builds the request with
:func:`kvcore.make_request`, the layout through the ``kvcore_buffer_layout`` hook and the pools through
``kvcore_create_pool``, exactly as ``kvcore up`` does, so a layout that disagrees with its pool fails here.
A backend outside the installed plugins (a test plugin) overrides ``kv_registry``.  Without ``kv_backend``,
provide ``kv_pool_factory`` and ``kv_layout`` yourself.
"""

from __future__ import annotations

import os

if os.environ.get("KVCORE_TEST_COMPILED") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import attrs  # noqa: E402
import pytest  # noqa: E402

from kvcore.hookspecs import API_VERSION  # noqa: E402
from kvcore.testing.suite import (  # noqa: E402
    CAPABILITIES,
    BaseBufferInfoTests,
    BaseCpuCopyTests,
    BaseLayoutTests,
    BaseMoveTests,
    BaseStoreTests,
    KVCacheConformance,
    KVWriter,
    assert_same_bytes,
    pool_writer,
    randomize,
)
from kvcore.testing.tensors import test_device  # noqa: E402

KIT_VERSION = API_VERSION

__all__ = [
    "CAPABILITIES",
    "KIT_VERSION",
    "BaseBufferInfoTests",
    "BaseCpuCopyTests",
    "BaseLayoutTests",
    "BaseMoveTests",
    "BaseStoreTests",
    "KVCacheConformance",
    "KVWriter",
    "assert_same_bytes",
    "pool_writer",
    "randomize",
]


def _provide(name: str, what: str):
    pytest.fail(f"the kvcore conformance kit needs the fixture {name!r}: {what}", pytrace=False)


# -- what the implementer names --------------------------------------------------------------------------------


@pytest.fixture
def kv_backend():
    _provide("kv_backend", "the name of your registered backend (or provide kv_pool_factory and kv_layout yourself)")


@pytest.fixture
def kv_config():
    """Config overrides of a small model your backend serves (``model=...`` and dotted keys); the kit adds the
    backend, page size, device and kernels mode."""
    return []


@pytest.fixture
def kv_kernels():
    """``hardware.kernels`` of the pools under test (``auto``: Triton on CUDA, torch on the CPU)."""
    return "auto"


@pytest.fixture
def kv_registry():
    """The plugins the backend is looked up in: the installed ones."""
    from kvcore.plugins import get_registry

    return get_registry()


# -- derived from the backend ------------------------------------------------------------------------------------


@pytest.fixture
def kv_request(kv_backend, kv_config, kv_kernels, kv_page_size, kv_registry):
    """The request kvcore makes for the backend on the test device, resolved (model sections and options
    validated by the backend)."""
    from kvcore import load_config, make_request

    cfg = load_config(
        *kv_config, f"kv_cache.backend={kv_backend}", f"kv_cache.page_size={kv_page_size}",
        f"hardware.device={test_device()}", f"hardware.kernels={kv_kernels}", registry=kv_registry,
    )  # fmt: skip
    return make_request(cfg, registry=kv_registry)


@pytest.fixture
def kv_backend_spec(kv_backend, kv_registry):
    return kv_registry.backends[kv_backend]


def _layout(registry, backend, request):
    from kvcore.layout import PoolLayout

    layout = registry.hook.kvcore_buffer_layout(backend=backend, request=request)
    assert isinstance(layout, PoolLayout), f"backend {backend.name!r} declared {type(layout).__name__}, not a PoolLayout"
    return layout


@pytest.fixture
def kv_layout(kv_request, kv_backend_spec, kv_registry):
    """The layout the backend declares for ``kv_request`` (the kit's ``kv_pool`` is built from the same request)."""
    return _layout(kv_registry, kv_backend_spec, kv_request)


@pytest.fixture
def kv_pool_factory(kv_request, kv_backend_spec, kv_registry):
    """``(size, page_size, start_layer) -> pool``, through the backend's own layout and ``kvcore_create_pool``."""

    def make(size, page_size, start_layer):
        request = attrs.evolve(
            kv_request, page_size=page_size, start_layer=start_layer, end_layer=start_layer + kv_request.layer_num - 1
        )
        layout = _layout(kv_registry, kv_backend_spec, request)
        sizes = {group: size for group in layout.groups}
        return kv_registry.hook.kvcore_create_pool(backend=kv_backend_spec, request=request, layout=layout, sizes=sizes)

    return make


# -- defaults ------------------------------------------------------------------------------------------------------


@pytest.fixture
def kv_writer():
    """How the store tests write rows: by default the pool's own ``self_test_write``."""
    return pool_writer


@pytest.fixture
def kv_capabilities():
    """What the pool supports; tests needing anything else are skipped by capability."""
    return set(CAPABILITIES)


@pytest.fixture
def kv_pool_size(kv_page_size):
    """Tokens of the pool under test: whole pages, odd page counts."""
    return 61 if kv_page_size == 1 else 7 * kv_page_size


@pytest.fixture
def kv_page_size():
    return 1
