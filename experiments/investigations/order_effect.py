"""Does a decoder's measured speed depend on which decoder ran just before it? (a check of the method)

    python experiments/investigations/order_effect.py [--model smollm2-135m] [--draft-model NAME]
        [--prompts spec-bench] [--category summarization] [--limit 6] [--max-new-tokens 48]
        [--costs 1.30,1.00] [--out experiments/out]

Three decoders that do the same work on every prompt, greedy: prompt lookup at N = 7 (A), the same
with the adaptive fallback at the step costs ``--costs`` (Ad, what ``--method auto`` runs when tuned
to it), and a heavy program between them (H: the draft model at N = 7 with ``--draft-model``, else
the shipped EAGLE-3 head). They take turns prompt by prompt in the order of
:func:`jspec.analysis.bench.turn_order`, in which A and Ad each run right after H equally often.
A and Ad emit the same tokens in the same steps, so any gap between them is the program's or the
order's doing. Reports Ad over A (paired over prompts, 95% interval), and for A and Ad the log rate
relative to their mean on the prompt, split by whether H ran just before.

Before 2026-12-06 the order only rotated, so every decoder always followed the same one; on the
Qwen pair's summarization cell ``auto`` (Ad) always ran after the draft model and measured 6%
below A over 14 prompts (docs/log 2026-12-06).
"""

from __future__ import annotations

import math
import sys
import time

from jspec.analysis.harness import arguments, floats, save


def _mean_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t interval (scipy's t quantile) of ``values``."""
    from scipy import stats

    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, -math.inf, math.inf
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, model="smollm2-135m", prompts="spec-bench", limit=6, max_new_tokens=48,
                       out="experiments/out")  # fmt: skip
    parser.add_argument("--category", default="summarization")
    parser.add_argument("--draft-model", default=None, help="the heavy program: this draft model at N = 7")
    parser.add_argument("--costs", default="1.30,1.00", help="the adaptive fallback's step costs (speculative, plain)")
    args = parser.parse_args(argv)
    costs = floats(args.costs)
    if len(costs) != 2 or min(costs) <= 0:
        raise SystemExit(f"--costs takes two step costs > 0, speculative and plain; got {args.costs!r}.")

    from jspec.analysis.bench import run_interleaved, turn_order
    from jspec.analysis.paired import speedup_interval
    from jspec.analysis.prompts import load_prompts
    from jspec.api import make_decoder
    from jspec.core.sampling import SamplingParams
    from jspec.loop.adaptive import Adaptive, StepCosts
    from jspec.loop.xla_cache import enable_compilation_cache
    from jspec.models.hub import load_model

    enable_compilation_cache()
    model, tokenizer = load_model(args.model)
    eos = tokenizer.eos_token_ids
    prompts = load_prompts(args.prompts, args.category or None, args.limit)
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p.text}])) for p in prompts]
    if args.draft_model:
        heavy = make_decoder("draft", model, eos_ids=eos, num_draft=7, draft_model=load_model(args.draft_model)[0])
    else:
        heavy = make_decoder("eagle3", model, eos_ids=eos, num_draft=7, model_name=args.model)
    adaptive = make_decoder("ngram", model, eos_ids=eos, num_draft=7, adaptive=Adaptive(),
                            costs=StepCosts.create(*costs))  # fmt: skip
    decoders = {"A": make_decoder("ngram", model, eos_ids=eos, num_draft=7), "Ad": adaptive, "H": heavy}
    runs = run_interleaved(decoders, ids, args.max_new_tokens, SamplingParams.greedy(), progress=True)
    names = list(decoders)
    rates = {n: [t / s for t, s in zip(runs[n]["batch_tokens"], runs[n]["batch_seconds"], strict=True)] for n in names}
    after = {"H": [], "other": []}  # A's and Ad's log rate relative to their mean on the prompt
    per_prompt = []
    for i in range(len(ids)):
        order = [names[j] for j in turn_order(len(names), i)]
        mean = (math.log(rates["A"][i]) + math.log(rates["Ad"][i])) / 2
        for name in ("A", "Ad"):
            before = order[order.index(name) - 1] if order.index(name) else None
            after["H" if before == "H" else "other"].append(math.log(rates[name][i]) - mean)
        per_prompt.append({"order": order, "tokens_per_s": {n: rates[n][i] for n in names}})
    effect = {k: dict(zip(("mean", "low", "high"), _mean_interval(v), strict=True)) | {"n": len(v)}
              for k, v in after.items()}  # fmt: skip
    low, high = speedup_interval(runs["Ad"], runs["A"])
    report = {
        "adaptive_over_fixed": runs["Ad"]["tokens_per_s"] / runs["A"]["tokens_per_s"],
        "adaptive_over_fixed_interval": [low, high],
        "log_rate_after": effect,
        "same_tokens": runs["A"]["new_tokens"] == runs["Ad"]["new_tokens"],
        "steps": {n: [runs[n].get("verify_steps"), runs[n].get("plain_steps")] for n in ("A", "Ad")},
        "fallback_steps": runs["Ad"].get("fallback_steps", 0),
        "prompts": per_prompt,
        "compile_seconds": {n: runs[n]["compile_seconds"] for n in names},
    }
    print(f"Ad / A = {report['adaptive_over_fixed']:.3f} ({low:.3f}-{high:.3f}); log rate after H "
          f"{effect['H']['mean']:+.3f} ({effect['H']['low']:+.3f}, {effect['H']['high']:+.3f}; n {effect['H']['n']}), "
          f"after another {effect['other']['mean']:+.3f} (n {effect['other']['n']})", file=sys.stderr)  # fmt: skip
    return save(args.out / "order_effect.json", report, args=args, started=started)


if __name__ == "__main__":
    main()
