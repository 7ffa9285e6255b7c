"""kvcore_mamba: hybrid Mamba / linear-attention pools (Qwen3-Next's gated DeltaNet, Mamba2), plugin ``mamba``."""
