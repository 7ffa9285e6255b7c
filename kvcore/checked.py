"""Checked mode: every pool and allocator call validated before it runs (``KVCORE_CHECKED=1`` or
``hardware.checked: true``).

A wrong index silently corrupts another request's cache; checked mode makes such calls loud.
:func:`kvcore.build_pools` wraps the token pool in a :class:`CheckedPool` and the allocator in a
:class:`CheckedAllocator`; each checks its call's arguments (which may read them back from the device: checked
mode is for debugging, not for speed), raises one :class:`CheckError` naming the call, the argument, what was
expected and what came, and otherwise hands the call to the object it wraps, unchanged.  Anything it does not
check passes straight through.  With checked mode off nothing is wrapped, so the hot paths cost what they
always do.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kvcore.errors import KVCoreError

__all__ = ["CheckError", "CheckedAllocator", "CheckedPool", "checked_enabled"]

_INDEX_DTYPES = (torch.int32, torch.int64)
_VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)


class CheckError(KVCoreError, ValueError):
    """A pool or allocator call that checked mode refused."""


def checked_enabled(cfg: Any = None) -> bool:
    """True with ``KVCORE_CHECKED=1`` in the environment or ``hardware.checked: true`` in ``cfg``."""
    if os.environ.get("KVCORE_CHECKED", "0") not in ("", "0"):
        return True
    return bool(getattr(getattr(cfg, "hardware", None), "checked", False))


def _fail(call: str, argument: str, expected: str, got: str) -> None:
    raise CheckError(f"{call}: {argument} must be {expected}, got {got}")


def _few(values: torch.Tensor) -> str:
    shown = values[:8].tolist()
    return f"{shown}{' ...' if values.numel() > 8 else ''}"


def _index(call: str, name: str, t: Any, device: torch.device) -> torch.Tensor:
    """``t`` as a flat index tensor, after checking its type, dtype and device."""
    if not isinstance(t, torch.Tensor):
        _fail(call, name, "an int32/int64 tensor", type(t).__name__)
    if t.dtype not in _INDEX_DTYPES:
        _fail(call, name, "int32 or int64", str(t.dtype))
    if t.device != device:
        _fail(call, name, f"on {device}", str(t.device))
    return t.reshape(-1)


def _forwarded(proxy: Any, inner: str, name: str) -> Any:
    """Attribute ``name`` of the object a proxy wraps (its ``inner`` attribute).  Special names (``__deepcopy__``,
    ``__setstate__``, ...) are not forwarded, and nothing is while the proxy has no inner object yet (a copy being
    built): ``copy.deepcopy`` and pickling then treat the proxy as an object of its own, which wraps a copy of the
    inner one."""
    wrapped = proxy.__dict__.get(inner)
    if wrapped is None or (name.startswith("__") and name.endswith("__")):
        raise AttributeError(f"{type(proxy).__name__!r} object has no attribute {name!r}")
    return getattr(wrapped, name)


class CheckedPool:
    """A token-to-KV pool whose calls are checked first (see the module docstring); every other attribute is
    the wrapped pool's.

    Checks: locations are int32/int64 tensors on the pool's device, within the pool's ``size + page_size``
    rows, and never in the padding page for writes (stores, move targets, CPU loads); a move's targets are
    distinct and as many as its sources; rows to store are float or fp8 tensors on the device with one row
    per location; layers are this rank's (``start_layer .. end_layer``)."""

    def __init__(self, pool: Any):
        self.__dict__["_pool"] = pool
        device = torch.device(pool.device)
        if device.type == "cuda" and device.index is None:  # "cuda": the device current when the pool was built
            device = torch.device("cuda", torch.cuda.current_device())
        self.__dict__["_device"] = device

    def __getattr__(self, name: str) -> Any:
        return _forwarded(self, "_pool", name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._pool, name, value)

    @property
    def unchecked(self) -> Any:
        """The pool itself."""
        return self._pool

    # -- checks -------------------------------------------------------------------------------------------

    def _locations(self, call: str, name: str, loc: Any, write: bool) -> torch.Tensor:
        from kvcore.pools import tokens_of  # not at import (see _layer)

        flat = _index(call, name, tokens_of(loc), self._device)
        if flat.numel() == 0:
            return flat
        rows = self._pool.size + self._pool.page_size
        low, high = int(flat.min()), int(flat.max())
        if low < 0 or high >= rows:
            bad = flat[(flat < 0) | (flat >= rows)]
            _fail(call, name, f"locations in [0, {rows}) (size {self._pool.size} + a padding page)", f"{_few(bad)}")
        page = self._pool.page_size
        if write and low < page:
            bad = flat[flat < page]
            _fail(call, name, f"outside the padding page [0, {page}) for a write", f"{_few(bad)}")
        return flat

    def _layer(self, call: str, layer: Any, override: int | None) -> None:
        from kvcore.pools import layer_id_of  # not at import: kvcore must not import Triton before the kit sets it up

        layer_id = override if override is not None else layer_id_of(layer)
        pool = self._pool
        if not pool.start_layer <= layer_id <= pool.end_layer:
            _fail(call, "layer", f"one of this rank's layers {pool.start_layer}..{pool.end_layer}", str(layer_id))

    def _rows(self, call: str, name: str, x: Any, n: int) -> None:
        if not isinstance(x, torch.Tensor):
            _fail(call, name, "a tensor", type(x).__name__)
        if x.dtype not in _VALUE_DTYPES:
            _fail(call, name, "a float32/float16/bfloat16 or fp8 tensor", str(x.dtype))
        if x.device != self._device:
            _fail(call, name, f"on {self._device}", str(x.device))
        if x.dim() == 0 or x.shape[0] != n:
            _fail(call, name, f"one row per location ({n} rows)", f"shape {tuple(x.shape)}")

    # -- the checked calls --------------------------------------------------------------------------------

    def set_kv_buffer(self, layer, loc, cache_k, *args, layer_id_override=None, **kwargs):
        self._layer("set_kv_buffer", layer, layer_id_override)
        n = self._locations("set_kv_buffer", "loc", loc, write=True).numel()
        self._rows("set_kv_buffer", "cache_k", cache_k, n)
        cache_v = args[0] if args else kwargs.get("cache_v")
        if cache_v is not None:
            self._rows("set_kv_buffer", "cache_v", cache_v, n)
        return self._pool.set_kv_buffer(layer, loc, cache_k, *args, layer_id_override=layer_id_override, **kwargs)

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope, cache_k_rope, *args, layer_id_override=None, **kwargs):
        self._layer("set_mla_kv_buffer", layer, layer_id_override)
        n = self._locations("set_mla_kv_buffer", "loc", loc, write=True).numel()
        self._rows("set_mla_kv_buffer", "cache_k_nope", cache_k_nope, n)
        self._rows("set_mla_kv_buffer", "cache_k_rope", cache_k_rope, n)
        return self._pool.set_mla_kv_buffer(layer, loc, cache_k_nope, cache_k_rope, *args,
                                            layer_id_override=layer_id_override, **kwargs)  # fmt: skip

    def get_mla_kv_buffer(self, layer, loc, *args, **kwargs):
        self._layer("get_mla_kv_buffer", layer, None)
        self._locations("get_mla_kv_buffer", "loc", loc, write=False)
        return self._pool.get_mla_kv_buffer(layer, loc, *args, **kwargs)

    def set_index_k_scale_buffer(self, layer_id, loc, index_k, *args, **kwargs):
        self._layer("set_index_k_scale_buffer", layer_id, None)
        n = self._locations("set_index_k_scale_buffer", "loc", loc, write=True).numel()
        self._rows("set_index_k_scale_buffer", "index_k", index_k, n)
        return self._pool.set_index_k_scale_buffer(layer_id, loc, index_k, *args, **kwargs)

    def move_kv_cache(self, tgt_loc, src_loc):
        tgt = self._locations("move_kv_cache", "tgt_loc", tgt_loc, write=True)
        src = self._locations("move_kv_cache", "src_loc", src_loc, write=False)
        if tgt.numel() != src.numel():
            _fail("move_kv_cache", "tgt_loc", f"as many locations as src_loc ({src.numel()})", str(tgt.numel()))
        if torch.unique(tgt).numel() != tgt.numel():
            values, counts = torch.unique(tgt, return_counts=True)
            _fail("move_kv_cache", "tgt_loc", "distinct locations", f"repeats {_few(values[counts > 1])}")
        return self._pool.move_kv_cache(tgt_loc, src_loc)

    def get_cpu_copy(self, indices, *args, **kwargs):
        self._locations("get_cpu_copy", "indices", torch.as_tensor(indices, device=self._device), write=False)
        return self._pool.get_cpu_copy(indices, *args, **kwargs)

    def load_cpu_copy(self, kv_cache_cpu, indices, *args, **kwargs):
        self._locations("load_cpu_copy", "indices", torch.as_tensor(indices, device=self._device), write=True)
        return self._pool.load_cpu_copy(kv_cache_cpu, indices, *args, **kwargs)


class CheckedAllocator:
    """An allocator whose frees are checked against what it handed out (see the module docstring); every
    other attribute is the wrapped allocator's.

    It keeps, on the host, which token slots (whole pages when paged) are handed out: a free of a slot that
    is not (a double free, or one never allocated) or of the padding slot / page raises, and so does a free of
    an index tensor of the wrong dtype or device.  Frees inside a free group count when made.  Its
    ``backup_state`` / ``restore_state`` carry that record along."""

    def __init__(self, allocator: Any):
        self.__dict__["_alloc"] = allocator
        self.__dict__["_live"] = torch.zeros(allocator.size + 2 * allocator.page_size, dtype=torch.bool)

    def __getattr__(self, name: str) -> Any:
        return _forwarded(self, "_alloc", name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._alloc, name, value)

    @property
    def unchecked(self) -> Any:
        return self._alloc

    def _pages(self, tokens: torch.Tensor) -> torch.Tensor:
        """Every token of the pages holding ``tokens``."""
        page = self._alloc.page_size
        first = torch.unique(tokens.cpu().long() // page) * page
        return (first[:, None] + torch.arange(page)).reshape(-1)

    def _took(self, call: str, out: torch.Tensor | None) -> torch.Tensor | None:
        if out is not None and out.numel():
            tokens = out.cpu().long()
            if bool(self._live[tokens].any()):
                raise CheckError(f"{call}: the allocator handed out slots that are in use: {_few(tokens[self._live[tokens]])}")
            self._live[tokens] = True
        return out

    def alloc(self, need_size: int, *args, **kwargs):
        return self._took("alloc", self._alloc.alloc(need_size, *args, **kwargs))

    def alloc_extend(self, *args, **kwargs):
        return self._took("alloc_extend", self._alloc.alloc_extend(*args, **kwargs))

    def alloc_decode(self, *args, **kwargs):
        return self._took("alloc_decode", self._alloc.alloc_decode(*args, **kwargs))

    def free(self, free_index):
        device = self._alloc.device
        flat = _index("free", "free_index", free_index, device)
        if flat.numel():
            tokens = flat.cpu().long()
            page = self._alloc.page_size
            if bool((tokens < page).any()):
                _fail("free", "free_index", f"outside the padding page [0, {page})", _few(tokens[tokens < page]))
            if bool((tokens >= self._live.numel()).any()):
                _fail("free", "free_index", f"slots below {self._live.numel()}", _few(tokens[tokens >= self._live.numel()]))
            if not bool(self._live[tokens].all()):
                _fail("free", "free_index", "slots that are allocated (a double free, or never handed out?)",
                      f"free slots {_few(tokens[~self._live[tokens]])}")  # fmt: skip
            self._live[self._pages(tokens)] = False
        return self._alloc.free(free_index)

    def free_swa(self, free_index):
        flat = _index("free_swa", "free_index", free_index, self._alloc.device)
        tokens = flat.cpu().long()
        if tokens.numel() and not bool(self._live[tokens].all()):
            _fail("free_swa", "free_index", "allocated full locations", f"free slots {_few(tokens[~self._live[tokens]])}")
        return self._alloc.free_swa(free_index)

    def backup_state(self):
        return self._alloc.backup_state(), self._live.clone()

    def restore_state(self, state):
        inner, live = state
        self._alloc.restore_state(inner)
        self.__dict__["_live"] = live.clone()

    def clear(self):
        self._live.zero_()
        return self._alloc.clear()
