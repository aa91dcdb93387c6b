"""Does a decoder's measured speed depend on which decoder ran just before it? (a check of the method)

    python experiments/investigations/order_effect.py [--prompts spec-bench] [--category summarization] [--limit 3]
        [--max-new-tokens 96] [--out experiments/out]

The same prompt-lookup program twice (two decoders, A and B, N = 7), plain decoding and the
EAGLE-3 head (more memory per step) between them, run prompt by prompt in a fixed order
(plain, A, EAGLE-3, B), then with the order rotating from prompt to prompt, then without the
EAGLE-3 head. A and B are one program: any gap between them is the order's doing.
"""

from __future__ import annotations

import sys
import time

from jspec.analysis.harness import arguments, save


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, model="smollm2-135m", prompts="spec-bench", limit=3, max_new_tokens=96,
                       out="experiments/out")  # fmt: skip
    parser.add_argument("--category", default="summarization")
    args = parser.parse_args(argv)

    from jspec.analysis.bench import run_interleaved
    from jspec.analysis.prompts import load_prompts
    from jspec.api import make_decoder
    from jspec.core.sampling import SamplingParams
    from jspec.loop.xla_cache import enable_compilation_cache
    from jspec.models.hub import load_model

    enable_compilation_cache()
    model, tokenizer = load_model(args.model)
    eos = tokenizer.eos_token_ids
    prompts = load_prompts(args.prompts, args.category or None, args.limit)
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p.text}])) for p in prompts]

    def lookup():
        return make_decoder("ngram", model, eos_ids=eos, num_draft=7)

    plain = make_decoder("ar", model, eos_ids=eos)
    eagle = make_decoder("eagle3", model, eos_ids=eos, num_draft=5, model_name=args.model)
    a, b = lookup(), lookup()
    setups = {
        "fixed order: plain, A, eagle3, B": ({"plain": plain, "A": a, "eagle3": eagle, "B": b}, False),
        "rotating order": ({"plain": plain, "A": a, "eagle3": eagle, "B": b}, True),
        "fixed order without eagle3: plain, A, B": ({"plain": plain, "A": a, "B": b}, False),
    }
    report = {}
    for label, (decoders, rotate) in setups.items():
        runs = run_interleaved(decoders, ids, args.max_new_tokens, SamplingParams.greedy(), rotate=rotate)
        base = runs["plain"]["tokens_per_s"]
        report[label] = {name: e["tokens_per_s"] / base for name, e in runs.items()}
        speeds = ", ".join(f"{n} {v:.3f}x" for n, v in report[label].items())
        print(f"{label}: {speeds}; B / A = {report[label]['B'] / report[label]['A']:.3f}", file=sys.stderr)
    report = save(args.out / "order_effect.json", report, args=args, started=started)
    return report


if __name__ == "__main__":
    main()
