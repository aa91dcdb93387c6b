"""Throughput against batch size: plain decoding and each method at batch 1, 2, 4, ..., 64, with the cost
model's prediction, and the batch where speculation stops paying on this machine.

    python experiments/benchmarks/batch_throughput.py [--model smollm2-135m] [--methods ngram,lookahead,eagle3]
        [--batches 1,2,4,8,16,32,64] [--temperature 0,1] [--prompts mt-bench] [--max-new-tokens 48]
        [--out experiments/out] [--tiny]

At each batch size B the same B prompts (MT-bench, repeated to fill the batch) run through every decoder,
taking turns (:func:`jspec.analysis.bench.run_interleaved`). The prediction for a method at batch B uses what was
measured at that batch, with the run's cache size (prompts padded to P, P + max-new-tokens slots): f_B, a
one-token forward of B rows; r_B(w), a w-token forward over f_B; c_B, the drafter's propose and commit over
f_B; and F_B, the target's prefill of the B padded prompts, which every decoder pays once per call. With
the run's own counts of steps, a method's time is F_B + (verify (r_B + c_B) + plain) f_B and plain
decoding's F_B + steps f_B; ``predicted`` is the ratio of tokens per second these give, ``predicted_loop``
the same without the prefill (the loops alone). As B grows a step stops being bound by reading the
weights and r_B(w) climbs toward w: speculation's gain shrinks (the EAGLE-3 paper's batch-64 question)
and, past some B, it loses. The prefill, the same for every decoder, pulls the measured ratio toward 1:
at B = 32 here the prompts pad to 256 tokens and it was 64% of plain decoding's time for 48 new tokens.
A drafter's own start over the prompt (EAGLE-3's head) is not in F_B.

``speedup`` here is a ratio of throughputs, the batch's new tokens per second, which is what a server at
batch B buys; unlike the per-prompt benchmarks (:func:`jspec.analysis.paired.speedup`, paired at matched
lengths) it is one batch a cell, so it has no interval, and at T = 1 the decoders' answers differ in length
(each cell keeps its ``new_tokens``).

Writes ``batch_throughput.json`` and ``batch_throughput.png`` to --out after every batch size (a run
stopped before the largest keeps what it measured).
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

from jspec.analysis.harness import arguments, plot, save


def ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"expected whole numbers separated by commas; got {text!r}.") from None
    if any(v < 1 for v in values):
        raise SystemExit(f"batch sizes must be >= 1; got {text!r}.")
    return values


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, model="smollm2-135m", prompts="mt-bench", max_new_tokens=48, out="experiments/out")
    parser.add_argument("--methods", default="ngram,lookahead,eagle3")
    parser.add_argument("--batches", type=ints, default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--temperature", default="0,1")
    parser.add_argument("--tiny", action="store_true", help="batches 1 and 2, 8 tokens, prompt lookup (tests)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.batches, args.max_new_tokens, args.methods, args.temperature = [1, 2], 8, "ngram", "0"

    import jspec
    from jspec.analysis.bench import forget_compiled, run_interleaved
    from jspec.analysis.prompts import load_prompts
    from jspec.core.sampling import SamplingParams
    from jspec.loop.batching import bucket
    from jspec.loop.xla_cache import enable_compilation_cache
    from jspec.models.hub import load_model
    from jspec.tune.costs import drafter_cost, forward_cost, prefill_cost

    enable_compilation_cache()
    model, tok = load_model(args.model)
    eos = tok.eos_token_ids
    drafters = {name: jspec.make_drafter(name, model, model_name=args.model) for name in args.methods.split(",")}
    widths = {name: (d.num_nodes or d.num_draft + 1) + d.num_lookahead for name, d in drafters.items()}
    texts = [p.text for p in load_prompts(args.prompts, None, max(args.batches))]
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    repeats = 2 if args.tiny else 5
    cells = []
    for b in args.batches:
        rows = (ids * b)[:b]
        prompt_len = bucket(max(map(len, rows)))  # the loops' padded prompt length and cache size
        cache = prompt_len + args.max_new_tokens
        forward_ms = forward_cost(model, widths=[1, *widths.values()], repeats=repeats, batch=b, context=cache)
        prefill_ms = prefill_cost(model, prompt_len, cache, repeats=max(1, repeats // 2), batch=b)
        costs = {name: drafter_cost(model, d, repeats=repeats, batch=b, context=cache) for name, d in drafters.items()}
        decoders = {"ar": jspec.Decoder(model, eos_ids=eos)}
        decoders |= {name: jspec.SpeculativeDecoder(model, d, eos_ids=eos) for name, d in drafters.items()}
        for t in (float(x) for x in args.temperature.split(",")):
            runs = run_interleaved(decoders, rows, args.max_new_tokens, SamplingParams.create(t), batch=b)
            base = runs["ar"]
            f, pre = forward_ms[1] / 1000, prefill_ms / 1000
            ar_steps = base["target_calls"] - base["calls"]  # the prefill is a target call of each batch
            for name, entry in runs.items():
                keep = ("new_tokens", "seconds", "target_calls", "verify_steps", "plain_steps")
                cell = {"batch": b, "temperature": t, "method": name, "tokens_per_s": entry["tokens_per_s"],
                        "speedup": entry["tokens_per_s"] / base["tokens_per_s"], "tau": entry["tau"],
                        "prompt_len": prompt_len, "forward_ms": forward_ms[1], "prefill_ms": prefill_ms,
                        **{k: entry[k] for k in keep if k in entry}}  # fmt: skip
                if name != "ar":
                    r = forward_ms[widths[name]] / forward_ms[1]
                    c = (costs[name]["propose_ms"] + costs[name]["commit_ms"]) / forward_ms[1]
                    steps = entry["verify_steps"] * (r + c) + entry["plain_steps"]
                    ratio = entry["new_tokens"] / base["new_tokens"]
                    loop = ratio * ar_steps / steps if steps else None
                    whole = ratio * (pre + ar_steps * f) / (pre + steps * f)
                    cell |= {"r": r, "c": c, "predicted": whole, "predicted_loop": loop}
                cells.append(cell)
                pred = (f" (predicted {cell['predicted']:.2f}x; loops alone {cell['predicted_loop']:.2f}x)"
                        if cell.get("predicted_loop") else "")  # fmt: skip
                print(f"B {b:>3} T {t:g} {name:<10} {cell['tokens_per_s']:8.1f} tokens/s {cell['speedup']:.2f}x{pred}",
                      file=sys.stderr)  # fmt: skip
        forget_compiled(decoders.values())
        # after every batch size: a stopped run keeps its figures
        report = write_report(args, cells, list(drafters), started)
    print(json.dumps({"crossover": report["crossover"]}, indent=1))
    return report


def write_report(args, cells: list[dict], methods: list[str], started: float) -> dict:
    """The report of the cells measured so far (with the crossover: the smallest batch where a method
    loses to plain decoding), written with its plot to --out."""
    crossover = {}
    for t in sorted({c["temperature"] for c in cells}):
        for name in methods:
            mine = sorted((c for c in cells if c["method"] == name and c["temperature"] == t), key=lambda c: c["batch"])
            losing = [c["batch"] for c in mine if c["speedup"] < 1.0]
            crossover[f"{name}|T={t:g}"] = min(losing) if losing else None
    report = {"model": args.model, "max_new_tokens": args.max_new_tokens, "cells": cells, "crossover": crossover}
    report = save(args.out / "batch_throughput.json", report, args=args, started=started)
    _plot(report, args.out / "batch_throughput.png")
    return report


def _plot(report: dict, path: pathlib.Path) -> None:
    temps = sorted({c["temperature"] for c in report["cells"]})
    with plot(path, figsize=(5 * len(temps), 3.5), dpi=110) as fig:
        axes = fig.subplots(1, len(temps), squeeze=False)[0]
        for ax, t in zip(axes, temps, strict=True):
            for name in sorted({c["method"] for c in report["cells"]}):
                mine = sorted((c for c in report["cells"] if c["method"] == name and c["temperature"] == t),
                              key=lambda c: c["batch"])  # fmt: skip
                line = ax.plot([c["batch"] for c in mine], [c["tokens_per_s"] for c in mine], marker="o", label=name)
                pred = [(c["batch"], c["predicted"] * next(a["tokens_per_s"] for a in report["cells"]
                         if a["method"] == "ar" and a["batch"] == c["batch"] and a["temperature"] == t))
                        for c in mine if c.get("predicted")]  # fmt: skip
                if pred:
                    ax.plot(*zip(*pred, strict=True), linestyle=":", color=line[0].get_color())
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size")
            ax.set_ylabel("tokens/s (dotted: predicted)")
            ax.set_title(f"{report['model']}, T = {t:g}")
            ax.legend(fontsize=7)


if __name__ == "__main__":
    main()
