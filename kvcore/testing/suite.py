"""Conformance tests every token-to-KV pool must pass, as mixin classes.

An implementer's whole test file is a subclass plus the fixtures below::

    from kvcore.testing import KVCacheConformance

    class TestAcmePool(KVCacheConformance):
        @pytest.fixture
        def kv_pool_factory(self): ...   # (size, page_size, start_layer) -> pool
        @pytest.fixture
        def kv_layout(self, kv_pool): ...  # the PoolLayout the backend declared for that pool

Fixtures the implementer may override: ``kv_capabilities`` (a set of capability names; tests that need
a capability the pool does not declare are skipped by capability, never by backend name), ``kv_pool_size``
and ``kv_page_size``; ``kv_writer`` defaults to the pool's own ``self_test_write``.  Without the required
fixtures every test fails with a message naming the fixture.

A pool that stores values lossily subclasses :class:`LossyKVCacheConformance` instead, which declares :data:`LOSSY`
as well and adds :class:`BaseLossyTests`.

Moves and CPU offload are checked on every row of :meth:`KVCache.token_rows` (by default the token buffers;
a pool with per-token state inside pages reports it there, as :class:`kvcore.token_rows.TokenRows`), and a
move must leave every other byte of :meth:`KVCache.buffers` unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Protocol

import pytest
import torch

from kvcore.errors import ConfigError
from kvcore.testing.tensors import addresses_kept

#: capability names a pool may declare through the ``kv_capabilities`` fixture (the default declares these).
CAPABILITIES = frozenset({"store", "move", "cpu_offload", "buffer_infos"})
#: declared in addition by a pool that stores values lossily (quantized caches): its round trip is checked
#: within ``pool.lossy_bound`` (relative RMS error) through ``pool.self_test_values`` and ``pool.read_values``
#: (:class:`BaseLossyTests`; the protocol is documented on :class:`kvcore.pools.KVCache`), beside the byte checks
#: that hold for the bytes its writer reports.
LOSSY = "lossy"


class KVWriter(Protocol):
    """Writes random rows into ``pool`` at ``loc`` of ``layer`` through the family's own write API.

    :returns: for every :meth:`~kvcore.pools.KVCache.token_rows` buffer touched, the exact rows (storage
        dtype, shape ``[len(loc), ...]``) that must now be the rows of tokens ``loc`` in that layer.
    """

    def __call__(self, pool, layer: int, loc: torch.Tensor, generator: torch.Generator) -> Mapping[str, torch.Tensor]: ...


def pool_writer(pool, layer: int, loc: torch.Tensor, generator: torch.Generator) -> Mapping[str, torch.Tensor]:
    """The default :class:`KVWriter`: the pool's own :meth:`~kvcore.pools.KVCache.self_test_write`."""
    return pool.self_test_write(layer, loc, generator)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a, e = _bytes(actual.cpu()), _bytes(expected.cpu())
    if not torch.equal(a, e):
        bad = (a != e).nonzero()
        raise AssertionError(f"{what}: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}")


def randomize(pool, generator: torch.Generator, buffers: Mapping[str, torch.Tensor] | None = None) -> None:
    """Fill every buffer (or only ``buffers``) with random bytes (tests never run on zeros)."""
    for buf in (pool.buffers() if buffers is None else buffers).values():
        raw = buf.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator).to(raw.device))


class _Base:
    @pytest.fixture
    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(1234)

    @pytest.fixture
    def kv_pool(self, kv_pool_factory, kv_pool_size, kv_page_size):
        return kv_pool_factory(size=kv_pool_size, page_size=kv_page_size, start_layer=0)

    @staticmethod
    def need(capabilities, name: str) -> None:
        if name not in capabilities:
            pytest.skip(f"pool does not declare capability {name!r}")

    @staticmethod
    def free_slots(pool, n: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` distinct non-padding slots, in random order (split one draw for disjoint sets)."""
        usable = torch.arange(pool.page_size, pool.size + pool.page_size)
        picked = usable[torch.randperm(usable.numel(), generator=generator)[:n]]
        return picked.to(pool.device)


class _LayerObject:
    """What engines pass as ``layer``: an attention module with a ``layer_id``."""

    def __init__(self, layer_id: int):
        self.layer_id = layer_id


class BaseLayoutTests(_Base):
    def test_layout_bytes_equal_allocated_bytes(self, kv_pool, kv_layout):
        buffers = kv_pool.buffers()
        declared = kv_layout.by_name()
        assert set(buffers) == set(declared), f"buffers {sorted(buffers)} != layout {sorted(declared)}"
        sizes = kv_pool.size_groups()
        missing = sorted(set(kv_layout.groups) - set(sizes))
        assert not missing, f"size_groups() {sizes} gives no size for the layout's group(s) {missing}"
        for name, buf in buffers.items():
            spec = declared[name]
            size = sizes[spec.sized_by]
            assert tuple(buf.shape) == spec.shape(size), f"buffer {name}: shape {tuple(buf.shape)} != {spec.shape(size)}"
            assert buf.dtype == spec.dtype, f"buffer {name}: dtype {buf.dtype} != layout {spec.dtype}"
            assert buf.nbytes == spec.total_bytes(size)
        assert sum(b.nbytes for b in buffers.values()) == kv_layout.total_bytes(sizes)

    def test_kv_size_bytes_counts_every_buffer(self, kv_pool):
        reported = kv_pool.get_kv_size_bytes()
        reported = sum(reported) if isinstance(reported, tuple) else reported
        buffers = kv_pool.buffers()
        states = kv_pool.request_state_buffers()  # per-request state: reported apart (get_state_buf_infos)
        unknown = sorted(set(states) - set(buffers))
        assert not unknown, f"request_state_buffers() names {unknown}, which buffers() does not"
        assert reported + sum(b.nbytes for b in states.values()) == sum(b.nbytes for b in buffers.values())

    def test_store_dtype_is_what_the_kv_buffers_hold(self, kv_pool):
        """``store_dtype`` is the dtype of every buffer holding K/V rows (:meth:`~kvcore.pools.KVCache.token_buffers`
        but the per-request state), which engines view those buffers with; an fp8 cache is stored as uint8."""
        if kv_pool.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            assert kv_pool.store_dtype == torch.uint8, f"an {kv_pool.dtype} pool has store_dtype {kv_pool.store_dtype}"
        states = kv_pool.request_state_buffers()
        held = {name: buf.dtype for name, buf in kv_pool.token_buffers().items() if name not in states}
        if not held:  # a pool that keeps no rows per token (the no-op pool's placeholders): its buffers, then
            held = {name: buf.dtype for name, buf in kv_pool.buffers().items() if name not in states}
        assert held, "the pool names no buffer of K/V rows (token_buffers() and buffers() are empty)"
        wrong = {name: dtype for name, dtype in held.items() if dtype != kv_pool.store_dtype}
        assert not wrong, f"store_dtype is {kv_pool.store_dtype}, but the K/V buffers hold {wrong}"


class BaseStoreTests(_Base):
    @pytest.mark.parametrize("n", [1, 5, 17])
    @pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
    def test_round_trip_only_target_rows_change(self, kv_pool, kv_capabilities, kv_writer, generator, n, index_dtype):
        self.need(kv_capabilities, "store")
        randomize(kv_pool, generator)
        before = {name: buf.clone() for name, buf in kv_pool.buffers().items()}
        layer = kv_pool.token_layers()[-1]  # the last layer catches per-layer offset mistakes
        loc = self.free_slots(kv_pool, n, generator).to(index_dtype)
        token_rows = kv_pool.token_rows()
        local = {name: kv_pool.layer_in_buffer(name, layer) for name in token_rows}
        old_rows = {name: rows.take(loc, local[name]) for name, rows in token_rows.items() if local[name] is not None}
        expected = kv_writer(kv_pool, layer, loc, generator)
        assert expected, "kv_writer returned no buffers"
        unknown = sorted(set(expected) - set(old_rows))
        assert not unknown, f"kv_writer returned rows of {unknown}, which token_rows() does not name for layer {layer}"
        what = f"writing {n} rows of layer {layer}"
        for name, rows in expected.items():
            assert_same_bytes(token_rows[name].take(loc, local[name]), rows, f"{name} rows after {what}")
        # Nothing else may change: with the old rows put back, every buffer is as before.
        for name in expected:
            rows = token_rows[name]
            rows.rows[local[name], rows.row_of(loc).long()] = old_rows[name]
        for name, buf in kv_pool.buffers().items():
            assert_same_bytes(buf, before[name], f"buffer {name} outside the written rows after {what}")

    def test_padding_page_untouched(self, kv_pool, kv_capabilities, kv_writer, generator):
        self.need(kv_capabilities, "store")
        randomize(kv_pool, generator)
        padding_tokens = torch.arange(kv_pool.page_size, device=kv_pool.device)
        padding = {name: rows.take(padding_tokens) for name, rows in kv_pool.token_rows().items()}
        for layer in kv_pool.token_layers():
            kv_writer(kv_pool, layer, self.free_slots(kv_pool, 8, generator), generator)
        for name, rows in kv_pool.token_rows().items():
            assert_same_bytes(rows.take(padding_tokens), padding[name], f"padding page of buffer {name}")

    def test_a_deep_copy_stores_in_its_own_buffers(self, kv_pool, kv_capabilities, kv_writer, generator):
        """``copy.deepcopy`` of a pool (a cache copied to reuse a prompt) holds buffers of its own: the same bytes,
        and a write to either lands in that one alone (kernels that keep their buffers' addresses work them out
        again in the copy: :mod:`kvcore.kernels.addresses`)."""
        self.need(kv_capabilities, "store")
        randomize(kv_pool, generator)
        layer = kv_pool.token_layers()[-1]
        kv_writer(kv_pool, layer, self.free_slots(kv_pool, 3, generator), generator)  # its kernels have launched
        twin = copy.deepcopy(kv_pool)
        kept = addresses_kept(twin, kv_pool)
        assert not kept, f"the copy keeps addresses of the original's memory, at {', '.join(kept[:4])}"
        for name, buf in twin.buffers().items():
            assert buf.data_ptr() != kv_pool.buffers()[name].data_ptr(), f"the copy shares buffer {name}"
            assert_same_bytes(buf, kv_pool.buffers()[name], f"buffer {name} of the copy")
        for target, other, what in ((twin, kv_pool, "the copy"), (kv_pool, twin, "the original")):
            untouched = {name: buf.clone() for name, buf in other.buffers().items()}
            loc = self.free_slots(target, 5, generator)
            expected = kv_writer(target, layer, loc, generator)
            token_rows = target.token_rows()
            for name, rows in expected.items():
                at = target.layer_in_buffer(name, layer)
                assert_same_bytes(token_rows[name].take(loc, at), rows, f"{name} rows written to {what}")
            for name, buf in other.buffers().items():
                assert_same_bytes(buf, untouched[name], f"buffer {name} after a write to {what}")

    @pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")
    def test_layer_object_with_layer_id_and_offset_layers(self, kv_pool_factory, kv_pool_size, kv_page_size, kv_writer,
                                                          generator, kv_capabilities):  # fmt: skip
        self.need(kv_capabilities, "store")
        try:
            pool = kv_pool_factory(size=kv_pool_size, page_size=kv_page_size, start_layer=5)
        except ConfigError as exc:  # a model whose config describes each of its own layers, and no layer past them
            pytest.skip(f"the model describes no layers 5.. of a later pipeline stage ({exc}); check with a model "
                        "config that does")  # fmt: skip
        assert pool.start_layer == 5 and pool.end_layer == 5 + pool.layer_num - 1
        randomize(pool, generator)
        loc = self.free_slots(pool, 3, generator)
        last = pool.token_layers()[-1]
        expected = kv_writer(pool, last, loc, generator)
        token_rows = pool.token_rows()
        for name, rows in expected.items():
            at = pool.layer_in_buffer(name, last)
            assert_same_bytes(token_rows[name].take(loc, at), rows, f"buffer {name}, global layer {last}")
        # an attention module (anything with an int layer_id) addresses the same layer as its id
        by_object, by_id = pool.get_key_buffer(_LayerObject(last)), pool.get_key_buffer(last)
        assert_same_bytes(by_object, by_id, f"get_key_buffer of a layer object with layer_id={last}")
        with pytest.raises(IndexError, match="layer"):
            pool.get_key_buffer(pool.start_layer - 1)
        with pytest.raises(IndexError, match="layer"):
            pool.get_key_buffer(pool.end_layer + 1)


class BaseMoveTests(_Base):
    @pytest.mark.parametrize("pattern", ["disjoint", "shift", "swap", "cycle", "identity"])
    def test_move_matches_gather_then_scatter(self, kv_pool, kv_capabilities, generator, pattern):
        self.need(kv_capabilities, "move")
        randomize(kv_pool, generator)
        n = 9
        if pattern == "disjoint":  # one draw, so sources and targets never share a slot
            base = self.free_slots(kv_pool, 2 * n, generator)
            src, tgt = base[:n], base[n:]
        else:
            base = self.free_slots(kv_pool, n + 1, generator)
            src = base[:n]
            tgt = {
                "shift": base[1 : n + 1],
                "swap": src.view(-1, 1)[: n - 1].view(-1, 2).flip(1).reshape(-1),
                "cycle": src.roll(1),
                "identity": src,
            }[pattern]
            src = src[: tgt.numel()]
        what = f"a {pattern} move of {src.numel()} slots"
        before = {name: buf.clone() for name, buf in kv_pool.buffers().items()}
        token_rows = kv_pool.token_rows()  # views, possibly several of one buffer (a page's keys and scales)
        sources = {name: rows.take(src) for name, rows in token_rows.items()}
        old_targets = {name: rows.take(tgt) for name, rows in token_rows.items()}
        kv_pool.move_kv_cache(tgt, src)
        for name, rows in token_rows.items():
            assert_same_bytes(rows.take(tgt), sources[name], f"{name} rows of the targets after {what}")
        # Nothing else may change: with the targets' old rows put back, every buffer is as before.
        for name, rows in token_rows.items():
            rows.rows[:, rows.row_of(tgt)] = old_targets[name]
        for name, buf in kv_pool.buffers().items():
            assert_same_bytes(buf, before[name], f"buffer {name} outside the targets' rows after {what}")

    def test_empty_move_is_a_no_op(self, kv_pool, kv_capabilities, generator):
        self.need(kv_capabilities, "move")
        randomize(kv_pool, generator)
        before = {name: buf.clone() for name, buf in kv_pool.buffers().items()}
        empty = torch.empty(0, dtype=torch.int64, device=kv_pool.device)
        kv_pool.move_kv_cache(empty, empty)
        for name, buf in kv_pool.buffers().items():
            assert_same_bytes(buf, before[name], f"buffer {name} after an empty move")


class BaseCpuCopyTests(_Base):
    @pytest.mark.parametrize("chunk", [3, 8192])
    def test_cpu_copy_round_trip(self, kv_pool, kv_capabilities, generator, chunk):
        self.need(kv_capabilities, "cpu_offload")
        kv_pool.cpu_offloading_chunk_size = chunk
        randomize(kv_pool, generator)
        src, dst = self.free_slots(kv_pool, 20, generator).split(10)
        saved = {name: rows.take(src) for name, rows in kv_pool.token_rows().items()}
        copy = kv_pool.get_cpu_copy(src)
        randomize(kv_pool, generator)  # the copy must not alias device memory
        kv_pool.load_cpu_copy(copy, dst)
        for name, rows in kv_pool.token_rows().items():
            assert_same_bytes(rows.take(dst), saved[name], f"buffer {name} rows loaded back from the CPU copy")

    def test_cpu_copy_accepts_the_retraction_keywords(self, kv_pool, kv_capabilities, generator):
        """SGLang's retraction path passes ``mamba_indices=`` and ``req_pool_index=``; a pool without
        per-request state accepts and ignores them."""
        self.need(kv_capabilities, "cpu_offload")
        randomize(kv_pool, generator)
        src, dst = self.free_slots(kv_pool, 8, generator).split(4)
        saved = {name: rows.take(src) for name, rows in kv_pool.token_rows().items()}
        copy = kv_pool.get_cpu_copy(src, mamba_indices=None, req_pool_index=None)
        kv_pool.load_cpu_copy(copy, dst, mamba_indices=None, req_pool_index=None)
        for name, rows in kv_pool.token_rows().items():
            assert_same_bytes(rows.take(dst), saved[name], f"buffer {name} rows after a copy with retraction keywords")


class BaseBufferInfoTests(_Base):
    def test_contiguous_buf_infos_match_buffers(self, kv_pool, kv_capabilities, kv_layout):
        """Per layer of every token buffer: its pointer, its bytes, and the bytes of one page of it (an item
        for transfer engines), whatever the buffer keeps in a row (a token, or a whole page)."""
        self.need(kv_capabilities, "buffer_infos")
        ptrs, lens, item_lens = kv_pool.get_contiguous_buf_infos()
        declared = kv_layout.by_name()
        expected = [(name, layer) for name, buf in kv_pool.token_buffers().items() for layer in buf.unbind(0)]
        assert len(ptrs) == len(lens) == len(item_lens) == len(expected), (
            f"{len(ptrs)} buffer infos for {len(expected)} layers of the token buffers {sorted(kv_pool.token_buffers())}")
        for i, (name, layer) in enumerate(expected):
            assert ptrs[i] == layer.data_ptr(), f"buffer info {i} ({name}): pointer is not the layer's"
            assert lens[i] == layer.nbytes, f"buffer info {i} ({name}): {lens[i]} bytes, the layer has {layer.nbytes}"
            spec = declared.get(name)
            tokens_per_row = spec.tokens_per_row if spec is not None else 1
            page = layer[0].nbytes * kv_pool.page_size // tokens_per_row
            assert item_lens[i] == page, f"buffer info {i} ({name}): item of {item_lens[i]} bytes, a page is {page}"
            assert lens[i] % item_lens[i] == 0, "a layer must hold whole pages"


class BaseLossyTests(_Base):
    """For pools declaring :data:`LOSSY`: values written through the family's write path
    (``pool.self_test_values(layer, loc, generator) -> {part: float values written}``) read back
    (``pool.read_values(layer, loc) -> {part: float values}``) within ``pool.lossy_bound``, the relative RMS
    error the pool states, and nothing else in its buffers changes.  The protocol (what each member returns, and
    who calls it) is documented on :class:`kvcore.pools.KVCache`, under "Lossy pools"."""

    @pytest.mark.parametrize("n", [3, 17])
    def test_round_trip_within_the_stated_bound(self, kv_pool, kv_capabilities, generator, n):
        self.need(kv_capabilities, LOSSY)
        bound = float(kv_pool.lossy_bound)
        randomize(kv_pool, generator, kv_pool.token_buffers())  # per-layer constants (global scales) stay valid
        before = {name: buf.clone() for name, buf in kv_pool.buffers().items()}
        rows_before = {name: rows.rows.clone() for name, rows in kv_pool.token_rows().items()}  # views, by row name
        layer = kv_pool.token_layers()[-1]
        loc = self.free_slots(kv_pool, n, generator)
        written = kv_pool.self_test_values(layer, loc, generator)
        read = kv_pool.read_values(layer, loc)
        assert written and set(read) == set(written), f"read_values gave {sorted(read)}, the write {sorted(written)}"
        for part, values in written.items():
            got, want = read[part].float().cpu(), values.float().cpu()
            assert got.shape == want.shape, f"{part}: read {tuple(got.shape)}, wrote {tuple(want.shape)}"
            error = ((got - want).norm() / want.norm()).item()
            assert error <= bound, f"{part}: relative RMS error {error:.4f} of a round trip exceeds the stated {bound}"
        # Nothing else may change: with the written rows put back, every buffer is as before.
        for name, rows in kv_pool.token_rows().items():
            at = kv_pool.layer_in_buffer(name, layer)
            if at is not None:
                rows.rows[at, rows.row_of(loc).long()] = rows_before[name][at, rows.row_of(loc).long()]
        for name, buf in kv_pool.buffers().items():
            assert_same_bytes(buf, before[name], f"buffer {name} outside the written rows after a lossy write")


class KVCacheConformance(BaseLayoutTests, BaseStoreTests, BaseMoveTests, BaseCpuCopyTests, BaseBufferInfoTests):
    """Every conformance test; subclass it and provide the fixtures named in the module docstring."""


class LossyKVCacheConformance(KVCacheConformance, BaseLossyTests):
    """Every conformance test and the lossy round trip, for pools that store values lossily (quantized
    caches): it declares :data:`LOSSY` besides the default capabilities."""

    @pytest.fixture
    def kv_capabilities(self):
        return set(CAPABILITIES) | {LOSSY}

