"""Index arithmetic for paged KV allocation: Triton kernels and their torch references.

Two operations, each with a Triton version (``*_triton``, one kernel launch, no host sync) and a vectorised
torch version (``*_native``, any device, used on the CPU and as the reference the kernels are tested against).
Both versions of an operation take the same arguments and return the same tensor.

Conventions (shared with :mod:`kvcore.allocators`):

* token index of offset ``o`` in page ``p`` is ``p * page_size + o``;
* ``free_pages`` is the allocator's free list of page ids; new pages are taken from its front, in request
  order, and the functions here only *read* it (the caller drops the pages it used);
* ``last_loc[i]`` is the token index of request ``i``'s last prefix token; it is only read when the prefix
  ends inside a page (``prefix_lens[i] % page_size != 0``), otherwise any value (``-1`` by habit) will do.

``alloc_extend``: request ``i`` gets locations for its tokens ``prefix_lens[i] .. seq_lens[i]-1``: first the
rest of its partially filled last page (``last_loc[i] + 1, + 2, ...``), then whole new pages, then the tail in
one more new page.  Outputs are concatenated in request order.  Request ``i`` uses
``ceil(seq_lens[i] / page_size) - ceil(prefix_lens[i] / page_size)`` new pages.

``alloc_decode``: ``seq_lens`` already counts the token being decoded.  Request ``i`` takes a new page iff
``(seq_lens[i] - 1) % page_size == 0`` and its location is then ``new_page * page_size``; otherwise it is
``last_loc[i] + 1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = [
    "alloc_extend_native",
    "alloc_extend_triton",
    "alloc_decode_native",
    "alloc_decode_triton",
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


def num_new_pages_extend(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> int:
    """Total new pages an extend needs: ``sum(ceil(seq/ps) - ceil(prefix/ps))``.

    Syncs with the device when the tensors live on one; pass CPU copies on the hot path.
    """
    pre, seq = _host_array(prefix_lens), _host_array(seq_lens)
    if page_size == 1:
        return int((seq - pre).sum())
    return int(((seq + (page_size - 1)) // page_size - (pre + (page_size - 1)) // page_size).sum())


def num_new_pages_decode(seq_lens: torch.Tensor, page_size: int) -> int:
    """New pages a decode step needs: how many requests' new token opens a page.

    Syncs with the device when ``seq_lens`` lives on one; pass a CPU copy on the hot path.
    """
    if page_size == 1:
        return int(seq_lens.numel())
    seq = _host_array(seq_lens)
    return int(((seq - 1) % page_size == 0).sum())


# --------------------------------------------------------------------------------------------------------
# alloc_extend
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _alloc_extend_kernel(
    prefix_lens_ptr,
    seq_lens_ptr,
    last_loc_ptr,
    free_pages_ptr,
    out_ptr,
    PAGE_SIZE: tl.constexpr,
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
        in_old_page = t < boundary
        page_rank = page_start + t // PAGE_SIZE - pre_pages
        page = tl.load(free_pages_ptr + page_rank, mask=mask & (~in_old_page), other=0).to(tl.int64)
        loc = tl.where(in_old_page, last + 1 + j, page * PAGE_SIZE + t % PAGE_SIZE)
        tl.store(out_ptr + out_start + j, loc, mask=mask)


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
    free_pages: torch.Tensor,
    page_size: int,
    extend_num_tokens: int,
) -> torch.Tensor:
    """Token locations for an extend batch, in one Triton launch (see the module docstring).

    :param prefix_lens: ``[bs]`` integer tokens already cached per request.
    :param seq_lens: ``[bs]`` integer sequence lengths after the extend.
    :param last_loc: ``[bs]`` integer token index of each request's last prefix token.
    :param free_pages: int64 free page ids; must hold at least the pages the batch needs (not checked here).
    :param page_size: tokens per page.
    :param extend_num_tokens: ``sum(seq_lens - prefix_lens)``, known by the caller without a sync.
    :returns: int64 ``[extend_num_tokens]`` on ``free_pages.device``.
    """
    _check_extend_args(prefix_lens, seq_lens, last_loc)
    out = torch.empty((extend_num_tokens,), dtype=torch.int64, device=free_pages.device)
    bs = prefix_lens.numel()
    if bs == 0 or extend_num_tokens == 0:
        return out
    _alloc_extend_kernel[(bs,)](
        prefix_lens,
        seq_lens,
        last_loc,
        free_pages,
        out,
        PAGE_SIZE=page_size,
        BS_BLOCK=_BS_BLOCK,
        TOKEN_BLOCK=_TOKEN_BLOCK,
    )
    return out


def _gather_pages(free_pages: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """``free_pages[rank]`` where ``rank`` is valid; entries with an out-of-range rank are unspecified."""
    n = free_pages.numel()
    if n == 0:
        return torch.zeros_like(rank)
    return free_pages[rank.clamp(0, n - 1)]


def alloc_extend_native(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    extend_num_tokens: int,
) -> torch.Tensor:
    """Torch reference of :func:`alloc_extend_triton` (same arguments, same result, no host sync)."""
    _check_extend_args(prefix_lens, seq_lens, last_loc)
    device = free_pages.device
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
    in_old_page = t < pre_pages[req] * page_size
    page = _gather_pages(free_pages, page_start[req] + t // page_size - pre_pages[req])
    return torch.where(in_old_page, last[req] + 1 + j, page * page_size + t % page_size)


# --------------------------------------------------------------------------------------------------------
# alloc_decode
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _alloc_decode_kernel(
    seq_lens_ptr,
    last_loc_ptr,
    free_pages_ptr,
    out_ptr,
    PAGE_SIZE: tl.constexpr,
    BS_BLOCK: tl.constexpr,
):
    # One program per request; its new page (if it needs one) is the number of earlier requests that need one.
    pid = tl.program_id(0)
    bs_offs = tl.arange(0, BS_BLOCK)
    acc = tl.zeros([BS_BLOCK], dtype=tl.int64)
    for start in range(0, pid, BS_BLOCK):
        idx = start + bs_offs
        mask = idx < pid
        seq = tl.load(seq_lens_ptr + idx, mask=mask, other=0).to(tl.int64)
        acc += tl.where(mask & ((seq - 1) % PAGE_SIZE == 0), 1, 0).to(tl.int64)
    page_rank = tl.sum(acc, axis=0)

    seq = tl.load(seq_lens_ptr + pid).to(tl.int64)
    last = tl.load(last_loc_ptr + pid).to(tl.int64)
    need_page = (seq - 1) % PAGE_SIZE == 0
    page = tl.load(free_pages_ptr + page_rank, mask=need_page, other=0).to(tl.int64)
    tl.store(out_ptr + pid, tl.where(need_page, page * PAGE_SIZE, last + 1))


def _check_decode_args(seq_lens, last_loc):
    if not (seq_lens.dim() == last_loc.dim() == 1) or seq_lens.numel() != last_loc.numel():
        raise ValueError(
            "alloc_decode takes 1-D seq_lens and last_loc of one length (the batch size), got shapes "
            f"{tuple(seq_lens.shape)} and {tuple(last_loc.shape)}"
        )


def alloc_decode_triton(
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """One new token location per request, in one Triton launch (see the module docstring).

    :param seq_lens: ``[bs]`` integer sequence lengths including the token being decoded (each >= 1).
    :param last_loc: ``[bs]`` integer token index of each request's previous last token.
    :param free_pages: int64 free page ids; must hold the pages the step needs (not checked here).
    :param page_size: tokens per page.
    :returns: int64 ``[bs]`` on ``free_pages.device``.
    """
    _check_decode_args(seq_lens, last_loc)
    bs = seq_lens.numel()
    out = torch.empty((bs,), dtype=torch.int64, device=free_pages.device)
    if bs == 0:
        return out
    _alloc_decode_kernel[(bs,)](
        seq_lens, last_loc, free_pages, out, PAGE_SIZE=page_size, BS_BLOCK=_BS_BLOCK
    )
    return out


def alloc_decode_native(
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """Torch reference of :func:`alloc_decode_triton` (same arguments, same result, no host sync)."""
    _check_decode_args(seq_lens, last_loc)
    device = free_pages.device
    if seq_lens.numel() == 0:
        return torch.empty((0,), dtype=torch.int64, device=device)
    seq = seq_lens.to(device=device, dtype=torch.int64)
    last = last_loc.to(device=device, dtype=torch.int64)
    need_page = (seq - 1) % page_size == 0
    rank = torch.cumsum(need_page.to(torch.int64), 0) - need_page.to(torch.int64)
    return torch.where(need_page, _gather_pages(free_pages, rank) * page_size, last + 1)
