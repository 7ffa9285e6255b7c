"""kvcore_swa: hybrid sliding-window attention pools (gpt-oss, Gemma 3, Mistral), plugin ``swa``."""
