"""Many short prompts or a few long ones: which narrows the tuner's interval for the same time?

    python experiments/investigations/tune_prompts.py [--model smollm2-135m] [--method ngram] [--num-draft 4]
        [--shapes 3x96,9x32] [--repeats 3] [--skip 8] [--out experiments/results/tune_prompts.json]

For each shape P x T (P prompts of T new tokens; the default shapes spend the same 288 tokens),
``--repeats`` disjoint slices of MT-bench (from prompt ``--skip`` on) are measured as the tuner
measures a candidate: plain decoding and the drafter taking turns prompt by prompt
(:func:`jspec.analysis.bench.run_interleaved`), the speedup and its paired 95% t interval over the
prompts (:func:`jspec.analysis.paired.speedup_interval`). Reports each slice's interval, its width, and the
seconds the pair of decoders spent generating.
"""

from __future__ import annotations

import statistics
import time

from jspec.analysis.harness import append, arguments


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, model="smollm2-135m", repeats=3, out="experiments/results/tune_prompts.json")
    parser.add_argument("--method", default="ngram")
    parser.add_argument("--num-draft", type=int, default=4)
    parser.add_argument("--shapes", default="3x96,9x32")
    parser.add_argument("--skip", type=int, default=8)
    args = parser.parse_args(argv)

    from jspec.analysis.bench import run_interleaved
    from jspec.analysis.paired import speedup_interval
    from jspec.analysis.prompts import load_prompts
    from jspec.api import make_decoder
    from jspec.core.sampling import SamplingParams
    from jspec.models.hub import load_model

    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    model, tok = load_model(args.model)
    eos = tok.eos_token_ids
    decoders = {"ar": make_decoder("ar", model, eos_ids=eos),
                args.method: make_decoder(args.method, model, eos_ids=eos, num_draft=args.num_draft,
                                          model_name=args.model)}  # fmt: skip
    need = max(p for p, _ in shapes) * args.repeats
    prompts = load_prompts("mt-bench", None, need, args.skip)
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p.text}])) for p in prompts]
    candidate = f"{args.method}:N={args.num_draft}"
    result = {"model": args.model, "candidate": candidate, "shapes": {}}
    for repeat in range(args.repeats):
        for p, t in shapes:  # the shapes take turns too
            chosen = ids[repeat * p : (repeat + 1) * p]
            runs = run_interleaved(decoders, chosen, t, SamplingParams.greedy())
            spec, plain = runs[args.method], runs["ar"]
            lo, hi = speedup_interval(spec, plain)
            row = {"speedup": spec["tokens_per_s"] / plain["tokens_per_s"], "interval": [lo, hi], "width": hi - lo,
                   "seconds": spec["seconds"] + plain["seconds"], "tokens": spec["new_tokens"]}  # fmt: skip
            result["shapes"].setdefault(f"{p}x{t}", []).append(row)
            print(f"{p} prompts x {t} tokens, slice {repeat}: {row['speedup']:.3f}x ({lo:.3f}-{hi:.3f}, width "
                  f"{hi - lo:.3f}) in {row['seconds']:.1f} s", flush=True)  # fmt: skip
    for shape, rows in result["shapes"].items():
        widths = [r["width"] for r in rows]
        print(f"{shape}: median width {statistics.median(widths):.3f}, median seconds "
              f"{statistics.median(r['seconds'] for r in rows):.1f}")  # fmt: skip
    return append(args.out, result, args=args, specs=["ar", candidate], started=started)[-1]


if __name__ == "__main__":
    main()
