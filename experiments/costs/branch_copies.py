"""What XLA's conditionals cost a loop that writes a KV cache in a branch, and what jspec.loop.control saves.

    python experiments/costs/branch_copies.py [--rows 8] [--capacity 300] [--steps 100]

1. A loop whose step writes one slot per row of a cache (k and v, [30 layers, rows, capacity, 3 KV
   heads, 64], SmolLM2's shape) in one of two branches, then reads all of it: whole-cache copies in the
   compiled loop and milliseconds per step with ``lax.cond`` and with :func:`jspec.loop.control.cond`.
2. The compiled loops of a tiny target (prompt lookup, a draft model): copies of the caches in the loop
   with the engine's branches as they are and with ``lax.cond`` put back in their place.

3. With ``--real``: SmolLM2 on MT-bench prompts at batches 1, 8 and 32 (48 new tokens, greedy), plain
   decoding, prompt lookup and the shipped EAGLE-3 head (chain of 5), each speculative method compiled
   once with the engine's branches and once with ``lax.cond`` in their place, all taking turns
   (:func:`jspec.analysis.bench.run_interleaved`): tokens/s of each against plain decoding's.

Prints one JSON object.
"""

from __future__ import annotations

import json
import re
import sys
import time

import jax
import jax.numpy as jnp

from jspec.analysis.harness import arguments, ints, save
from jspec.loop import control

COPY = re.compile(r"= f32\[([\d,]+)\]\{[0-9,]*\} copy\(")


def copies_in_loop(hlo: str, is_cache) -> int:
    """Copies of arrays whose dims satisfy ``is_cache``, outside the entry computation."""
    return sum(is_cache([int(d) for d in dims.split(",")]) for dims in COPY.findall(hlo.split("\nENTRY ")[0]))


def micro(branch, rows: int, capacity: int, steps: int) -> dict:
    layers, heads, dim = 30, 3, 64
    shape = (layers, rows, capacity, heads, dim)

    def run(k, v, q):
        def body(s):
            i, k, v, acc = s
            pos = (i + jnp.arange(rows)) % capacity
            write = lambda c, x: c.at[:, jnp.arange(rows), pos].set(x)  # noqa: E731
            plain = lambda kv: (write(kv[0], 1.0), write(kv[1], 1.0))  # noqa: E731
            wide = lambda kv: (write(write(kv[0], 2.0), 3.0), write(kv[1], 2.0))  # noqa: E731
            k, v = branch(i % 3 == 0, wide, plain, (k, v))
            return i + 1, k, v, acc + jnp.einsum("lbshd,bd->b", k, q)

        return jax.lax.while_loop(lambda s: s[0] < steps, body, (0, k, v, jnp.zeros(rows)))

    fn = jax.jit(run, donate_argnums=(0, 1))
    args = jnp.zeros(shape), jnp.zeros(shape), jnp.ones((rows, dim))
    hlo = fn.lower(*args).compile().as_text()
    _, k, v, acc = fn(*args)  # warm
    jax.block_until_ready(acc)
    t0 = time.perf_counter()
    _, k, v, acc = fn(k, v, args[2])
    jax.block_until_ready(acc)
    ms = 1000 * (time.perf_counter() - t0) / steps
    return {"copies": copies_in_loop(hlo, lambda d: d == list(shape)), "ms_per_step": round(ms, 3),
            "cache_mb": 2 * 4 * layers * rows * capacity * heads * dim / 2**20}  # fmt: skip


def engine_copies() -> dict:
    import jspec.drafters.draft_model
    import jspec.loop.engine
    from jspec.core.sampling import SamplingParams
    from jspec.drafters import DraftModel, PromptLookup
    from jspec.models.tiny import tiny_model

    target = tiny_model(num_layers=5)
    draft = tiny_model(num_layers=2, seed=1)
    c = target.config
    is_cache = lambda d: len(d) == 5 and d[1] == 2 and d[3:] == [c.num_kv_heads, c.head_dim] and d[2] > 8  # noqa: E731
    makers = {"prompt lookup": lambda: PromptLookup(num_draft=3),
              "draft model": lambda: DraftModel.from_model(draft, target, num_draft=3)}  # fmt: skip
    lax_cond = lambda pred, t, f, x: jax.lax.cond(pred, t, f, x)  # noqa: E731
    out = {}
    for name, make in makers.items():
        for label in ("jspec.loop.control", "lax.cond"):
            saved = jspec.loop.engine.cond, jspec.drafters.draft_model.cond
            if label == "lax.cond":
                jspec.loop.engine.cond = jspec.drafters.draft_model.cond = lax_cond
            try:
                jax.clear_caches()
                decoder = jspec.loop.engine.SpeculativeDecoder(target, make(), eos_ids=(3,))
                decoder.generate([[5, 6, 7, 5, 6, 7, 5, 6]] * 2, 12, SamplingParams.greedy())
                hlo = next(iter(decoder._compiled.values())).as_text()
            finally:
                jspec.loop.engine.cond, jspec.drafters.draft_model.cond = saved
            out[f"{name} / {label}"] = copies_in_loop(hlo, is_cache)
    return out


def real(batches: list[int], rounds: int) -> dict:
    """Part 3: the same speculative loops with jspec.loop.control's branches and with lax.cond's, interleaved."""
    import jspec
    import jspec.loop.engine
    from jspec.analysis.bench import forget_compiled, run_interleaved, warm_up
    from jspec.analysis.prompts import load_prompts
    from jspec.core.sampling import SamplingParams
    from jspec.models.hub import load_model

    model, tok = load_model("smollm2-135m")
    texts = [p.text for p in load_prompts("mt-bench", None, max(batches) * rounds)]
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    greedy, eos = SamplingParams.greedy(), tok.eos_token_ids
    lax_cond = lambda pred, t, f, x: jax.lax.cond(pred, t, f, x)  # noqa: E731
    out = {}
    for b in batches:
        rows = (ids * b)[: b * rounds]
        decoders = {"ar": jspec.Decoder(model, eos_ids=eos)}
        for label in ("control", "lax.cond"):
            jax.clear_caches()  # so that the second variant is traced again, under its own branches
            saved = jspec.loop.engine.cond
            if label == "lax.cond":
                jspec.loop.engine.cond = lax_cond
            try:
                for method in ("ngram", "eagle3"):
                    name = f"{method}/{label}"
                    drafter = jspec.make_drafter(method, model, model_name="smollm2-135m")
                    decoders[name] = jspec.SpeculativeDecoder(model, drafter, eos_ids=eos)
                    warm_up(decoders[name], rows, 48, greedy, batch=b)  # compiled here, under this variant
            finally:
                jspec.loop.engine.cond = saved
        runs = run_interleaved(decoders, rows, 48, greedy, batch=b)
        base = runs["ar"]["tokens_per_s"]
        out[b] = {name: {"tokens_per_s": round(r["tokens_per_s"], 2), "tau": round(r["tau"], 3),
                         "speedup": round(r["tokens_per_s"] / base, 3), "seconds": round(r["seconds"], 2)}
                  for name, r in runs.items()}  # fmt: skip
        print(f"batch {b}: " + ", ".join(f"{k} {v['speedup']:.2f}x" for k, v in out[b].items()), file=sys.stderr)
        forget_compiled(decoders.values())
    return out


def main(argv=None) -> dict:
    started = time.time()
    p = arguments(__doc__, out="experiments/out")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--capacity", type=int, default=300)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--real", action="store_true", help="also part 3: SmolLM2, interleaved (about 50 minutes here)")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--rounds", type=int, default=2, help="batches per batch size and decoder (part 3)")
    args = p.parse_args(argv)
    lax_cond = lambda pred, t, f, x: jax.lax.cond(pred, t, f, x)  # noqa: E731
    branches = {"lax.cond": lax_cond, "jspec.loop.control.cond": control.cond}
    report = {
        "backend": jax.default_backend(),
        "micro": {name: micro(fn, args.rows, args.capacity, args.steps) for name, fn in branches.items()},
        "engine_cache_copies": engine_copies(),
    }
    if args.real:
        report["smollm2"] = real(ints(args.batches), args.rounds)
    print(json.dumps(report, indent=1))
    return save(args.out / "branch_copies.json", report, args=args, started=started)


if __name__ == "__main__":
    main()
