"""Speculative decoding on real models and prompt sets: jspec beside transformers, with predictions.

    python experiments/benchmarks/bench_spec.py [--setups smollm2-ngram,qwen-draft] [--prompts mt-bench,humaneval]
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
  (:func:`jspec.analysis.bench.predicted_seconds`); the gap is what the engine adds.
* transformers (PyTorch, float32, the same GGUF weights, the same token ids):
  ``generate`` plain, with ``assistant_model`` (a constant ``N`` draft tokens)
  or with ``prompt_lookup_num_tokens=N``.

Speedups over plain decoding, for both engines, are paired prompt by prompt at matched answer lengths
with a 95% interval (:func:`jspec.analysis.paired.speedup`, :func:`~jspec.analysis.paired.speedup_interval`):
sampled answers differ in length, and a ratio of rates then also measures how long they were.

First turns of MT-bench and HumanEval prompts, each with the chat template.
Writes ``bench_spec.json`` to --out and prints the tables the log (docs/log/) keeps.
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

from jspec.analysis.harness import arguments, floats, ints, save

SETUPS = {
    "smollm2-ngram": {"target": "smollm2-135m", "method": "ngram", "draft": None},
    "qwen-draft": {"target": "qwen2.5-coder-1.5b", "method": "draft", "draft": "qwen2.5-coder-0.5b"},
    "smollm2-eagle3": {"target": "smollm2-135m", "method": "eagle3", "draft": None},  # no transformers twin
}


def _tree(spec: str):
    """A --trees entry: a branching list "2,2,2" or "dynamic:TOP_K:DEPTH:NODES"."""
    from jspec.core.tree import DynamicTreeSpec, StaticTree

    if spec.startswith("dynamic"):
        top_k, depth, nodes = (int(x) for x in spec.split(":")[1:])
        return DynamicTreeSpec(top_k, depth, nodes)
    return StaticTree.from_branching(ints(spec))


def _prompt_ids(tokenizer, prompt_sets: list[str], limit: int) -> dict[str, list[list[int]]]:
    from jspec.analysis.prompts import load_prompts

    ids = {}
    for name in prompt_sets:
        prompts = load_prompts(name, None, limit)
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": p.text}]) for p in prompts]
        ids[name] = [tokenizer.encode(chat) for chat in chats]
    return ids


def worker_jspec(setup: dict, args) -> dict:
    import jax

    from jspec.analysis.bench import predicted_seconds, run_interleaved, run_prompts
    from jspec.analysis.paired import speedup, speedup_interval
    from jspec.core.sampling import SamplingParams
    from jspec.drafters import DraftModel, PromptLookup
    from jspec.loop.decode import Decoder
    from jspec.loop.engine import SpeculativeDecoder
    from jspec.loop.xla_cache import enable_compilation_cache
    from jspec.models.hub import load_model
    from jspec.tune.costs import drafter_cost, forward_cost

    enable_compilation_cache()
    target, tokenizer = load_model(setup["target"])
    grid = ints(args.num_draft)
    trees = [t for t in (args.trees or "").split(";") if t] if setup["method"] in ("eagle3", "draft") else []
    out = {"engine": "jspec", "backend": jax.default_backend(), "jax": jax.__version__}
    head = draft_model = None
    if setup["method"] == "eagle3":
        from jspec.drafters import EagleDrafter
        from jspec.heads.eagle import load_head
        from jspec.models.hub import shipped_head

        head = load_head(args.head or shipped_head(setup["target"], "eagle3"), target)
    elif setup["method"] == "draft":
        draft_model, _ = load_model(setup["draft"])

    def drafter_for(key):
        """The drafter of a grid entry: "N=5" or "tree=SPEC"."""
        kind, value = key.split("=", 1)
        if head is not None:
            tree = _tree(value) if kind == "tree" else None
            return EagleDrafter.from_head(head, target, num_draft=None if tree else int(value), tree=tree)
        if draft_model is None:
            return PromptLookup(num_draft=int(value))
        if kind == "tree":  # static trees only: the draft model's top choices below each node
            return DraftModel.from_model(draft_model, target, tree=_tree(value))
        return DraftModel.from_model(draft_model, target, num_draft=int(value))

    keys = [f"N={n}" for n in grid] + [f"tree={t}" for t in trees]

    def width(drafter) -> int:
        """Tokens in one verify forward: a tree's nodes, or the pending token and N drafts."""
        return drafter.num_nodes or drafter.num_draft + 1

    widths = {key: width(drafter_for(key)) for key in keys}

    # Costs measured alone.
    ms = forward_cost(target, max_k=max(widths.values()), context=256)
    relative = {k: v / ms[1] for k, v in ms.items()}
    costs = {"target_ms": ms, "relative": relative}
    if draft_model is not None:
        draft_trees = [drafter_for(k).tree.fed_per_depth for k in keys if k.startswith("tree=")]
        dms = forward_cost(draft_model, max_k=max([2, *(max(f) for f in draft_trees if f)]), context=256)
        costs |= {"draft_ms": dms, "c": dms[1] / ms[1], "draft_r2": dms[2] / dms[1]}
    elif head is not None:
        costs |= {"head_ms": {key: drafter_cost(target, drafter_for(key)) for key in keys}}
    else:
        lookup = {n: drafter_cost(target, PromptLookup(num_draft=n))["propose_ms"] for n in grid}
        costs |= {"lookup_ms": lookup}
    out["costs"] = costs
    print(f"  costs: {json.dumps(costs)}", file=sys.stderr)

    def units(key):
        """(draft units per verify step, units per plain step, prefill units) in target steps."""
        n = int(key[2:]) if key.startswith("N=") else 0
        if head is not None:  # the head's propose and commit per step; its prefill rides on the target's
            h = costs["head_ms"][key]
            return (h["propose_ms"] + h["commit_ms"]) / ms[1], 0.0, 0.0
        if draft_model is None:
            u = costs["lookup_ms"][n] / ms[1]
            return u, u, 0.0
        c = costs["c"]
        if key.startswith("tree="):  # the catch-up forward, then one forward per fed depth
            r_d = {k: v / costs["draft_ms"][1] for k, v in costs["draft_ms"].items()}
            fed = drafter_for(key).tree.fed_per_depth
            return c * (costs["draft_r2"] + sum(r_d[f] for f in fed)), 0.0, c
        return c * (costs["draft_r2"] + n - 1), 0.0, c

    ids = _prompt_ids(tokenizer, args.prompts.split(","), args.limit)
    eos = tokenizer.eos_token_ids
    results: dict = {}
    for name, prompt_ids in ids.items():
        # Fresh decoders per prompt set, the last set's compiled loops freed first: holding every
        # loop of two Qwen models for every bucket ran the compiler out of memory (docs/log).
        decoders = None
        jax.clear_caches()
        gc.collect()
        plain = Decoder(target, eos_ids=eos)
        decoders = {"ar": plain}
        for key in keys:
            decoders[key] = SpeculativeDecoder(target, drafter_for(key), eos_ids=eos)
        # Prefill alone: a one-token generation per prompt.
        prefill = run_prompts(plain, prompt_ids, 1, SamplingParams.greedy())
        for t in floats(args.temperatures):
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
                du, pu, fu = units(key)
                step_s = ar["step_ms"] / 1000
                pred = predicted_seconds(e, step_s, ar["prefill_seconds"], relative, du, pu, fu, widths[key])
                e["width"] = widths[key]
                # Paired prompt by prompt at matched answer lengths, not a ratio of rates (sampled
                # answers differ in length, and the prefill does not scale with it).
                e["speedup"] = speedup(e, ar)
                e["speedup_interval"] = list(speedup_interval(e, ar))
                e["predicted_seconds"] = pred
                # Plain decoding's measured time moved along its step to this run's length, over the
                # prediction for the same length.
                ar_seconds = ar["seconds"] + step_s * (e["new_tokens"] - ar["new_tokens"])
                e["predicted_speedup"] = ar_seconds / pred
                # Where the time went, from the costs measured alone: drafting, verifying, the rest.
                e["breakdown_s"] = {
                    "prefill": ar["prefill_seconds"],
                    "draft": e["verify_steps"] * du * step_s,
                    "verify": e["verify_steps"] * relative[widths[key]] * step_s,
                    "plain_steps": e["plain_steps"] * (1 + pu) * step_s,
                }
                e["breakdown_s"]["rest"] = e["seconds"] - sum(e["breakdown_s"].values())
                results[f"{name}|T={t}|{key}"] = e
                print(
                    f"  {name} T={t} {key}: tau {e['tau']:.2f}, {e['tokens_per_s']:.2f} tokens/s, "
                    f"speedup {e['speedup']:.2f} ({_interval(e)}; predicted {e['predicted_speedup']:.2f}), "
                    f"plain steps {e['plain_steps']}/{e['plain_steps'] + e['verify_steps']}",
                    file=sys.stderr,
                )
    out["results"] = results
    return out


def worker_hf(setup: dict, args) -> dict:
    import torch
    import transformers

    from jspec.analysis.paired import speedup, speedup_interval
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

    grid = [0, *ints(args.hf_num_draft)]
    run(next(iter(ids.values()))[0], 0, 0.0, 0)  # warm-up
    results = {}
    for name, prompt_ids in ids.items():
        for t in floats(args.hf_temperatures or args.temperatures):
            runs = {n: ([], []) for n in grid}  # per prompt: new tokens, seconds
            for i, p in enumerate(prompt_ids):  # plain and every N take turns, as in the jspec worker
                for n in grid:
                    new, seconds = run(p, args.seed + i, t, n)
                    runs[n][0].append(new)
                    runs[n][1].append(seconds)
            entries = {
                n: {"new_tokens": sum(tokens), "seconds": sum(seconds), "tokens_per_s": sum(tokens) / sum(seconds),
                    "batch_tokens": tokens, "batch_seconds": seconds}
                for n, (tokens, seconds) in runs.items()
            }  # fmt: skip
            ar = entries[0]
            results[f"{name}|T={t}|ar"] = ar
            print(f"  transformers {name} T={t} ar: {ar['tokens_per_s']:.2f} tokens/s", file=sys.stderr)
            for n in grid[1:]:  # measured as the jspec worker's are: paired, at matched lengths
                e = entries[n] | {"num_draft": n, "speedup": speedup(entries[n], ar),
                                  "speedup_interval": list(speedup_interval(entries[n], ar))}  # fmt: skip
                results[f"{name}|T={t}|N={n}"] = e
                print(f"  transformers {name} T={t} N={n}: speedup {e['speedup']:.2f} ({_interval(e)})",
                      file=sys.stderr)  # fmt: skip
    out["results"] = results
    return out


def _run_worker(kind: str, setup_name: str, argv: list[str]) -> dict:
    cmd = [sys.executable, __file__, *argv, "--worker", kind, "--setups", setup_name]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode:
        raise RuntimeError(f"{kind} worker for {setup_name} failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _interval(entry: dict) -> str:
    """A speedup's 95% interval as the tables print it (runs recorded before it was kept have none)."""
    low, high = entry.get("speedup_interval", (float("nan"),) * 2)
    return f"{low:.2f}-{high:.2f}x"


def _table(setup_name: str, jspec: dict, hf: dict | None) -> str:
    lines = [
        f"{setup_name}: prompts | T | N | τ | tokens/s | speedup (95%) | predicted | transformers speedup (95%)",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, e in jspec["results"].items():
        name, t, n = key.split("|")
        hf_e = (hf or {}).get("results", {}).get(key)
        if hf_e is None:
            hf_cell = ""
        else:
            hf_cell = (f"{hf_e['tokens_per_s']:.2f} tok/s" if n == "ar"
                       else f"{hf_e['speedup']:.2f}x ({_interval(hf_e)})")  # fmt: skip
        if n == "ar":
            lines.append(f"| {name} | {t[2:]} | plain | 1 | {e['tokens_per_s']:.2f} | 1 | - | {hf_cell} |")
        else:
            lines.append(
                f"| {name} | {t[2:]} | {n[2:] if n.startswith('N=') else n} | {e['tau']:.2f} | {e['tokens_per_s']:.2f} "
                f"| {e['speedup']:.2f}x ({_interval(e)}) "
                f"| {e['predicted_speedup']:.2f}x | {hf_cell} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, prompts="mt-bench,humaneval", limit=4, max_new_tokens=96, temperatures="0,1")
    parser.add_argument("--setups", default="smollm2-ngram,qwen-draft")
    parser.add_argument("--num-draft", default="2,4,6,8")
    parser.add_argument("--hf-num-draft", default="2,4,6,8")
    parser.add_argument(
        "--trees",
        default="",
        help='EAGLE and draft-model setups: trees, e.g. "2,2,2;dynamic:4:4:16" (the draft model: static trees only)',
    )
    parser.add_argument("--head", default=None, help="EAGLE setups: the head folder (default: the shipped one)")
    parser.add_argument("--hf-temperatures", default=None, help="default: --temperatures")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument(
        "--transformers-only",
        action="store_true",
        help="only the transformers worker (to complete a grid whose jspec side ran before)",
    )
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
        entry = {} if args.transformers_only else {"jspec": _run_worker("jspec", name, forwarded)}
        if not args.no_transformers and SETUPS[name]["method"] != "eagle3":
            entry["transformers"] = _run_worker("transformers", name, forwarded)
        report["setups"][name] = entry
        if "jspec" in entry:
            print(_table(name, entry["jspec"], entry.get("transformers")), flush=True)
        else:
            for key, e in entry["transformers"]["results"].items():
                cell = f"{e['tokens_per_s']:.2f} tokens/s" if key.endswith("|ar") else f"{e['speedup']:.2f}x"
                print(f"  transformers {key}: {cell}", flush=True)
        report = save(args.out / "bench_spec.json", report, args=args, started=started)
    return report


if __name__ == "__main__":
    main()
