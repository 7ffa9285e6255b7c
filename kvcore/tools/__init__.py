"""Tools on top of the library: the ``kvcore`` command (:mod:`kvcore.tools.cli`), ``kvcore up``'s self-check of
freshly built pools (:mod:`kvcore.tools.selfcheck`), ``kvcore plan --sweep`` (:mod:`kvcore.tools.sweep`),
``kvcore check`` (:mod:`kvcore.tools.check`) and ``kvcore bench`` (:mod:`kvcore.tools.bench`,
:mod:`kvcore.tools.bench_engine`).

May import anything of kvcore's; nothing of the library imports this package.
"""
