"""kvcore_dsa: the DSA pool family (DeepSeek sparse attention: MLA rows plus an fp8 indexer cache), plugin ``dsa``."""
