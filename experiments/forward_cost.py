"""Cost of one target forward over k tokens relative to one token, with a warm cache.

    python experiments/forward_cost.py [--models smollm2-135m] [--max-k 16] [--context 256]

This is r(N + 1) in the speedup formula speedup = E / (r + N c): it bounds what
any drafter can gain on this hardware. Writes ``forward_cost.json`` to --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax.numpy as jnp

from jspec.decode import jit_forward
from jspec.models.hub import load_model
from jspec.speedup import linear_verify_cost

__all__ = ["forward_cost"]


def forward_cost(model, max_k: int = 16, context: int = 256, repeats: int = 10) -> dict:
    """Median milliseconds of a k-token forward (k = 1..max_k) after ``context`` cached tokens."""
    state, forward = jit_forward(model)  # the cache is donated: each call reuses its buffers
    cache = model.init_cache(1, context + max_k).rollback(jnp.array([context]))
    ks = range(1, max_k + 1)
    inputs = {k: (jnp.full((1, k), 5, jnp.int32), context + jnp.arange(k, dtype=jnp.int32)[None, :]) for k in ks}
    times = {k: [] for k in ks}
    for i in range(repeats + 1):  # round 0 compiles; then every k takes its turn each round, so drift hits all
        for k in ks:
            t0 = time.perf_counter()
            logits, cache = forward(state, *inputs[k], cache)
            logits.block_until_ready()
            if i:
                times[k].append(time.perf_counter() - t0)
            cache = cache.rollback(jnp.array([context]))
    out = {k: 1000 * sorted(times[k])[repeats // 2] for k in ks}
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m")
    parser.add_argument("--max-k", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("experiments/out"))
    args = parser.parse_args(argv)
    results = {}
    for name in args.models.split(","):
        model, _ = load_model(name)
        ms = forward_cost(model, args.max_k, args.context)
        ratio = {k: v / ms[1] for k, v in ms.items()}
        # Least-squares slope of r(k) = 1 + s (k - 1): the --verify-slope of `jspec speedup`.
        num = sum((k - 1) * (r - 1) for k, r in ratio.items())
        den = sum((k - 1) ** 2 for k in ratio) or 1
        slope = num / den
        results[name] = {"ms": ms, "relative": ratio, "fitted_slope": slope}
        print(f"{name} (context {args.context}): one token {ms[1]:.1f} ms")
        print("  k: " + " ".join(f"{k:>5}" for k in ms))
        print("  r: " + " ".join(f"{ratio[k]:5.2f}" for k in ms))
        print(f"  fit r(N + 1) = 1 + {slope:.3f} N; e.g. N = 5: {linear_verify_cost(1, slope)(5):.2f}")
        del model
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "forward_cost.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
