"""Cost of top-k / top-p filtering per token: jspec's threshold search against a sort.

    python experiments/costs/bench_sampling.py [--vocab 49152] [--batches 1,32] [--repeats 20]
        [--model smollm2-135m --new-tokens 64]

Times ``probs_from_logits`` jitted on random logits [B, V] with no filter, top-p 0.95 and top-k 50,
beside the sort-based formulation jspec used before (argsort, cumulative mass, inverse
permutation), checking that both keep the same tokens; with ``--model`` it also times a whole
sampled generation (batch 32) with and without top-p. Prints JSON.
"""

from __future__ import annotations

import json
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jspec.analysis.harness import arguments, ints, medians_ms, save


def sorted_top_p(logits, top_p):
    """The sort-based top-p mask (the reference formulation)."""
    probs = jax.nn.softmax(logits, axis=-1)
    order = jnp.argsort(-logits, axis=-1)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    keep_sorted = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs < top_p[..., None]
    keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
    return jax.nn.softmax(jnp.where(keep, logits, -jnp.inf), axis=-1)


def main(argv=None) -> dict:
    started = time.time()
    parser = arguments(__doc__, repeats=20, model=None, out="experiments/out")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    from jspec.core.sampling import SamplingParams, probs_from_logits

    out = {"vocab": args.vocab, "ms": {}}
    rng = np.random.default_rng(0)
    for b in ints(args.batches):
        logits = jnp.asarray(rng.standard_normal((b, args.vocab)) * 3, jnp.float32)
        run, reference = jax.jit(probs_from_logits), jax.jit(sorted_top_p)
        settings = {"none": SamplingParams.create(1.0), "top_p_0.95": SamplingParams.create(1.0, top_p=0.95),
                    "top_k_50": SamplingParams.create(1.0, top_k=50)}  # fmt: skip
        fns = {name: partial(run, logits, sp) for name, sp in settings.items()}
        fns["sorted_top_p_0.95"] = partial(reference, logits, jnp.full((b,), 0.95))
        rows = medians_ms(fns, args.repeats)  # median ms per call, the four taking turns
        ours = np.asarray(run(logits, SamplingParams.create(1.0, top_p=0.95))) > 0
        ref = np.asarray(sorted_top_p(logits, jnp.full((b,), 0.95))) > 0
        rows["same_support"] = bool((ours == ref).all())
        out["ms"][f"B={b}"] = rows
        print(f"B={b}: " + json.dumps(rows), flush=True)
    if args.model:
        from jspec.loop.decode import Decoder
        from jspec.models.hub import load_model

        model, tokenizer = load_model(args.model)
        prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}]))
        decoder = Decoder(model)  # no EOS: every row runs the whole budget
        gen = {}
        settings = {"T=1": SamplingParams.create(1.0), "T=1 top_p=0.95": SamplingParams.create(1.0, top_p=0.95)}
        for name, sp in settings.items():
            decoder.generate([prompt] * 32, args.new_tokens, sp)  # compile
            gen[name] = decoder.generate([prompt] * 32, args.new_tokens, sp, seed=1).seconds
        out["generate_s"] = gen
        print("generate (batch 32): " + json.dumps(gen), flush=True)
    return save(args.out / "bench_sampling.json", out, args=args, started=started)


if __name__ == "__main__":
    main()
