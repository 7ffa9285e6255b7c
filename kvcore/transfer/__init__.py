"""KV transfer between pools, for prefill/decode disaggregation: a prefill worker's pool writes a request's KV (and
a hybrid model's states) into a decode worker's pool through NIXL (``pip install 'kvcore[nixl]'``).

- :mod:`kvcore.transfer.agent`: :class:`KVTransferAgent` (one pool's NIXL agent: its buffers registered once,
  peers connected by metadata, writes of token pages and state slots) and :class:`KVTransfer` (one posted write).

Owns nothing of the pools: it reads what every pool reports for transfer engines (``get_contiguous_buf_infos``,
``get_state_buf_infos``, ``size_groups``, ``translate_loc_from_full_to_swa``).  May import :mod:`kvcore.errors`
and :mod:`kvcore.plugins.lazy`; NIXL is imported when an agent is built.  docs/transfer.md has the details.
"""

from kvcore.plugins.lazy import lazy_getattr

#: public name -> the module defining it, imported on first use
_PUBLIC = dict.fromkeys(("KVTransfer", "KVTransferAgent", "METADATA_FORMAT", "TransferError"), "kvcore.transfer.agent")
__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC, submodules=True)
