"""kvcore_dsa: the DSA pool family (DeepSeek sparse attention: MLA rows plus an fp8 indexer cache), plugin ``dsa``.

Builds on the base family ``kvcore_mla``: ``DSATokenToKVPool`` subclasses ``MLATokenToKVPool`` (through the
hooks ``kvcore_mla``'s docstring names), its layout extends ``mla_layout``, and the backend reads ``model.mla``
(``MLADims``) besides its own ``model.dsa``.
"""

from __future__ import annotations

from kvcore.plugins.lazy import lazy_getattr

#: public name -> the module that defines it (imported on first use: importing the package stays light,
#: so a test kit can choose interpreted or compiled Triton kernels before any kernel module loads)
_PUBLIC = {
    "DSATokenToKVPool": "kvcore_dsa.pool",
    "NSATokenToKVPool": "kvcore_dsa.pool",
    "DSADims": "kvcore_dsa.layout",
}

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC)
