"""Bridges from kvcore's pools to other libraries' cache interfaces.

Each integration lives in its own module and imports its library there, so ``import kvcore`` (and this
package) never needs any of them:

* :mod:`kvcore.integrations.transformers`: :class:`~kvcore.integrations.transformers.PagedKVCache`, a
  ``transformers.Cache`` whose keys and values live in a kvcore pool (``pip install "kvcore[hf]"``).
"""

__all__: list[str] = []
