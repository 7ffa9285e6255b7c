"""``kvcore.testing.tensors.addresses_kept``, the deep-copy check of the pools', allocators' and cache's tests: it
reports a raw address of the original's memory that a copy kept, and nothing a copy shares by design."""

import copy

import torch

from kvcore.kernels.addresses import shared_by_copies
from kvcore.testing.tensors import addresses_kept


class _Buffers:
    """Owns a tensor and the raw address kernels launch with; ``rebind`` makes a copy's address its own."""

    def __init__(self, rebind: bool):
        self.buffer = torch.zeros(64, dtype=torch.uint8)
        self.rebind = rebind
        self.ptrs = [self.buffer.data_ptr() + 16]

    def __deepcopy__(self, memo):
        twin = object.__new__(_Buffers)
        memo[id(self)] = twin
        twin.__dict__.update(copy.deepcopy(self.__dict__, memo))
        if self.rebind:
            twin.ptrs = [twin.buffer.data_ptr() + 16]
        return twin


class _Record:
    """A frozen record copies share, holding an int that may equal an address of the original's by chance."""

    __deepcopy__ = shared_by_copies

    def __init__(self, count: int):
        self.count = count


def test_a_copy_that_keeps_the_originals_address_is_reported():
    original = {"pool": _Buffers(rebind=False)}
    assert addresses_kept(copy.deepcopy(original), original) == ["copy['pool'].ptrs[0]"]


def test_a_copy_with_its_own_addresses_is_clean():
    original = {"pool": _Buffers(rebind=True)}
    twin = copy.deepcopy(original)
    assert twin["pool"].ptrs[0] != original["pool"].ptrs[0]
    assert addresses_kept(twin, original) == []


def test_an_int_in_a_record_copies_share_is_not_an_address_kept():
    """A shared plan's byte count that lands in the original's memory is the original's and the copy's alike."""
    pool = _Buffers(rebind=True)
    original = {"pool": pool, "plan": _Record(pool.buffer.data_ptr() + 8)}
    twin = copy.deepcopy(original)
    assert twin["plan"] is original["plan"]
    assert addresses_kept(twin, original) == []
    # the same int in an object the copy owns is reported
    original["owned"] = [pool.buffer.data_ptr() + 8]
    assert addresses_kept(copy.deepcopy(original), original) == ["copy['owned'][0]"]
