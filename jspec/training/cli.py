"""``jspec train``: a draft head trained end to end (the parser and the command; :mod:`jspec.cli.main` is the
entry point)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import jax

from jspec.analysis.bench import run_prompts
from jspec.analysis.prompts import load_prompts
from jspec.cli.common import add_mesh_options, mesh_from_args
from jspec.core.sampling import SamplingParams
from jspec.drafters import EagleDrafter, MedusaDrafter
from jspec.drafters.medusa import best_branching
from jspec.loop.engine import SpeculativeDecoder
from jspec.methods import DEFAULTS
from jspec.models.hub import load_model
from jspec.training import Recipe, TrainConfig, train_head
from jspec.training.conversations import DatasetName

__all__ = ["add_train_command"]


def add_train_command(sub, positive_int, add_json) -> None:
    """Registers ``jspec train`` on the command line's subparsers."""
    p = sub.add_parser("train", help="train a draft head (EAGLE-3 with training-time test, EAGLE-1, or Medusa heads)")
    p.add_argument("kind", choices=["eagle3", "eagle1", "medusa"])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", required=True, help="folder for the head, its checkpoints and (by default) its data")
    p.add_argument("--data", default=None, help="training data folder (made there once; default OUT/data)")
    p.add_argument("--prompts", type=positive_int, default=2000, help="training prompts to make")
    p.add_argument("--prompt-source", choices=["stdlib", "self"], default="stdlib",
                   help="stdlib: requests built from the standard library's docs; self: user turns written by the "
                        "target itself (Magpie), none sharing 8 words with an evaluation prompt")  # fmt: skip
    p.add_argument("--data-file", action="append", default=[], metavar="F.jsonl",
                   help="your conversations, ShareGPT ('conversations': from/value) or OpenAI chat ('messages': "
                        "role/content), trained on as written (loss on assistant turns) not prompts")  # fmt: skip
    p.add_argument("--dataset", action="append", default=[], metavar="NAME[:SPLIT]",
                   help="a Hugging Face dataset of such conversations by name (split train by default), from the "
                        "local datasets cache or the Hub (HF_HUB_OFFLINE=1: the cache only); "
                        "needs jspec[datasets]")  # fmt: skip
    p.add_argument("--features", choices=["stored", "online"], default="stored",
                   help="stored: the target's hidden states kept per training token (~4.6 KB a token for SmolLM2); "
                        "online: computed in each training step from the token ids (5 bytes a token)")  # fmt: skip
    p.add_argument("--regenerate", action="store_true",
                   help="with --data-file: the target rewrites every assistant turn first (its own continuations; "
                        "--max-new-tokens each), else the text as given")  # fmt: skip
    p.add_argument(
        "--extra-data",
        action="append",
        default=[],
        metavar="DIR",
        help="a data folder made by an earlier run (same model, layers, --seq-len) to train on too",
    )
    p.add_argument(
        "--init",
        default=None,
        metavar="HEAD_DIR",
        help="start from a saved head (fine-tuning; its draft vocabulary is kept)",
    )
    p.add_argument(
        "--warm-start",
        action="store_true",
        help="start a new head's layer, fusion and output from the target's own weights (learns faster on little data)",
    )
    p.add_argument("--seq-len", type=positive_int, default=256)
    p.add_argument("--max-new-tokens", type=positive_int, default=192, help="response length when regenerating")
    p.add_argument("--gen-batch", type=positive_int, default=16)
    p.add_argument(
        "--draft-vocab",
        type=positive_int,
        default=None,
        help="EAGLE: the K most frequent target tokens (default 8192; Medusa drafts from the whole vocabulary)",
    )
    p.add_argument("--medusa-heads", type=positive_int, default=None, help="Medusa: heads K (default 4)")
    p.add_argument("--decay", type=float, default=0.8,
                   help="loss weight of TTT step / Medusa head k: decay ** k")  # fmt: skip
    p.add_argument("--feature-layers", default=None, help="e.g. 2,15,27 (default: 2, L/2, L-3)")
    p.add_argument("--steps", type=positive_int, default=1000)
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="examples per micro-batch (with --accumulate K a step trains on K micro-batches)")  # fmt: skip
    p.add_argument("--accumulate", type=positive_int, default=1, metavar="K",
                   help="gradient accumulation: each step sums the gradients of K micro-batches run one after "
                        "another (the step of one batch of K x --batch-size examples in one's memory)")  # fmt: skip
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="compute dtype of the forward and backward passes, the target's weights too; the head's "
                        "weights and optimizer stay float32 (default: float32 on CPU, bfloat16 elsewhere)")  # fmt: skip
    p.add_argument("--ttt-steps", type=positive_int, default=None, help="EAGLE-3: training-time-test steps (default 7)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: min(50, steps // 10))")
    p.add_argument("--checkpoint-every", type=positive_int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-after", type=positive_int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--eval-prompts", type=int, default=4, help="held-out MT-bench prompts for tau at the end")
    p.add_argument("--eval-tokens", type=positive_int, default=64)
    p.add_argument("--num-draft", type=positive_int, default=5)
    p.add_argument("--tiny", action="store_true", help="a minute-long run on tiny settings (tests, notebooks)")
    add_mesh_options(p)
    add_json(p)
    p.set_defaults(fn=_cmd_train)


def _cmd_train(args) -> int:
    for path in args.data_file:  # checked before the model loads (their rows when the tokenizer is there)
        if not pathlib.Path(path).exists():
            raise ValueError(f"--data-file {path}: no such file (a JSONL file of ShareGPT or OpenAI chat rows, or a "
                             "folder a Hugging Face dataset was saved to).")  # fmt: skip
    if args.dataset:  # found (or refused by name) before the model loads
        for name in args.dataset:
            DatasetName(name).open()
    if args.regenerate and not (args.data_file or args.dataset):
        raise ValueError("--regenerate rewrites the assistant turns of --data-file or --dataset conversations; "
                         "pass one.")  # fmt: skip
    if (args.data_file or args.dataset) and args.prompt_source != "stdlib":
        raise ValueError("--prompt-source chooses prompts to regenerate from; --data-file and --dataset train on "
                         "your conversations as written. Pass one of them.")  # fmt: skip
    for folder in args.extra_data:  # checked before the model loads
        if not (pathlib.Path(folder) / "meta.json").is_file():
            raise ValueError(f"--extra-data {folder} holds no finished data set (no meta.json); "
                             "pass a --data folder of an earlier run.")  # fmt: skip
    if args.init and not (pathlib.Path(args.init) / "head.json").is_file():
        raise ValueError(f"--init {args.init} holds no saved head (no head.json); pass a folder jspec train wrote.")
    if args.init and args.warm_start:
        raise ValueError("--warm-start starts a new head from the target's weights and --init from a saved head; "
                         "pass one of them.")  # fmt: skip
    medusa = args.kind == "medusa"
    for flag, value in (("--draft-vocab", args.draft_vocab), ("--ttt-steps", args.ttt_steps)):
        if medusa and value is not None:
            raise ValueError(f"{flag} is an EAGLE option; Medusa heads draft from the whole vocabulary, one head "
                             "per position (--medusa-heads).")  # fmt: skip
    if args.medusa_heads is not None and not medusa:
        raise ValueError("--medusa-heads is for `jspec train medusa`.")
    if args.ttt_steps is not None and args.kind == "eagle1":
        raise ValueError("--ttt-steps is for EAGLE-3 heads (EAGLE-1 trains without training-time test).")

    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    if args.tiny:
        recipe = dataclasses.replace(Recipe.tiny(args.kind), prompt_source=args.prompt_source, init_from=args.init,
                                     warm_start=args.warm_start, data_files=tuple(args.data_file),
                                     datasets=tuple(args.dataset), regenerate=args.regenerate,
                                     features=args.features)  # fmt: skip
        train = dataclasses.replace(recipe.train, accumulate=args.accumulate, compute_dtype=dtype)
        if medusa and args.medusa_heads:
            train = dataclasses.replace(train, num_steps=args.medusa_heads)
        recipe = dataclasses.replace(recipe, train=train)
    else:
        warmup = min(50, args.steps // 10) if args.warmup is None else args.warmup
        steps = {"eagle1": 1, "eagle3": args.ttt_steps or 7, "medusa": args.medusa_heads or 4}[args.kind]
        train = TrainConfig(
            num_steps=steps, batch_size=args.batch_size, decay=args.decay,
            total_steps=args.steps, warmup_steps=warmup, learning_rate=args.lr,
            checkpoint_every=args.checkpoint_every, seed=args.seed, accumulate=args.accumulate, compute_dtype=dtype,
        )  # fmt: skip
        layers = tuple(int(x) for x in args.feature_layers.split(",")) if args.feature_layers else None
        recipe = Recipe(
            args.kind, num_prompts=args.prompts, seq_len=args.seq_len, max_new_tokens=args.max_new_tokens,
            gen_batch=args.gen_batch, draft_vocab=args.draft_vocab or 8192, feature_layers=layers, train=train,
            prompt_source=args.prompt_source, init_from=args.init, warm_start=args.warm_start,
            data_files=tuple(args.data_file), datasets=tuple(args.dataset), regenerate=args.regenerate,
            features=args.features,
        )  # fmt: skip
    # --tiny runs each program for seconds, so compiling dominates: layers in a scan compile once
    # (the measured trade-off: docs/log, "`jspec train eagle3 --tiny` under a minute").
    mesh = mesh_from_args(args)  # joins the other processes (--coordinator) before anything loads
    data_axis = 1 if mesh is None else mesh.shape["data"]
    if recipe.train.batch_size % data_axis:
        raise ValueError(f"--batch-size {recipe.train.batch_size} does not split over the mesh's data axis of "
                         f"{data_axis}: choose a multiple of {data_axis}.")  # fmt: skip
    model, tokenizer = load_model(args.model, layer_loop="scan" if args.tiny else None, dtype=dtype)
    head, report = train_head(model, tokenizer, recipe, args.out, model_name=args.model, data_dir=args.data,
                              extra_data=args.extra_data, progress=not args.json, until=args.stop_after,
                              mesh=mesh)  # fmt: skip
    if jax.process_index() > 0:  # over several processes the first one evaluates, saves and reports
        return 0
    finished = report["steps"] >= recipe.train.total_steps
    evaluation = None
    if finished and args.eval_prompts:
        evaluation = _evaluate_head(head, model, tokenizer, args)
    final = report["final"] or {}
    out = {
        "head": str(args.out) if finished else None, "steps": report["steps"], "final_loss": final.get("total"),
        "tokens_per_s": report["tokens_per_s"], "out": str(args.out), "recipe": dataclasses.asdict(recipe),
        "report": report, "evaluation": evaluation,
    }  # fmt: skip
    if args.json:
        print(json.dumps(out, default=str))
    else:
        final = report["final"] or {}
        print(f"head: {args.out} ({report['steps']} steps, {report['examples']} examples, "
              f"{report['response_tokens']} response tokens)")  # fmt: skip
        if final:
            print("loss per TTT step: " + " ".join(f"{x:.3f}" for x in final["loss"]))
            print("top-1 agreement per TTT step: " + " ".join(f"{x:.3f}" for x in final["acc"]))
        if "rank_rates" in report:
            rates = report["rank_rates"]
            print(f"held-out rank rates per head ({report['held_out_examples']} examples), top 1..3: "
                  + "; ".join(" ".join(f"{x:.3f}" for x in row[:3]) for row in rates))  # fmt: skip
            n, shape = DEFAULTS.tree_nodes, ",".join(map(str, best_branching(rates, DEFAULTS.tree_nodes)))
            print(f"jspec generate --method medusa --tree measured: branching {shape} (at most --tree-nodes {n})")
        if evaluation:
            print(
                f"held-out {evaluation['prompts']} prompts, N = {evaluation['num_draft']}: tau {evaluation['tau']:.2f}"
            )
    return 0


def _evaluate_head(head, model, tokenizer, args) -> dict:
    """τ of the trained head on held-out MT-bench prompts (greedy, chain of --num-draft)."""

    prompts = load_prompts("mt-bench", None, args.eval_prompts)
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p.text}])) for p in prompts]
    if args.kind == "medusa":
        drafter = MedusaDrafter.from_heads(head, model, num_draft=min(args.num_draft, head.config.num_heads))
    else:
        drafter = EagleDrafter.from_head(head, model, num_draft=args.num_draft)
    decoder = SpeculativeDecoder(model, drafter, eos_ids=tokenizer.eos_token_ids)
    entry = run_prompts(decoder, ids, args.eval_tokens, SamplingParams.greedy(), progress=not args.json)
    return {"prompts": "mt-bench", "count": len(ids), "num_draft": args.num_draft, "tau": entry["tau"],
            "acceptance_by_position": entry["acceptance_by_position"]}  # fmt: skip
