"""Measuring what speculation costs on this machine, so that jspec can choose a method from numbers.

:mod:`.costs` holds the cost profile: a target forward over k tokens against a one-token
step, and each drafter's propose and commit, measured with warm-up, interleaved, median of
repeats, and cached per model, backend, device kind, dtype and batch bucket.
"""

from jspec.tune.costs import CostProfile, drafter_cost, forward_cost, load_profile, measure_profile, profile_path

__all__ = ["CostProfile", "drafter_cost", "forward_cost", "load_profile", "measure_profile", "profile_path"]
