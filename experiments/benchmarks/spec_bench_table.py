"""Every available method side by side on Spec-Bench's categories, interleaved, with the cost model's prediction.

    python experiments/benchmarks/spec_bench_table.py [--model smollm2-135m] [--draft-model NAME]
        [--methods ar,ngram,eagle3,lookahead,auto] [--categories multi-turn,translation,summarization,qa,
        math_reasoning,rag] [--temperatures 0,1] [--limit 2] [--max-new-tokens 64] [--out experiments/out] [--tiny]

Spec-Bench (Xia et al. 2024) has six categories: multi-turn conversation (MT-bench's 80 questions;
their first turn here), translation, summarization, question answering, mathematical reasoning
and retrieval-augmented generation. For each category and temperature, every method runs the
category's first ``--limit`` prompts, taking turns prompt by prompt
(:func:`jspec.analysis.bench.run_interleaved`), at the library's defaults (``jspec.methods.DEFAULTS``):
plain decoding (ar), prompt lookup (ngram), a draft model (draft, with ``--draft-model``), the
shipped EAGLE-3 head (eagle3), Medusa or EAGLE-1 heads (medusa, eagle1, with ``--head`` where
trained ones exist; none ships), Lookahead decoding (lookahead) and ``--method auto`` (the config
tuned for that category's prompts where ``jspec tune`` made one, else the model's latest).

Each speedup over plain decoding is paired prompt by prompt at matched answer lengths, with its 95%
interval (:func:`jspec.analysis.paired.speedup_interval`; sampled answers differ in length). Beside it,
the cost model's, for the decoding loop alone (no prefill): a run of ``tokens`` new tokens
in v verify steps of w tokens and p plain steps runs at ``tokens / (v (r(w) + c) + p)`` of plain
decoding's speed, with r(w) and c (the drafter's propose and commit over a plain step) measured
at the start (:mod:`jspec.tune.costs`); auto's setting varies per call, so it has none.

Writes ``spec_bench_table.json``, ``spec_bench_table.png`` (a heat map of speedups per method and
category at each temperature) and ``spec_bench_table.md`` to --out.
"""

from __future__ import annotations

import sys
import time

from jspec.analysis.harness import arguments, plot, save

MULTI_TURN = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
CATEGORIES = ("multi-turn", "translation", "summarization", "qa", "math_reasoning", "rag")


def category_prompts(category: str, limit: int):
    """The first ``limit`` prompts of a Spec-Bench category (multi-turn: MT-bench's questions, first turn)."""
    from jspec.analysis.prompts import load_prompts

    if category not in CATEGORIES:
        raise ValueError(f"Spec-Bench has no category {category!r}; choose from {', '.join(CATEGORIES)}.")
    if category == "multi-turn":
        return [p for p in load_prompts("spec-bench") if p.category in MULTI_TURN][:limit]
    return load_prompts("spec-bench", category, limit)


def _decoders(args, model, tokenizer, methods, category):
    from jspec.api import make_decoder

    eos = tokenizer.eos_token_ids
    out = {}
    for method in methods:
        if method == "auto":
            workload = "mt-bench" if category == "multi-turn" else f"spec-bench:{category}"
            out[method] = make_decoder("auto", model, eos_ids=eos, model_name=args.model, workload=workload,
                                       draft_model=args.draft_model)  # fmt: skip
        elif method in ("ar", "ngram", "lookahead"):
            out[method] = make_decoder(method, model, eos_ids=eos)
        elif method == "draft":
            out[method] = make_decoder(method, model, eos_ids=eos, draft_model=args.draft_model)
        else:
            out[method] = make_decoder(method, model, eos_ids=eos, head=args.head, model_name=args.model)
    return out


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, model="smollm2-135m", temperatures="0,1", limit=2, max_new_tokens=64,
                       out="experiments/out")  # fmt: skip
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--head", default=None, help="heads for eagle1 / medusa (none ships)")
    parser.add_argument("--methods", default="ar,ngram,eagle3,lookahead,auto")
    parser.add_argument("--categories", default=",".join(CATEGORIES))
    parser.add_argument("--tiny", action="store_true", help="one category, one prompt, 12 tokens, T = 0 (tests)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.methods, args.categories, args.temperatures, args.limit, args.max_new_tokens = (
            "ar,ngram,lookahead", "qa", "0", 1, 12)  # fmt: skip
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    if methods[0] != "ar":
        raise SystemExit("--methods must start with ar: speedups are over plain decoding.")
    prompts = {c: category_prompts(c, args.limit) for c in categories}  # unknown categories refused first

    from jspec.analysis.bench import forget_compiled, run_interleaved
    from jspec.analysis.paired import speedup, speedup_interval
    from jspec.core.sampling import SamplingParams
    from jspec.loop.xla_cache import enable_compilation_cache
    from jspec.models.hub import load_model
    from jspec.tune.costs import drafter_cost, forward_cost

    enable_compilation_cache()
    model, tokenizer = load_model(args.model)
    shared = _decoders(args, model, tokenizer, [m for m in methods if m != "auto"], None)
    fixed = {m: d.drafter for m, d in shared.items() if m != "ar"}
    widths = {m: (d.num_nodes or d.num_draft + 1) + d.num_lookahead for m, d in fixed.items()}
    repeats = 2 if args.tiny else 8
    forward_ms = forward_cost(model, widths=[1, *widths.values()], repeats=repeats)
    step = forward_ms[1]
    units = {m: sum(drafter_cost(model, d, repeats=repeats).values()) / step for m, d in fixed.items()}

    table = {}
    for c in categories:  # a category's decoders compile once for both temperatures, then are dropped
        ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p.text}]))
               for p in prompts[c]]  # fmt: skip
        decoders = shared | (_decoders(args, model, tokenizer, ["auto"], c) if "auto" in methods else {})
        decoders = {m: decoders[m] for m in methods}
        for t in temperatures:
            cell, missing = _runnable(decoders, t)
            runs = run_interleaved(cell, ids, args.max_new_tokens, SamplingParams.create(t))
            if missing:  # auto without a tuned setting for this temperature band: said, not run
                table[f"T={t:g}|{c}|auto"] = {"speedup": float("nan"), "tau": float("nan"), "error": missing}
                print(f"  T={t:g} {c:<15} auto       not run: {missing}", file=sys.stderr)
            base = runs["ar"]
            for m, entry in runs.items():
                row = {"speedup": speedup(entry, base), "interval": list(speedup_interval(entry, base)),
                       "tau": entry["tau"], "tokens_per_s": entry["tokens_per_s"],
                       "new_tokens": entry["new_tokens"]}  # fmt: skip
                if m in fixed:
                    cost = entry["verify_steps"] * (forward_ms[widths[m]] / step + units[m]) + entry["plain_steps"]
                    row["predicted"] = entry["new_tokens"] / cost
                if m == "auto":
                    row["setting"] = entry.get("setting")
                table[f"T={t:g}|{c}|{m}"] = row
                pred = f" (predicted {row['predicted']:.2f}x)" if "predicted" in row else ""
                low, high = row["interval"]
                print(f"  T={t:g} {c:<15} {m:<10} {row['speedup']:.2f}x ({low:.2f}-{high:.2f}) "
                      f"tau {row['tau']:.2f}{pred}", file=sys.stderr)  # fmt: skip
        forget_compiled(decoders.values())  # ~2,000 memory mappings per compiled loop; a process may hold 65,530
    report = {
        "model": args.model,
        "draft_model": args.draft_model,
        "limit": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "forward_ms": forward_ms,
        "drafter_units": units,
        "widths": widths,
        "table": table,
    }
    report["overall"] = _overall(table, methods, categories, temperatures)
    report = save(args.out / "spec_bench_table.json", report, args=args, started=started)
    (args.out / "spec_bench_table.md").write_text(markdown(report, methods, categories, temperatures))
    _heat_map(report, methods, categories, temperatures, args.out / "spec_bench_table.png")
    print(markdown(report, methods, categories, temperatures))
    return report


def _runnable(decoders, temperature):
    """(the decoders that can run at this temperature, why auto cannot or None)."""
    auto = decoders.get("auto")
    if auto is None:
        return decoders, None
    try:
        auto.choose(temperature, 1)
    except ValueError as err:
        return {m: d for m, d in decoders.items() if m != "auto"}, str(err)
    return decoders, None


def _overall(table, methods, categories, temperatures) -> dict:
    """Per temperature and method: the geometric mean of the categories' speedups."""
    import math

    out = {}
    for t in temperatures:
        for m in methods:
            values = [table[f"T={t:g}|{c}|{m}"]["speedup"] for c in categories]
            values = [v for v in values if not math.isnan(v)]
            out[f"T={t:g}|{m}"] = math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")
    return out


def markdown(report, methods, categories, temperatures) -> str:
    """The table: one row per method and temperature, measured speedup [95% interval] (predicted) and tau per
    category."""
    lines = []
    for t in temperatures:
        lines.append(f"\n**T = {t:g}** — speedup over plain [95% interval] (predicted), τ\n")
        lines.append("| method | " + " | ".join(categories) + " | overall |")
        lines.append("|---" * (len(categories) + 2) + "|")
        for m in methods:
            cells = []
            for c in categories:
                row = report["table"][f"T={t:g}|{c}|{m}"]
                if "error" in row:
                    cells.append("n/a")
                    continue
                pred = f" ({row['predicted']:.2f})" if "predicted" in row else ""
                span = "[{:.2f}-{:.2f}]".format(*row["interval"]) if "interval" in row else ""
                cells.append(f"{row['speedup']:.2f}x {span}{pred}, {row['tau']:.2f}")
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {report['overall'][f'T={t:g}|{m}']:.2f}x |")
    return "\n".join(lines) + "\n"


def _heat_map(report, methods, categories, temperatures, path) -> None:
    import numpy as np

    size = (1.6 + 1.3 * len(categories), 0.8 + 0.45 * len(methods) * len(temperatures))
    with plot(path, figsize=size, dpi=110) as fig:
        axes = fig.subplots(len(temperatures), 1, squeeze=False)[:, 0]
        for ax, t in zip(axes, temperatures, strict=True):
            grid = np.array([[report["table"][f"T={t:g}|{c}|{m}"]["speedup"] for c in categories] for m in methods])
            image = ax.imshow(grid, cmap="RdYlGn", vmin=0.5, vmax=1.5, aspect="auto")
            for (i, j), value in np.ndenumerate(grid):
                ax.text(j, i, "n/a" if np.isnan(value) else f"{value:.2f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(categories)), categories, fontsize=8)
            ax.set_yticks(range(len(methods)), methods, fontsize=8)
            ax.set_title(f"{report['model']}, T = {t:g}: speedup over plain decoding", fontsize=9)
            fig.colorbar(image, ax=ax)


if __name__ == "__main__":
    main()
