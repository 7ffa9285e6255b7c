"""kvcore_mla: the MLA pool family (DeepSeek multi-head latent attention), plugin ``mla``."""
