"""``jspec generate`` and ``jspec bench``: decoders on real models (the parser and the commands;
:mod:`jspec.cli.main` is the entry point)."""

from __future__ import annotations

import json
import sys
import time

import jax

from jspec.analysis.bench import run_interleaved
from jspec.analysis.paired import speedup, speedup_interval
from jspec.analysis.prompts import load_prompts
from jspec.api import make_decoder
from jspec.cli.common import (
    add_mesh_options,
    add_model_options,
    mesh_from_args,
    on_interrupt,
    plot_bench,
    stream_printer,
)
from jspec.core.sampling import SamplingParams
from jspec.drafters.base import draft_depth
from jspec.methods import DEFAULTS, METHODS, AutoSpec, PlainSpec, parse_all, parse_tree
from jspec.models.hub import load_model
from jspec.tune.tuned import load_tuned

__all__ = ["add_decode_commands"]

HEAD_HELP = "folder of a trained EAGLE head or of Medusa heads (default: the EAGLE head shipped for --model)"


def _tree(args):
    """--tree and its knobs as a draft shape (:func:`jspec.methods.parse_tree`); None for a chain."""

    return parse_tree(args.tree, top_k=args.tree_top_k, depth=args.tree_depth, total=args.tree_nodes)


def _num_draft(args) -> int:
    """N as the drafters take it: --num-draft, or the shared default for a chain, or the tree's depth."""

    return draft_depth(args.num_draft, _tree(args))


def _specs(args, methods, draft_model=None, workload=None) -> list:
    """Each method's spec with the flags it takes (:func:`jspec.methods.parse_all`): a flag no method
    takes, an unknown method or a bad option is refused by name before any model is loaded."""

    given = {"num_draft": args.num_draft, "tree": _tree(args), "head": args.head, "config": args.config,
             "draft_model": draft_model or args.draft_model, "ngram_min": args.ngram_min, "ngram_max": args.ngram_max,
             "window": args.lookahead_window, "level": args.lookahead_level, "guesses": args.lookahead_guesses,
             "pool_size": args.lookahead_pool}  # fmt: skip
    flags = {k: "--" + k.replace("_", "-") for k in given}
    flags |= {"window": "--lookahead-window", "level": "--lookahead-level", "guesses": "--lookahead-guesses",
              "pool_size": "--lookahead-pool"}  # fmt: skip
    specs = parse_all(methods, context={"workload": workload}, flags=flags, **given)
    if args.config and any(isinstance(s, AutoSpec) for s in specs):
        # a damaged file, another model's, or one without the temperature's band: refused before any model loads
        load_tuned(args.config, model=args.model).choose(args.temperature)
    return specs


def _decoder(spec, args, model, tokenizer, mesh=None):
    """The decoder of a method's spec (:func:`jspec.api.make_decoder`): plain, prompt lookup, a draft
    model, an EAGLE head (``--head``, or the one shipped for ``--model``), Medusa, Lookahead, or auto
    (``--config``, else the config tuned for the workload or last for the model, else the cost profile)."""

    return make_decoder(spec, model, eos_ids=tokenizer.eos_token_ids, mesh=mesh, model_name=args.model)


def jax_process_index() -> int:

    return jax.process_index()


def _cmd_generate(args) -> int:

    started = time.time()
    sampling = SamplingParams.create(args.temperature, args.top_k, args.top_p)
    if not args.prompt:
        raise ValueError("--prompt is empty; give the text to continue.")
    (spec,) = _specs(args, [args.method])
    if args.stream and args.json:
        raise ValueError("--stream prints the text as it comes and --json one object at the end; drop one of them.")
    mesh = mesh_from_args(args)
    if mesh is not None and mesh.is_multi_process and args.stream:
        raise ValueError("--stream prints from one process; a run over several processes prints at the end.")
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    loaded = time.time()
    text = args.prompt
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    ids = tokenizer.encode(text)
    decoder = _decoder(spec, args, model, tokenizer, mesh=mesh)
    # Always listening (the loop resumed one step at a time: jspec.loop.batching.drive), so that a Ctrl-C still
    # prints what was generated; --stream prints it as it comes.
    printer = stream_printer(tokenizer, show=args.stream)

    def interrupted():
        if args.json:  # still one object on stdout
            print(json.dumps({"interrupted": True, "text": tokenizer.decode(printer.latest), "tokens": printer.latest}))
        else:
            printer.interrupted()

    listen = mesh is None or not mesh.is_multi_process
    with on_interrupt(interrupted):
        result = decoder.generate([ids], args.max_new_tokens, sampling, seed=args.seed,
                                  on_tokens=printer if listen else None)  # fmt: skip
    if mesh is not None and jax_process_index() > 0:
        return 0  # every process has the result; the first one prints it
    new = result.tokens[0]
    completion = tokenizer.decode(new)
    if args.json:
        stats = result.stats() | {"prompt_tokens": len(ids), "method": args.method, "spec": spec.to_json()}
        first = None if printer.first_at is None else round(printer.first_at - started, 3)
        stats["startup"] = {"started_at": started, "load_s": round(loaded - started, 3),  # since the command began
                            "compile_s": round(result.compile_seconds, 3), "first_token_s": first}  # fmt: skip
        print(json.dumps({"text": completion, "tokens": new, "stats": stats}))
    else:
        printer.finish(completion) if args.stream else print(completion)
        tau = f", tau {result.tau:.2f}" if result.speculative else ""
        ran = f"{args.method} ran {result.setting} from the {decoder.source}; " if result.setting else ""
        print(
            f"[{ran}{len(new)} tokens in {result.seconds:.2f} s, {result.tokens_per_s:.1f} tokens/s{tau}; "
            f"compile {result.compile_seconds:.1f} s]",
            file=sys.stderr,
        )
    return 0


def _cmd_bench(args) -> int:

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    named = _specs(args, methods)  # checked before anything loads; recorded with the results
    sampling = SamplingParams.create(args.temperature, args.top_k, args.top_p)
    prompts = load_prompts(args.prompts, args.category, args.limit, args.skip)
    mesh = mesh_from_args(args)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p.text}])) for p in prompts]
    draft_model = load_model(args.draft_model, dtype=args.dtype)[0] if args.draft_model else None
    workload = args.prompts + (f":{args.category}" if args.category else "")
    specs = dict(zip(methods, _specs(args, methods, draft_model, workload), strict=True))
    decoders = {method: _decoder(spec, args, model, tokenizer, mesh) for method, spec in specs.items()}
    first = mesh is None or jax_process_index() == 0  # over several processes the first one reports
    results = run_interleaved(decoders, ids, args.max_new_tokens, sampling, seed=args.seed,
                              progress=first and not args.json)  # fmt: skip
    if not first:
        return 0
    for method, entry in results.items():
        entry["spec"] = dict(zip(methods, named, strict=True))[method].to_json()
        print(f"  {method}: {entry['tokens_per_s']:.2f} tokens/s, tau {entry['tau']:.2f}", file=sys.stderr)
    plain = next((results[m] for m, spec in specs.items() if isinstance(spec, PlainSpec)), None)
    if plain is not None:
        for entry in results.values():
            entry["speedup"] = speedup(entry, plain)  # at matched answer lengths
            entry["speedup_interval"] = list(speedup_interval(entry, plain))  # 95%, paired over prompts
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
        "dtype": str(model.embed[...].dtype),
        "methods": results,
    }
    if args.plot:
        plot_bench(out, args.plot)
    if args.json:
        print(json.dumps(out))
    else:
        shape = f"N = {_num_draft(args)}" if args.tree == "chain" else f"tree {args.tree}"
        print(f"{args.model} on {len(prompts)} {args.prompts} prompts, T = {args.temperature}, {shape}")
        print(f"{'method':<8} {'tau':>6} {'tokens/s':>9} {'speedup':>8} {'95% interval':>13} {'compile s':>10}")
        for name, e in results.items():
            sp = f"{e['speedup']:.2f}x" if "speedup" in e else "-"
            interval = "{:.2f}-{:.2f}x".format(*e["speedup_interval"]) if "speedup_interval" in e else "-"
            ran = f"  (ran {e['setting']})" if e.get("setting") else ""
            print(f"{name:<8} {e['tau']:>6.2f} {e['tokens_per_s']:>9.2f} {sp:>8} {interval:>13} "
                  f"{e['compile_seconds']:>10.1f}{ran}")  # fmt: skip
        if "speedup_interval" in next(iter(results.values())):
            print(f"(95% intervals: paired over the {len(prompts)} prompts, Student's t on the log ratios)")
    return 0


def _add_ngram(p, positive_int) -> None:
    p.add_argument("--ngram-min", type=positive_int, default=None,
                   help=f"prompt lookup: the shortest suffix that counts as a match (default {DEFAULTS.ngram_min}: "
                        "a single repeated token drafts too often in vain)")  # fmt: skip
    p.add_argument("--ngram-max", type=positive_int, default=None,
                   help=f"prompt lookup: the longest suffix tried first (default {DEFAULTS.ngram_max})")  # fmt: skip


def _add_lookahead(p, positive_int) -> None:

    d = DEFAULTS
    p.add_argument("--lookahead-window", type=positive_int, default=None,
                   help=f"lookahead: W, Jacobi columns (default {d.lookahead_window})")  # fmt: skip
    p.add_argument(
        "--lookahead-level",
        type=positive_int,
        default=None,
        help=f"lookahead: N, the n-gram size; the window has N - 1 levels (default {d.lookahead_level})",
    )
    p.add_argument(
        "--lookahead-guesses",
        type=positive_int,
        default=None,
        help=f"lookahead: G, candidate n-grams verified per step (default {d.lookahead_guesses})",
    )
    p.add_argument("--lookahead-pool", type=positive_int, default=None,
                   help=f"lookahead: n-grams kept per row (default {d.lookahead_pool})")  # fmt: skip


def _add_tree(p, positive_int) -> None:

    tree_help = (
        "chain (N = --num-draft), dynamic (EAGLE-2), measured (Medusa: the best tree for the heads' "
        "measured acceptance) or a static branching list such as 2,2,2"
    )
    p.add_argument("--tree", default="chain", help=tree_help)
    num_help = f"N, tokens drafted per step (default {DEFAULTS.num_draft}; a tree's depth is its own)"
    p.add_argument("--num-draft", type=positive_int, default=None, help=num_help)
    p.add_argument("--tree-top-k", type=positive_int, default=DEFAULTS.tree_top_k,
                   help="dynamic tree: children per expanded node")  # fmt: skip
    p.add_argument("--tree-depth", type=positive_int, default=DEFAULTS.tree_depth, help="dynamic tree: depth")
    p.add_argument("--tree-nodes", type=positive_int, default=DEFAULTS.tree_nodes,
                   help="dynamic or measured tree: nodes, root included")  # fmt: skip


def _methods() -> tuple[str, ...]:
    return METHODS


def add_decode_commands(sub, positive_int, add_json) -> None:
    """Adds ``jspec generate`` and ``jspec bench`` to the ``jspec`` parser's subcommands."""
    p = sub.add_parser("generate", help="generate text with a real model")
    add_model_options(p)
    p.add_argument(
        "--method",
        default="ar",
        choices=_methods(),
        help="ar: plain decoding; ngram: prompt lookup; draft: a smaller draft model (--draft-model); "
        "eagle3 / eagle1: an EAGLE head (the shipped one, or --head DIR); medusa: Medusa heads (--head DIR); "
        "lookahead: Lookahead decoding (Jacobi n-grams, no second model; --lookahead-*); "
        "auto: what measured fastest here (a tuned config from jspec tune, else the cost profile with the "
        "adaptive fallback)",
    )
    p.add_argument("--config", default=None, help="method auto: a tuned config (jspec tune --out FILE)")
    p.add_argument(
        "--head",
        default=None,
        help="an EAGLE head or Medusa heads: a folder or Hub id ORG/NAME[@REV], saved by jspec or published by "
        "SafeAILab/EAGLE, SpecForge, speculators or Medusa (default: the one shipped)",
    )
    p.add_argument("--draft-model", default=None, help="registry name or folder of the draft model (--method draft)")
    _add_tree(p, positive_int)
    _add_ngram(p, positive_int)
    _add_lookahead(p, positive_int)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 keeps every token")
    p.add_argument("--top-p", type=float, default=1.0, help="1 keeps every token")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--stream", action="store_true", help="print the text as tokens are accepted")
    add_mesh_options(p)
    add_json(p)
    p.set_defaults(fn=_cmd_generate)

    p = sub.add_parser("bench", help="methods side by side on a prompt set (compilation timed apart)")
    add_model_options(p)
    p.add_argument("--plot", default=None, metavar="FILE.png", help="tokens/s and tau per method")
    p.add_argument("--methods", default="ar,ngram", help=f"comma-separated: {', '.join(_methods())}")
    p.add_argument(
        "--head",
        default=None,
        help="an EAGLE head or Medusa heads: a folder or Hub id ORG/NAME[@REV], saved by jspec or published by "
        "SafeAILab/EAGLE, SpecForge, speculators or Medusa (default: the one shipped)",
    )
    p.add_argument(
        "--prompts", default="spec-bench", help="mt-bench, humaneval, spec-bench or a Spec-Bench style jsonl path"
    )
    p.add_argument("--config", default=None, help="method auto: a tuned config (jspec tune --out FILE)")
    p.add_argument("--category", default=None, help="only prompts of this category")
    p.add_argument("--skip", type=int, default=0, help="leave out the first K prompts")
    p.add_argument("--limit", type=positive_int, default=8, help="the first K prompts (after --skip)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-model", default=None)
    _add_tree(p, positive_int)
    _add_ngram(p, positive_int)
    _add_lookahead(p, positive_int)
    add_mesh_options(p)
    add_json(p)
    p.set_defaults(fn=_cmd_bench)
