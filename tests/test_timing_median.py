"""kvcore.tools.timing.median_ms on the wall clock: one untimed run first, ``before_each`` before every timed run
and outside the time, the median of the runs."""

import time

from kvcore.tools.timing import median_ms


def test_median_ms_times_each_run_after_a_warm_up_and_leaves_before_each_out():
    calls, befores = [], []
    pauses = iter([0.0, 0.03, 0.001, 0.001, 0.02])  # the warm-up's, then four timed runs'

    def fn():
        calls.append(1)
        time.sleep(next(pauses))

    ms = median_ms(fn, 4, cuda=False, before_each=lambda: (befores.append(1), time.sleep(0.05)))
    assert len(calls) == 5 and len(befores) == 4
    # the median of four runs is the mean of the middle two: (1 + 20) / 2 ms plus sleep overheads, far from the
    # 50 ms of before_each and from the 30 ms outlier
    assert 10.5 <= ms < 18, ms
