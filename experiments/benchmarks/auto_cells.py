"""--method auto against plain decoding and fixed settings, per workload and temperature (issue 17's goals).

    python experiments/benchmarks/auto_cells.py [--model smollm2-135m] [--draft-model NAME]
        [--workloads mt-bench,humaneval,spec-bench:summarization,spec-bench:rag,spec-bench:math_reasoning]
        [--temperatures 0,1] [--tune-skip 8] [--tune-limit 4] [--tune-quick] [--limit 3] [--max-new-tokens 96]
        [--batch 1] [--num-draft 1,2,3,4,5,6,7] [--fixed ngram:N=3,ngram:N=7,...] [--out experiments/out] [--tiny]

First, for each workload, ``jspec tune`` in a process of its own on a slice of its prompts (``--tune-skip``
on, ``--tune-limit`` prompts); then, for each workload, on the first ``--limit`` prompts (never tuned on),
every decoder runs every prompt, taking turns prompt by prompt (:func:`jspec.analysis.bench.run_interleaved`):
plain decoding, fixed settings (prompt lookup N = 3 and 7, and where available the EAGLE-3 chain of 5 and
dynamic tree, the draft model at N = 4 and 7), the tuner's predicted best fixed setting, and ``auto`` with the
tuned config.
Reports per cell (workload x temperature): auto over plain with its 95% interval (paired over the
prompts at matched answer lengths, :func:`jspec.analysis.paired.speedup_interval`), auto over the best fixed
setting, whether the tuner's predicted best is among the two fastest measured, and the tuner's
predicted against measured speedups; and the goals over all cells: auto never measurably slower
than plain (every interval's upper end >= 1) and auto within 5% of the best fixed setting's mean
in at least 80% of the cells; each decoder's tokens and seconds per prompt (``batches``: a cell read
again with another estimate needs no run). ``--tune-quick`` tunes with ``jspec tune --quick`` (its own prompt
count and length); ``--fixed`` names the fixed settings instead. Writes ``auto_cells.json`` (after
every cell) and ``auto_cells.png`` to --out; run again with the same arguments, it keeps the cells
that file holds and the workloads' tuned configs, and measures only what is missing; a cell cut short
resumes at its next prompt (``journal_*.jsonl``, removed once the cell is saved).
"""

from __future__ import annotations

import gc
import json
import pathlib
import subprocess
import sys
import time

from jspec.analysis.harness import arguments, plot, save


def _tune(args, workload: str, prompts: str, category: str | None, out: pathlib.Path) -> dict:
    argv = ["tune", "--model", args.model, "--prompts", prompts, "--skip", str(args.tune_skip),
            "--temperature", args.temperatures, "--batch", str(args.batch), "--out", str(out), "--json"]  # fmt: skip
    if args.tune_quick:
        argv += ["--quick"]
    else:
        argv += ["--limit", str(args.tune_limit), "--max-new-tokens", str(args.max_new_tokens)]
    argv += ["--category", category] if category else []
    argv += ["--draft-model", args.draft_model] if args.draft_model else []
    argv += ["--num-draft", "1,2,3", "--methods", "ngram"] if args.tiny else []
    argv += ["--num-draft", args.num_draft] if args.num_draft and not args.tiny else []
    argv += ["--limit", "2", "--max-new-tokens", "12"] if args.tiny and args.tune_quick else []
    # A process of its own, whose memory leaves with it (main: every tune runs before the models load).
    done = subprocess.run([sys.executable, "-m", "jspec.cli.main", *argv], stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"jspec tune failed for {workload} (exit {done.returncode}): {done.stdout}")
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, model="smollm2-135m")
    parser.add_argument("--draft-model", default=None)
    workloads = "mt-bench,humaneval,spec-bench:summarization,spec-bench:rag,spec-bench:math_reasoning"
    parser.add_argument("--workloads", default=workloads)
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--tune-skip", type=int, default=8)
    parser.add_argument("--tune-limit", type=int, default=4)
    parser.add_argument("--tune-quick", action="store_true", help="tune with jspec tune --quick")
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--num-draft", default=None, help="chain lengths the tuner considers (default 1..7)")
    parser.add_argument("--fixed", default=None,
                        help="fixed settings, e.g. ngram:N=3,eagle3:N=5,eagle3:tree=dynamic (default: prompt "
                             "lookup N = 3, 7; EAGLE-3 N = 5 and dynamic tree; draft N = 4, 7)")  # fmt: skip
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("experiments/out"))
    parser.add_argument("--tiny", action="store_true", help="one workload, T = 0, 2 prompts, 12 tokens (tests)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.workloads, args.temperatures, args.tune_limit, args.limit, args.max_new_tokens = (
            "humaneval", "0", 1, 1, 12)  # fmt: skip

    import jax

    from jspec.analysis.bench import run_interleaved
    from jspec.analysis.paired import speedup, speedup_interval
    from jspec.analysis.prompts import load_prompts
    from jspec.api import make_decoder
    from jspec.core.sampling import SamplingParams
    from jspec.loop.xla_cache import enable_compilation_cache
    from jspec.models.hub import load_model, shipped_head
    from jspec.tune.tuned import Setting, TunedConfig

    enable_compilation_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        head = None if args.tiny else shipped_head(args.model, "eagle3")
    except ValueError:
        head = None
    fixed = [Setting("ngram", num_draft=3)] + ([] if args.tiny else [Setting("ngram", num_draft=7)])
    if head is not None:
        fixed += [Setting("eagle3", num_draft=5), Setting("eagle3", tree="dynamic")]
    if args.draft_model:
        fixed += [Setting("draft", num_draft=4), Setting("draft", num_draft=7)]
    if args.fixed:
        fixed = [_setting_of(name.strip()) for name in args.fixed.split(",") if name.strip()]
    specs = ["ar", *(s.name for s in fixed), "auto"]
    run_args = {k: str(v) for k, v in vars(args).items() if k != "out"}
    saved = args.out / "auto_cells.json"
    previous = json.loads(saved.read_text()) if saved.exists() else {}
    same = previous.get("args") == run_args  # a killed run of the same grid: keep its cells and tunes
    cells, tuned_runs = (previous["cells"], previous.get("tune", {})) if same else ([], {})
    if not same:  # another grid's half-run cells (their journals) must not be resumed into this one
        for stale in args.out.glob("journal_*.jsonl"):
            stale.unlink()
    done = {(c["workload"], c["temperature"]) for c in cells}
    temperatures = [float(x) for x in args.temperatures.split(",")]
    todo = [w for w in args.workloads.split(",") if not all((w, t) in done for t in temperatures)]
    # Every tune first, each in a process of its own, before this process loads the models: the tuner
    # loads them too, and with both copies in one process (21.5 GB resident for the Qwen pair in float32)
    # a grid was killed for memory at 24 GB in its second workload's tune (docs/log, 2026-12-05).
    for workload in todo:
        if workload not in tuned_runs:  # else tuned before the run was killed
            prompts, _, category = workload.partition(":")
            t0 = time.perf_counter()
            tuned = _tune(
                args, workload, prompts, category or None, args.out / f"tuned_{workload.replace(':', '_')}.json"
            )
            config = TunedConfig.from_json(tuned["config"])
            tuned_runs[workload] = {"seconds": time.perf_counter() - t0, "config": tuned["config"],
                                    "candidates": config.candidates,
                                    "recommendations": [r.to_json() for r in config.recommendations]}  # fmt: skip
            save(saved, {"args": run_args, "cells": cells, "tune": tuned_runs, "partial": True}, args=args,
                 specs=specs, started=started)  # fmt: skip
    model, tokenizer = load_model(args.model)
    eos = tokenizer.eos_token_ids
    draft_model = load_model(args.draft_model)[0] if args.draft_model else None
    decoders: dict = {}

    def decoder(setting: Setting):
        if setting not in decoders:
            decoders[setting] = setting.decoder(model, eos_ids=eos, model_name=args.model, head=head,
                                                draft_model=draft_model)  # fmt: skip
        return decoders[setting]

    for workload in todo:
        # XLA on CPU maps each compiled program into memory regions of its own (65,530 per process):
        # drop every workload's programs before the next (a full run died there once, docs/log).
        decoders.clear()
        auto = runs_for = None  # the last workload's decoders, and their programs, go too
        gc.collect()
        jax.clear_caches()
        prompts, _, category = workload.partition(":")
        config = TunedConfig.from_json(tuned_runs[workload]["config"])
        auto = make_decoder("auto", model, eos_ids=eos, config=config, model_name=args.model, head=head,
                            draft_model=draft_model)  # fmt: skip
        chosen = load_prompts(prompts, category or None, args.limit)
        ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p.text}])) for p in chosen]
        for t in temperatures:
            if (workload, t) in done:
                continue
            rows = [r for r in config.candidates if r["temperature"] == t and r["batch"] == args.batch]
            spec = [r for r in rows if r["name"] != "ar" and not r["name"].endswith("+adaptive")]
            predicted_best = max(spec, key=lambda r: r["predicted_speedup"])["name"]
            settings = {s.name: s for s in fixed}
            if predicted_best not in settings:
                settings[predicted_best] = _setting_of(predicted_best)
            runs_for = {"ar": decoder(Setting("ar"))} | {n: decoder(s) for n, s in settings.items()} | {"auto": auto}
            # Every prompt's runs are kept as they finish: a killed cell resumes at its next prompt.
            journal = args.out / f"journal_{workload.replace(':', '_')}_T{t}.jsonl"
            runs = run_interleaved(runs_for, ids, args.max_new_tokens, SamplingParams.create(t), batch=args.batch,
                                   journal=journal)  # fmt: skip
            speed = {name: speedup(e, runs["ar"]) for name, e in runs.items()}  # at matched answer lengths
            fixed_names = [n for n in runs if n not in ("ar", "auto")]
            best_fixed = max(fixed_names, key=speed.get)
            two_fastest = sorted([*fixed_names, "ar"], key=lambda n: -speed[n])[:2]
            rec = config.choose(t, args.batch)
            pred_errors = [r["measured_speedup"] / r["predicted_speedup"] - 1 for r in rows
                           if "measured_speedup" in r and r["name"] != "ar"]  # fmt: skip
            intervals = {name: list(speedup_interval(e, runs["ar"])) for name, e in runs.items()}
            cell = {
                "workload": workload, "temperature": t, "batch": args.batch, "prompts": len(ids),
                "auto_ran": runs["auto"].get("setting"), "recommended": rec.setting.name,
                "speedup": speed, "speedup_interval": intervals, "tau": {n: e["tau"] for n, e in runs.items()},
                "auto_over_plain": speed["auto"], "auto_over_plain_interval": intervals["auto"],
                "best_fixed": best_fixed,
                "auto_over_best_fixed": speed["auto"] / max(speed[best_fixed], 1.0),
                "predicted_best": predicted_best, "predicted_best_in_two_fastest": predicted_best in two_fastest,
                "tune_prediction_errors": pred_errors, "compile_seconds": {n: e["compile_seconds"] for n, e in
                                                                            runs.items()},
                "resumed_batches": runs["ar"]["resumed_batches"],
                "batches": {n: {k: e[k] for k in ("batch_tokens", "batch_seconds")} for n, e in runs.items()},
            }  # fmt: skip
            cells.append(cell)
            save(saved, {"args": run_args, "cells": cells, "tune": tuned_runs, "partial": True}, args=args,
                 specs=specs, started=started)  # fmt: skip
            journal.unlink()  # the cell is saved
            lo, hi = intervals["auto"]
            print(f"{workload} T={t}: auto {speed['auto']:.3f}x plain ({lo:.3f}-{hi:.3f}; ran {cell['auto_ran']}), "
                  f"best fixed {best_fixed} {speed[best_fixed]:.3f}x; predicted best {predicted_best} "
                  f"{'in' if cell['predicted_best_in_two_fastest'] else 'NOT in'} the two fastest; "
                  f"tune errors {', '.join(f'{e:+.0%}' for e in pred_errors)}", file=sys.stderr)  # fmt: skip
    # An interval of (0, inf) (the answers' lengths could not be matched) decides nothing: not counted as met.
    undecided = [c["auto_over_plain_interval"][1] == float("inf") for c in cells]
    never_slower = [c["auto_over_plain_interval"][1] >= 1.0 and not u for c, u in zip(cells, undecided, strict=True)]
    near_best = [c["auto_over_best_fixed"] >= 0.95 for c in cells]
    goals = {"never_measurably_slower": all(never_slower), "cells": len(cells),
             "cells_never_slower": sum(never_slower), "cells_undecided": sum(undecided),
             "cells_within_5pct_of_best_fixed": sum(near_best),
             "within_5pct_in_80pct_of_cells": sum(near_best) >= 0.8 * len(cells)}  # fmt: skip
    print(f"goals: auto's interval reaches 1.0 in {sum(never_slower)} of {len(cells)} cells ({sum(undecided)} with "
          f"no interval); within 5% of the best fixed setting in {sum(near_best)} of {len(cells)}",
          file=sys.stderr)  # fmt: skip
    report = {"args": run_args, "model": args.model, "draft_model": args.draft_model,
              "max_new_tokens": args.max_new_tokens, "limit": args.limit, "tune_quick": args.tune_quick,
              "tune": tuned_runs, "cells": cells, "goals": goals}  # fmt: skip
    report = save(saved, report, args=args, specs=specs, started=started)
    _plot(cells, args.out / "auto_cells.png", args.model)
    return report


def _setting_of(name: str):
    from jspec.tune.tuned import Setting

    shape, _, _ = name.partition("+")
    method, _, rest = shape.partition(":")
    key, _, value = rest.partition("=")
    return Setting(method, num_draft=int(value)) if key == "N" else Setting(method, tree=value)


def _plot(cells, path, model) -> None:
    labels = [f"{c['workload'].replace('spec-bench:', '')}\nT={c['temperature']:g}" for c in cells]
    x = range(len(cells))
    with plot(path, figsize=(max(6, 1.1 * len(cells)), 4)) as fig:
        ax = fig.subplots()
        ax.bar([i - 0.2 for i in x], [c["speedup"][c["best_fixed"]] for c in cells], 0.4, label="best fixed setting")
        autos = [c["auto_over_plain"] for c in cells]
        bounds = [c.get("auto_over_plain_interval", (a, a)) for a, c in zip(autos, cells, strict=True)]
        spans = [[a - lo for a, (lo, _) in zip(autos, bounds, strict=True)],
                 [hi - a for a, (_, hi) in zip(autos, bounds, strict=True)]]  # fmt: skip
        ax.bar([i + 0.2 for i in x], autos, 0.4, yerr=spans, capsize=3, label="auto (95% interval)")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(0.97, color="r", lw=0.6, ls="--", label="0.97x plain (goal floor)")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set(ylabel="speedup over plain decoding", title=f"{model}: auto against the best fixed setting")
        ax.legend(fontsize=8)


if __name__ == "__main__":
    main()
