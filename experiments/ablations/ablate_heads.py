"""Head-family ablation: EAGLE-3, EAGLE-1 and Medusa heads and their options, every cell trained on the same
token ids with the same steps, batches and seed, then scored the same way.

    python experiments/ablations/ablate_heads.py --data DIR [--model smollm2-135m] [--prompts 200] [--seq-len 160]
        [--max-new-tokens 128] --grid kind=eagle3,eagle1,medusa [--grid ttt=1,3] [--grid layers=default,1-15-27]
        [--grid vocab=2048,8192] [--grid decay=0.8] [--grid warm=0,1] [--steps 300] [--batch-size 4] [--seed 0]
        [--num-draft 4] [--heldout 16] [--eval-prompts mt-bench] [--limit 4] [--eval-tokens 48] [--tiny]
        [--out experiments/out/ablate_heads]

The data (``--data``): a folder made by ``jspec train`` or made here once (the target's greedy responses to
standard-library prompts, with its features at the default layers), or made from the token ids an earlier run
saved (``--ids OUT/ids.npz``: the features computed again, nothing generated); its last ``--heldout``
examples are never trained on. A cell whose feature layers are not the stored ones computes them in its steps from the
same ids (``Trainer.features_online``; float32 there, float16 stored). Options that do not apply to a kind
collapse: EAGLE-1 runs one TTT step and reads the top layer; Medusa has ``--num-draft`` heads over the whole
vocabulary and starts at zero.

Each cell reports:
- agreement per draft position, held out and teacher forced: how often the head's top-1 draft at position k
  is the token that follows (EAGLE: ``teacher_forced_agreement``; Medusa: head k's top-1 ``rank_rates``);
- τ and acceptance by position from a greedy decode, a chain of ``--num-draft``, on ``--eval-prompts``
  (another domain than the training data's), and τ on the first ``--limit`` held-out examples' own prompts;
- the predicted speedup τ / (r + c): r the verify forward of N + 1 tokens and c the cell's drafter (propose
  and commit per step), each over a plain step, measured taking turns in one run (``drafter_step_costs``).

Resumable: the grid and settings are recorded in ``OUT/ablate_heads.json`` with every finished cell; a rerun
with the same arguments keeps those cells (a killed cell resumes from its checkpoints), a rerun with other
arguments is refused. Writes a table, ``ablate_heads.json`` and ``ablate_heads.png``.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import sys
import time

from jspec.analysis.harness import arguments, plot, save

GRID_KEYS = {"kind": str, "ttt": int, "layers": str, "vocab": int, "decay": float, "warm": int}
DEFAULTS = {"kind": "eagle3", "ttt": 3, "layers": "default", "vocab": 8192, "decay": 0.8, "warm": 0}
KINDS = ("eagle3", "eagle1", "medusa")


def parse_grid(items: list[str]) -> dict:
    """``["kind=eagle3,medusa", "ttt=1,3"]`` -> {"kind": ["eagle3", "medusa"], "ttt": [1, 3]}; refuses unknown keys."""
    grid = {}
    for item in items:
        key, eq, values = item.partition("=")
        if not eq or key not in GRID_KEYS or not values:
            raise ValueError(f"--grid takes KEY=V1,V2 with KEY one of {', '.join(GRID_KEYS)}; got {item!r}.")
        if key in grid:
            raise ValueError(f"--grid names {key} twice; give its values once, comma-separated.")
        try:
            grid[key] = [GRID_KEYS[key](v) for v in values.split(",")]
        except ValueError:
            raise ValueError(f"--grid {key}: {values!r} are not {GRID_KEYS[key].__name__} values.") from None
    bad = [k for k in grid.get("kind", []) if k not in KINDS]
    if bad:
        raise ValueError(f"--grid kind: {bad} are not head kinds; choose from {', '.join(KINDS)}.")
    if any(v < 1 for v in grid.get("ttt", []) + grid.get("vocab", [])):
        raise ValueError("--grid ttt and vocab values must be at least 1.")
    for layers in grid.get("layers", []):
        if layers != "default" and not all(p.isdigit() for p in layers.split("-")):
            raise ValueError(f"--grid layers: {layers!r} is neither 'default' nor layer numbers joined by '-'.")
    return grid


def cells(grid: dict) -> list[dict]:
    """Every combination, with the options a kind does not have set to its fixed value, duplicates dropped."""
    keys = list(DEFAULTS)
    out = []
    for values in itertools.product(*(grid.get(k, [DEFAULTS[k]]) for k in keys)):
        cell = dict(zip(keys, values, strict=True))
        if cell["kind"] == "eagle1":
            cell |= {"ttt": 1, "layers": "top"}
        if cell["kind"] == "medusa":
            cell |= {"ttt": None, "layers": "top", "vocab": None, "warm": 0}
        if cell not in out:
            out.append(cell)
    return out


def cell_name(cell: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in cell.items() if v is not None)


def _slug(cell: dict) -> str:
    return cell_name(cell).replace(" ", "_").replace("=", "-")


def _heldout_sequences(data: dict) -> tuple[list[list[int]], list[int]]:
    """Each held-out example as (its tokens up to its last response token, where its response starts)."""
    seqs, starts = [], []
    for tokens, mask in zip(data["tokens"], data["mask"], strict=True):
        if mask.any():
            last = len(mask) - 1 - int(mask[::-1].argmax())
            seqs.append(tokens[: last + 1].tolist())
            starts.append(max(int(mask.argmax()), 1))
    return seqs, starts


def train_cell(cell, args, target, data, stored_layers, folder: pathlib.Path):
    """(the trained head, its trainer's report); resumes from the cell's checkpoints."""
    import numpy as np
    from flax import nnx

    from jspec.heads.eagle import DraftHead, HeadConfig, draft_vocabulary
    from jspec.heads.medusa import MedusaConfig, MedusaHeads
    from jspec.training.trainer import TrainConfig, Trainer

    kind = cell["kind"]
    steps = {"eagle3": cell["ttt"], "eagle1": 1, "medusa": args.num_draft}[kind]
    config = TrainConfig(num_steps=steps, decay=cell["decay"], batch_size=args.batch_size, learning_rate=args.lr,
                         total_steps=args.steps, warmup_steps=min(50, args.steps // 10),
                         checkpoint_every=max(args.steps // 4, 1), seed=args.seed)  # fmt: skip
    if kind == "medusa":
        head = MedusaHeads(MedusaConfig.for_target(target.config, steps), rngs=nnx.Rngs(args.seed))
        head.attach_target(target)
        trainer = Trainer.for_medusa(head, config, folder / "checkpoints")
    else:
        layers = None if cell["layers"] in ("default", "top") else tuple(int(x) for x in cell["layers"].split("-"))
        head_config = HeadConfig.for_target(target.config, kind, cell["vocab"], layers)
        head = DraftHead(head_config, rngs=nnx.Rngs(args.seed))
        train_tokens, train_mask = data["tokens"][: -args.heldout], data["mask"][: -args.heldout]
        counts = np.bincount(train_tokens[train_mask], minlength=target.config.vocab_size)  # held out: unseen
        head.attach_target(target, draft_vocabulary(counts, cell["vocab"]))
        if cell["warm"]:
            head.warm_start(target)
        trainer = Trainer.for_target(head, target, config, folder / "checkpoints")
        if kind == "eagle3" and tuple(head_config.feature_layers) != tuple(stored_layers):
            trainer.features_online(target, head_config.feature_layers)
    resumed = trainer.step if trainer.restore() else None
    train = {k: v[: -args.heldout] for k, v in data.items() if k != "counts" and k in trainer.data_keys}
    t0 = time.perf_counter()
    history = trainer.fit(train, log_every=max(args.steps // 10, 1))
    seconds = time.perf_counter() - t0
    final = history[-1] if history else {}
    rates = [r["tokens_per_s"] for r in history]
    report = {"resumed_from": resumed, "train_seconds": seconds, "online_features": "features" not in trainer.data_keys,
              "final_loss": final.get("total"), "tokens_per_s": float(np.mean(rates)) if rates else None}  # fmt: skip
    return trainer.head(), report


def score_cell(cell, head, args, target, tokenizer, data, prompt_ids) -> dict:
    """Held-out agreement per position, τ from a short greedy decode, and the predicted speedup."""
    import numpy as np

    from jspec.analysis.bench import run_prompts
    from jspec.core.sampling import SamplingParams
    from jspec.drafters import EagleDrafter, MedusaDrafter
    from jspec.loop.engine import SpeculativeDecoder
    from jspec.training.loss import teacher_forced_agreement
    from jspec.training.medusa import rank_rates
    from jspec.tune.costs import drafter_step_costs

    n = args.num_draft
    held = {k: v[-args.heldout :] for k, v in data.items() if k != "counts"}
    if cell["kind"] == "medusa":
        agreement = rank_rates(head, held, width=1)[:, 0]
        drafter = MedusaDrafter.from_heads(head, target, num_draft=n)
    else:
        counts = teacher_forced_agreement(head, target, *_heldout_sequences(held), n)
        agreement = counts[:, 0] / np.maximum(counts[:, 1], 1)
        drafter = EagleDrafter.from_head(head, target, num_draft=n)
    decoder = SpeculativeDecoder(target, drafter, eos_ids=tokenizer.eos_token_ids)
    entry = run_prompts(decoder, prompt_ids, args.eval_tokens, SamplingParams.greedy())
    seqs, starts = _heldout_sequences(held)  # the held-out examples' own prompts: the training data's domain
    inside = run_prompts(decoder, [q[:s] for q, s in zip(seqs, starts, strict=True)][: args.limit], args.eval_tokens,
                         SamplingParams.greedy())  # fmt: skip
    ms = drafter_step_costs(target, drafter, repeats=7)  # r and c measured taking turns: ratios of one run
    r, c = ms["verify_ms"] / ms["step_ms"], (ms["propose_ms"] + ms["commit_ms"]) / ms["step_ms"]
    return {"agreement": np.round(agreement, 4).tolist(), "tau": entry["tau"],
            "acceptance_by_position": entry["acceptance_by_position"], "drafter_cost": c, "r": r,
            "predicted_speedup": entry["tau"] / (r + c), "tau_heldout": inside["tau"],
            "predicted_speedup_heldout": inside["tau"] / (r + c)}  # fmt: skip


def _data(args, target, tokenizer):
    """The shared data: the folder's if finished; else made there from ``--ids`` (the target's features over
    those token ids), or from scratch (standard-library prompts, the target's responses). Saves the ids it
    holds as ``OUT/ids.npz`` (tokens and masks, a few bytes a token): what remakes it without generating."""
    import numpy as np

    from jspec.training import Recipe
    from jspec.training.data import load_shards, sequence_examples, write_shards
    from jspec.training.recipe import prepare_data

    if not (args.data / "meta.json").exists():
        if args.ids is not None:
            with np.load(args.ids) as f:
                tokens, mask, meta = f["tokens"], f["mask"], json.loads(str(f["meta"]))
            if meta["model"] != args.model or int(tokens.max()) >= target.config.vocab_size:
                raise SystemExit(f"--ids {args.ids} holds token ids of {meta['model']}, not {args.model}: make "
                                 "the data for this model (drop --ids).")  # fmt: skip
            # Whole rows, padding included: the same tokens as when the features were first made (causal:
            # the padding after a row's end changes none of its features).
            made = sequence_examples(target, list(tokens), list(mask), tuple(meta["feature_layers"]),
                                     seq_len=tokens.shape[1])  # fmt: skip
            write_shards(made, args.data, meta | {"from_ids": str(args.ids)})
        else:
            recipe = Recipe.tiny() if args.tiny else Recipe(num_prompts=args.prompts, seq_len=args.seq_len,
                                                            max_new_tokens=args.max_new_tokens)  # fmt: skip
            prepare_data(target, tokenizer, recipe, args.data, args.model)
    data, meta = load_shards(args.data)
    if meta.get("model") != args.model:
        raise SystemExit(f"{args.data} holds data made for {meta.get('model')}, not {args.model}; pass its data.")
    if len(data["tokens"]) <= args.heldout:
        raise SystemExit(f"{args.data} holds {len(data['tokens'])} examples: fewer than --heldout {args.heldout} "
                         "plus one to train on. Make more (--prompts) or hold out fewer.")  # fmt: skip
    keep = {k: meta[k] for k in ("model", "feature_layers", "seq_len") if k in meta}
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out / "ids.npz", tokens=data["tokens"], mask=data["mask"], meta=json.dumps(keep))
    return data, meta["feature_layers"]


def _table(report: dict) -> str:
    evaluated = report["args"]["eval_prompts"]
    lines = [f"| cell | agreement by position (held out) | τ, {evaluated} (predicted speedup) "
             "| τ, held-out data prompts (predicted speedup) | r + c | final loss | train s |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in report["cells"].items():
        agree = " ".join(f"{a:.2f}" for a in r["agreement"])
        lines.append(f"| {name} | {agree} | {r['tau']:.2f} ({r['predicted_speedup']:.2f}x) | "
                     f"{r['tau_heldout']:.2f} ({r['predicted_speedup_heldout']:.2f}x) | "
                     f"{r['r'] + r['drafter_cost']:.2f} | {r['train']['final_loss']:.3f} | "
                     f"{r['train']['train_seconds']:.0f} |")  # fmt: skip
    return "\n".join(lines)


def _plot(report: dict, path: pathlib.Path) -> None:
    with plot(path, figsize=(8, 4.5)) as fig:
        ax = fig.add_subplot()
        for name, r in report["cells"].items():
            ax.plot(range(1, len(r["agreement"]) + 1), r["agreement"], marker="o",
                    label=f"{name} (τ {r['tau']:.2f})")  # fmt: skip
        ax.set_xticks(range(1, report["args"]["num_draft"] + 1))
        ax.set_xlabel("draft position")
        ax.set_ylabel("held-out top-1 agreement (teacher forced)")
        a = report["args"]
        ax.set_title(f"{a['model']}: {a['steps']} steps, batch {a['batch_size']}")
        ax.legend(fontsize=7)


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, model="smollm2-135m")
    parser.add_argument("--data", type=pathlib.Path, required=True, help="the shared data folder (made once)")
    parser.add_argument("--ids", type=pathlib.Path, default=None,
                        help="an ids.npz an earlier run saved: the data made from it (no generation)")  # fmt: skip
    parser.add_argument("--prompts", type=int, default=200, help="training prompts, when the data is made here")
    parser.add_argument("--seq-len", type=int, default=160)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                        help=f"values of one option (keys: {', '.join(GRID_KEYS)}); default kind=eagle3")  # fmt: skip
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-draft", type=int, default=4, help="draft positions scored; Medusa's heads")
    parser.add_argument("--heldout", type=int, default=16, help="the data's last examples, never trained on")
    parser.add_argument("--eval-prompts", default="mt-bench")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--eval-tokens", type=int, default=48)
    parser.add_argument("--tiny", action="store_true", help="the tiny recipe's data, for tests")
    parser.add_argument("--rescore", action="store_true",
                        help="score finished cells again from their checkpoints (training reports kept)")  # fmt: skip
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("experiments/out/ablate_heads"))
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "num_draft", "heldout", "limit", "eval_tokens", "prompts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}.")
    try:
        grid = parse_grid(args.grid)
    except ValueError as e:
        parser.error(str(e))
    settings = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
                if k not in ("out", "rescore")}  # fmt: skip
    path = args.out / "ablate_heads.json"
    report = {"args": settings, "cells": {}}
    if path.exists():
        had = json.loads(path.read_text())
        recorded = {k: parser.get_default(k) for k in settings} | had.get("args", {})  # options added since: defaults
        if recorded != settings:
            diff = sorted(k for k in settings if recorded.get(k) != settings[k])
            raise SystemExit(f"{path} holds an ablation run with other arguments ({', '.join(diff)}); pass its "
                             "arguments to resume it, or another --out.")  # fmt: skip
        report = had
    todo = [c for c in cells(grid) if cell_name(c) not in report["cells"] or args.rescore]
    print(f"{len(cells(grid)) - len(todo)} cell(s) kept from {path}; {len(todo)} to run", file=sys.stderr)

    from jspec.analysis.prompts import load_prompts
    from jspec.models.hub import load_model

    target, tokenizer = load_model(args.model)
    data, stored_layers = _data(args, target, tokenizer)
    prompts = load_prompts(args.eval_prompts, None, args.limit)
    prompt_ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p.text}]))
                  for p in prompts]  # fmt: skip
    trained_tokens = int(data["mask"][: -args.heldout].sum())
    report["data"] = {"folder": str(args.data), "examples": len(data["tokens"]), "heldout": args.heldout,
                      "response_tokens": trained_tokens, "feature_layers": stored_layers}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    for cell in todo:
        name = cell_name(cell)
        print(f"cell {name}: training", file=sys.stderr)
        head, train = train_cell(cell, args, target, data, stored_layers, args.out / "cells" / _slug(cell))
        if name in report["cells"]:  # --rescore: trained before (its checkpoints restored, no step taken)
            train = report["cells"][name]["train"]
        print(f"cell {name}: scoring", file=sys.stderr)
        report["cells"][name] = {"cell": cell, "train": train} | score_cell(
            cell, head, args, target, tokenizer, data, prompt_ids
        )
        save(path, report, args=args, started=started)
    print(_table(report))
    _plot(report, args.out / "ablate_heads.png")
    return report


if __name__ == "__main__":
    main()
