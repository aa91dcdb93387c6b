"""Stored against online target features for head training (issue 34, part 2).

    python experiments/ablations/online_features.py [--model smollm2-135m] [--examples 32] [--seq-len 128]
        [--batch-size 8] [--steps 12] [--rounds 3] [--out experiments/results/online_features.json]

The same EAGLE-3 head trained twice from the same start on the same examples (the target's own
greedy continuations of held-apart prompts: token ids and a loss mask), once reading stored
features and once computing them inside each step; the runs take turns ``--rounds`` times, a
block of ``--steps`` steps each (the first block of each compiles and is not timed). Reports
bytes per training token of each data set, the median step time of each, and the losses at the
end (the same head either way, up to the float16 rounding of the stored features: online ones stay
in the target's dtype).
"""

from __future__ import annotations

import json
import time

import numpy as np

from jspec.analysis.harness import append, arguments


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, model="smollm2-135m", out="experiments/results/online_features.json")
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    import jax
    from flax import nnx

    from jspec.heads.eagle import DraftHead, HeadConfig, draft_vocabulary
    from jspec.models.hub import load_model
    from jspec.training.data import sequence_examples
    from jspec.training.trainer import TrainConfig, Trainer

    model, _ = load_model(args.model)
    rng = np.random.default_rng(0)
    from jspec.loop.decode import Decoder

    prompts = [rng.integers(100, 20_000, 16).tolist() for _ in range(args.examples)]
    cont = Decoder(model).generate(prompts, args.seq_len - 16).tokens
    ids = [np.asarray(p + c, np.int32) for p, c in zip(prompts, cont, strict=True)]
    masks = [np.arange(len(i)) >= 16 for i in ids]
    config = HeadConfig.for_target(model.config, "eagle3", 8192)
    stored = sequence_examples(model, ids, masks, config.feature_layers, seq_len=args.seq_len)
    online = sequence_examples(model, ids, masks, None, seq_len=args.seq_len)
    tokens = stored["tokens"].size

    def per_token(data):
        return sum(v.nbytes for k, v in data.items() if k != "counts") / tokens

    def trainer(features_online: bool):
        head = DraftHead(config, rngs=nnx.Rngs(0))
        head.attach_target(model, draft_vocabulary(stored["counts"], config.draft_vocab_size))
        total = args.steps * args.rounds
        cfg = TrainConfig(num_steps=3, batch_size=args.batch_size, total_steps=total, warmup_steps=1, seed=0)
        t = Trainer.for_target(head, model, cfg)
        return t.features_online(model, config.feature_layers) if features_online else t

    runs = {"stored": (trainer(False), stored), "online": (trainer(True), online)}
    times = {name: [] for name in runs}
    history = {name: [] for name in runs}
    for r in range(args.rounds):
        for name, (t, data) in runs.items():
            t0 = time.perf_counter()
            history[name] += t.fit(data, until=(r + 1) * args.steps, log_every=1)
            if r:
                times[name].append((time.perf_counter() - t0) / args.steps)
    final = {name: h[-1]["loss"] for name, h in history.items()}
    pairs = zip(jax.tree.leaves(runs["stored"][0].params), jax.tree.leaves(runs["online"][0].params), strict=True)
    gap = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs)
    report = {
        "model": args.model, "examples": args.examples, "seq_len": args.seq_len, "batch_size": args.batch_size,
        "bytes_per_token": {"stored": per_token(stored), "online": per_token(online)},
        "step_seconds": {n: float(np.median(v)) for n, v in times.items()},
        "step_seconds_all": times,
        "online_over_stored": float(np.median(times["online"]) / np.median(times["stored"])),
        "final_loss": final, "max_parameter_gap": gap,
    }  # fmt: skip
    print(json.dumps({k: v for k, v in report.items() if k != "step_seconds_all"}, indent=1))
    return append(args.out, report, args=args, started=started)[-1]


if __name__ == "__main__":
    main()
