"""Cost of one target forward over k tokens relative to one token, with a warm cache.

    python experiments/costs/forward_cost.py [--models smollm2-135m] [--max-k 16] [--context 256]

This is r(N + 1) in the speedup formula speedup = E / (r + N c): it bounds what
any drafter can gain on this hardware. Writes ``forward_cost.json`` to --out.
"""

from __future__ import annotations

import time

from jspec.analysis.harness import arguments, save
from jspec.analysis.speedup import linear_verify_cost
from jspec.models.hub import load_model
from jspec.tune.costs import forward_cost


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, out="experiments/out")
    parser.add_argument("--models", default="smollm2-135m")
    parser.add_argument("--max-k", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
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
    results = save(args.out / "forward_cost.json", results, args=args, started=started)
    return results


if __name__ == "__main__":
    main()
