"""kvcore_swa: hybrid sliding-window attention pools (gpt-oss, Gemma 3, Mistral), plugin ``swa``, and a *base
family* (see ``kvcore_mha``'s docstring): ``kvcore_unified`` lays its pools over a unified memory.  Public for
composition: ``SWAKVPool`` and ``SWATokenToKVPoolAllocator`` (their constructors and SGLang's methods), ``SWADims``
and ``swa_shape`` (a request's full and window layers and widths).

Builds on the base family ``kvcore_mha``: its full and sliding-window sub-pools are ``MHATokenToKVPool`` (or
``PageMajorMHATokenToKVPool``), declared with ``mha_layout`` / ``page_major_layout``.
"""

from __future__ import annotations

from kvcore.plugins.lazy import lazy_getattr

#: public name -> the module that defines it (imported on first use: importing the package stays light,
#: so a test kit can choose interpreted or compiled Triton kernels before any kernel module loads)
_PUBLIC = {
    "SWAKVPool": "kvcore_swa.pool",
    "SWATokenToKVPoolAllocator": "kvcore_swa.allocator",
    "SWADims": "kvcore_swa.layout",
    "swa_shape": "kvcore_swa.layout",
}

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC)
