"""kvcore's conformance kit, for anyone implementing a pool backend.

Load it as a pytest plugin (``pytest -p kvcore.testing``) and subclass the mixins in your test file; see
:mod:`kvcore.testing.suite`.  The kit is public API, versioned with the hook specs
(:data:`KIT_VERSION`).  The default fixtures below fail with a message naming what to provide.
"""

from __future__ import annotations

import pytest

from kvcore.testing.suite import (
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

KIT_VERSION = "1"

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


@pytest.fixture
def kv_pool_factory():
    _provide("kv_pool_factory", "a callable (size, page_size, start_layer) -> your KVCache, small and on your device")


@pytest.fixture
def kv_layout():
    _provide("kv_layout", "the kvcore.layout.PoolLayout your backend declares for the pool in kv_pool")


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
