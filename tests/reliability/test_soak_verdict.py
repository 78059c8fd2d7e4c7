"""The soak's verdict (benchmarks/soak.py `compare`): window medians, not single iterations, against hand numbers."""

from __future__ import annotations

import math

from benchmarks.soak import compare


def test_compare_takes_window_medians_and_flags_growth() -> None:
    # 30 iterations; RSS steady at 100 except one spike inside each window, checkpoint disk jumps at the last one
    # (the final optimizer state), fds grow 20% over the run.
    rows = {i: {"gen RSS MiB": 100.0, "checkpoint disk MiB": 2000.0, "flow fds": 10.0 + i / 10} for i in range(30)}
    rows[9]["gen RSS MiB"] = 180.0
    rows[25]["gen RSS MiB"] = 180.0
    rows[29]["checkpoint disk MiB"] = 3600.0
    before, after, verdicts = compare(rows, reference=10, window=10)
    assert (before, after) == (range(5, 15), range(20, 30))
    by_name = {name: (b, a, ratio, over) for name, b, a, ratio, _, over in verdicts}
    assert by_name["gen RSS MiB"] == (100.0, 100.0, 1.0, False)  # the spikes are one value of ten each
    assert by_name["checkpoint disk MiB"][:2] == (2000.0, 2000.0)  # one jump at the end does not move the median
    b, a, ratio, over = by_name["flow fds"]
    assert (b, a) == (10.95, 12.45) and math.isclose(ratio, 12.45 / 10.95) and over  # 1.137 > 1.10


def test_compare_on_a_short_run_keeps_the_windows_apart() -> None:
    rows = {i: {"flow RSS MiB": 300.0 + i} for i in range(14)}
    before, after, verdicts = compare(rows, reference=10, window=10)
    assert before == range(5, 15) and after == range(15, 14)  # empty: nothing after the reference window yet
    ((name, b, a, ratio, _, over),) = verdicts
    assert b == 309.0 and math.isnan(a) and over
