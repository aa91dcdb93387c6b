"""What one Medusa training step costs at the shipped EAGLE-3 head's shapes, on a real target.

    python experiments/costs/medusa_step_cost.py [--model smollm2-135m] [--heads 4] [--batch-size 8]
        [--seq-len 256] [--response 160] [--repeats 3]

Times ``Trainer.for_medusa``'s step (K heads, each a residual block and the target's full
output layer, on the loss window) on batches shaped like the shipped head's data: 256-token
examples whose responses are at most 160 tokens. The token ids and hidden states are random
(a step's cost does not depend on their values). Prints the compile time, the median step and
what the shipped head's schedule (750 steps) would take.
"""

from __future__ import annotations

import json
import time

from jspec.analysis.harness import arguments, save


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, model="smollm2-135m", repeats=3, out="experiments/out")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--response", type=int, default=160)
    parser.add_argument("--schedule", type=int, default=750, help="steps of the schedule to estimate")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jspec.heads.medusa import MedusaConfig, MedusaHeads
    from jspec.models.hub import load_model
    from jspec.training import TrainConfig, Trainer
    from jspec.training.loss import loss_window

    model, _ = load_model(args.model)
    c = model.config
    heads = MedusaHeads(MedusaConfig.for_target(c, args.heads), rngs=nnx.Rngs(0))
    heads.attach_target(model)
    train = TrainConfig(num_steps=args.heads, batch_size=args.batch_size, total_steps=10**6, warmup_steps=1)
    trainer = Trainer.for_medusa(heads, train)
    rng = np.random.default_rng(0)
    b, t = args.batch_size, args.seq_len
    mask = np.zeros((b, t), bool)
    mask[:, t - args.response :] = True
    window = loss_window(mask, args.heads)

    def step():
        batch = {
            "tokens": jnp.asarray(rng.integers(0, c.vocab_size, (b, t)), jnp.int32),
            "mask": jnp.asarray(mask),
            "top": jnp.asarray(rng.standard_normal((b, t, c.hidden_size)), jnp.float16),
        }
        t0 = time.perf_counter()
        jax.block_until_ready(trainer.train_step(batch, window))
        return time.perf_counter() - t0

    first = step()
    times = [step() for _ in range(args.repeats)]
    med = float(np.median(times))
    report = {"model": args.model, "heads": args.heads, "batch_size": b, "seq_len": t, "window": window,
              "first_step_seconds": first, "step_seconds": times, "median_step_seconds": med,
              "schedule_steps": args.schedule, "schedule_minutes": med * args.schedule / 60}  # fmt: skip
    print(json.dumps(report, indent=1))
    return save(args.out / "medusa_step_cost.json", report, args=args, started=started)


if __name__ == "__main__":
    main()
