"""Speculative decoding on real models and prompt sets: jspec beside transformers, with predictions.

    python experiments/bench_spec.py [--setups smollm2-ngram,qwen-draft] [--prompts mt-bench,humaneval]
        [--limit 4] [--max-new-tokens 96] [--temperatures 0,1] [--num-draft 2,4,6,8]
        [--hf-num-draft 2,4,6,8] [--no-transformers] [--tiny] [--out experiments/out]

Setups: ``smollm2-ngram`` (prompt lookup on SmolLM2-135M-Instruct) and
``qwen-draft`` (Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B). For each,
in its own subprocess per engine:

* jspec: the costs that bound any speedup, measured alone — r(k), a k-token
  target forward over a one-token one (warm cache, 256 cached tokens), the
  drafter's cost (a draft model's one-token forward and two-token catch-up
  over the target's step; prompt lookup's search), the prefills — then plain
  decoding and speculative decoding at every N on the same prompts (batch 1,
  compilation timed apart): τ, acceptance by position, tokens/s, speedup, and
  the speedup predicted from τ's step counts and the costs measured alone
  (:func:`jspec.bench.predicted_seconds`); the gap is what the engine adds.
* transformers (PyTorch, float32, the same GGUF weights, the same token ids):
  ``generate`` plain, with ``assistant_model`` (a constant ``N`` draft tokens)
  or with ``prompt_lookup_num_tokens=N``.

First turns of MT-bench and HumanEval prompts, each with the chat template.
Writes ``bench_spec.json`` to --out and prints the tables BENCHMARKS.md keeps.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import subprocess
import sys
import time

SETUPS = {
    "smollm2-ngram": {"target": "smollm2-135m", "method": "ngram", "draft": None},
    "qwen-draft": {"target": "qwen2.5-coder-1.5b", "method": "draft", "draft": "qwen2.5-coder-0.5b"},
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _prompt_ids(tokenizer, prompt_sets: list[str], limit: int) -> dict[str, list[list[int]]]:
    from jspec.prompts import load_prompts

    ids = {}
    for name in prompt_sets:
        prompts = load_prompts(name, None, limit)
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": p.text}]) for p in prompts]
        ids[name] = [tokenizer.encode(chat) for chat in chats]
    return ids


def _median_ms(fn, repeats: int = 10) -> float:
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[len(times) // 2]


def _lookup_ms(drafter, vocab_size: int, capacity: int = 512, length: int = 300) -> float:
    """One prompt-lookup search over a history of ``length`` tokens (random, so matches are rare)."""
    import jax
    import jax.numpy as jnp

    from jspec.drafters import Context
    from jspec.sampling import SamplingParams

    history = jax.random.randint(jax.random.PRNGKey(0), (1, capacity), 0, vocab_size)
    ctx = Context(history, jnp.array([length]), jnp.array([length - 1]))
    propose = jax.jit(lambda ctx: drafter.propose((), (), ctx, jax.random.PRNGKey(1), SamplingParams.greedy())[0])
    return _median_ms(lambda: propose(ctx), repeats=20)


def worker_jspec(setup: dict, args) -> dict:
    import jax

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from forward_cost import forward_cost

    from jspec.bench import predicted_seconds, run_interleaved, run_prompts
    from jspec.cli import _enable_compilation_cache
    from jspec.decode import Decoder
    from jspec.drafters import DraftModel, PromptLookup
    from jspec.engine import SpeculativeDecoder
    from jspec.models.hub import load_model
    from jspec.sampling import SamplingParams

    _enable_compilation_cache()
    target, tokenizer = load_model(setup["target"])
    vocab = target.config.vocab_size
    grid = _ints(args.num_draft)
    out = {"engine": "jspec", "backend": jax.default_backend(), "jax": jax.__version__}

    # Costs measured alone.
    ms = forward_cost(target, max_k=max(grid) + 1, context=256)
    relative = {k: v / ms[1] for k, v in ms.items()}
    costs = {"target_ms": ms, "relative": relative}
    draft_model = None
    if setup["method"] == "draft":
        draft_model, _ = load_model(setup["draft"])
        dms = forward_cost(draft_model, max_k=2, context=256)
        costs |= {"draft_ms": dms, "c": dms[1] / ms[1], "draft_r2": dms[2] / dms[1]}
    else:
        lookup = {n: _lookup_ms(PromptLookup(n, vocab), vocab) for n in grid}
        costs |= {"lookup_ms": lookup}
    out["costs"] = costs
    print(f"  costs: {json.dumps(costs)}", file=sys.stderr)

    def drafter_for(n):
        if draft_model is None:
            return PromptLookup(n, vocab), ()
        return DraftModel.from_model(draft_model, n, vocab)

    def units(n):
        """(draft units per verify step, units per plain step, prefill units) in target steps."""
        if draft_model is None:
            u = costs["lookup_ms"][n] / ms[1]
            return u, u, 0.0
        c = costs["c"]
        return c * (costs["draft_r2"] + n - 1), 0.0, c

    ids = _prompt_ids(tokenizer, args.prompts.split(","), args.limit)
    eos = tokenizer.eos_token_ids
    results: dict = {}
    for name, prompt_ids in ids.items():
        # Fresh decoders per prompt set, the last set's compiled loops freed first: holding every
        # loop of two Qwen models for every bucket ran the compiler out of memory (BENCHMARKS.md).
        decoders = None
        jax.clear_caches()
        gc.collect()
        plain = Decoder(target, eos)
        decoders = {"ar": plain}
        for n in grid:
            drafter, weights = drafter_for(n)
            decoders[f"N={n}"] = SpeculativeDecoder(target, drafter, weights, eos)
        # Prefill alone: a one-token generation per prompt.
        prefill = run_prompts(plain, prompt_ids, 1, SamplingParams.greedy())
        for t in _floats(args.temperatures):
            sampling = SamplingParams.create(t)
            # Plain and every N take turns prompt by prompt: drift in the machine's speed hits all alike.
            runs = run_interleaved(decoders, prompt_ids, args.max_new_tokens, sampling, seed=args.seed)
            ar = runs.pop("ar")
            steps = ar["target_calls"] - len(prompt_ids)
            ar["step_ms"] = 1000 * (ar["seconds"] - prefill["seconds"]) / max(steps, 1)
            ar["prefill_seconds"] = prefill["seconds"]
            results[f"{name}|T={t}|ar"] = ar
            print(f"  {name} T={t} ar: {ar['tokens_per_s']:.2f} tokens/s, step {ar['step_ms']:.1f} ms", file=sys.stderr)
            for key, e in runs.items():
                n = int(key[2:])
                du, pu, fu = units(n)
                pred = predicted_seconds(e, ar["step_ms"] / 1000, ar["prefill_seconds"], relative, du, pu, fu)
                e["num_draft"] = n
                e["speedup"] = e["tokens_per_s"] / ar["tokens_per_s"]
                e["predicted_seconds"] = pred
                e["predicted_speedup"] = (e["new_tokens"] / pred) / ar["tokens_per_s"]
                results[f"{name}|T={t}|N={n}"] = e
                print(
                    f"  {name} T={t} N={n}: tau {e['tau']:.2f}, {e['tokens_per_s']:.2f} tokens/s, "
                    f"speedup {e['speedup']:.2f} (predicted {e['predicted_speedup']:.2f}), "
                    f"plain steps {e['plain_steps']}/{e['plain_steps'] + e['verify_steps']}",
                    file=sys.stderr,
                )
    out["results"] = results
    return out


def worker_hf(setup: dict, args) -> dict:
    import torch
    import transformers

    from jspec.models.hub import ensure_gguf, fetch
    from jspec.models.tokenizer import TextTokenizer

    torch.set_num_threads(os.cpu_count() or 1)

    def load(name):
        path = ensure_gguf(name)
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        return model.eval()

    tokenizer = TextTokenizer.load(fetch(setup["target"]))  # the jspec worker's token ids, without its weights
    ids = _prompt_ids(tokenizer, args.prompts.split(","), args.limit)
    target = load(setup["target"])
    assistant = load(setup["draft"]) if setup["draft"] else None
    eos = list(tokenizer.eos_token_ids)
    out = {"engine": "transformers", "version": transformers.__version__, "torch": torch.__version__}

    def run(p, seed, t, n):
        """(new tokens, seconds) of one prompt; n = 0 is plain decoding."""
        kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=t > 0, eos_token_id=eos, pad_token_id=eos[0])
        if t > 0:
            kwargs |= dict(temperature=t, top_k=0, top_p=1.0)
        if n and assistant is not None:
            assistant.generation_config.num_assistant_tokens = n
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            assistant.generation_config.assistant_confidence_threshold = 0.0
            kwargs["assistant_model"] = assistant
        elif n:
            kwargs["prompt_lookup_num_tokens"] = n
        torch.manual_seed(seed)
        x = torch.tensor([p])
        with torch.no_grad():
            t0 = time.perf_counter()
            gen = target.generate(x, attention_mask=torch.ones_like(x), **kwargs)
            seconds = time.perf_counter() - t0
        return gen.shape[1] - x.shape[1], seconds

    grid = [0, *_ints(args.hf_num_draft)]
    run(next(iter(ids.values()))[0], 0, 0.0, 0)  # warm-up
    results = {}
    for name, prompt_ids in ids.items():
        for t in _floats(args.hf_temperatures or args.temperatures):
            sums = {n: [0, 0.0] for n in grid}
            for i, p in enumerate(prompt_ids):  # plain and every N take turns, as in the jspec worker
                for n in grid:
                    new, seconds = run(p, args.seed + i, t, n)
                    sums[n][0] += new
                    sums[n][1] += seconds
            ar = {"new_tokens": sums[0][0], "seconds": sums[0][1], "tokens_per_s": sums[0][0] / sums[0][1]}
            results[f"{name}|T={t}|ar"] = ar
            print(f"  transformers {name} T={t} ar: {ar['tokens_per_s']:.2f} tokens/s", file=sys.stderr)
            for n in grid[1:]:
                e = {"new_tokens": sums[n][0], "seconds": sums[n][1], "tokens_per_s": sums[n][0] / sums[n][1]}
                e |= {"num_draft": n, "speedup": e["tokens_per_s"] / ar["tokens_per_s"]}
                results[f"{name}|T={t}|N={n}"] = e
                print(f"  transformers {name} T={t} N={n}: speedup {e['speedup']:.2f}", file=sys.stderr)
    out["results"] = results
    return out


def _run_worker(kind: str, setup_name: str, argv: list[str]) -> dict:
    cmd = [sys.executable, __file__, *argv, "--worker", kind, "--setups", setup_name]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode:
        raise RuntimeError(f"{kind} worker for {setup_name} failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(setup_name: str, jspec: dict, hf: dict | None) -> str:
    lines = [
        f"{setup_name}: prompts | T | N | τ | tokens/s | speedup | predicted | transformers speedup",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, e in jspec["results"].items():
        name, t, n = key.split("|")
        hf_e = (hf or {}).get("results", {}).get(key)
        if hf_e is None:
            hf_cell = ""
        else:
            hf_cell = f"{hf_e['tokens_per_s']:.2f} tok/s" if n == "ar" else f"{hf_e['speedup']:.2f}x"
        if n == "ar":
            lines.append(f"| {name} | {t[2:]} | plain | 1 | {e['tokens_per_s']:.2f} | 1 | - | {hf_cell} |")
        else:
            lines.append(
                f"| {name} | {t[2:]} | {n[2:]} | {e['tau']:.2f} | {e['tokens_per_s']:.2f} | {e['speedup']:.2f}x "
                f"| {e['predicted_speedup']:.2f}x | {hf_cell} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setups", default="smollm2-ngram,qwen-draft")
    parser.add_argument("--prompts", default="mt-bench,humaneval")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--num-draft", default="2,4,6,8")
    parser.add_argument("--hf-num-draft", default="2,4,6,8")
    parser.add_argument("--hf-temperatures", default=None, help="default: --temperatures")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="SmolLM2 prompt lookup, 1 prompt, 8 tokens, N = 2")
    parser.add_argument("--worker", choices=["jspec", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("experiments/out"))
    raw = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(raw)
    if args.tiny:
        args.setups, args.prompts, args.limit, args.max_new_tokens = "smollm2-ngram", "humaneval", 1, 8
        args.temperatures, args.num_draft, args.no_transformers = "0", "2", True
    unknown = [s for s in args.setups.split(",") if s not in SETUPS]
    if unknown:
        raise SystemExit(f"unknown setup(s) {unknown}; known: {', '.join(SETUPS)}.")
    if args.worker:
        fn = worker_jspec if args.worker == "jspec" else worker_hf
        result = fn(SETUPS[args.setups], args)
        print(json.dumps(result))
        return result

    forwarded = [a for a in raw if a != "--tiny"]
    if args.tiny:
        forwarded = ["--prompts", args.prompts, "--limit", "1", "--max-new-tokens", "8", "--temperatures", "0",
                     "--num-draft", "2"]  # fmt: skip
    report = {"args": vars(args) | {"out": str(args.out)}, "setups": {}}
    for name in args.setups.split(","):
        entry = {"jspec": _run_worker("jspec", name, forwarded)}
        if not args.no_transformers:
            entry["transformers"] = _run_worker("transformers", name, forwarded)
        report["setups"][name] = entry
        print(_table(name, entry["jspec"], entry.get("transformers")), flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_spec.json").write_text(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    main()
