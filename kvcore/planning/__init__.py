"""Planning: a memory budget turned into pool sizes, from declared layouts, allocating nothing.

- :mod:`kvcore.planning.planner`: the budget (profiled free memory or an explicit one, less weights and slack),
  bytes per token from the layouts, then tokens, window tokens, request-state slots and running requests:
  SGLang's configurator arithmetic, as a :class:`~kvcore.planning.planner.MemoryPlan`;
- :mod:`kvcore.planning.distributed`: each rank's pipeline stage, and the ranks agreeing on one plan (an
  all-reduce of the sizes).

May import: :mod:`kvcore.config`, :mod:`kvcore.layout`, :mod:`kvcore.errors`.
"""
