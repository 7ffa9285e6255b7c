"""The checks ``kvcore up`` runs on freshly built pools, through the family-independent pool API only."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from kvcore.api import Pools


@attrs.frozen
class CheckResult:
    name: str
    ok: bool
    detail: str


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def run_self_check(pools: Pools, *, tokens: int = 64, seed: int = 0) -> list[CheckResult]:
    """Allocate, write, read, move, offload and free a few tokens; every check reports what it saw."""
    pool, allocator = pools.token_to_kv_pool, pools.token_to_kv_pool_allocator
    page = pool.page_size
    tokens = max(page, tokens // page * page)
    generator = torch.Generator().manual_seed(seed)
    results: list[CheckResult] = []

    def check(name: str, fn: Callable[[], tuple[bool, str]]) -> None:
        try:
            ok, detail = fn()
        except Exception as exc:  # a self-check reports, it does not crash the report
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        results.append(CheckResult(name, ok, detail))

    before = allocator.available_size()
    padding_tokens = torch.arange(page, device=pool.device)
    padding = {name: rows.take(padding_tokens) for name, rows in pool.token_rows().items()}
    state: dict[str, torch.Tensor] = {}

    def alloc() -> tuple[bool, str]:
        loc = allocator.alloc(2 * tokens)
        if loc is None:
            return False, f"allocator could not give {2 * tokens} tokens of {before} free"
        state["loc"] = loc
        fine = int(loc.min()) >= page and allocator.available_size() == before - 2 * tokens
        return fine, f"{2 * tokens} slots, {allocator.available_size()} of {before} left, slot 0 untouched"

    check("alloc", alloc)
    if "loc" not in state:
        return results
    loc = state["loc"]
    src, dst = loc[:tokens], loc[tokens:]

    def write_read() -> tuple[bool, str]:
        layers = pool.token_layers()
        for layer in layers:
            expected = pool.self_test_write(layer, src, generator)
            token_rows = pool.token_rows()
            for name, rows in expected.items():
                if not _same_bytes(token_rows[name].take(src, pool.layer_in_buffer(name, layer)), rows):
                    return False, f"layer {layer}: buffer {name!r} rows read back differ from the rows written"
        return True, f"{tokens} tokens x {len(layers)} layers written by the pool's own write path, read back bit-exact"

    def move() -> tuple[bool, str]:
        expected = {name: rows.take(src) for name, rows in pool.token_rows().items()}
        pool.move_kv_cache(dst, src)
        for name, rows in pool.token_rows().items():
            if not _same_bytes(rows.take(dst), expected[name]):
                return False, f"buffer {name!r}: moved rows differ from their sources"
        return True, f"{tokens} slots moved in all layers of {', '.join(expected)}"

    def offload() -> tuple[bool, str]:
        copy = pool.get_cpu_copy(dst)
        expected = {name: rows.take(dst) for name, rows in pool.token_rows().items()}
        pool.load_cpu_copy(copy, src)
        for name, rows in pool.token_rows().items():
            if not _same_bytes(rows.take(src), expected[name]):
                return False, f"buffer {name!r}: rows loaded from the CPU copy differ"
        return True, "device -> host -> device round trip bit-exact"

    def padding_untouched() -> tuple[bool, str]:
        for name, rows in pool.token_rows().items():
            if not _same_bytes(rows.take(padding_tokens), padding[name]):
                return False, f"buffer {name!r}: the padding page was written"
        return True, "page 0 (padding) unchanged"

    def free() -> tuple[bool, str]:
        allocator.free(loc)
        after = allocator.available_size()
        return after == before, f"{after} of {before} slots free after freeing"

    storing = [("write/read", write_read), ("move", move), ("cpu offload", offload), ("padding", padding_untouched)]
    if not pool.token_rows():  # a pool that stores nothing (prefill-only): capacity and the allocator only
        storing = [("storage", lambda: (True, f"{type(pool).__name__} stores no KV: write, move and offload skipped"))]
    for name, fn in (*storing, ("free", free)):
        check(name, fn)
    return results
