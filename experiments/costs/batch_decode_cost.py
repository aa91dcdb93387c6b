"""Where a batched one-token decode step's time goes: the cache's capacity against the batch.

    python experiments/costs/batch_decode_cost.py [--model smollm2-135m] [--batches 8,32] \
        [--capacities 128,256,512,1024] [--generate 32]

Generating training data decodes 32 prompts at a time; its step cost decides how much data an
hour buys. Each step attends over every slot of the cache (static shapes), so the step is
timed at several capacities (half of it filled; the cache donated, as in the decode loop),
and the attention's two products alone, for one layer, beside the time it takes just to read
that layer's keys. With ``--generate B``, one batch of B training prompts is decoded as
``jspec.training.data.generate_examples`` does (stdlib prompts, 160 new tokens within 256), with the
cache the two buckets add up to and with the one :func:`jspec.loop.batching.cache_slots` picks, taking
turns. Writes ``batch_decode_cost.json`` to --out.
"""

from __future__ import annotations

import json
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec.analysis.harness import arguments, median_ms, save
from jspec.loop.decode import jit_forward
from jspec.models.hub import load_model

__all__ = ["attention_parts", "generate_cost", "step_cost"]


def step_cost(model, batch: int, capacity: int, repeats: int = 5) -> float:
    """Median ms of one decode step for ``batch`` rows with ``capacity`` cache slots, half filled."""
    state, forward = jit_forward(model)
    cache = model.init_cache(batch, capacity).rollback(jnp.full((batch,), capacity // 2, jnp.int32))
    tokens = jnp.full((batch, 1), 5, jnp.int32)
    positions = cache.lengths[:, None]
    times = []
    for i in range(repeats + 1):  # round 0 compiles
        t0 = time.perf_counter()
        logits, cache = forward(state, tokens, positions, cache)
        logits.block_until_ready()
        if i:
            times.append(time.perf_counter() - t0)
        cache = cache.rollback(jnp.full((batch,), capacity // 2, jnp.int32))
    return 1000 * float(np.median(times))


def attention_parts(config, batch: int, capacity: int, repeats: int = 20) -> dict:
    """Median ms, for one layer and one new token per row, of the attention's two products
    (the shapes and einsums of ``jspec.models.layers.attention``) and of reading the layer's keys."""
    kv, d = config.num_kv_heads, config.head_dim
    group = config.num_heads // kv
    key = jax.random.PRNGKey(0)
    q = jax.random.normal(key, (batch, 1, kv, group, d))
    k = jax.random.normal(key, (batch, capacity, kv, d))
    w = jax.random.normal(key, (batch, kv, group, 1, capacity))
    return {
        "scores_ms": median_ms(partial(jax.jit(lambda q, k: jnp.einsum("btkgd,bskd->bkgts", q, k)), q, k), repeats),
        "values_ms": median_ms(partial(jax.jit(lambda w, v: jnp.einsum("bkgts,bskd->btkgd", w, v)), w, k), repeats),
        "read_keys_ms": median_ms(partial(jax.jit(lambda k: k.sum()), k), repeats),
        "keys_mb": k.nbytes / 1e6,
    }


def generate_cost(model, tokenizer, batch: int, repeats: int = 2, seq_len: int = 256, max_new: int = 160) -> dict:
    """Seconds to decode one batch of training prompts with each cache size (greedy, same tokens)."""
    from jspec.core.sampling import SamplingParams
    from jspec.loop.batching import LoopConfig, batch_inputs, compile_loop, drive
    from jspec.loop.decode import PlainLoop, plain_loop
    from jspec.training.data import fitting_prompts, stdlib_prompts

    prompts = sorted(fitting_prompts(tokenizer, stdlib_prompts(), seq_len - 64, 4 * batch), key=len)
    ids = prompts[len(prompts) // 2 : len(prompts) // 2 + batch]  # a middle batch of the sorted data
    budget_n = min(max_new, seq_len - max(len(p) for p in ids))
    batch = batch_inputs(ids, budget_n, None, None)
    p, m = batch.prompt_len, batch.max_new
    graphdef, state = nnx.split(model)
    eos = tuple(tokenizer.eos_token_ids)
    configs = {"buckets": LoopConfig(p, m, eos), "tight": LoopConfig(p, m, eos, batch.cache_len)}
    compiled, seconds, outputs = {}, {k: [] for k in configs}, {}
    args = (state, *batch[:3], SamplingParams.greedy(), jax.random.PRNGKey(0))
    for i in range(repeats + 1):  # round 0 compiles
        for name, config in configs.items():
            run, _ = compile_loop(compiled, name, plain_loop, (PlainLoop(graphdef, config), *args))
            t0 = time.perf_counter()
            final = drive(run, args)
            tokens = jax.block_until_ready(final.tokens)
            if i:
                seconds[name].append(time.perf_counter() - t0)
            outputs[name] = np.asarray(tokens)
    return {
        "prompt_bucket": p,
        "new_bucket": m,
        "capacity": {k: c.capacity() for k, c in configs.items()},
        "seconds": {k: float(np.median(v)) for k, v in seconds.items()},
        "same_tokens": bool((outputs["buckets"] == outputs["tight"]).all()),
    }


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, model="smollm2-135m", repeats=5, out="experiments/out")
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--capacities", default="128,256,512,1024")
    parser.add_argument("--generate", type=int, default=0, help="also time one batch of B training prompts")
    parser.add_argument("--generate-tokens", type=int, default=160, help="new tokens per prompt with --generate")
    args = parser.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    capacities = [int(x) for x in args.capacities.split(",")]

    model, tokenizer = load_model(args.model)
    c = model.config
    report = {"model": args.model, "backend": jax.default_backend(), "step_ms": {}, "attention_layer": {}}
    for b in batches:
        for cap in capacities:
            ms = step_cost(model, b, cap, args.repeats)
            parts = attention_parts(c, b, cap)
            report["step_ms"][f"{b}x{cap}"] = ms
            report["attention_layer"][f"{b}x{cap}"] = parts
            both = c.num_layers * (parts["scores_ms"] + parts["values_ms"])
            print(
                f"batch {b:3d} capacity {cap:5d}: step {ms:7.1f} ms; per layer scores {parts['scores_ms']:.2f} + "
                f"values {parts['values_ms']:.2f} ms (x{c.num_layers} layers = {both:.0f} ms), "
                f"reading its {parts['keys_mb']:.1f} MB of keys {parts['read_keys_ms']:.2f} ms",
                flush=True,
            )
    if args.generate:
        report["generate"] = generate_cost(model, tokenizer, args.generate, max_new=args.generate_tokens)
        print(json.dumps(report["generate"]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    return save(args.out / "batch_decode_cost.json", report, args=args, started=started)


if __name__ == "__main__":
    main()
