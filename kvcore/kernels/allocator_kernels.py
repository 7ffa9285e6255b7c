"""Index arithmetic for paged KV allocation: Triton kernels and their torch references.

Three operations (``alloc_pages``, ``alloc_extend``, ``alloc_decode``), each with a Triton version
(``*_triton``, one kernel launch, no host sync, launched directly: :mod:`kvcore.kernels.launch`) and a vectorised torch
version (``*_native``, any device, used on the CPU and as the reference the kernels are tested against).  Both
versions of an operation take the same arguments, return the same tensor and mark the same pages allocated.

Conventions (shared with :mod:`kvcore.allocators`):

* token index of offset ``o`` in page ``p`` is ``p * page_size + o``;
* new pages come from a :class:`kvcore.kernels.free_list.PageSource` (the allocator's free list, a ring on the device):
  the ``r``-th new page of a call is the page ``r`` places after the ring's head, in request order.  The
  functions mark those pages ALLOCATED in the source's page states; ``alloc_pages`` and ``alloc_extend`` move
  nothing else (the caller, who knows how many pages they take, records it:
  :meth:`kvcore.kernels.free_list.FreePageList.took`), ``alloc_decode`` counts its pages itself and moves the ring's
  head by them on the device (:meth:`kvcore.kernels.free_list.FreePageList.decode_source`);
* ``last_loc[i]`` is the token index of request ``i``'s last prefix token; it is only read when the prefix
  ends inside a page (``prefix_lens[i] % page_size != 0``), otherwise any value (``-1`` by habit) will do.

``alloc_extend``: request ``i`` gets locations for its tokens ``prefix_lens[i] .. seq_lens[i]-1``: first the
rest of its partially filled last page (``last_loc[i] + 1, + 2, ...``), then whole new pages, then the tail in
one more new page.  Outputs are concatenated in request order.  Request ``i`` uses
``ceil(seq_lens[i] / page_size) - ceil(prefix_lens[i] / page_size)`` new pages.

``alloc_decode``: ``seq_lens`` already counts the token being decoded.  Request ``i`` takes a new page iff
``(seq_lens[i] - 1) % page_size == 0`` and its location is then ``new_page * page_size``; otherwise it is
``last_loc[i] + 1``.  One program walks the requests in blocks (the count of pages taken is a running sum).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kvcore.kernels.free_list import ALLOCATED, TAKEN_BIAS, PageSource
from kvcore.kernels.launch import KernelArgs, Plan, cdiv, launcher_for

__all__ = [
    "alloc_pages_native",
    "alloc_pages_triton",
    "alloc_extend_native",
    "alloc_extend_triton",
    "alloc_decode_native",
    "alloc_decode_triton",
    "DecodeStep",
    "ExtendStep",
    "extend_counts",
    "num_new_pages_extend",
    "num_new_pages_decode",
]

# Fixed block sizes: the kernels loop over earlier requests / over a request's tokens in blocks of these, so
# neither batch size nor prompt length triggers a recompile (only the page size, a constexpr, does).
_BS_BLOCK = 256
_TOKEN_BLOCK = 256


# --------------------------------------------------------------------------------------------------------
# Page counting
# --------------------------------------------------------------------------------------------------------


def _host_array(x):
    """A CPU tensor as a numpy view (numpy arithmetic on a few hundred ints costs far less host time than
    torch's CPU dispatch); anything else is returned as it is."""
    if isinstance(x, torch.Tensor) and x.device.type == "cpu" and not x.requires_grad:
        return x.numpy()
    return x


#: CPU batches up to this many requests are counted on their Python lists, larger ones through numpy views (each
#: is the cheaper on its side: on the CPU, 0.7 against 5.8 us for 1 request, 36 against 6.3 us for 256)
_LIST_COUNT_MAX = 32


def extend_counts(prefix_lens_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, page_size: int) -> tuple[int, int]:
    """``(tokens, new pages)`` of an extend, from the CPU copies of its lengths, in one pass:
    ``sum(seq - prefix)`` and ``sum(ceil(seq/ps) - ceil(prefix/ps))`` (what the allocator checks the caller's
    token count against, and takes).  Never touches a device."""
    if prefix_lens_cpu.numel() <= _LIST_COUNT_MAX and not prefix_lens_cpu.requires_grad:
        tokens = pages = 0
        for pre, seq in zip(prefix_lens_cpu.tolist(), seq_lens_cpu.tolist()):
            tokens += seq - pre
            pages += (seq + page_size - 1) // page_size - (pre + page_size - 1) // page_size
        return int(tokens), int(pages)
    pre, seq = _host_array(prefix_lens_cpu), _host_array(seq_lens_cpu)
    tokens = int((seq - pre).sum())
    if page_size == 1:
        return tokens, tokens
    return tokens, int(((seq + (page_size - 1)) // page_size - (pre + (page_size - 1)) // page_size).sum())


def num_new_pages_extend(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> int:
    """Total new pages an extend needs: ``sum(ceil(seq/ps) - ceil(prefix/ps))``.

    Syncs with the device when the tensors live on one; pass CPU copies on the hot path.
    """
    pre, seq = _host_array(prefix_lens), _host_array(seq_lens)
    if page_size == 1:
        return int((seq - pre).sum())
    return int(((seq + (page_size - 1)) // page_size - (pre + (page_size - 1)) // page_size).sum())


def num_new_pages_decode(seq_lens: torch.Tensor, page_size: int) -> int:
    """New pages a decode step needs: how many requests' new token opens a page (``seq % page_size == 1``).

    Syncs with the device when ``seq_lens`` lives on one; pass a CPU copy on the hot path (counted through a
    numpy view: it runs every decode step, and numpy on a few hundred ints costs a fraction of torch's
    dispatch).
    """
    if page_size == 1:
        return seq_lens.numel()
    if not seq_lens.is_cpu:
        return int(((seq_lens - 1) % page_size == 0).sum())
    seq = seq_lens.numpy()
    if page_size & (page_size - 1) == 0:  # a power of two: a mask instead of a division
        return int(np.count_nonzero((seq & (page_size - 1)) == 1))
    return int(np.count_nonzero(seq % page_size == 1))


_PAGES_BLOCK = 1024


def _launch(binding: KernelArgs, grid: int, inputs: tuple, buffers: tuple, scalars: tuple, key: tuple) -> None:
    """``kernel[grid](*inputs, *buffers, *scalars)`` through the direct launcher (``scalars``: the runtime ones,
    then the constexprs, in the binding's order).  The key adds what Triton specializes the caller's ``inputs``
    on (dtype, 16-byte alignment) to ``key``, which names the specialized runtime ints (the launcher adds the
    constexprs and the warps); ``buffers`` are the source's and the output, always int64 / int32 and freshly
    allocated (aligned).

    Plain loops, no generators: this runs on every allocation, and each generator costs a fraction of a
    microsecond of host time."""
    tensors, addresses, meta = [], [], list(key)
    for t in inputs:
        if not t.is_contiguous():
            t = t.contiguous()  # the kernels read them as flat arrays
        p = t.data_ptr()
        tensors.append(t)
        addresses.append(p)
        meta.append(t.dtype)
        meta.append(p % 16 == 0)
    for t in buffers:
        tensors.append(t)
        addresses.append(t.data_ptr())
    launcher_for(binding, buffers[0].device)(tuple(meta), grid, 1, (*addresses, *scalars), tensors)


def _check_source(pages: PageSource, *tensors: torch.Tensor) -> None:
    device = pages.ring.get_device()
    for t in tensors:
        if t.get_device() != device:
            raise ValueError(f"allocation inputs must be on the allocator's device {pages.ring.device}, got {t.device}")


@triton.jit
def _page_at(ring_ptr, ctl_ptr, taken, rank, cap, BIAS: tl.constexpr):
    """The page ``rank`` places after the ring's head (``rank`` may be a block)."""
    head = ((taken - BIAS - tl.load(ctl_ptr)) % cap + cap) % cap
    return tl.load(ring_ptr + ((head + rank) % cap + cap) % cap)


def _pages_native(pages: PageSource, rank: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``_page_at``; ``rank`` entries past the source's pages are unspecified (any page)."""
    head = (pages.taken - pages.ctl[0]) % pages.capacity
    return pages.ring[(head + rank) % pages.capacity]


def _mark_allocated_native(pages: PageSource, page: torch.Tensor, mask: torch.Tensor) -> None:
    pages.state[torch.where(mask, page, pages.state.numel() - 1)] = ALLOCATED


# --------------------------------------------------------------------------------------------------------
# alloc_pages: whole pages
# --------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["n_tokens", "taken"])
def _alloc_pages_kernel(ring_ptr, ctl_ptr, state_ptr, out_ptr, n_tokens, taken, cap,
                        PAGE_SIZE: tl.constexpr, BIAS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n_tokens
    page = _page_at(ring_ptr, ctl_ptr, taken, i // PAGE_SIZE, cap, BIAS)
    tl.store(out_ptr + i, page * PAGE_SIZE + i % PAGE_SIZE, mask=mask)
    tl.store(state_ptr + page, tl.full([BLOCK], 2147483647, tl.int32), mask=mask & (i % PAGE_SIZE == 0))


#: the kernel's argument list (:class:`kvcore.kernels.launch.KernelArgs`; ``*_ptr`` parameters passed as addresses)
_PAGES_ARGS = KernelArgs(_alloc_pages_kernel, "ring_ptr ctl_ptr state_ptr out_ptr n_tokens taken cap",
                         "PAGE_SIZE BIAS BLOCK")  # fmt: skip


def alloc_pages_triton(pages: PageSource, num_pages: int, page_size: int) -> torch.Tensor:
    """The token indices of the ``num_pages`` pages at the head, page after page (one launch).

    :returns: int64 ``[num_pages * page_size]`` on the source's device.
    """
    n = num_pages * page_size
    out = pages.ring.new_empty(n)  # int64 on its device, less host time than torch.empty (probe_alloc_step.py)
    if n:
        constexprs = _PAGES_ARGS.constexprs(PAGE_SIZE=page_size, BIAS=TAKEN_BIAS, BLOCK=_PAGES_BLOCK)
        _launch(_PAGES_ARGS, cdiv(n, _PAGES_BLOCK), (), (pages.ring, pages.ctl, pages.state, out),
                (n, pages.taken + TAKEN_BIAS, pages.capacity, *constexprs), (pages.capacity,))  # fmt: skip
    return out


def alloc_pages_native(pages: PageSource, num_pages: int, page_size: int) -> torch.Tensor:
    """Torch reference of :func:`alloc_pages_triton`."""
    device = pages.ring.device
    page = _pages_native(pages, torch.arange(num_pages, device=device))
    _mark_allocated_native(pages, page, torch.ones_like(page, dtype=torch.bool))
    return (page[:, None] * page_size + torch.arange(page_size, device=device)).reshape(-1)


# --------------------------------------------------------------------------------------------------------
# alloc_extend
# --------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["taken"])
def _alloc_extend_kernel(
    prefix_lens_ptr,
    seq_lens_ptr,
    last_loc_ptr,
    ring_ptr,
    ctl_ptr,
    state_ptr,
    out_ptr,
    taken,
    cap,
    PAGE_SIZE: tl.constexpr,
    BIAS: tl.constexpr,
    BS_BLOCK: tl.constexpr,
    TOKEN_BLOCK: tl.constexpr,
):
    # One program per request.  Its output offset and its first new page are exclusive prefix sums, over
    # the earlier requests, of the extend lengths and of the new-page counts.
    pid = tl.program_id(0)
    bs_offs = tl.arange(0, BS_BLOCK)
    acc_tokens = tl.zeros([BS_BLOCK], dtype=tl.int64)
    acc_pages = tl.zeros([BS_BLOCK], dtype=tl.int64)
    for start in range(0, pid, BS_BLOCK):
        idx = start + bs_offs
        mask = idx < pid
        pre = tl.load(prefix_lens_ptr + idx, mask=mask, other=0).to(tl.int64)
        seq = tl.load(seq_lens_ptr + idx, mask=mask, other=0).to(tl.int64)
        acc_tokens += seq - pre
        acc_pages += (seq + PAGE_SIZE - 1) // PAGE_SIZE - (pre + PAGE_SIZE - 1) // PAGE_SIZE
    out_start = tl.sum(acc_tokens, axis=0)
    page_start = tl.sum(acc_pages, axis=0)

    pre = tl.load(prefix_lens_ptr + pid).to(tl.int64)
    seq = tl.load(seq_lens_ptr + pid).to(tl.int64)
    last = tl.load(last_loc_ptr + pid).to(tl.int64)
    pre_pages = (pre + PAGE_SIZE - 1) // PAGE_SIZE
    boundary = pre_pages * PAGE_SIZE  # first token that lands in a new page
    num_tokens = (seq - pre).to(tl.int32)

    tok_offs = tl.arange(0, TOKEN_BLOCK)
    for tstart in range(0, num_tokens, TOKEN_BLOCK):
        j = (tstart + tok_offs).to(tl.int64)
        mask = j < num_tokens
        t = pre + j  # token position in the sequence
        new_page = mask & (t >= boundary)
        page = tl.where(new_page, _page_at(ring_ptr, ctl_ptr, taken, page_start + t // PAGE_SIZE - pre_pages, cap,
                                           BIAS), 0)  # fmt: skip
        loc = tl.where(new_page, page * PAGE_SIZE + t % PAGE_SIZE, last + 1 + j)
        tl.store(out_ptr + out_start + j, loc, mask=mask)
        tl.store(state_ptr + page, tl.full([TOKEN_BLOCK], 2147483647, tl.int32), mask=new_page & (t % PAGE_SIZE == 0))


#: the kernel's argument list (:class:`kvcore.kernels.launch.KernelArgs`; ``*_ptr`` parameters passed as addresses)
_EXTEND_ARGS = KernelArgs(
    _alloc_extend_kernel, "prefix_lens_ptr seq_lens_ptr last_loc_ptr ring_ptr ctl_ptr state_ptr out_ptr taken cap",
    "PAGE_SIZE BIAS BS_BLOCK TOKEN_BLOCK",
)


def _check_extend_args(prefix_lens, seq_lens, last_loc):
    if not (prefix_lens.dim() == seq_lens.dim() == last_loc.dim() == 1):
        raise ValueError(
            "alloc_extend takes 1-D prefix_lens, seq_lens and last_loc (one entry per request), got shapes "
            f"{tuple(prefix_lens.shape)}, {tuple(seq_lens.shape)}, {tuple(last_loc.shape)}"
        )
    if not (prefix_lens.numel() == seq_lens.numel() == last_loc.numel()):
        raise ValueError(
            "alloc_extend needs prefix_lens, seq_lens and last_loc of one length (the batch size), got "
            f"{prefix_lens.numel()}, {seq_lens.numel()}, {last_loc.numel()}"
        )


def alloc_extend_triton(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    pages: PageSource,
    page_size: int,
    extend_num_tokens: int,
) -> torch.Tensor:
    """Token locations for an extend batch, in one Triton launch (see the module docstring).

    :param prefix_lens: ``[bs]`` integer tokens already cached per request.
    :param seq_lens: ``[bs]`` integer sequence lengths after the extend.
    :param last_loc: ``[bs]`` integer token index of each request's last prefix token.
    :param pages: where new pages come from; must hold at least the pages the batch needs (not checked here).
    :param page_size: tokens per page.
    :param extend_num_tokens: ``sum(seq_lens - prefix_lens)``, known by the caller without a sync.
    :returns: int64 ``[extend_num_tokens]`` on the source's device.
    """
    _check_extend_args(prefix_lens, seq_lens, last_loc)
    _check_source(pages, prefix_lens, seq_lens, last_loc)
    out = pages.ring.new_empty(extend_num_tokens)
    bs = prefix_lens.numel()
    if bs == 0 or extend_num_tokens == 0:
        return out
    constexprs = _EXTEND_ARGS.constexprs(PAGE_SIZE=page_size, BIAS=TAKEN_BIAS, BS_BLOCK=_BS_BLOCK,
                                         TOKEN_BLOCK=_TOKEN_BLOCK)  # fmt: skip
    _launch(_EXTEND_ARGS, bs, (prefix_lens, seq_lens, last_loc), (pages.ring, pages.ctl, pages.state, out),
            (pages.taken + TAKEN_BIAS, pages.capacity, *constexprs), (pages.capacity,))  # fmt: skip
    return out


def alloc_extend_native(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    pages: PageSource,
    page_size: int,
    extend_num_tokens: int,
) -> torch.Tensor:
    """Torch reference of :func:`alloc_extend_triton` (same arguments, same result, no host sync)."""
    _check_extend_args(prefix_lens, seq_lens, last_loc)
    device = pages.ring.device
    bs = prefix_lens.numel()
    if bs == 0 or extend_num_tokens == 0:
        return torch.empty((extend_num_tokens,), dtype=torch.int64, device=device)
    pre = prefix_lens.to(device=device, dtype=torch.int64)
    seq = seq_lens.to(device=device, dtype=torch.int64)
    last = last_loc.to(device=device, dtype=torch.int64)

    ext = seq - pre
    out_start = torch.cumsum(ext, 0) - ext
    pre_pages = (pre + (page_size - 1)) // page_size
    new_pages = (seq + (page_size - 1)) // page_size - pre_pages
    page_start = torch.cumsum(new_pages, 0) - new_pages

    req = torch.repeat_interleave(
        torch.arange(bs, device=device), ext, output_size=extend_num_tokens
    )  # request of each output slot
    j = torch.arange(extend_num_tokens, device=device) - out_start[req]  # rank inside its request
    t = pre[req] + j  # token position in its sequence
    new_page = t >= pre_pages[req] * page_size
    page = _pages_native(pages, page_start[req] + t // page_size - pre_pages[req])
    _mark_allocated_native(pages, page, new_page & (t % page_size == 0))
    return torch.where(new_page, page * page_size + t % page_size, last[req] + 1 + j)


class _ListStep:
    """What :class:`ExtendStep` and :class:`DecodeStep` keep of one free list: the list, its page size, the kernel
    mode, and (Triton) the launcher of the subclass's ``_binding`` and a :class:`~kvcore.kernels.launch.Plan` per
    kind of inputs (their dtypes and alignments: a handful), whose constexprs are fixed at creation."""

    __slots__ = ("pages", "page_size", "use_triton", "_launch", "_device_index", "_key", "_constexprs", "_plans")
    _binding: KernelArgs

    def __init__(self, pages, page_size: int, use_triton: bool):
        self.pages, self.page_size, self.use_triton = pages, page_size, use_triton
        self._launch = launcher_for(self._binding, pages.device) if use_triton else None
        self._device_index = pages.ring.get_device()
        self._key = (pages.capacity,)  # what Triton specializes on besides the inputs (the launcher adds the rest)
        self._constexprs = self._constexpr_values(page_size)
        self._plans: dict[tuple, Plan] = {}

    @staticmethod
    def _constexpr_values(page_size: int) -> tuple:
        raise NotImplementedError

    def _plan(self, inputs: tuple) -> Plan:
        """The plan of inputs of one kind (``inputs``: their dtypes and 16-byte alignments): a program per
        request or per call, as the subclass launches it."""
        plan = self._plans.get(inputs)
        if plan is None:
            plan = self._plans[inputs] = Plan(self._launch, (*self._key, *inputs), 1, (1, 1), 4,
                                              constexprs=self._constexprs)  # fmt: skip
        return plan


class ExtendStep(_ListStep):
    """``alloc_extend`` of one free list, as an allocator runs it for every prefill: :func:`alloc_extend_triton`
    (``use_triton``) or :func:`alloc_extend_native` on the list's pages, the caller recording the pages taken
    (:meth:`kvcore.kernels.free_list.FreePageList.took`).

    Like :class:`DecodeStep`, the Triton path works out once what stays fixed (the launcher, the launch key's
    fixed part) and reads the list's buffer addresses and the tuning constants per call: a call costs the input
    checks, one allocation and one direct launch (:func:`alloc_extend_triton`, which builds its source and key
    each call, is kept for tests and tools).

    :param pages: the allocator's :class:`~kvcore.kernels.free_list.FreePageList` (kept: its buffers may be copied
        after a snapshot, its object stays).
    :param page_size: tokens per page.
    """

    __slots__ = ()
    _binding = _EXTEND_ARGS

    @staticmethod
    def _constexpr_values(page_size: int) -> tuple:
        return _EXTEND_ARGS.constexprs(PAGE_SIZE=page_size, BIAS=TAKEN_BIAS, BS_BLOCK=_BS_BLOCK, TOKEN_BLOCK=_TOKEN_BLOCK)

    def __call__(self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor,
                 extend_num_tokens: int) -> torch.Tensor:  # fmt: skip
        """The extend's locations (int64 ``[extend_num_tokens]``); the list must hold the pages the batch needs
        (the caller checks, and records them as taken)."""
        pages = self.pages
        pages.before_write()
        if not self.use_triton:
            return alloc_extend_native(prefix_lens, seq_lens, last_loc, pages.source(), self.page_size,
                                       extend_num_tokens)  # fmt: skip
        bs = prefix_lens.numel()
        if (prefix_lens.dim() != 1 or seq_lens.dim() != 1 or last_loc.dim() != 1 or seq_lens.numel() != bs
                or last_loc.numel() != bs):  # fmt: skip
            _check_extend_args(prefix_lens, seq_lens, last_loc)
        device = self._device_index
        if prefix_lens.get_device() != device or seq_lens.get_device() != device or last_loc.get_device() != device:
            raise ValueError(
                f"allocation inputs must be on the allocator's device {pages.device}, got prefix_lens on "
                f"{prefix_lens.device}, seq_lens on {seq_lens.device} and last_loc on {last_loc.device}"
            )
        out = pages.ring.new_empty(extend_num_tokens)
        if bs == 0 or extend_num_tokens == 0:
            return out
        if not prefix_lens.is_contiguous():
            prefix_lens = prefix_lens.contiguous()
        if not seq_lens.is_contiguous():
            seq_lens = seq_lens.contiguous()
        if not last_loc.is_contiguous():
            last_loc = last_loc.contiguous()
        pre, seq, last = prefix_lens.data_ptr(), seq_lens.data_ptr(), last_loc.data_ptr()
        ring, _, _, ctl, state, _ = pages.pointers()
        plan = self._plan((prefix_lens.dtype, pre % 16 == 0, seq_lens.dtype, seq % 16 == 0, last_loc.dtype,
                           last % 16 == 0))  # fmt: skip
        plan(bs, (pre, seq, last, ring, ctl, state, out.data_ptr(), pages.taken + TAKEN_BIAS, pages.capacity),
             lambda: (prefix_lens, seq_lens, last_loc, pages.ring, pages.ctl, pages.state, out))  # a program a request
        return out


# --------------------------------------------------------------------------------------------------------
# alloc_decode
# --------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["bs", "taken", "bits"])
def _alloc_decode_kernel(
    seq_lens_ptr,
    last_loc_ptr,
    ring_ptr,
    ctl_ptr,
    state_ptr,
    out_ptr,
    words_ptr,
    bs,
    taken,
    cap,
    bits,
    PAGE_SIZE: tl.constexpr,
    BIAS: tl.constexpr,
    BS_BLOCK: tl.constexpr,
):
    # One program, over the requests in blocks: a request whose new token opens a page takes the next page
    # from the head (its rank among such requests); the count of pages taken moves OFFSET and ADDED back (the
    # host does not count them) and is published with ``bits`` (kvcore.kernels.free_list).
    offset = tl.load(ctl_ptr + 0)
    added = tl.load(ctl_ptr + 1)
    lanes = tl.arange(0, BS_BLOCK)
    count = tl.sum(tl.zeros([BS_BLOCK], dtype=tl.int64), axis=0)
    for start in range(0, bs, BS_BLOCK):
        i = start + lanes
        mask = i < bs
        seq = tl.load(seq_lens_ptr + i, mask=mask, other=1).to(tl.int64)
        last = tl.load(last_loc_ptr + i, mask=mask, other=0).to(tl.int64)
        need = mask & ((seq - 1) % PAGE_SIZE == 0)
        k = need.to(tl.int32)
        rank = count + (tl.cumsum(k, axis=0) - k).to(tl.int64)
        page = tl.where(need, _page_at(ring_ptr, ctl_ptr, taken, rank, cap, BIAS), 0)
        tl.store(out_ptr + i, tl.where(need, page * PAGE_SIZE, last + 1), mask=mask)
        tl.store(state_ptr + page, tl.full([BS_BLOCK], 2147483647, tl.int32), mask=need)
        count += tl.sum(k.to(tl.int64), axis=0)
    tl.store(ctl_ptr + 0, offset - count)
    tl.store(ctl_ptr + 1, added - count)
    tl.store(words_ptr + 0, bits | ((added - count) & 0xFFFFFFFF))


#: the kernel's argument list (:class:`kvcore.kernels.launch.KernelArgs`; ``*_ptr`` parameters passed as addresses)
_DECODE_ARGS = KernelArgs(
    _alloc_decode_kernel, "seq_lens_ptr last_loc_ptr ring_ptr ctl_ptr state_ptr out_ptr words_ptr bs taken cap bits",
    "PAGE_SIZE BIAS BS_BLOCK",
)


def _check_decode_args(seq_lens, last_loc):
    if not (seq_lens.dim() == last_loc.dim() == 1) or seq_lens.numel() != last_loc.numel():
        raise ValueError(
            "alloc_decode takes 1-D seq_lens and last_loc of one length (the batch size), got shapes "
            f"{tuple(seq_lens.shape)} and {tuple(last_loc.shape)}"
        )


def alloc_decode_triton(
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    pages: PageSource,
    page_size: int,
) -> torch.Tensor:
    """One new token location per request, in one Triton launch (see the module docstring).  The pages taken
    are counted on the device: the source's ``OFFSET`` and ``ADDED`` move back by that count, published into
    ``pages.words[0]`` with ``pages.word_bits`` (:meth:`kvcore.kernels.free_list.FreePageList.decode_source`).

    :param seq_lens: ``[bs]`` integer sequence lengths including the token being decoded (each >= 1).
    :param last_loc: ``[bs]`` integer token index of each request's previous last token.
    :param pages: where new pages come from; must hold the pages the step needs (not checked here).
    :param page_size: tokens per page.
    :returns: int64 ``[bs]`` on the source's device.
    """
    _check_decode_args(seq_lens, last_loc)
    _check_source(pages, seq_lens, last_loc)
    bs = seq_lens.numel()
    out = pages.ring.new_empty(bs)
    if bs == 0:
        return out
    constexprs = _DECODE_ARGS.constexprs(PAGE_SIZE=page_size, BIAS=TAKEN_BIAS, BS_BLOCK=_BS_BLOCK)
    _launch(_DECODE_ARGS, 1, (seq_lens, last_loc), (pages.ring, pages.ctl, pages.state, out, pages.words),
            (bs, pages.taken + TAKEN_BIAS, pages.capacity, pages.word_bits, *constexprs),
            (pages.capacity,))  # fmt: skip
    return out


def alloc_decode_native(
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    pages: PageSource,
    page_size: int,
) -> torch.Tensor:
    """Torch reference of :func:`alloc_decode_triton` (same arguments, same result and counts, no host sync)."""
    _check_decode_args(seq_lens, last_loc)
    device = pages.ring.device
    if seq_lens.numel() == 0:
        return torch.empty((0,), dtype=torch.int64, device=device)
    seq = seq_lens.to(device=device, dtype=torch.int64)
    last = last_loc.to(device=device, dtype=torch.int64)
    need_page = (seq - 1) % page_size == 0
    k = need_page.to(torch.int64)
    page = _pages_native(pages, torch.cumsum(k, 0) - k)
    _mark_allocated_native(pages, page, need_page)
    count = k.sum()
    pages.ctl[0] -= count
    pages.ctl[1] -= count
    word = (pages.ctl[1] & 0xFFFFFFFF) | pages.word_bits
    pages.words[0].copy_(word, non_blocking=True)
    return torch.where(need_page, page * page_size, last + 1)


class DecodeStep(_ListStep):
    """``alloc_decode`` of one free list, as an allocator runs it every decode step: numbers the launch
    (:meth:`kvcore.kernels.free_list.FreePageList.decode_bits`) and runs :func:`alloc_decode_triton` (``use_triton``)
    or :func:`alloc_decode_native` on the list's pages.

    The Triton path works out once what stays fixed between steps (the launcher, the launch key's fixed part)
    and reads the list's buffer addresses and the tuning constants at each step, so a step costs two input
    checks, one allocation and one direct launch: the decode loop runs it once per step, and its host time is the
    step's.

    :param pages: the allocator's :class:`~kvcore.kernels.free_list.FreePageList` (kept: its buffers may be copied
        after a snapshot, its object stays).
    :param page_size: tokens per page.
    """

    __slots__ = ()
    _binding = _DECODE_ARGS

    @staticmethod
    def _constexpr_values(page_size: int) -> tuple:
        return _DECODE_ARGS.constexprs(PAGE_SIZE=page_size, BIAS=TAKEN_BIAS, BS_BLOCK=_BS_BLOCK)

    def __call__(self, seq_lens: torch.Tensor, last_loc: torch.Tensor, most: int) -> torch.Tensor:
        """The step's locations (int64 ``[bs]``); ``most`` bounds the pages it takes and must be at most the
        list's :attr:`~kvcore.kernels.free_list.FreePageList.known` (the caller checks)."""
        pages = self.pages
        pages.before_write()
        if not self.use_triton:
            return alloc_decode_native(seq_lens, last_loc, pages.decode_source(most), self.page_size)
        bs = seq_lens.numel()
        if seq_lens.dim() != 1 or last_loc.dim() != 1 or last_loc.numel() != bs:
            _check_decode_args(seq_lens, last_loc)
        if seq_lens.get_device() != self._device_index or last_loc.get_device() != self._device_index:
            raise ValueError(
                f"allocation inputs must be on the allocator's device {pages.device}, got seq_lens on "
                f"{seq_lens.device} and last_loc on {last_loc.device}"
            )
        bits = pages.decode_bits(most)
        out = pages.ring.new_empty(bs)
        if bs == 0:
            return out
        if not seq_lens.is_contiguous():
            seq_lens = seq_lens.contiguous()
        if not last_loc.is_contiguous():
            last_loc = last_loc.contiguous()
        seq, last = seq_lens.data_ptr(), last_loc.data_ptr()
        ring, _, _, ctl, state, words = pages.pointers()
        plan = self._plan((seq_lens.dtype, seq % 16 == 0, last_loc.dtype, last % 16 == 0))
        plan(1, (seq, last, ring, ctl, state, out.data_ptr(), words, bs, pages.taken + TAKEN_BIAS, pages.capacity,
                 bits), lambda: (seq_lens, last_loc, pages.ring, pages.ctl, pages.state, out, pages.words))  # one program
        return out
