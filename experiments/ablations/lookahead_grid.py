"""Lookahead decoding over a grid of small W, N, G on the real model, against plain decoding and prompt
lookup at the same verify width, with the cost model's prediction beside each.

    python experiments/ablations/lookahead_grid.py [--model smollm2-135m] [--prompts mt-bench,humaneval] [--limit 3]
        [--max-new-tokens 96] [--temperature 0] [--grid 2:3:2,3:3:3,...] [--out experiments/out] [--tiny]

A grid point W:N:G is a window of W columns and N - 1 levels and G candidate n-grams of N - 1
tokens verified per step, so one step's forward is 1 + G (N - 1) + W (N - 1) tokens. Prompt lookup
drafts a tree of G continuations of N - 1 tokens (a chain when G = 1): the same verified width,
without the window. Every decoder runs every prompt, taking turns prompt by prompt
(:func:`jspec.analysis.bench.run_interleaved`); speedups are paired prompt by prompt at matched answer
lengths, with a 95% interval (:func:`jspec.analysis.paired.speedup_interval`).

The prediction: a decoder that takes v verify forwards of w tokens and p plain steps (prompt
lookup finding nothing) for ``tokens`` new tokens runs at ``tokens / (v (r(w) + c) + p)`` of plain
decoding's speed, r(w) measured here (a w-token forward over a one-token one, after 256 cached
tokens) and c the drafter's propose and commit over a plain step
(:func:`jspec.tune.costs.drafter_cost`); prefill left out. ``tokens_per_step`` is new tokens over
all target forwards (Lookahead verifies every step; prompt lookup's ``tau`` counts its verify
steps only).

Writes ``lookahead_grid.json`` to --out.
"""

from __future__ import annotations

import sys
import time

from jspec.analysis.harness import arguments, save


def parse_grid(text: str) -> list[tuple[int, int, int]]:
    points = []
    for item in text.split(","):
        try:
            w, n, g = (int(x) for x in item.split(":"))
        except ValueError:
            raise SystemExit(f"--grid takes W:N:G points separated by commas; got {item!r}.") from None
        points.append((w, n, g))
    return points


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, model="smollm2-135m", prompts="mt-bench,humaneval", limit=3,
                       max_new_tokens=96, out="experiments/out")  # fmt: skip
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--grid", default="2:2:2,2:3:2,3:3:3,5:3:3,3:4:3")
    parser.add_argument("--tiny", action="store_true", help="one prompt, 16 tokens, two grid points (tests)")
    args = parser.parse_args(argv)

    from jspec.analysis.bench import forget_compiled, run_interleaved
    from jspec.analysis.paired import speedup, speedup_interval
    from jspec.analysis.prompts import load_prompts
    from jspec.core.sampling import SamplingParams
    from jspec.drafters import LookaheadDecoding, PromptLookup
    from jspec.loop.decode import Decoder
    from jspec.loop.engine import SpeculativeDecoder
    from jspec.loop.xla_cache import enable_compilation_cache
    from jspec.models.hub import load_model
    from jspec.tune.costs import drafter_cost, forward_cost

    enable_compilation_cache()
    if args.tiny:
        args.prompts, args.limit, args.max_new_tokens, args.grid = "mt-bench", 1, 16, "2:2:1,2:3:2"
    grid = parse_grid(args.grid)
    model, tokenizer = load_model(args.model)
    eos = tokenizer.eos_token_ids

    drafters = {}
    for w, n, g in grid:
        drafters[f"lookahead {w}:{n}:{g}"] = LookaheadDecoding(window=w, level=n, guesses=g)
        drafters.setdefault(f"ngram {n - 1}x{g}", PromptLookup(num_draft=n - 1, num_paths=g))
    widths = {name: (d.num_nodes or d.num_draft + 1) + d.num_lookahead for name, d in drafters.items()}
    repeats = 2 if args.tiny else 8
    forward_ms = forward_cost(model, widths=[1, *widths.values()], repeats=repeats)
    costs = {name: drafter_cost(model, d, repeats=repeats) for name, d in drafters.items()}
    step = forward_ms[1]
    decoders = {"plain": Decoder(model, eos_ids=eos)}
    decoders |= {name: SpeculativeDecoder(model, d, eos_ids=eos) for name, d in drafters.items()}

    sampling = SamplingParams.create(args.temperature)
    results = {}
    for source in args.prompts.split(","):
        prompts = load_prompts(source, None, args.limit)
        ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p.text}])) for p in prompts]
        runs = run_interleaved(decoders, ids, args.max_new_tokens, sampling)
        forget_compiled(decoders.values())  # ~2,000 memory mappings per compiled loop
        for name, entry in runs.items():  # paired prompt by prompt at matched lengths (sampled answers differ)
            entry["speedup"] = speedup(entry, runs["plain"])
            entry["speedup_interval"] = list(speedup_interval(entry, runs["plain"]))
            if name != "plain":
                steps = entry["verify_steps"] + entry["plain_steps"]
                r = forward_ms[widths[name]] / step
                c = (costs[name]["propose_ms"] + costs[name]["commit_ms"]) / step
                entry |= {
                    "width": widths[name],
                    "r": r,
                    "c": c,
                    "tokens_per_step": entry["new_tokens"] / steps,
                    "predicted": entry["new_tokens"] / (entry["verify_steps"] * (r + c) + entry["plain_steps"]),
                }
            results[f"{source}|{name}"] = entry
            tau = entry.get("tokens_per_step", 1.0)
            pred = (
                f"  predicted {entry['predicted']:.3f}x (r {entry['r']:.2f}, c {entry['c']:.2f})"
                if name != "plain"
                else ""
            )
            lo, hi = entry["speedup_interval"]
            print(f"  {source:<10} {name:<18} tokens/step {tau:5.2f}  {entry['speedup']:.3f}x "
                  f"({lo:.3f}-{hi:.3f}){pred}", file=sys.stderr)  # fmt: skip
    report = {
        "model": args.model,
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "limit": args.limit,
        "forward_ms": forward_ms,
        "drafter_ms": costs,
        "results": results,
    }
    report = save(args.out / "lookahead_grid.json", report, args=args, started=started)
    return report


if __name__ == "__main__":
    main()
