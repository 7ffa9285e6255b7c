"""Moving a request's KV cache from one pool to another through NIXL (disaggregated prefill and decode).

A :class:`KVTransferAgent` wraps one pool: it registers every buffer the pool reports for transfer engines with
a NIXL agent once, at construction, and writes rows of them into a connected peer's pool, one NIXL transfer per
call::

    prefill = KVTransferAgent("prefill", prefill_pools.token_to_kv_pool)
    decode = KVTransferAgent("decode", decode_pools.token_to_kv_pool)     # usually in another process
    prefill.connect(decode.metadata())         # bytes: decode's NIXL agent and its buffers, sent out of band
    prefill.write("decode", src_loc, dst_loc).wait()          # every layer and buffer of those tokens' pages
    prefill.write_states("decode", src_slots, dst_slots).wait()   # hybrid linear-attention pools' states

What is moved is found from the pool's own descriptors, by index space:

* ``pages``: :meth:`~kvcore.pools.KVCache.get_contiguous_buf_infos` (one entry per layer and token buffer, or one
  per page-major buffer; an item is one page of tokens: ``page_size`` rows, or a page of every layer), plus, for a
  pool that reports page-indexed state beside them (DSA's indexer pages), ``get_state_buf_infos``.  A token
  location ``t`` is on page ``t // page_size``; whole pages move.
* ``window_pages``: a sliding-window pool's window sub-pool (``get_state_buf_infos``, the pool reporting a
  ``swa_tokens`` size group), addressed through each side's full -> window mapping
  (``translate_loc_from_full_to_swa``).
* ``states``: a hybrid linear-attention pool's per-request states (``get_state_buf_infos``, the pool reporting a
  ``requests`` size group); an item is one state slot.

Runs of consecutive items (consecutive on both sides) become one descriptor per run and buffer.  The module
imports NIXL only when an agent is built (``pip install 'kvcore[nixl]'``).  docs/transfer.md has the details.

**Pools whose ids are virtual** (the unified memory's, ``memory.unified=true``): their items move when the memory
compacts.  The source translates its own tokens and state slots (the pool's ``translate_loc`` and
``translate_state_slots``) and holds the memory's moves (``pool.memory.hold_moves()``) until the write is done,
failed or cancelled; the destination gives the source its physical places (:meth:`KVTransferAgent.physical_loc`,
:meth:`KVTransferAgent.window_loc`, :meth:`KVTransferAgent.physical_slots`) and holds its own moves from then until
the data has landed (the write's notification).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvcore.errors import KVCoreError

__all__ = ["KVTransfer", "KVTransferAgent", "TransferError", "METADATA_FORMAT"]

#: the ``format`` field of :meth:`KVTransferAgent.metadata`
METADATA_FORMAT = "kvcore-transfer/1"
PAGES, WINDOW, STATES = "pages", "window_pages", "states"
_ITEM = {PAGES: "page", WINDOW: "window page", STATES: "state slot"}


class TransferError(KVCoreError):
    """A transfer that could not be set up or did not complete: the pools do not match, NIXL refused or failed
    it, the peer went away, or it was not done within the timeout.  (Bad arguments are ``ValueError``.)"""


def _nixl():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:  # pragma: no cover - the tests skip without NIXL
        raise TransferError("kvcore.transfer needs NIXL's Python API: pip install 'kvcore[nixl]' (nixl>=1.5)") from exc
    return nixl_agent, nixl_agent_config


# -- what a pool registers ----------------------------------------------------------------------------------------


def _infos(call) -> list[tuple[int, int, int]]:
    ptrs, lens, items = call()
    if not len(ptrs) == len(lens) == len(items):
        raise TransferError(f"buffer infos disagree: {len(ptrs)} pointers, {len(lens)} lengths, {len(items)} items")
    return [(int(p), int(n), int(i)) for p, n, i in zip(ptrs, lens, items)]


def _labels(named: dict[str, torch.Tensor], count: int) -> list[str]:
    """Names of the first ``count`` registered regions (``k layer 3``), from stacked buffers listed in the order
    their infos are; ``#i`` where the buffers do not account for them."""
    labels = [f"{name} layer {i}" for name, buf in named.items() for i in range(buf.shape[0])]
    return labels[:count] if len(labels) >= count else [f"#{i}" for i in range(count)]


def describe_pool(pool: Any) -> dict[str, Any]:
    """What :meth:`KVTransferAgent.metadata` says of a pool (besides the NIXL agent): its registered regions by
    index space (``[pointer, bytes, bytes per item]`` and a label each), and what the two sides must agree on."""
    groups = pool.size_groups()
    tokens = _infos(pool.get_contiguous_buf_infos)
    extra = _infos(pool.get_state_buf_infos) if hasattr(pool, "get_state_buf_infos") else []
    named = dict(pool.token_buffers())
    if "swa_tokens" in groups:  # the state infos are the window's alone; the buffer infos list them last, or not
        split = len(tokens) - len(extra) if len(tokens) >= len(extra) and tokens[len(tokens) - len(extra):] == extra \
            else len(tokens)  # fmt: skip
        labels = _labels(named, len(tokens) + len(extra))
        spaces = {PAGES: (tokens[:split], labels[:split]), WINDOW: (extra, labels[split : split + len(extra)])}
    elif "requests" in groups:
        spaces = {PAGES: (tokens, _labels(named, len(tokens))),
                  STATES: (extra, _labels(pool.request_state_buffers(), len(extra)))}  # fmt: skip
    else:  # page-indexed state beside the token buffers (DSA's indexer pages) is addressed by the same pages
        state_names = {k: v for k, v in pool.buffers().items() if k not in named}
        spaces = {PAGES: (tokens + extra, _labels(named, len(tokens)) + _labels(state_names, len(extra)))}
    sizes = {PAGES: pool.size, WINDOW: groups.get("swa_tokens", 0)}
    out: dict[str, Any] = {}
    for space, (regions, labels) in spaces.items():
        if not regions:
            continue
        counts = {n // i for _, n, i in regions if i > 0 and n % i == 0}
        expected = {sizes[space] // pool.page_size + 1} if space in sizes else counts
        if len(counts) != 1 or counts != expected or any(i <= 0 or n % i for _, n, i in regions):
            raise TransferError(f"{type(pool).__name__}: its {space} buffer infos are not whole {_ITEM[space]}s of "
                                f"one count {sorted(expected)} (items per buffer: {sorted(counts)}); kvcore.transfer "
                                f"cannot address them")  # fmt: skip
        out[space] = {"regions": [list(r) for r in regions], "labels": labels, "items": counts.pop()}
    first = next(iter(pool.buffers().values()))
    window = getattr(pool, "swa_kv_pool", None)
    return {
        "pool": type(pool).__name__,
        "subpools": [type(p).__name__ for p in (getattr(pool, "full_kv_pool", None), window) if p is not None],
        "page_size": pool.page_size,
        "layers": [pool.start_layer, pool.end_layer],
        "dtype": str(pool.dtype),
        "store_dtype": str(pool.store_dtype),
        "kv_format": getattr(pool, "kv_format", None),
        "head_num": getattr(pool, "head_num", None),
        "window_head_num": getattr(window, "head_num", None),
        "global_scale": _global_scales(pool),
        "mem_type": "DRAM" if first.device.type == "cpu" else "VRAM",
        "device_id": max(first.get_device(), 0),
        "spaces": out,
    }


def _global_scales(pool: Any) -> list[float] | None:
    """A block-scaled pool's global scales as they are now (nvfp4's, which may be calibrated after the pool is
    built), as a flat list; None for a pool without them."""
    scale = getattr(pool, "global_scale", None)
    return scale.detach().float().cpu().reshape(-1).tolist() if isinstance(scale, torch.Tensor) else None


def check_compatible(mine: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Raise :class:`TransferError` unless pools described by :func:`describe_pool` can exchange rows: the same page
    size, layers, heads, cache dtype and format, and in every index space the same buffers with the same bytes per
    item (their sizes may differ).  Each message names both sides' values."""
    a, b = mine["name"], theirs["name"]

    def refuse(what: str, x: Any, y: Any, hint: str = "") -> None:
        raise TransferError(f"cannot connect {a!r} to {b!r}: {what} differ: {a} {x}, {b} {y}{hint}")

    if mine["page_size"] != theirs["page_size"]:
        refuse("page sizes", f"page_size={mine['page_size']}", f"page_size={theirs['page_size']}",
               " (kv_cache.page_size must be the same on both sides)")  # fmt: skip
    if (mine["pool"], mine["subpools"]) != (theirs["pool"], theirs["subpools"]):
        same = mine["spaces"].keys() == theirs["spaces"].keys() and all(
            [r[2] for r in mine["spaces"][s]["regions"]] == [r[2] for r in theirs["spaces"][s]["regions"]]
            for s in mine["spaces"])  # fmt: skip
        if not same:
            refuse("pool layouts", _pool_name(mine), _pool_name(theirs),
                   " (kv_cache.layout and the backend must be the same on both sides)")  # fmt: skip
    if mine["layers"] != theirs["layers"]:
        refuse("layers", "{}..{}".format(*mine["layers"]), "{}..{}".format(*theirs["layers"]),
               " (the pipeline stages must match)")  # fmt: skip
    for key, what in (("head_num", "KV heads per rank"), ("window_head_num", "sliding-window KV heads per rank")):
        if mine[key] != theirs[key]:
            refuse(what, f"{mine[key]} heads", f"{theirs[key]} heads",
                   ": head slicing (tensor-parallel sizes that differ between the sides) is not supported")  # fmt: skip
    for key in ("dtype", "store_dtype", "kv_format"):
        if mine[key] != theirs[key]:
            refuse(f"cache {key}s", mine[key], theirs[key])
    if mine["spaces"].keys() != theirs["spaces"].keys():
        refuse("buffer kinds", sorted(mine["spaces"]), sorted(theirs["spaces"]))
    for space, here in mine["spaces"].items():
        there = theirs["spaces"][space]
        if len(here["regions"]) != len(there["regions"]):
            refuse(f"numbers of {space} buffers", len(here["regions"]), len(there["regions"]))
        for i, (x, y) in enumerate(zip(here["regions"], there["regions"])):
            if x[2] != y[2]:
                refuse(f"bytes per {_ITEM[space]} of {space} buffer {i} ({here['labels'][i]})", x[2], y[2])
    x, y = mine["global_scale"], theirs["global_scale"]
    if x != y:
        i = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), 0) if x and y and len(x) == len(y) else 0
        at = f" (layer {mine['layers'][0] + i // 2}, scale {i % 2})" if x and y and len(x) == len(y) else ""
        refuse(f"global scales{at}", x[i] if at else x, y[i] if at else y,
               ": block-scaled codes are only meaningful under the global scales they were stored with; calibrate "
               "both sides alike (set_kv_global_scale) before connecting")  # fmt: skip


def _pool_name(desc: dict[str, Any]) -> str:
    def sizes(regions: list[list[int]]) -> str:
        return "/".join(str(b) for b in sorted({r[2] for r in regions}))

    parts = "; ".join(f"{len(v['regions'])} buffers by {_ITEM[k]}, {sizes(v['regions'])} bytes per {_ITEM[k]}"
                      for k, v in desc["spaces"].items())  # fmt: skip
    sub = f"[{', '.join(desc['subpools'])}]" if desc["subpools"] else ""
    return f"{desc['pool']}{sub} ({parts})"


class _Regions:
    """One index space's registered regions, as arrays: pointers, bytes per item, and items per region."""

    __slots__ = ("ptr", "item", "items", "device_id")

    def __init__(self, space: dict[str, Any], device_id: int):
        regions = np.asarray(space["regions"], dtype=np.int64).reshape(-1, 3)
        self.ptr, self.item, self.items, self.device_id = regions[:, 0], regions[:, 2], int(space["items"]), device_id

    def descriptors(self, first: np.ndarray, count: np.ndarray) -> np.ndarray:
        """``[regions * runs, 3]`` (address, bytes, device) of runs of ``count`` items from item ``first``."""
        addr = self.ptr[:, None] + first[None, :] * self.item[:, None]
        size = count[None, :] * self.item[:, None]
        dev = np.full(addr.size, self.device_id, dtype=np.int64)
        return np.stack([addr.reshape(-1), size.reshape(-1), dev], axis=1).astype(np.uint64)


# -- indices --------------------------------------------------------------------------------------------------


def _index(x: Any, what: str) -> np.ndarray:
    """Locations or slots as a flat int64 host array (a tensor on any device, a list, an int)."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise ValueError(f"{what} must hold integers, got a {x.dtype} tensor")
        return x.detach().reshape(-1).to("cpu", torch.int64).numpy()
    arr = np.asarray(x)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must hold integers, got {arr.dtype}")
    return arr.astype(np.int64).reshape(-1)


def _pairs(space: str, src: np.ndarray, dst: np.ndarray, src_items: int, dst_items: int, skip_zero: bool, a: str,
           b: str) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The distinct (source item, destination item) pairs, sorted by source: every source item goes to one
    destination item, and no destination item receives two.  Item 0 is padding: refused, or with ``skip_zero`` (a
    window slot that slid out on either side) left out."""
    if skip_zero:
        keep = (src != 0) & (dst != 0)
        src, dst = src[keep], dst[keep]
    for side, items, limit in ((a, src, src_items), (b, dst, dst_items)):
        if items.size == 0:
            continue
        if not skip_zero and (items == 0).any():
            raise ValueError(f"{space}: {side}'s {_ITEM[space]} 0 is the padding one; nothing moves from or to it")
        if items.min() < 0 or items.max() >= limit:
            bad = items[(items < 0) | (items >= limit)][:4].tolist()
            raise ValueError(f"{space}: {side}'s {_ITEM[space]}s {bad} are outside its {limit} {_ITEM[space]}s")
    pairs = np.unique(np.stack([src, dst], axis=1), axis=0) if src.size else np.empty((0, 2), np.int64)
    for col, side in ((0, a), (1, b)):
        values, counts = np.unique(pairs[:, col], return_counts=True)
        if (counts > 1).any():
            v = int(values[counts > 1][0])
            other = pairs[pairs[:, col] == v, 1 - col][:4].tolist()
            raise ValueError(f"{space}: {side}'s {_ITEM[space]} {v} pairs with several {_ITEM[space]}s {other} of "
                             f"the other side; each {_ITEM[space]} must map to one")  # fmt: skip
    return pairs[:, 0], pairs[:, 1]


def _runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of pairs consecutive on both sides (``src`` sorted): first source, first destination, length."""
    breaks = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.concatenate([[0], np.nonzero(breaks)[0] + 1]).astype(np.int64)
    lengths = np.diff(np.concatenate([starts, [src.size]])).astype(np.int64)
    return src[starts], dst[starts], lengths


# -- transfers ------------------------------------------------------------------------------------------------


class KVTransfer:
    """One posted NIXL write (what :meth:`KVTransferAgent.write` returns).  :meth:`wait` polls it until done;
    ``bytes`` and ``descriptors`` say how much it moves and in how many pieces."""

    def __init__(self, agent: Any, handle: Any, peer: str, nbytes: int, descriptors: int, timeout_s: float,
                 state: str = "PROC", on_end: Callable[[], None] | None = None):  # fmt: skip
        self._agent, self._handle, self.peer = agent, handle, peer
        self.bytes, self.descriptors, self.timeout_s = nbytes, descriptors, timeout_s
        self._finished = False
        self._on_end = on_end  # called once, when the transfer is done, failed or cancelled
        self._settle(state)

    def _settle(self, state: str) -> bool:
        if state == "DONE":
            self._release()
            self._finished = True
        elif state != "PROC":
            self._release()
            raise TransferError(f"the transfer of {self.bytes} bytes to {self.peer!r} failed (NIXL state {state})")
        return self._finished

    def _release(self) -> None:
        handle, self._handle = self._handle, None
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()
        if handle is not None:
            try:
                handle.release()
            except Exception:  # noqa: BLE001 - a transfer that cannot be cancelled: NIXL keeps it and frees it later
                pass

    def done(self) -> bool:
        """Whether the transfer is done (one poll); raises :class:`TransferError` when it failed."""
        if self._finished:
            return True
        try:
            state = self._agent.check_xfer_state(self._handle)
        except Exception as exc:  # noqa: BLE001 - NIXL's errors (a peer disconnected, ...) as TransferError
            self._release()
            raise TransferError(f"the transfer of {self.bytes} bytes to {self.peer!r} failed: {exc}") from exc
        return self._settle(state)

    def wait(self, timeout_s: float | None = None) -> None:
        """Poll until the transfer is done; :class:`TransferError` when it fails or is not done within ``timeout_s``
        (default: the agent's), after which it is cancelled."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline, pause = time.monotonic() + limit, 0.0
        while not self.done():
            if time.monotonic() >= deadline:
                self._release()
                raise TransferError(f"the transfer of {self.bytes} bytes to {self.peer!r} was not done after {limit} s "
                                    f"(the peer may be gone or stalled); it was cancelled")  # fmt: skip
            time.sleep(pause)
            pause = min(max(pause * 2, 5e-5), 1e-3)


class KVTransferAgent:
    """A pool's side of KV transfers: a NIXL agent named ``name`` with every buffer of ``pool`` registered (host
    memory as ``DRAM``, CUDA memory as ``VRAM``), the peers it connected to, and the writes into their pools.

    :param name: the agent's name, unique among the agents that connect to each other; peers are named by it.
    :param pool: a kvcore token-to-KV pool (checked mode's wrapper is looked through).
    :param backend: the NIXL backend (plugin) to transfer with.
    :param timeout_s: how long :meth:`KVTransfer.wait` polls before it gives up.
    :raises TransferError: without NIXL, or when the pool's buffer infos cannot be addressed.
    """

    def __init__(self, name: str, pool: Any, *, backend: str = "UCX", timeout_s: float = 30.0):
        nixl_agent, nixl_agent_config = _nixl()
        self.name, self.backend, self.timeout_s = name, backend, float(timeout_s)
        self.pool = getattr(pool, "unchecked", pool)
        self._desc = {"name": name, **describe_pool(self.pool)}
        self._mem_type, self._device_id = self._desc["mem_type"], self._desc["device_id"]
        self._regions = {s: _Regions(v, self._device_id) for s, v in self._desc["spaces"].items()}
        try:
            self._agent = nixl_agent(name, nixl_agent_config(backends=[backend]))
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"could not start NIXL agent {name!r} with backend {backend}: {exc}") from exc
        if backend not in self._agent.backends:
            raise TransferError(f"NIXL has no {backend} backend here (plugins: {self._agent.get_plugin_list()})")
        regions = [(p, n, self._device_id, "") for v in self._desc["spaces"].values() for p, n, _ in v["regions"]]
        try:
            self._registered = self._agent.register_memory(regions, self._mem_type) if regions else None
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"NIXL agent {name!r} could not register the pool's {len(regions)} buffers: "
                                f"{exc}") from exc  # fmt: skip
        self._peers: dict[str, tuple[dict[str, Any], dict[str, _Regions]]] = {}

    # -- connecting -----------------------------------------------------------------------------------------

    def _current(self) -> dict[str, Any]:
        """The pool's description, with nvfp4's global scales as they are now (they may be calibrated later)."""
        self._desc["global_scale"] = _global_scales(self.pool)
        return self._desc

    def metadata(self) -> bytes:
        """What a peer needs to write into this pool (:meth:`connect`): this NIXL agent's metadata and the
        description of the registered buffers, as bytes (JSON) to send out of band."""
        agent = self._live()
        return json.dumps({"format": METADATA_FORMAT, **self._current(),
                           "nixl": base64.b64encode(agent.get_agent_metadata()).decode("ascii")}).encode()  # fmt: skip

    def connect(self, metadata: bytes) -> str:
        """Add the peer described by ``metadata`` (its :meth:`metadata`), after checking that its pool matches
        this one; connecting again to a name replaces the earlier peer.  Returns the peer's name.

        :raises TransferError: for metadata that is not a kvcore agent's, pools that do not match (the message names
            both sides' values), or a peer NIXL cannot reach."""
        agent = self._live()
        try:
            theirs = json.loads(bytes(metadata).decode())
            assert theirs.get("format") == METADATA_FORMAT
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"not the metadata of a kvcore transfer agent ({METADATA_FORMAT})") from exc
        peer = theirs["name"]
        if peer == self.name:
            raise TransferError(f"agent {self.name!r} cannot connect to itself (or to a peer of the same name)")
        check_compatible(self._current(), theirs)
        if peer in self._peers:
            self.disconnect(peer)
        try:
            added = agent.add_remote_agent(base64.b64decode(theirs["nixl"]))
        except Exception as exc:  # noqa: BLE001 - NIXL cannot load it: a peer that is gone, an unknown backend
            raise TransferError(f"NIXL agent {self.name!r} could not connect to {peer!r}: {exc}") from exc
        added = added.decode() if isinstance(added, bytes) else str(added)
        if added != peer:
            raise TransferError(f"the metadata of {peer!r} holds the NIXL agent {added!r}")
        regions = {s: _Regions(v, theirs["device_id"]) for s, v in theirs["spaces"].items()}
        self._peers[peer] = (theirs, regions)
        return peer

    def disconnect(self, peer: str) -> None:
        """Forget a peer (NIXL disconnects from it)."""
        if self._peers.pop(peer, None) is not None and self._agent is not None:
            try:
                self._agent.remove_remote_agent(peer)
            except Exception:  # noqa: BLE001 - already gone
                pass

    @property
    def peers(self) -> list[str]:
        return sorted(self._peers)

    def close(self) -> None:
        """Disconnect every peer, deregister the buffers and stop the NIXL agent (peers writing here then fail)."""
        if self._agent is None:
            return
        for peer in list(self._peers):
            self.disconnect(peer)
        if self._registered is not None:
            try:
                self._agent.deregister_memory(self._registered)
            except Exception:  # noqa: BLE001
                pass
        self._agent = self._registered = None

    def __enter__(self) -> KVTransferAgent:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _live(self) -> Any:
        if self._agent is None:
            raise TransferError(f"agent {self.name!r} is closed")
        return self._agent

    # -- writing --------------------------------------------------------------------------------------------

    def physical_loc(self, loc: Any) -> np.ndarray:
        """This pool's physical tokens of tokens ``loc`` (int64, on the host): what the destination of a
        :meth:`write` sends its source as ``dst_loc``.  The tokens themselves for a pool whose ids are physical; a
        unified pool's are valid while its memory's moves are held (``pool.memory.hold_moves()``)."""
        flat = self._tokens(loc)
        translate = getattr(self.pool, "translate_loc", None)
        if translate is None or flat.size == 0:
            return flat
        return _index(translate(torch.as_tensor(flat, device=self.pool.device)), "loc")

    def _tokens(self, loc: Any) -> np.ndarray:
        """``loc`` as a flat int64 host array, checked to lie in the pool's token slots."""
        flat = _index(loc, "loc")
        rows = self.pool.size + self.pool.page_size
        if flat.size and (flat.min() < 0 or flat.max() >= rows):
            raise ValueError(f"locations {flat[(flat < 0) | (flat >= rows)][:4].tolist()} are outside the pool's "
                             f"{rows} token slots")  # fmt: skip
        return flat

    def physical_slots(self, slots: Any) -> np.ndarray:
        """This hybrid pool's state items of request-state slots ``slots`` (int64, on the host): what the destination
        of a :meth:`write_states` sends its source as ``dst_slots``.  The slots themselves unless the pool's slots are
        virtual (a unified pool's: valid while its memory's moves are held)."""
        flat = _index(slots, "slots")
        translate = getattr(self.pool, "translate_state_slots", None)
        if translate is None or flat.size == 0:
            return flat
        return _index(translate(torch.as_tensor(flat, device=self.pool.device)), "slots")

    def _hold_moves(self) -> Callable[[], None] | None:
        """Hold the pool's memory's moves (a unified pool's) for a transfer in flight: the release, or None."""
        memory = getattr(self.pool, "memory", None)
        if memory is None or not hasattr(memory, "hold_moves"):
            return None
        memory.hold_moves()
        return memory.release_moves

    def window_loc(self, loc: Any) -> torch.Tensor:
        """This pool's sliding-window slots of full locations ``loc`` (int64, on the CPU; 0 for a token that slid
        out of the window): what the destination of a :meth:`write` sends its source as ``dst_window_loc``.  The
        locations themselves while no full -> window mapping is registered."""
        if WINDOW not in self._regions:
            raise ValueError(f"{type(self.pool).__name__} keeps no sliding-window layers")
        flat = self._tokens(loc)
        mapping = getattr(self.pool, "full_to_swa_index_mapping", None)
        if mapping is None:
            return torch.as_tensor(flat)
        flat = torch.as_tensor(flat, device=self.pool.device)
        window = self.pool.translate_loc_from_full_to_swa(flat).long()
        # a token that slid out is 0 here, whatever its pool's reads find for it (a unified pool's padding page)
        return torch.where(mapping[flat] == 0, 0, window).to("cpu", torch.int64)

    def write(self, peer: str, src_loc: Any, dst_loc: Any, *, dst_window_loc: Any = None,
              notify: bytes | None = None) -> KVTransfer:  # fmt: skip
        """Write the KV of tokens ``src_loc`` of this pool into tokens ``dst_loc`` of ``peer``'s pool: every layer
        of every registered buffer, in one NIXL transfer.

        Pages are the unit: token ``src_loc[i]``'s whole page goes to ``dst_loc[i]``'s page (every slot of it), so
        both must sit at the same offset in their pages and the pages must pair one to one.  Sliding-window layers
        move the window pages of the tokens through each side's mapping: ``dst_window_loc`` is required when the
        peer keeps window layers (the peer's :meth:`window_loc` of ``dst_loc``); tokens that slid out on either
        side (window slot 0) move no window rows.

        :param notify: a message NIXL delivers to the peer once the data is there (its :meth:`notifications`).
        :raises ValueError: for locations that do not pair up, lie in the padding page or outside a pool.
        :raises TransferError: for an unknown peer, or when NIXL refuses the transfer."""
        theirs, remote = self._peer(peer)
        src, dst = self.physical_loc(src_loc), _index(dst_loc, "dst_loc")
        if src.size != dst.size:
            raise ValueError(f"write: {src.size} source locations but {dst.size} destinations")
        page = self.pool.page_size
        if (src % page != dst % page).any():
            i = int(np.nonzero(src % page != dst % page)[0][0])
            raise ValueError(f"write: tokens move with their pages, so each keeps its offset in the page; src_loc[{i}]="
                             f"{src[i]} and dst_loc[{i}]={dst[i]} differ at page_size={page}")  # fmt: skip
        parts = [(PAGES, src // page, dst // page, False)]
        if WINDOW in self._regions:
            if dst_window_loc is None:
                raise ValueError(f"write: {peer!r} keeps sliding-window layers: pass dst_window_loc=, its window slots "
                                 f"of dst_loc ({peer!r}'s KVTransferAgent.window_loc(dst_loc))")  # fmt: skip
            src_w, dst_w = self.window_loc(src_loc).numpy(), _index(dst_window_loc, "dst_window_loc")
            if dst_w.size != dst.size:
                raise ValueError(f"write: {dst_w.size} dst_window_loc for {dst.size} dst_loc")
            live = (src_w != 0) & (dst_w != 0)
            if (src_w[live] % page != dst_w[live] % page).any():
                raise ValueError("write: window slots must keep their offsets in the page on both sides")
            parts.append((WINDOW, src_w // page, dst_w // page, True))
        return self._post(peer, theirs, remote, parts, notify)

    def write_states(self, peer: str, src_slots: Any, dst_slots: Any, *, notify: bytes | None = None) -> KVTransfer:
        """Write the request states (every linear layer's convolution window and temporal state) of slots
        ``src_slots`` of this hybrid pool into slots ``dst_slots`` of ``peer``'s, in one NIXL transfer."""
        theirs, remote = self._peer(peer)
        if STATES not in self._regions:
            raise ValueError(f"{type(self.pool).__name__} keeps no request states (a hybrid linear-attention pool "
                             f"does)")  # fmt: skip
        src, dst = self.physical_slots(src_slots), _index(dst_slots, "dst_slots")
        if src.size != dst.size:
            raise ValueError(f"write_states: {src.size} source slots but {dst.size} destinations")
        return self._post(peer, theirs, remote, [(STATES, src, dst, False)], notify)

    def notifications(self) -> dict[str, list[bytes]]:
        """The messages peers attached to their writes into this pool (``notify=``) since the last call, by peer."""
        new = self._live().get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else k): list(v) for k, v in new.items()}

    def _peer(self, peer: str) -> tuple[dict[str, Any], dict[str, _Regions]]:
        self._live()
        if peer not in self._peers:
            raise TransferError(f"agent {self.name!r} is not connected to {peer!r} (connected: {self.peers}); call "
                                f"connect(<its metadata()>) first")  # fmt: skip
        return self._peers[peer]

    def _post(self, peer: str, theirs: dict[str, Any], remote: dict[str, _Regions], parts, notify) -> KVTransfer:
        local_rows, remote_rows = [], []
        for space, src, dst, skip in parts:
            here, there = self._regions.get(space), remote.get(space)
            if here is None or there is None:
                continue
            src, dst = _pairs(space, src, dst, here.items, there.items, skip, self.name, peer)
            if src.size:
                first_src, first_dst, count = _runs(src, dst)
                local_rows.append(here.descriptors(first_src, count))
                remote_rows.append(there.descriptors(first_dst, count))
        agent = self._live()
        if not local_rows:
            return KVTransfer(agent, None, peer, 0, 0, self.timeout_s, "DONE")
        local, far = np.concatenate(local_rows), np.concatenate(remote_rows)
        if self._mem_type == "VRAM":  # the rows were written on a stream: NIXL reads memory as it is now
            torch.cuda.synchronize(self._device_id)
        message = notify or b""
        try:
            handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, self._mem_type),
                                           agent.get_xfer_descs(far, theirs["mem_type"]), peer, message)  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"NIXL refused a write of {int(local[:, 1].sum())} bytes to {peer!r}: {exc}") from exc
        transfer = KVTransfer(agent, handle, peer, int(local[:, 1].sum()), len(local), self.timeout_s,
                              on_end=self._hold_moves())  # fmt: skip
        try:
            state = agent.transfer(handle, message)
        except Exception as exc:  # noqa: BLE001 - a peer that disconnected, ...
            transfer._release()
            raise TransferError(f"the write of {transfer.bytes} bytes to {peer!r} could not be posted: {exc}") from exc
        transfer._settle(state)
        return transfer
