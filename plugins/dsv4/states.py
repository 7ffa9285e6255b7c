"""DeepSeek-V4's compressor states: rows of a running compression, kept in rings (SGLang's ``CompressStatePool``).

A compressor turns every ``ratio`` tokens of a layer into one compressed latent.  Until a block is complete it
keeps the block's raw tokens: per token a row of its projected ``kv`` and its ``score`` (float32 by default),
ratio 4 twice over (its windows overlap by a block).  The rows live in rings of ``ring_size`` rows:

* ratio 4 (page-scoped): a ring per window page, so the state follows the window's slots: window slot ``s`` is
  row ``(s // swa_page_size) * ring_size + s % ring_size``;
* ratio 128 (request-scoped): a ring per request slot: position ``p`` of request ``r`` is row
  ``r * ring_size + p % ring_size``.

The last row (-1) is the empty row: a negative location addresses it, and a store clears it again (kv 0, score
-inf), so padded tokens read an empty state.  The rows are views into the pool's stacked state buffers.
"""

from __future__ import annotations

import torch


class KVAndScore:
    """Rows of ``kv`` then ``score`` halves, side by side in one tensor (``kv_score[..., :d]`` and ``[..., d:]``)."""

    __slots__ = ("kv_score",)

    def __init__(self, kv_score: torch.Tensor):
        self.kv_score = kv_score

    @property
    def item_size(self) -> int:
        return self.kv_score.shape[-1] // 2

    @property
    def kv(self) -> torch.Tensor:
        return self.kv_score[..., : self.item_size]

    @property
    def score(self) -> torch.Tensor:
        return self.kv_score[..., self.item_size :]

    @property
    def shape(self) -> torch.Size:
        return self.kv_score.shape

    @staticmethod
    def from_kv_score(*, kv: torch.Tensor, score: torch.Tensor) -> KVAndScore:
        if kv.shape != score.shape:
            raise ValueError(f"kv {tuple(kv.shape)} and score {tuple(score.shape)} must have one shape")
        return KVAndScore(torch.cat([kv, score], dim=-1))

    def __getitem__(self, index) -> KVAndScore:
        return KVAndScore(self.kv_score[index])

    def __setitem__(self, index, value: KVAndScore) -> None:
        self.kv_score[index] = value.kv_score

    def clear(self) -> None:
        """Empty rows: kv 0, score -inf (a softmax over the block gives them no weight)."""
        self.kv.zero_()
        self.score.fill_(float("-inf"))


class CompressStatePool:
    """One layer's compressor state rows (SGLang's ``CompressStatePool``, offline compression).

    :param kv_score: ``[size + pad rows, 2 * (1 + overlap) * head_dim]`` (a layer of the pool's stacked state
        buffer; :func:`~kvcore_dsv4.layout.state_pad_rows` gives the padding).
    :param ring_size: rows of one ring.
    :param ratio: the compression ratio (4: overlapping windows, page-scoped; 128: request-scoped).
    :param swa_page_size: the window's page, which a page-scoped ring follows.
    """

    def __init__(self, kv_score: torch.Tensor, ring_size: int, ratio: int, swa_page_size: int):
        self.ratio = ratio
        self.ring_size = ring_size
        self.overlap = ratio == 4
        self.request_scoped = ratio == 128
        self.online = False
        self.swa_page_size = swa_page_size
        self.kv_score_buffer = KVAndScore(kv_score)
        self.kv_score_buffer[-1].clear()

    @property
    def size(self) -> int:
        """Rows of the rings (the buffer less its padding)."""
        return self.kv_score_buffer.shape[0]

    def translate_from_swa_loc_to_state_loc(self, swa_loc: torch.Tensor) -> torch.Tensor:
        """Rows of window slots ``swa_loc`` (page-scoped rings); a negative slot gives the empty row -1."""
        state_loc = (swa_loc // self.swa_page_size) * self.ring_size + swa_loc % self.ring_size
        return state_loc.masked_fill_(swa_loc < 0, -1)  # no host scalar: graph-safe

    def translate_from_req_position_to_state_loc(self, req_pool_indices: torch.Tensor, positions: torch.Tensor
                                                 ) -> torch.Tensor:  # fmt: skip
        """Rows of positions ``positions`` of requests ``req_pool_indices`` (request-scoped rings); a negative
        position gives the empty row -1."""
        state_loc = req_pool_indices * self.ring_size + positions % self.ring_size
        return state_loc.masked_fill_(positions < 0, -1)

    def get_state_by_state_loc(self, state_loc: torch.Tensor) -> KVAndScore:
        """A copy of rows ``state_loc``."""
        return self.kv_score_buffer[state_loc]

    def set_state_by_state_loc(self, state_loc: torch.Tensor, value: KVAndScore) -> None:
        """Write rows ``state_loc``; the empty row is cleared again after (padded tokens wrote into it)."""
        self.kv_score_buffer[state_loc] = value
        self.kv_score_buffer[-1].clear()

    def transfer_indices(self, req_pool_idx: int, seq_len: int) -> list[int]:
        """Request-scoped state only: the ring row page that holds the one pending (incomplete) block of a request
        of ``seq_len`` tokens, for a disaggregation transfer; none at a block boundary."""
        if not self.request_scoped:
            raise ValueError("page-scoped state travels with the window's pages")
        if seq_len == 0 or seq_len % self.ratio == 0:
            return []
        pages_per_request = self.ring_size // self.ratio
        return [int(req_pool_idx) * pages_per_request + ((seq_len - 1) % self.ring_size) // self.ratio]
