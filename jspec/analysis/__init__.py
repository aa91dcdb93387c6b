"""Analysis: the exactness check, speedup math, toy simulations, benchmarks, step traces, prompt sets, and the
harness the experiment scripts share."""
