"""Cached or recomputed target features for EAGLE training: which is faster here.

    python experiments/costs/eagle_feature_cost.py --data DIR [--model smollm2-135m] [--batch-size 8] [--repeats 5]

Training needs, per batch, the target's hidden states at the head's feature
layers and at the top layer. They can be stored once with the data (what
``jspec train`` does: float16 shards) or recomputed by a target forward at
every step. This times both ways of getting one batch — gathering it from the
stored arrays and putting it on the device, or one jitted target forward over
the batch's tokens — beside one training step of the head on that batch.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from jspec.analysis.harness import load_script, medians_ms, save


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    step_cost = load_script(pathlib.Path(__file__).with_name("bench_train_step.py"))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    step_cost.add_training_args(parser)
    args = parser.parse_args(argv)

    import jax.numpy as jnp
    import numpy as np

    from jspec.models.hub import load_model
    from jspec.training.data import feature_forward, load_shards
    from jspec.training.trainer import batch_order

    model, _ = load_model(args.model)
    t0 = time.perf_counter()
    data, meta = load_shards(args.data)
    load_s = time.perf_counter() - t0
    n = len(data["tokens"])
    layers = (*meta["feature_layers"], model.config.num_layers - 1)
    idx = np.sort(batch_order(n, args.batch_size, 0, 0))

    def cached():
        return {k: jnp.asarray(data[k][idx]) for k in ("tokens", "mask", "features", "top")}

    recompute, state = feature_forward(model, layers)  # what data generation runs
    tokens = jnp.asarray(data["tokens"][idx])
    ms = medians_ms({"cached": cached, "recompute": lambda: recompute(state, tokens)}, args.repeats)
    cached_s, recompute_s = ms["cached"] / 1000, ms["recompute"] / 1000

    trainer = step_cost.fresh_trainer(model, data, args)
    trainer.fit(data, until=1)
    t0 = time.perf_counter()
    trainer.fit(data, until=1 + args.repeats)
    step_s = (time.perf_counter() - t0) / args.repeats

    report = {
        "examples": n,
        "batch": [args.batch_size, int(data["tokens"].shape[1])],
        "stored_bytes_per_example": int(sum(data[k][0].nbytes for k in ("tokens", "mask", "features", "top"))),
        "load_all_seconds": load_s,
        "cached_batch_seconds": cached_s,
        "recompute_batch_seconds": recompute_s,
        "train_step_seconds": step_s,
        "recompute_over_step": recompute_s / step_s,
    }
    print(json.dumps(report, indent=1))
    return save(args.out / "eagle_feature_cost.json", report, args=args, started=started)


if __name__ == "__main__":
    main()
