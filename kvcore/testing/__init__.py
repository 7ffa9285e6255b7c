"""kvcore's conformance kit, for anyone implementing a pool backend.

Load it as a pytest plugin (``pytest -p kvcore.testing``) and subclass the mixins in your test file; see
:mod:`kvcore.testing.suite`.  The kit is public API, versioned with the hook specs (:data:`KIT_VERSION` is
:data:`kvcore.hookspecs.API_VERSION`).

Loading the plugin sets ``TRITON_INTERPRET=1`` (unless ``KVCORE_TEST_COMPILED=1`` asks for compiled kernels
on a GPU, where it sets ``KVCORE_LAUNCH_CHECK=1`` instead: every direct launch is checked against Triton's own
dispatch), so Triton kernels run on the CPU in the interpreter with no conftest of yours; it must load before
your kernels are imported, which ``-p kvcore.testing`` does.

The pools under test come from your backend itself.  A whole test file is::

    from kvcore.testing import KVCacheConformance, Variant

    class TestAcme(KVCacheConformance):
        backend = "acme"                                   # its registered name
        config = ["model=qwen2.5-0.5b", "model.num_hidden_layers=3", "hardware.vendor=acme"]  # a small model it serves
        variants = [Variant("bfloat16", "triton", 1), Variant("float32", "native", 16)]

and the kit builds the request with :func:`kvcore.make_request`, the layout through the
``kvcore_buffer_layout`` hook and the pools through ``kvcore_create_pool``, exactly as ``kvcore up`` does,
so a layout that disagrees with its pool fails here.  Each test runs once per variant.  The class attributes
feed the fixtures ``kv_backend``, ``kv_config`` and ``kv_variant``, which a test may override instead; a
backend outside the installed plugins (a test plugin) overrides ``kv_registry``.  Without a backend, provide
``kv_pool_factory`` and ``kv_layout`` yourself.
"""

from __future__ import annotations

import os

if os.environ.get("KVCORE_TEST_COMPILED") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:  # compiled kernels: check every direct launch against Triton's own dispatch (kvcore.kernels.launch)
    os.environ.setdefault("KVCORE_LAUNCH_CHECK", "1")

import attrs  # noqa: E402
import pytest  # noqa: E402

from kvcore.hookspecs import API_VERSION  # noqa: E402
from kvcore.testing.suite import (  # noqa: E402
    CAPABILITIES,
    LOSSY,
    BaseBufferInfoTests,
    BaseLossyTests,
    BaseCpuCopyTests,
    BaseLayoutTests,
    BaseMoveTests,
    BaseStoreTests,
    KVCacheConformance,
    KVWriter,
    LossyKVCacheConformance,
    assert_same_bytes,
    pool_writer,
    randomize,
)
from kvcore.testing.allocators import (  # noqa: E402
    KIT_REQUESTS,
    REQUEST_GROUPS,
    AllocatorConformance,
    AllocatorMachine,
    BackendAllocatorConformance,
)
from kvcore.testing.tensors import test_device  # noqa: E402

KIT_VERSION = API_VERSION

__all__ = [
    "AllocatorConformance",
    "AllocatorMachine",
    "BackendAllocatorConformance",
    "CAPABILITIES",
    "LOSSY",
    "BaseLossyTests",
    "KIT_VERSION",
    "BaseBufferInfoTests",
    "BaseCpuCopyTests",
    "BaseLayoutTests",
    "BaseMoveTests",
    "BaseStoreTests",
    "KVCacheConformance",
    "KVWriter",
    "LossyKVCacheConformance",
    "Variant",
    "assert_same_bytes",
    "pool_writer",
    "randomize",
]


def _provide(name: str, what: str):
    pytest.fail(f"the kvcore conformance kit needs the fixture {name!r}: {what}", pytrace=False)


# -- what the implementer names --------------------------------------------------------------------------------


@attrs.frozen
class Variant:
    """One configuration the kit runs every test under.

    :param dtype: ``kv_cache.dtype`` (``auto``: the model's).
    :param kernels: ``hardware.kernels`` (``auto``: Triton on CUDA, torch on the CPU; ``triton`` runs the kernels
        in Triton's interpreter on the CPU).
    :param page_size: ``kv_cache.page_size``.
    :param overrides: more config overrides for this variant (``kv_cache.options.x=...``).
    """

    dtype: str = "auto"
    kernels: str = "auto"
    page_size: int = 1
    overrides: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    @property
    def id(self) -> str:
        return "-".join([self.dtype, self.kernels, f"page{self.page_size}", *self.overrides])


def pytest_generate_tests(metafunc):
    """Run each test of a class with ``variants`` once per variant (the ``kv_variant`` fixture)."""
    variants = getattr(metafunc.cls, "variants", None)
    if variants and "kv_variant" in metafunc.fixturenames:
        metafunc.parametrize("kv_variant", variants, ids=[v.id for v in variants])


@pytest.fixture
def kv_backend(request):
    """The backend under test: the test class's ``backend``."""
    name = getattr(request.cls, "backend", None)
    if name is None:
        _provide("kv_backend", "a class attribute backend = 'your backend name' (or provide kv_pool_factory and kv_layout)")
    return name


@pytest.fixture
def kv_config(request):
    """Config overrides of a small model the backend serves (the test class's ``config``); the kit adds the
    backend, the variant, the device and the kernels mode."""
    return list(getattr(request.cls, "config", ()))


@pytest.fixture
def kv_variant():
    """The variant a test runs under (parametrized from the class's ``variants``; one default otherwise)."""
    return Variant()


@pytest.fixture
def kv_kernels(kv_variant):
    return kv_variant.kernels


@pytest.fixture
def kv_registry():
    """The plugins the backend is looked up in: the installed ones."""
    from kvcore.plugins import get_registry

    return get_registry()


# -- derived from the backend ------------------------------------------------------------------------------------


@pytest.fixture
def kv_request(kv_backend, kv_config, kv_variant, kv_kernels, kv_page_size, kv_registry):
    """The request kvcore makes for the backend on the test device, resolved (model sections and options
    validated by the backend)."""
    from kvcore import load_config, make_request

    cfg = load_config(
        *kv_config, f"kv_cache.backend={kv_backend}", f"kv_cache.dtype={kv_variant.dtype}", *kv_variant.overrides,
        f"kv_cache.page_size={kv_page_size}", f"hardware.device={test_device()}", f"hardware.kernels={kv_kernels}",
        registry=kv_registry,
    )  # fmt: skip
    return make_request(cfg, registry=kv_registry)


@pytest.fixture
def kv_backend_spec(kv_backend, kv_registry):
    return kv_registry.backends[kv_backend]


@pytest.fixture
def kv_layout(kv_request, kv_backend_spec, kv_registry):
    """The layout the backend declares for ``kv_request`` (the kit's ``kv_pool`` is built from the same request)."""
    from kvcore.api import buffer_layout

    return buffer_layout(kv_backend_spec, kv_registry, kv_request)


@pytest.fixture
def kv_pool_factory(kv_request, kv_backend_spec, kv_registry):
    """``(size, page_size, start_layer) -> pool``, through the backend's own layout and ``kvcore_create_pool``."""
    from kvcore.api import buffer_layout


    def make(size, page_size, start_layer):
        request = attrs.evolve(
            kv_request, page_size=page_size, start_layer=start_layer, end_layer=start_layer + kv_request.layer_num - 1
        )
        layout = buffer_layout(kv_backend_spec, kv_registry, request)
        sizes = {"tokens": size, **{group: size for group in layout.groups}}  # "tokens" always, as the planner
        for group in REQUEST_GROUPS & sizes.keys():  # per-request state: a few requests, not one per token
            sizes[group] = min(size, KIT_REQUESTS)
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
def kv_page_size(kv_variant):
    return kv_variant.page_size
