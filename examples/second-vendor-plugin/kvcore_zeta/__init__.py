"""kvcore_zeta: a vendor plugin that needs no pool of its own: it serves kvcore's MHA pools for ``hardware.vendor=zeta``
(a vendor could tune them, e.g. with its own allocator hook, without writing a pool).

Builds on the base family ``kvcore_mha``: its layout is ``mha_layout`` and its pool ``MHATokenToKVPool``.
"""
