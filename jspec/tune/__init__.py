"""Measuring what speculation costs and gains here, so that jspec can choose a method from numbers.

:mod:`.costs` holds the cost profile of the machine: a target forward over k tokens against a
one-token step, and each drafter's propose and commit, measured with warm-up, interleaved,
median of repeats, and cached per model, backend, device kind, dtype and batch bucket.
:mod:`.workload` measures acceptance on a workload's prompts, predicts every candidate's speed
from it and the profile, and measures the best; :mod:`.tuned` is the recommendation as a file,
what ``--method auto`` (:class:`jspec.AutoDecoder`) reads.
"""

from jspec.tune.costs import CostProfile, drafter_cost, forward_cost, load_profile, measure_profile, profile_path
from jspec.tune.tuned import Recommendation, Setting, TunedConfig, band_of, load_tuned, save_tuned, tuned_path

__all__ = ["CostProfile", "Recommendation", "Setting", "TunedConfig", "band_of", "drafter_cost", "forward_cost",
           "load_profile", "load_tuned", "measure_profile", "profile_path", "save_tuned", "tuned_path"]  # fmt: skip
