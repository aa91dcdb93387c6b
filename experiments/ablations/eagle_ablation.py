"""EAGLE ablation: EAGLE-3 with training-time test, EAGLE-3 without (K = 1), EAGLE-1; same data, same steps.

    python experiments/ablations/eagle_ablation.py --data DIR [--model smollm2-135m] [--steps 1000] [--batch-size 8]
        [--ttt-steps 7] [--draft-vocab 8192] [--lr 3e-4] [--warmup 50]
        [--prompts mt-bench,humaneval] [--limit 8] [--max-new-tokens 96] [--num-draft 5] [--tiny] [--out DIR]
        [--trained VARIANT=HEAD_DIR ...]

The training data (``--data``, made by ``jspec train`` or made here once; its
recipe is read from its ``meta.json``) is shared by the three heads; each
trains for the same number of steps with the same optimizer settings, then drafts a chain of ``--num-draft`` tokens at
temperature 0 and 1 on held-out MT-bench and HumanEval prompts. Reports τ and
acceptance by position per head; writes ``eagle_ablation.json`` to --out.

``--trained eagle3-ttt=HEAD_DIR`` uses a head that was
already trained instead of training that variant again; it is refused unless
the recipe in its ``head.json`` (data, vocabulary, every training option but the
checkpoint interval) is the one this run would train it with.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time

from jspec.analysis.harness import arguments, save

VARIANTS = {
    "eagle3-ttt": {"kind": "eagle3", "num_steps": None},  # --ttt-steps
    "eagle3-no-ttt": {"kind": "eagle3", "num_steps": 1},
    "eagle1": {"kind": "eagle1", "num_steps": 1},
}


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, model="smollm2-135m", prompts="mt-bench,humaneval", limit=8,
                       max_new_tokens=96, out="experiments/out")  # fmt: skip
    parser.add_argument("--data", type=pathlib.Path, required=True, help="training data folder (made once)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--ttt-steps", type=int, default=7, help="EAGLE-3 with TTT: steps (the others use 1)")
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--num-draft", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="the tiny recipe, 2 TTT steps, one prompt per set")
    parser.add_argument(
        "--trained",
        action="append",
        default=[],
        metavar="VARIANT=HEAD_DIR",
        help="reuse a trained head for a variant when its recipe matches (repeatable)",
    )
    args = parser.parse_args(argv)
    trained = {}
    for item in args.trained:
        variant, sep, folder = item.partition("=")
        if not sep or variant not in VARIANTS:
            parser.error(f"--trained takes VARIANT=HEAD_DIR with VARIANT one of {', '.join(VARIANTS)}; got {item!r}.")
        if not (pathlib.Path(folder) / "head.json").exists():
            parser.error(f"--trained {item}: {folder} holds no head.json; pass a folder written by jspec train.")
        trained[variant] = pathlib.Path(folder)

    from jspec.analysis.bench import run_prompts
    from jspec.analysis.prompts import load_prompts
    from jspec.core.sampling import SamplingParams
    from jspec.drafters import EagleDrafter
    from jspec.heads.eagle import load_head
    from jspec.loop.engine import SpeculativeDecoder
    from jspec.models.hub import load_model
    from jspec.training import Recipe, train_head

    model, tokenizer = load_model(args.model)
    base = Recipe.tiny() if args.tiny else Recipe()
    if not args.tiny:
        train = dataclasses.replace(base.train, total_steps=args.steps, batch_size=args.batch_size,
                                    learning_rate=args.lr, warmup_steps=args.warmup)  # fmt: skip
        base = dataclasses.replace(base, draft_vocab=args.draft_vocab, train=train)
        meta_path = args.data / "meta.json"
        if meta_path.exists():  # the data's own recipe, so that it is reused rather than refused
            meta = json.loads(meta_path.read_text())
            base = dataclasses.replace(base, num_prompts=meta["num_prompts"], seq_len=meta["seq_len"],
                                       max_new_tokens=meta["max_new_tokens"],
                                       gen_temperature=meta["gen_temperature"])  # fmt: skip
    limit = 1 if args.tiny else args.limit
    ids = {}
    for name in args.prompts.split(","):
        chats = [
            tokenizer.apply_chat_template([{"role": "user", "content": p.text}])
            for p in load_prompts(name, None, limit)
        ]
        ids[name] = [tokenizer.encode(c) for c in chats]
    report = {"args": vars(args) | {"data": str(args.data), "out": str(args.out)}, "variants": {}}
    for variant, spec in VARIANTS.items():
        want = spec["num_steps"] or args.ttt_steps
        steps = min(want, base.train.num_steps) if args.tiny else want
        recipe = dataclasses.replace(base, kind=spec["kind"], train=dataclasses.replace(base.train, num_steps=steps))
        if variant in trained:
            train_report = _check_recipe(trained[variant], recipe, args.model) | {"reused": str(trained[variant])}
            head = load_head(trained[variant], model)
        else:
            head, train_report = train_head(model, tokenizer, recipe, args.out / "heads" / variant,
                                            model_name=args.model, data_dir=args.data,
                                            progress=sys.stderr.isatty())  # fmt: skip
        drafter = EagleDrafter.from_head(head, model, num_draft=args.num_draft)
        decoder = SpeculativeDecoder(model, drafter, eos_ids=tokenizer.eos_token_ids)
        results = {}
        for name, prompt_ids in ids.items():
            for t in (0.0, 1.0):
                e = run_prompts(decoder, prompt_ids, args.max_new_tokens, SamplingParams.create(t))
                results[f"{name}|T={t}"] = {k: e[k] for k in ("tau", "acceptance_by_position", "tokens_per_s")}
                print(f"{variant} {name} T={t}: tau {e['tau']:.2f}", flush=True)
        report["variants"][variant] = {"train": train_report, "results": results}
        report = save(args.out / "eagle_ablation.json", report, args=args, started=started)
    return report


def _check_recipe(folder: pathlib.Path, recipe, model_name: str) -> dict:
    """The saved head's training report; raises ValueError when its recipe is not ``recipe``."""
    saved = json.loads((folder / "head.json").read_text()).get("recipe") or {}
    want = dataclasses.asdict(recipe) | {"model": model_name}
    defaults = {f.name: f.default for f in dataclasses.fields(recipe)}  # fields newer than the saved head
    ignore = {"gen_batch", "report"}  # generation batching does not change greedy responses
    diff = [
        f"{k}: saved {saved.get(k)!r}, wanted {v!r}"
        for k, v in want.items()
        if k not in ignore and k != "train" and _norm(saved.get(k, defaults.get(k))) != _norm(v)
    ]
    saved_train = {f.name: f.default for f in dataclasses.fields(recipe.train)} | (saved.get("train") or {})
    diff += [
        f"train.{k}: saved {saved_train.get(k)!r}, wanted {v!r}"
        for k, v in want["train"].items()
        if k != "checkpoint_every" and saved_train.get(k) != v
    ]
    if diff:
        raise ValueError(f"the head in {folder} was trained with another recipe ({'; '.join(diff)}); "
                         "train it here instead (drop --trained) or match the options.")  # fmt: skip
    return saved.get("report") or {}


def _norm(x):
    return list(x) if isinstance(x, tuple) else x


if __name__ == "__main__":
    main()
