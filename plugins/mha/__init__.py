"""kvcore_mha: the MHA/GQA pool family (plugin ``mha``)."""
