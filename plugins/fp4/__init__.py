"""kvcore_fp4: block-scaled low-precision KV caches (block FP4, NVFP4, MXFP8), plugin ``fp4``."""
