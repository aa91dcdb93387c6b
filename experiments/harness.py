"""What the experiments share: timing and list arguments (more of their common parts belong here).

Scripts run from anywhere import it as a sibling (``from harness import median_ms``); the tests load
scripts with ``experiments/`` on the path (``tests/experiment.py``).
"""

from __future__ import annotations

import statistics
import time


def median_ms(fn, repeats: int = 10) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls, each waited for, after one untimed call
    (the compilation)."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def ints(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4] (empty items skipped)."""
    return [int(x) for x in text.split(",") if x.strip()]


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]
