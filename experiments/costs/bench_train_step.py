"""One EAGLE training step on every row against the step on the loss window alone.

    python experiments/costs/bench_train_step.py --data DIR [--model smollm2-135m] [--batch-size 8]
        [--ttt-steps 5] [--draft-vocab 8192] [--repeats 5]

Step 0 of training-time test runs on every row (each is context for later
steps); steps after it, the output layer and the loss can run on the loss
window alone: the rows whose predicted tokens are response tokens
(:func:`jspec.training.loss.loss_window`). The loss and its gradients are the
same (tests/test_eagle.py); this times both on the same batches of a prepared
data set, taking turns, so that drift in the machine's speed hits both alike.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from jspec.analysis.harness import save


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """The options of a training-step experiment on a prepared data set (also eagle_feature_cost.py's)."""
    parser.add_argument("--data", required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--ttt-steps", type=int, default=5)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("experiments/out"))


STARTS = ("random", "output", "target")


def fresh_trainer(model, data: dict, args, train=None, start: str = "random"):
    """A new EAGLE-3 head over the data's most frequent tokens and its trainer, as ``jspec train`` makes them.

    ``train``: a :class:`jspec.training.TrainConfig` (default: endless, for timing steps).
    ``start``: "random"; "output" (the target's final norm and output rows only); "target"
    (:meth:`jspec.heads.eagle.DraftHead.warm_start`, what ``jspec train --warm-start`` does).
    """
    from flax import nnx

    from jspec.heads.eagle import DraftHead, HeadConfig, draft_vocabulary
    from jspec.training import TrainConfig, Trainer

    head = DraftHead(HeadConfig.for_target(model.config, "eagle3", args.draft_vocab), rngs=nnx.Rngs(0))
    head.attach_target(model, draft_vocabulary(data["counts"], args.draft_vocab))
    if start == "output":
        head.copy_target_output(model)
    elif start == "target":
        head.warm_start(model)
    elif start != "random":
        raise ValueError(f"unknown start {start!r}; choose from {', '.join(STARTS)}.")
    if train is None:
        train = TrainConfig(num_steps=args.ttt_steps, batch_size=args.batch_size, total_steps=10**6, warmup_steps=1)
    return Trainer.for_target(head, model, train)


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_args(parser)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jspec.models.hub import load_model
    from jspec.training.data import load_shards
    from jspec.training.loss import loss_window
    from jspec.training.trainer import batch_order

    model, _ = load_model(args.model)
    data, _ = load_shards(args.data)
    trainer = fresh_trainer(model, data, args)
    window = loss_window(data["mask"], args.ttt_steps)
    seq_len = int(data["tokens"].shape[1])

    def step(i, w):
        idx = np.sort(batch_order(len(data["tokens"]), args.batch_size, i, 0))
        batch = {k: jnp.asarray(data[k][idx]) for k in ("tokens", "mask", "features", "top")}
        t0 = time.perf_counter()
        metrics = trainer.train_step(batch, w)
        jax.block_until_ready(metrics)
        return time.perf_counter() - t0

    compile_s = {"all rows": step(0, None), "window": step(0, window)}
    times = {"all rows": [], "window": []}
    for i in range(1, args.repeats + 1):
        times["all rows"].append(step(i, None))
        times["window"].append(step(i, window))
    med = {k: float(np.median(v)) for k, v in times.items()}
    report = {
        "examples": len(data["tokens"]),
        "seq_len": seq_len,
        "window": window,
        "batch_size": args.batch_size,
        "ttt_steps": args.ttt_steps,
        "draft_vocab": args.draft_vocab,
        "first_step_seconds": compile_s,
        "step_seconds": times,
        "median_step_seconds": med,
        "speedup": med["all rows"] / med["window"],
    }
    print(json.dumps(report, indent=1))
    return save(args.out / "bench_train_step.json", report, args=args, started=started)


if __name__ == "__main__":
    main()
