"""The adaptive engine against fixed speculation and plain decoding, on the real model, interleaved.

    python experiments/ablations/adaptive_fallback.py [--prompts mt-bench,humaneval] [--limit 3] [--max-new-tokens 96]
        [--temperatures 0] [--num-draft 5] [--widths 2,3,4] [--skip-forced] [--forced-off] [--out experiments/out]
        [--tiny]

For each prompt set and temperature, every decoder runs every prompt at batch 1, taking turns
prompt by prompt (:func:`jspec.analysis.bench.run_interleaved`): plain decoding; prompt lookup and the
shipped EAGLE-3 head with N drafts every step (fixed); the same drafters with the adaptive policy
and the step costs of this machine's cost profile (:mod:`jspec.tune`, measured or reused); and,
for the overhead of the adaptive machinery, the same with speculation made free (it then
speculates every step, like the fixed loop, and differs only by its bookkeeping). ``--forced-off`` adds
the opposite: speculation made so dear that the loop never speculates nor probes (every step is the
fallback: what falling back costs against plain decoding, and against fixed prompt lookup on
prompts where it finds no match). Every speedup is paired over the prompts at matched answer lengths and
carries a 95% interval (:func:`jspec.analysis.paired.speedup`, :func:`~jspec.analysis.paired.speedup_interval`). With
``--widths``, the EAGLE-3 head also runs with an adaptive draft length (the chain verified at one
of those widths or the full N + 1 per step, from the head's confidence and the measured r(w)),
beside fixed chains as long as each width.

Writes ``adaptive_fallback.json`` and ``adaptive_fallback.png`` (speedup over plain per decoder) to --out.
"""

from __future__ import annotations

import pathlib
import sys
import time

from jspec.analysis.harness import arguments, plot, save


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, model="smollm2-135m", prompts="mt-bench,humaneval", limit=3,
                       max_new_tokens=96, temperatures="0", out="experiments/out")  # fmt: skip
    parser.add_argument("--num-draft", type=int, default=5)
    parser.add_argument("--widths", default="", help="adaptive draft length for EAGLE-3: verify widths, e.g. 2,3,4")
    parser.add_argument("--skip-forced", action="store_true", help="leave out the forced-on (overhead) decoders")
    parser.add_argument("--forced-off", action="store_true", help="add the adaptive loops that never speculate")
    parser.add_argument("--tiny", action="store_true", help="one prompt, 16 tokens, prompt lookup only (tests)")
    args = parser.parse_args(argv)

    from jspec.analysis.bench import run_interleaved
    from jspec.analysis.paired import speedup, speedup_interval
    from jspec.analysis.prompts import load_prompts
    from jspec.core.sampling import SamplingParams
    from jspec.loop.adaptive import Adaptive, StepCosts
    from jspec.loop.decode import Decoder
    from jspec.loop.engine import SpeculativeDecoder
    from jspec.loop.xla_cache import enable_compilation_cache
    from jspec.methods import make_drafter
    from jspec.models.hub import load_model
    from jspec.tune.costs import load_profile, measure_profile, profile_path, save_profile

    enable_compilation_cache()
    if args.tiny:
        args.prompts, args.limit, args.max_new_tokens, args.num_draft = "humaneval", 1, 16, 2
    model, tokenizer = load_model(args.model)
    eos = tokenizer.eos_token_ids
    n = args.num_draft
    drafters = {"ngram": make_drafter("ngram", model, num_draft=n)}
    if not args.tiny:
        drafters["eagle3"] = make_drafter("eagle3", model, num_draft=n, model_name=args.model)
    names = {method: f"{method}:N={n}" for method in drafters}

    path = profile_path(args.model, 1, dtype="float32")
    profile = None if args.tiny else load_profile(path)  # the tiny run measures its own, and keeps it
    if profile is None or not set(names.values()) <= set(profile.drafters) or max(profile.forward_ms) < n + 1:
        max_k = n + 1 if args.tiny else max(8, n + 1)
        profile = measure_profile(model, args.model, {names[m]: d for m, d in drafters.items()}, max_k=max_k)
        if not args.tiny:
            save_profile(profile, path)
    widths = tuple(int(w) for w in args.widths.split(",") if w.strip())
    wanted = set(names.values()) | {f"eagle3:N={w - 1}" for w in widths}
    if widths and not args.tiny and (not wanted <= set(profile.drafters) or max(profile.forward_ms) < n + 1):
        raise SystemExit(f"the cost profile lacks {sorted(wanted - set(profile.drafters))}: jspec tune profile first")
    costs = {m: StepCosts.from_profile(profile, names[m], n + 1) for m in drafters}
    free = StepCosts.create(speculative=1e-3)
    dear, never = StepCosts.create(speculative=1e9), Adaptive(probe_every=2**30, max_probe_every=2**30)

    decoders = {"plain": Decoder(model, eos_ids=eos)}
    for method, drafter in drafters.items():
        decoders[f"{method} fixed"] = SpeculativeDecoder(model, drafter, eos_ids=eos)
        decoders[f"{method} adaptive"] = SpeculativeDecoder(model, drafter, eos_ids=eos, adaptive=Adaptive(),
                                                            costs=costs[method])  # fmt: skip
        if not args.skip_forced:
            decoders[f"{method} adaptive, forced on"] = SpeculativeDecoder(model, drafter, eos_ids=eos,
                                                                           adaptive=Adaptive(), costs=free)  # fmt: skip
        if args.forced_off:
            decoders[f"{method} adaptive, forced off"] = SpeculativeDecoder(model, drafter, eos_ids=eos,
                                                                            adaptive=never, costs=dear)  # fmt: skip
    if widths and "eagle3" in drafters:
        head = drafters["eagle3"]
        for w in widths:
            decoders[f"eagle3 fixed N={w - 1}"] = SpeculativeDecoder(
                model, make_drafter("eagle3", model, num_draft=w - 1, model_name=args.model), eos_ids=eos
            )
        length = StepCosts.from_profile(profile, names["eagle3"], n + 1, widths=widths)
        decoders[f"eagle3 adaptive, widths {args.widths}"] = SpeculativeDecoder(
            model, head, eos_ids=eos, adaptive=Adaptive(widths=widths), costs=length
        )

    results, over_fixed = {}, {}  # over_fixed: the forced-off loop's speed over fixed speculation's
    for name in args.prompts.split(","):
        prompts = load_prompts(name, None, args.limit)
        ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p.text}])) for p in prompts]
        for t in (float(x) for x in args.temperatures.split(",")):
            runs = run_interleaved(decoders, ids, args.max_new_tokens, SamplingParams.create(t))
            for key, entry in runs.items():  # paired at matched lengths: the interval's own estimate
                entry["speedup"] = speedup(entry, runs["plain"])
                entry["speedup_interval"] = list(speedup_interval(entry, runs["plain"]))
                results[f"{name}|T={t}|{key}"] = entry
                extra = (
                    f", fallback {entry['fallback_steps']} / verify {entry['verify_steps']}, "
                    f"drafts per verify {entry['drafts_per_verify']:.2f}"
                    if "tau" in entry and key != "plain"
                    else ""
                )
                lo, hi = entry["speedup_interval"]
                print(f"  {name} T={t} {key:<27} {entry['tokens_per_s']:7.2f} tokens/s  {entry['speedup']:.3f}x "
                      f"({lo:.3f}-{hi:.3f})  tau {entry['tau']:.2f}{extra}", file=sys.stderr)  # fmt: skip
            for method in drafters:
                off, fixed = runs.get(f"{method} adaptive, forced off"), runs[f"{method} fixed"]
                if off is not None:
                    lo, hi = speedup_interval(off, fixed)
                    ratio = speedup(off, fixed)
                    over_fixed[f"{name}|T={t}|{method}"] = {"ratio": ratio, "interval": [lo, hi]}
                    print(f"  {name} T={t} {method} forced off / fixed: {ratio:.3f}x ({lo:.3f}-{hi:.3f}); fixed "
                          f"drafted in {fixed['verify_steps']} of {fixed['verify_steps'] + fixed['plain_steps']} steps",
                          file=sys.stderr)  # fmt: skip
    report = {
        "model": args.model,
        "num_draft": n,
        "max_new_tokens": args.max_new_tokens,
        "profile": {"path": str(path), "step_ms": profile.step_ms, "relative_forward": {k: profile.relative_forward(k)
                    for k in sorted(profile.forward_ms)}, "costs": {m: c.speculative.item() for m, c in costs.items()}},
        "results": results,
        "forced_off_over_fixed": over_fixed,
    }  # fmt: skip
    report = save(args.out / "adaptive_fallback.json", report, args=args, started=started)
    _plot(results, args.out / "adaptive_fallback.png")
    return report


def _plot(results: dict, path: pathlib.Path) -> None:
    cells = sorted({key.rsplit("|", 1)[0] for key in results})
    methods = [m for m in dict.fromkeys(key.rsplit("|", 1)[1] for key in results) if m != "plain"]
    with plot(path, figsize=(min(14, 2 + 0.4 * len(methods) * len(cells)), 4), dpi=110) as fig:
        ax = fig.subplots()
        width = 0.8 / len(methods)
        for i, method in enumerate(methods):
            xs = [c + i * width for c in range(len(cells))]
            ax.bar(xs, [results[f"{cell}|{method}"]["speedup"] for cell in cells], width, label=method)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cells))], cells)
        ax.set_ylabel("speedup over plain decoding")
        ax.legend(fontsize=8)


if __name__ == "__main__":
    main()
