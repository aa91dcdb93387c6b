"""EAGLE-3 heads started at random or from the target's weights, on the same data and steps.

    python experiments/ablations/warm_start.py --data DIR [--model smollm2-135m] [--steps 120] [--lr 1e-3]
        [--batch-size 8] [--ttt-steps 5] [--draft-vocab 8192] [--starts random,output,target]
        [--prompts mt-bench,humaneval] [--limit 8] [--max-new-tokens 64] [--out DIR]

Each start trains a new head for ``--steps`` steps (the same seed, data order and optimizer:
AdamW, warmup a tenth of the steps, cosine decay) on a prepared data set (a ``--data`` folder
of ``jspec train``): "random" is the usual start; "output" takes the target's final norm and
output rows for the draft vocabulary; "target" is ``jspec train --warm-start``
(:meth:`jspec.heads.eagle.DraftHead.warm_start`). Each head is then scored on held-out prompts by
its teacher-forced agreement with the target's greedy responses per draft position
(``experiments/ablations/head_agreement.py``'s measure). Reports the last logged training loss too.
Writes ``warm_start.json`` and the heads to --out.
"""

from __future__ import annotations

import pathlib
import time

from jspec.analysis.harness import arguments, load_script, save


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, model="smollm2-135m", prompts="mt-bench,humaneval", limit=8,
                       max_new_tokens=64, out="experiments/out/warm_start")  # fmt: skip
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--ttt-steps", type=int, default=5)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--starts", default="random,output,target")
    args = parser.parse_args(argv)
    here = pathlib.Path(__file__).resolve().parent
    step_cost = load_script(here.parent / "costs" / "bench_train_step.py")
    starts = args.starts.split(",")
    if any(s not in step_cost.STARTS for s in starts):
        parser.error(f"--starts takes some of {', '.join(step_cost.STARTS)}; got {args.starts!r}.")
    agreement = load_script(here / "head_agreement.py").main

    from jspec.heads.eagle import save_head
    from jspec.models.hub import load_model
    from jspec.training import TrainConfig
    from jspec.training.data import load_shards

    model, _ = load_model(args.model)
    data, meta = load_shards(pathlib.Path(args.data))
    train = TrainConfig(num_steps=args.ttt_steps, batch_size=args.batch_size, learning_rate=args.lr,
                        warmup_steps=max(args.steps // 10, 1) if args.steps > 1 else 0, total_steps=args.steps,
                        checkpoint_every=10**9)  # fmt: skip
    report = {"args": vars(args) | {"out": str(args.out)}, "data": {k: meta.get(k) for k in ("examples",
              "response_tokens", "prompts", "prompt_seed")}, "starts": {}}  # fmt: skip
    folders = []
    for start in starts:
        trainer = step_cost.fresh_trainer(model, data, args, train, start)
        history = trainer.fit(data, log_every=10)
        folder = save_head(trainer.head(), args.out / "heads" / start, recipe={"start": start, "steps": args.steps})
        folders.append(str(folder))
        last = history[-1]
        report["starts"][start] = {"head": str(folder), "loss": last["total"], "train_acc": last["acc"]}
        print(f"{start}: step {last['step']} loss {last['total']:.3f}", flush=True)
    argv = ["--heads", ",".join(folders), "--model", args.model, "--prompts", args.prompts, "--limit",
            str(args.limit), "--max-new-tokens", str(args.max_new_tokens), "--steps", str(args.ttt_steps)]  # fmt: skip
    scores = agreement([*argv, "--out", str(args.out)])["heads"]
    for start, folder in zip(starts, folders, strict=True):
        report["starts"][start]["held_out"] = scores[folder]
    report = save(args.out / "warm_start.json", report, args=args, started=started)
    return report


if __name__ == "__main__":
    main()
