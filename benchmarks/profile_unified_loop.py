"""Where the host time of the unified memory's engine loop goes (``python benchmarks/profile_unified_loop.py``): the
engine loop of ``bench_unified_device.py`` (Qwen3-Next-80B, page 16, churning requests) under cProfile, split and
unified, the top functions by their own time."""

from __future__ import annotations

import cProfile
import pstats
import sys

sys.path.insert(0, "benchmarks")

from bench_unified_device import build, engine_loop  # noqa: E402


def main() -> None:
    for unified in (False, True):
        pools = build(unified)
        engine_loop(pools, steps=30, seed=1)  # warm
        profile = cProfile.Profile()
        profile.enable()
        us, peak, steps = engine_loop(pools, steps=150)
        profile.disable()
        print(f"\n{'unified' if unified else 'split'}: {us:.0f} us per step (profiled), peak {peak}")
        pstats.Stats(profile).sort_stats("tottime").print_stats(22)
        del pools


if __name__ == "__main__":
    main()
