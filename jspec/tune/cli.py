"""``jspec tune``: the workload tuner, and ``jspec tune profile``, the machine's cost profile (the parsers
and the commands; :mod:`jspec.cli.main` is the entry point)."""

from __future__ import annotations

import hashlib
import json
import pathlib
import shutil
import sys
import time

from jspec.analysis.prompts import load_prompts
from jspec.cli.common import add_mesh_options, figure, mesh_from_args
from jspec.heads.formats import load_eagle
from jspec.methods import TUNED, needs_of, options_of, parse_tree
from jspec.models.hub import load_model, shipped_head
from jspec.tune.costs import ensure_profile, profile_drafters, weights_dtype
from jspec.tune.tuned import BANDS, TunedConfig, band_of, save_tuned, tuned_path
from jspec.tune.workload import available_families, tune_cell

__all__ = ["add_tune_commands"]


def add_tune_commands(sub, positive_int, add_json) -> None:
    """Registers ``jspec tune`` and ``jspec tune profile`` on the command line's subparsers."""
    p = sub.add_parser("tune", help="measure what pays on this machine and workload; recommend a setting")
    p.add_argument("--model", default="smollm2-135m", help="registry name or a Hugging Face model folder")
    p.add_argument("--prompts", default=None, help="the workload: mt-bench, humaneval, spec-bench or a jsonl path")
    p.add_argument("--category", default=None, help="only prompts of this category")
    p.add_argument("--skip", type=int, default=0, help="leave out the first K prompts (keep them for evaluation)")
    p.add_argument("--limit", type=positive_int, default=None, help="prompts to tune on (default 4; --quick 8)")
    p.add_argument("--max-new-tokens", type=positive_int, default=None, help="per prompt (default 96; --quick 32)")
    p.add_argument("--temperature", default="0,1",
                   help="temperatures to tune for, at most one per band (T = 0; 0 < T <= 0.7; T > 0.7)")  # fmt: skip
    p.add_argument("--batch", default="1", help="batch sizes to tune for, e.g. 1,8")
    p.add_argument("--num-draft", default=None, help="chain lengths N to consider (default 1,...,7; --quick 2,4,7)")
    trees_help = "trees to consider, separated by ';' (dynamic, 2,2,2, ...; default dynamic; --quick none)"
    p.add_argument("--trees", default=None, help=trees_help)
    p.add_argument(
        "--head",
        default=None,
        help="an EAGLE-3 head: a folder or Hub id, jspec's or a published one (default: the one shipped for --model)",
    )
    p.add_argument("--draft-model", default=None, help="a draft model to consider (registry name or folder)")
    p.add_argument("--methods", default=None,
                   help="only these drafter families (ngram, eagle3, draft); default every one available")  # fmt: skip
    p.add_argument("--verify-top", type=positive_int, default=None,
                   help="measure this many best predicted settings (default 2; --quick 1)")  # fmt: skip
    p.add_argument("--quick", action="store_true",
                   help="a first tuning in a few minutes: fewer compiled loops (chains at N = 2, 4, 7, no tree, the "
                        "best predicted one measured with and without the fallback) on more, shorter prompts "
                        "(8 of 32 tokens); any of those options given explicitly wins")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the tuned config here too (jspec generate --config FILE)")
    p.add_argument("--plot", default=None, help="a PNG of predicted against measured speedup per candidate")
    add_mesh_options(p)
    add_json(p)
    p.set_defaults(fn=_cmd_tune)
    tune = p.add_subparsers(dest="tune_command", required=False, metavar="[profile]")
    p = tune.add_parser("profile", help="the target's k-token forward cost and each drafter's step cost, cached")
    p.add_argument("--model", default="smollm2-135m", help="registry name or a Hugging Face model folder")
    p.add_argument("--batch", type=positive_int, default=1, help="rows per batch (measured at its power-of-two bucket)")
    p.add_argument("--num-draft", default="1,2,3,4,5,6,7", help="chain lengths N to measure each drafter at")
    p.add_argument("--trees", default="dynamic", help="trees to measure, separated by ';' (dynamic, 2,2,2, ...)")
    p.add_argument(
        "--head",
        default=None,
        help="an EAGLE-3 head: a folder or Hub id, jspec's or a published one (default: the one shipped for --model)",
    )
    p.add_argument("--draft-model", default=None, help="a draft model to measure too (registry name or folder)")
    p.add_argument("--max-k", type=positive_int, default=8, help="measure target forwards of 1..K tokens at least")
    p.add_argument("--force", action="store_true", help="measure again even when a cached profile covers the request")
    add_mesh_options(p)
    add_json(p)
    p.set_defaults(fn=_cmd_tune_profile)


def _cmd_tune_profile(args) -> int:

    num_drafts = _int_list(args.num_draft, "--num-draft")
    trees = _trees(args.trees)
    mesh = mesh_from_args(args)
    model, _ = load_model(args.model)
    draft_model = load_model(args.draft_model)[0] if args.draft_model else None
    drafters = profile_drafters(model, args.model, num_drafts=num_drafts, trees=trees, head=args.head,
                                draft_model=draft_model)  # fmt: skip
    profile, path, cached = ensure_profile(model, args.model, drafters, batch=args.batch, max_k=args.max_k,
                                           force=args.force, mesh=mesh)  # fmt: skip
    if args.json:
        print(json.dumps({"path": str(path), "cached": cached, "profile": profile.to_json()}))
        return 0
    how = "cached" if cached else f"measured in {profile.seconds:.0f} s"
    print(f"{args.model} on {profile.backend} ({profile.device_kind}, {profile.dtype}, batch bucket {profile.batch}): "
          f"{how}; {path}")  # fmt: skip
    print(f"one target step {profile.step_ms:.1f} ms; r(k), a k-token forward over one step:")
    print("  " + "  ".join(f"k={k}: {profile.relative_forward(k):.2f}" for k in sorted(profile.forward_ms)))
    print("drafter cost per step (propose + commit), in target steps:")
    for name in sorted(profile.drafters):
        print(f"  {name:<24} {profile.relative_drafter(name):.3f}")
    return 0


def _cmd_tune(args) -> int:
    """Probe, predict, measure and recommend for each batch size and temperature asked."""

    if args.prompts is None:
        raise ValueError("jspec tune needs --prompts SET|PATH (the workload to tune for), or the profile command.")
    quick = {"limit": 8, "max_new_tokens": 32, "num_draft": "2,4,7", "trees": "", "verify_top": 1}
    full = {"limit": 4, "max_new_tokens": 96, "num_draft": "1,2,3,4,5,6,7", "trees": "dynamic", "verify_top": 2}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    temperatures = _float_list(args.temperature, "--temperature")
    bands = [band_of(t) for t in temperatures]
    if len(set(bands)) < len(bands):
        raise ValueError(f"--temperature takes at most one temperature per band ({'; '.join(BANDS.values())}); "
                         f"got {args.temperature!r}.")  # fmt: skip
    batches = sorted(set(_int_list(args.batch, "--batch")))
    num_drafts = _int_list(args.num_draft, "--num-draft")
    trees = _trees(args.trees)
    for tree in trees:
        parse_tree(tree)  # a malformed tree is refused before anything loads
    wanted = None
    if args.methods:
        wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
        known = [m for m in TUNED if "num_draft" in options_of(m)]
        if set(wanted) - set(known) or not wanted:
            raise ValueError(f"--methods takes drafter families among {', '.join(known)}; got {args.methods!r}.")
        for method in wanted:
            if needs_of(method) == "draft_model" and not args.draft_model:
                raise ValueError(f"--methods {method} needs --draft-model NAME.")
    prompts = load_prompts(args.prompts, args.category, args.limit, args.skip)
    mesh = mesh_from_args(args)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    head = args.head
    if wanted is not None and not any(needs_of(m) == "head" for m in wanted):
        head = None
    elif head is None:
        try:
            head = shipped_head(args.model, "eagle3")
        except ValueError:
            head = None
    if head is not None:
        head = load_eagle(head, model)  # read once, for every probe and candidate
    draft_model = load_model(args.draft_model)[0] if args.draft_model else None
    if wanted is not None and not any(needs_of(m) == "draft_model" for m in wanted):
        draft_model = None
    families = available_families(head=head, draft_model=draft_model)
    if wanted is not None and set(wanted) - set(families):
        raise ValueError(f"--methods {args.methods}: {sorted(set(wanted) - set(families))} not available for "
                         f"{args.model} (eagle3 needs a shipped head or --head DIR).")  # fmt: skip
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p.text}])) for p in prompts]
    eos = tokenizer.eos_token_ids
    drafters = profile_drafters(model, args.model, num_drafts=num_drafts, trees=trees, head=head,
                                draft_model=draft_model)  # fmt: skip
    drafters = {name: d for name, d in drafters.items() if name.split(":")[0] in families}
    key = args.prompts + (f":{args.category}" if args.category else "")
    journals = tune_journals(args, tuned_path(args.model, dtype=weights_dtype(model), workload=key, mesh=mesh))
    print(f"journals: {journals} (a killed tune, run again alike, resumes from them)", file=sys.stderr)
    recs, rows, profiles, cache = [], [], {}, {}
    for batch in batches:
        profile, path, cached = ensure_profile(
            model, args.model, drafters, batch=batch, mesh=mesh, max_k=None if args.quick else 8
        )  # quick: the verify widths alone
        profiles[batch] = {"path": str(path), "cached": cached}
        print(f"cost profile at batch {batch}: {'cached' if cached else 'measured'} ({path})", file=sys.stderr)
        for t in temperatures:
            rec, table = tune_cell(model, eos, ids, temperature=t, batch=batch, profile=profile,
                                   max_new_tokens=args.max_new_tokens, families=families, num_drafts=num_drafts,
                                   trees=trees, model_name=args.model, head=head, draft_model=draft_model,
                                   verify_top=args.verify_top, seed=args.seed, cache=cache, mesh=mesh,
                                   journals=journals)  # fmt: skip
            recs.append(rec)
            rows.extend(table)
    workload = {"prompts": args.prompts, "category": args.category, "skip": args.skip, "limit": len(prompts),
                "max_new_tokens": args.max_new_tokens, "head": args.head, "draft_model": args.draft_model,
                "mesh": args.mesh}  # fmt: skip
    config = TunedConfig(model=args.model, vocab_size=model.config.vocab_size, backend=profile.backend,
                         device_kind=profile.device_kind, dtype=weights_dtype(model), workload=workload,
                         recommendations=recs, candidates=rows, seconds=time.perf_counter() - t0)  # fmt: skip
    saved = [save_tuned(config, tuned_path(args.model, dtype=config.dtype, workload=w, mesh=mesh)) for w in (key, None)]
    if args.out:
        saved.append(save_tuned(config, args.out))
    shutil.rmtree(journals, ignore_errors=True)  # the tune is saved: nothing left to resume
    if args.plot:
        _plot(rows, args.plot, f"{args.model} on {key} ({len(prompts)} prompts)")
    if args.json:
        print(json.dumps({"config": config.to_json(), "saved": [str(s) for s in saved], "profiles": profiles}))
        return 0
    _print_table(config)
    print(f"tuned in {config.seconds:.0f} s; saved to " + ", ".join(str(s) for s in saved))
    return 0


def tune_journals(args, tuned) -> pathlib.Path:
    """The folder of a tune's journals, beside its tuned config ``tuned``: one per set of arguments
    (``jspec tune``'s own, the output options aside), so a tune run again alike resumes and any other
    starts afresh. The prompts' ids, the sampling, the seed and the decoders' names are in each
    journal's key too."""

    kept = {k: v for k, v in sorted(vars(args).items()) if k not in {"out", "plot", "json", "fn", "command"}}
    digest = hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return tuned.parent / "journals" / f"{tuned.stem}-{digest}"


def _print_table(config) -> None:

    cells = {}
    for row in config.candidates:
        cells.setdefault((row["batch"], row["temperature"]), []).append(row)
    for (batch, t), rows in cells.items():
        print(f"\nT = {t} ({BANDS[rows[0]['band']]}), batch {batch}: speedup over plain decoding")
        print(f"  {'candidate':<28} {'predicted':>9} {'measured':>9} {'95% interval':>13} {'tau':>6}  "
              "acceptance at 1, 2, 3")  # fmt: skip
        for r in sorted(rows, key=lambda r: -r["predicted_speedup"]):
            measured = f"{r['measured_speedup']:.3f}x" if "measured_speedup" in r else "-"
            interval = "{:.2f}-{:.2f}x".format(*r["speedup_interval"]) if "speedup_interval" in r else "-"
            tau = f"{r['tau']:.2f}" if "tau" in r else "-"
            acc = ", ".join(f"{a:.2f}" for a in r.get("acceptance_by_position", [])[:3])
            mark = " (both rounds)" if r.get("rounds_pooled", 1) > 1 else ""
            mark += " <- recommended" if r["recommended"] else ""
            print(f"  {r['name']:<28} {r['predicted_speedup']:>8.3f}x {measured:>9} {interval:>13} {tau:>6}  "
                  f"{acc}{mark}")  # fmt: skip
    print()
    for rec in config.recommendations:
        interval = "" if rec.speedup_interval is None else ", 95% interval {:.2f}-{:.2f}x".format(*rec.speedup_interval)
        print(
            f"recommended for {BANDS[rec.band]}, batch {rec.batch}: {rec.setting.name} "
            f"(measured {rec.measured_speedup:.2f}x plain{interval}; predicted {rec.predicted_speedup:.2f}x)"
        )
    print(
        "(a drafter is recommended only when its whole interval lies above 1x; else plain decoding; speedups at "
        "matched answer lengths, a candidate measured in both rounds on both together)"
    )


def _plot(rows, path, title) -> None:
    measured = [r for r in rows if "measured_speedup" in r and r["name"] != "ar"]  # plain is 1 by definition
    fig = figure(figsize=(7, 6))
    ax = fig.subplots()
    cells = sorted({(r["batch"], r["temperature"]) for r in measured})
    for i, cell in enumerate(cells):
        pts = [r for r in measured if (r["batch"], r["temperature"]) == cell]
        ys = [r["measured_speedup"] for r in pts]
        spans = [[y - r.get("speedup_interval", (y, y))[0] for r, y in zip(pts, ys, strict=True)],
                 [r.get("speedup_interval", (y, y))[1] - y for r, y in zip(pts, ys, strict=True)]]  # fmt: skip
        ax.errorbar([r["predicted_speedup"] for r in pts], ys, yerr=spans, fmt="o", color=f"C{i}", capsize=3,
                    label=f"batch {cell[0]}, T = {cell[1]} (bars: 95% intervals)")  # fmt: skip
        for r in pts:
            ax.annotate(r["name"], (r["predicted_speedup"], r["measured_speedup"]), fontsize=7, alpha=0.8,
                        xytext=(3, 3), textcoords="offset points")  # fmt: skip
    lo = min(min(r["predicted_speedup"], *r.get("speedup_interval", [r["measured_speedup"]])) for r in measured) * 0.9
    hi = max(max(r["predicted_speedup"], *r.get("speedup_interval", [r["measured_speedup"]])) for r in measured) * 1.1
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="measured = predicted")
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="grey", alpha=0.15,
                    label="within 15%")  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.6)
    ax.set(xlabel="predicted speedup over plain decoding", ylabel="measured speedup", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _trees(text: str | None) -> list[str]:
    return [t.strip() for t in text.split(";") if t.strip()] if text else []


def _float_list(text: str, flag: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes numbers separated by commas, e.g. 0,1; got {text!r}.") from None
    if not values or any(not v >= 0 or v == float("inf") for v in values):
        raise ValueError(f"{flag} takes finite numbers >= 0; got {text!r}.")
    return values


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes whole numbers separated by commas, e.g. 1,2,3; got {text!r}.") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes whole numbers >= 1; got {text!r}.")
    return values
