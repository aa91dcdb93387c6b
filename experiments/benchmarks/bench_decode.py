"""Plain greedy decoding: jspec beside transformers on the same weights, in one run.

    args.out.mkdir(parents=True, exist_ok=True)
    python experiments/benchmarks/bench_decode.py [--models smollm2-135m,qwen2.5-coder-1.5b] [--batches 1,8]
        [--max-new-tokens 64] [--no-transformers] [--tiny] [--out experiments/out]

For each model and batch size it measures, each engine in its own subprocess
(so peak memory is that engine's alone):

* jspec: tokens/s of the jitted ``lax.while_loop`` decoder (compilation timed
  apart), compile time, peak RSS;
* transformers (PyTorch, float32, the same GGUF weights): tokens/s of
  ``generate(do_sample=False)`` after a warm-up, peak RSS;
* one decode step with a warm cache for the unrolled and the scanned layer
  loop (the choice per backend lives in ``layer_loop_for_backend``);
* the memory-bandwidth roofline: bytes of weights read per step over the read
  bandwidth this script measures (a jitted sum over a 1 GiB array), and the
  fraction of it each engine reaches, end to end and, for jspec, over the decode
  phase alone (the run minus a prefill-only run of the same prompts): the
  roofline bounds a decode step, which reads every weight once; the prefill is a
  compute-bound forward over the whole prompt.

Every row generates exactly ``--max-new-tokens`` tokens (end-of-sequence is
ignored by both engines) so both do the same work.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from jspec.analysis.harness import arguments, save

PROMPTS = [
    "Explain how a hash map handles collisions.",
    "Write a Python function that reverses a linked list.",
    "What are the main causes of inflation?",
    "Summarize the plot of a heist movie in three sentences.",
    "Give me five tips for writing clear documentation.",
    "How does public-key cryptography work?",
    "Describe the water cycle to a ten-year-old.",
    "What is the difference between a process and a thread?",
]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _chat_ids(encode, template, n):
    return [encode(template(p)) for p in (PROMPTS * 2)[:n]]


def worker_jspec(model_name: str, batches: list[int], max_new: int) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jspec.core.cache import KVCache
    from jspec.loop.decode import Decoder
    from jspec.models.hub import load_model
    from jspec.models.llama import layer_loop_for_backend

    out = {"engine": "jspec", "backend": jax.default_backend(), "layer_loop": layer_loop_for_backend()}
    t0 = time.perf_counter()
    model, tok = load_model(model_name)
    out["load_seconds"] = time.perf_counter() - t0
    c = model.config
    out["params"] = c.num_params

    def template(p):
        return tok.apply_chat_template([{"role": "user", "content": p}])

    decoder = Decoder(model, eos_ids=())  # fixed work: every row makes max_new tokens
    out["runs"] = []
    for b in batches:
        prompts = _chat_ids(tok.encode, template, b)
        first = decoder.generate(prompts, max_new)
        best = min((decoder.generate(prompts, max_new) for _ in range(2)), key=lambda r: r.seconds)
        # The decode phase alone: the same prompts with a budget of one token are the
        # prefill (and its first token); the rest of the run is max_new - 1 decode steps.
        decoder.generate(prompts, 1)
        prefill_s = min(decoder.generate(prompts, 1).seconds for _ in range(3))
        decode_steps_per_s = (max_new - 1) / max(best.seconds - prefill_s, 1e-9)
        out["runs"].append(
            {
                "batch": b,
                "new_tokens": best.new_tokens,
                "seconds": best.seconds,
                "tokens_per_s": best.tokens_per_s,
                "compile_seconds": first.compile_seconds,
                "prefill_seconds": prefill_s,
                "decode_steps_per_s": decode_steps_per_s,
            }
        )
        print(f"  jspec {model_name} batch {b}: {best.tokens_per_s:.2f} tokens/s", file=sys.stderr)

    # One decode step with a warm cache, for each way of looping over layers. The model
    # already loaded serves its own loop; the other is loaded only after it is freed.
    from jspec.models.hub import fetch
    from jspec.models.loading import load_folder

    steps = {}
    loaded = model.layer_loop
    loops = [loaded] + [loop for loop in ("unrolled", "scan") if loop != loaded]
    del decoder
    for loop in loops:
        m = model if loop == loaded else load_folder(fetch(model_name), layer_loop=loop)[0]
        model = None  # drop every reference to the previous weights before the next load
        graphdef, state = nnx.split(m)
        del m

        @jax.jit
        def step(state, last, cache, graphdef=graphdef):
            o = nnx.merge(graphdef, state)(last[:, None], cache.lengths[:, None], cache)
            return o.logits, o.cache

        cache = KVCache.create(c.num_layers, 1, 256, c.num_kv_heads, c.head_dim).rollback(jnp.array([128]))
        last = jnp.array([5])
        t0 = time.perf_counter()
        jax.block_until_ready(step(state, last, cache))
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            jax.block_until_ready(step(state, last, cache))
            times.append(time.perf_counter() - t0)
        steps[loop] = {"step_ms": 1000 * sorted(times)[len(times) // 2], "compile_seconds": compile_s}
        del state, step
    out["one_step"] = steps
    out["peak_rss_mb"] = _peak_rss_mb()
    return out


def worker_hf(model_name: str, batches: list[int], max_new: int) -> dict:
    import torch
    import transformers

    from jspec.models.hub import ensure_gguf

    torch.set_num_threads(os.cpu_count() or 1)
    path = ensure_gguf(model_name)
    t0 = time.perf_counter()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    out = {"engine": "transformers", "version": transformers.__version__, "torch": torch.__version__}
    out["load_seconds"] = time.perf_counter() - t0
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    def template(p):
        return tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)

    out["runs"] = []
    for b in batches:
        texts = [template(p) for p in (PROMPTS * 2)[:b]]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        kwargs = dict(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
        with torch.no_grad():
            model.generate(**enc, **kwargs)  # warm-up
            best = float("inf")
            for _ in range(2):
                t0 = time.perf_counter()
                gen = model.generate(**enc, **kwargs)
                best = min(best, time.perf_counter() - t0)
        new = (gen.shape[1] - enc["input_ids"].shape[1]) * b
        out["runs"].append({"batch": b, "new_tokens": int(new), "seconds": best, "tokens_per_s": new / best})
        print(f"  transformers {model_name} batch {b}: {new / best:.2f} tokens/s", file=sys.stderr)
    out["peak_rss_mb"] = _peak_rss_mb()
    return out


def measure_read_bandwidth(gib: float = 1.0) -> float:
    """Bytes per second of a jitted sum over a large float32 array (what decoding does to weights)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((int(gib * (1 << 30)) // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        total(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return x.nbytes / min(times)


def measure_gemv_bandwidth(gib: float = 0.5) -> float:
    """Bytes per second XLA reaches in a matrix-vector product: the pattern of a batch-1 decode step."""
    import jax
    import jax.numpy as jnp

    cols = 1024
    w = jnp.ones((int(gib * (1 << 30)) // 4 // cols, cols), jnp.float32)
    x = jnp.ones((1, cols), jnp.float32)
    from jspec.models.layers import linear

    gemv = jax.jit(lambda x, w: linear(x, w))  # the model's own layout: w [out, in]
    gemv(x, w).block_until_ready()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        gemv(x, w).block_until_ready()
        times.append(time.perf_counter() - t0)
    return w.nbytes / min(times)


def _run_worker(kind: str, model: str, batches: list[int], max_new: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--models", model, "--batches", ",".join(map(str, batches)),
           "--max-new-tokens", str(max_new)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(proc.stderr[-2000:] if proc.returncode else "")
    if proc.returncode:
        raise RuntimeError(f"{kind} worker for {model} failed")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, max_new_tokens=64, out="experiments/out")
    parser.add_argument("--models", default="smollm2-135m,qwen2.5-coder-1.5b")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="SmolLM2 only, batch 1, 16 tokens, no transformers")
    parser.add_argument("--worker", choices=["jspec", "transformers"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    models = args.models.split(",")
    if args.worker:
        fn = worker_jspec if args.worker == "jspec" else worker_hf
        print(json.dumps(fn(models[0], batches, args.max_new_tokens)))
        return {}
    if args.tiny:
        models, batches, args.max_new_tokens, args.no_transformers = ["smollm2-135m"], [1], 16, True

    bandwidth = measure_read_bandwidth()
    gemv_bw = measure_gemv_bandwidth()
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s (XLA matrix-vector product: {gemv_bw / 1e9:.1f} GB/s)")
    results = {
        "read_bandwidth_gbps": bandwidth / 1e9,
        "gemv_bandwidth_gbps": gemv_bw / 1e9,
        "max_new_tokens": args.max_new_tokens,
        "models": {},
    }
    for name in models:
        entry = {"jspec": _run_worker("jspec", name, batches, args.max_new_tokens)}
        if not args.no_transformers:
            entry["transformers"] = _run_worker("transformers", name, batches, args.max_new_tokens)
        # Bandwidth again after the runs; the best seen counts (the machine is shared and noisy).
        bandwidth = max(bandwidth, measure_read_bandwidth())
        results["read_bandwidth_gbps"] = bandwidth / 1e9
        weight_bytes = entry["jspec"]["params"] * 4
        entry["weight_bytes"] = weight_bytes
        entry["roofline_steps_per_s"] = bandwidth / weight_bytes
        results["models"][name] = entry

        print(f"\n{name}: {weight_bytes / 1e6:.0f} MB of float32 weights read per step; "
              f"roofline {bandwidth / weight_bytes:.1f} steps/s")  # fmt: skip
        steps = entry["jspec"]["one_step"]
        cells = [f"{loop} {v['step_ms']:.1f} ms (compile {v['compile_seconds']:.1f} s)" for loop, v in steps.items()]
        print("  one decode step (warm cache, batch 1): " + ", ".join(cells))
        for run in entry["jspec"]["runs"]:
            frac = run["decode_steps_per_s"] / entry["roofline_steps_per_s"]
            run["decode_fraction_of_roofline"] = frac
            print(f"  jspec batch {run['batch']} decode phase alone (prefill {1000 * run['prefill_seconds']:.0f} ms "
                  f"taken out): {run['decode_steps_per_s']:.2f} steps/s, {frac:.0%} of the roofline")  # fmt: skip
        print(f"  {'engine':<13} {'batch':>5} {'tokens/s':>9} {'of roofline':>12} {'compile s':>10} {'peak MB':>8}")
        for engine in ("jspec", "transformers"):
            if engine not in entry:
                continue
            for run in entry[engine]["runs"]:
                frac = run["tokens_per_s"] / run["batch"] / entry["roofline_steps_per_s"]
                run["fraction_of_roofline"] = frac
                comp = f"{run['compile_seconds']:.1f}" if "compile_seconds" in run else "-"
                print(f"  {engine:<13} {run['batch']:>5} {run['tokens_per_s']:>9.2f} {frac:>11.0%} {comp:>10} "
                      f"{entry[engine]['peak_rss_mb']:>8.0f}")  # fmt: skip
        if "transformers" in entry:
            for a, b in zip(entry["jspec"]["runs"], entry["transformers"]["runs"], strict=True):
                a["ratio_to_transformers"] = a["tokens_per_s"] / b["tokens_per_s"]
                print(f"  batch {a['batch']}: jspec / transformers = {a['ratio_to_transformers']:.2f}x")
    results = save(args.out / "bench_decode.json", results, args=args, started=started)
    print(f"\nwrote {args.out / 'bench_decode.json'}")
    return results


if __name__ == "__main__":
    main()
