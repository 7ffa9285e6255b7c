"""kvcore_dsv4: DeepSeek-V4's compressed-attention pool (plugin ``dsv4``; SGLang's ``DeepSeekV4TokenToKVPool``).

Every layer keeps a sliding window of latent rows (the ``swa_tokens`` group); layers of compression ratio 4 and
128 also keep one compressed latent per 4 / 128 tokens (the ``tokens`` group), ratio-4 layers a lightning-indexer
key per compressed token, and both the compressors' running states (:mod:`kvcore_dsv4.layout`).  Rows are
SGLang's "V4" FlashMLA pages: fp8 nope with power-of-two scales and bf16 rope (:mod:`kvcore_dsv4.quantize`).

Builds on the base family ``kvcore_swa``: its ``SWATokenToKVPoolAllocator`` hands out the full locations and the
window slots and registers the map between them with the pool, as SGLang pairs them.  With HiSparse
(:mod:`kvcore_dsv4.hisparse`) the ratio-4 latents live on the host and their hot share on the device.
"""

from __future__ import annotations

from kvcore.plugins.lazy import lazy_getattr

#: public name -> the module that defines it (imported on first use)
_PUBLIC = {
    "CompressStatePool": "kvcore_dsv4.states",
    "DeepSeekV4Dims": "kvcore_dsv4.layout",
    "DeepSeekV4HiSparseTokenToKVPoolAllocator": "kvcore_dsv4.hisparse",
    "DeepSeekV4IndexerPool": "kvcore_dsv4.pool",
    "DeepSeekV4SingleKVPool": "kvcore_dsv4.pool",
    "DeepSeekV4TokenToKVPool": "kvcore_dsv4.pool",
    "HiSparseC4DevicePool": "kvcore_dsv4.hisparse",
}

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC)
