"""A vendor plugin that overrides the core's layout and allocator choices for its own backend only.

Backend 'ovr' (vendor 'ovr') declares a ``layout`` that must never be called: the tryfirst
``kvcore_buffer_layout`` answers for it.  ``kvcore_choose_allocator`` wraps the core's allocator.
Both hooks return None for other backends, so mha keeps the core defaults.
"""

from kvcore import hookimpl
from kvcore.backend import BackendSpec

from fake_plugins._common import kv_layout, mha_pool

NOTE = "laid out by the ovr tryfirst hook"
calls = {"layout": 0, "allocator": 0}


def _must_not_be_called(request):
    raise AssertionError("BackendSpec.layout of 'ovr' was called; the tryfirst kvcore_buffer_layout should answer")


class OvrAllocator:
    """Marks that the override chose the allocator; delegates to the core's choice."""

    def __init__(self, inner, sizes):
        self.inner = inner
        self.sizes = dict(sizes)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@hookimpl
def kvcore_register_backends():
    return [BackendSpec(name="ovr", attention=("mha",), vendors=("ovr",), layout=_must_not_be_called,
                        create_pool=mha_pool)]


@hookimpl(tryfirst=True)
def kvcore_buffer_layout(backend, request):
    if backend.name != "ovr":
        return None
    calls["layout"] += 1
    base = kv_layout("ovr", request)
    return type(base)(backend=base.backend, buffers=base.buffers, notes=(NOTE,))


@hookimpl(tryfirst=True)
def kvcore_choose_allocator(backend, request, pool, sizes):
    if backend.name != "ovr":
        return None
    calls["allocator"] += 1
    from kvcore.allocators import TokenToKVPoolAllocator

    inner = TokenToKVPoolAllocator(sizes["tokens"], dtype=request.kv_dtype, device=request.device, kvcache=pool,
                                   need_sort=False, kernels=request.kernels)
    return OvrAllocator(inner, sizes)
