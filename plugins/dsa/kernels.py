"""Hot-path kernels of the DSA pool, by what they serve (one name for the pool, tests and benchmarks to import):

- :mod:`kvcore_dsa.quantize`: the fp8 latent row as torch computes it (``quantize_parts``,
  ``quantize_concatenated``, ``dequantize_rows``): the references the kernels are bit-exact with, and the
  quantization's arithmetic;
- :mod:`kvcore_dsa.scaled_rows`: the quantize-and-store and the dequantizing gather of the fp8 latent rows
  (:class:`ScaledRows`, ``store_dsa_fp8_*``, ``gather_dsa_fp8_*``) with their Triton kernels;
- :mod:`kvcore_dsa.indexer`: the indexer pages' writes and reads (:class:`IndexerPages`, ``set_index_k_*``,
  ``get_index_k_*``) with their Triton kernels.

Row formats are described in :mod:`kvcore_dsa.layout`.  Every kernel has a torch reference of the same signature
beside it (``*_native``); the pool picks one (see ``kvcore.kernels.kernel_mode``).  Tuning constants live with
their kernels (``kvcore_dsa.scaled_rows._STORE_BLOCK_N`` ...).
"""

from __future__ import annotations

from kvcore_dsa.indexer import (
    IndexerPages,
    get_index_k_native,
    get_index_k_triton,
    set_index_k_native,
    set_index_k_triton,
)
from kvcore_dsa.quantize import dequantize_rows, quantize_concatenated, quantize_parts
from kvcore_dsa.scaled_rows import (
    ScaledRows,
    gather_dsa_fp8_native,
    gather_dsa_fp8_triton,
    store_dsa_fp8_native,
    store_dsa_fp8_triton,
)

__all__ = [
    "IndexerPages",
    "ScaledRows",
    "dequantize_rows",
    "gather_dsa_fp8_native",
    "gather_dsa_fp8_triton",
    "get_index_k_native",
    "get_index_k_triton",
    "quantize_concatenated",
    "quantize_parts",
    "set_index_k_native",
    "set_index_k_triton",
    "store_dsa_fp8_native",
    "store_dsa_fp8_triton",
]
