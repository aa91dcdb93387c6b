"""One command that measures what jspec needs to know about an accelerator, in minutes, with no files.

    python experiments/device_check.py [--shapes qwen2.5-1.5b,llama-3.1-8b] [--budget 420] [--small]
        [--out experiments/out]

Random weights of real shapes (speed does not depend on the values), bfloat16 and scanned layers on an
accelerator (float32 and unrolled layers on CPU, as jspec chooses by itself). Per shape, printed as one
JSON object and written to ``device_check.json``:

- ``compile_s``: compiling the plain decode loop (batch 1) and the speculative loop (prompt lookup, N 4);
- ``plain_tokens_per_s`` at batch 1 and its ``hbm_roofline_fraction``: the weights' bytes read per token
  over the time per token, against the device's peak memory bandwidth (known devices only);
- ``r``: a k-token forward's time over a one-token one, k = 1 ... 64, after 256 cached tokens (the
  verify cost of the speedup formula: near 1 on an accelerator, what makes drafting pay);
- ``loop_overhead``: the speculative loop's time per target call over the plain loop's per step, with
  prompt lookup on sampled text from random weights, where it (almost) never finds a draft
  (``speculative_verify_steps`` says how often it did): the machinery's own cost;
- ``batch_tokens_per_s``: plain decoding at batch 1, 2, 4, ..., 64;
- ``eagle3`` (``--eagle3``, on by default for llama-3.1-8b and --small): a random EAGLE-3 head of the
  published shapes (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's: one layer as wide as the target, a 32,000-token
  draft vocabulary, the target's outputs 1, L/2-1, L-4), the head's cost per step for a chain of 5 and
  for the paper's dynamic tree (10 children, depth 6, 60 nodes) over a one-token target step (``c``),
  the verify cost of those widths (``r``), and the speedup the paper's τ would give here:
  τ / (r(width) + c) (τ 6.13 is the EAGLE-3 paper's MT-bench figure for LLaMA-3.1-8B, T = 0, trees).

Stops starting new measurements when ``--budget`` seconds have passed (the rest are marked skipped), so
it fits a short device lease. ``--small`` runs tiny shapes on any machine (the tests run it on CPU).
"""

from __future__ import annotations

import json
import time

from jspec.analysis.harness import arguments, save

SHAPES = {  # the published configurations' shapes; the weights are random
    "qwen2.5-1.5b": dict(
        family="qwen2",
        vocab_size=151_936,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
        rope_theta=1e6,
        rms_eps=1e-6,
        qkv_bias=True,
        tie_embeddings=True,
        max_position=32_768,
    ),
    "llama-3.1-8b": dict(
        family="llama",
        vocab_size=128_256,
        hidden_size=4096,
        intermediate_size=14_336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=5e5,
        rms_eps=1e-5,
        tie_embeddings=False,
        max_position=131_072,
    ),
    "tiny": dict(
        family="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position=1024,
    ),
}

PEAK_HBM_GBPS = {"H100": 3350, "H200": 4800, "A100": 2039, "L4": 300, "TPU v5 lite": 819, "TPU v4": 1200}


def peak_bandwidth(device_kind: str) -> float | None:
    return next((v for k, v in PEAK_HBM_GBPS.items() if k.lower() in device_kind.lower()), None)


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> bool:
        return time.monotonic() < self.end


def build(name: str, dtype):
    from flax import nnx

    from jspec.models.config import ModelConfig
    from jspec.models.llama import Transformer

    config = ModelConfig(**SHAPES[name])
    return Transformer(config, rngs=nnx.Rngs(0), dtype=dtype)


def weight_bytes(model) -> int:
    import jax
    from flax import nnx

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def measure(name: str, args, budget: Budget) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jspec
    from jspec.tune.costs import forward_cost

    accelerator = jax.default_backend() != "cpu"
    dtype = jnp.bfloat16 if accelerator else jnp.float32
    t0 = time.perf_counter()
    model = build(name, dtype)
    jax.block_until_ready(jax.tree.leaves(model))
    out = {"dtype": jnp.dtype(dtype).name, "layer_loop": model.layer_loop, "build_s": time.perf_counter() - t0,
           "weight_bytes": weight_bytes(model), "skipped": []}  # fmt: skip
    tokens = 32 if args.small else 128
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompt = rng.permutation(vocab)[:64].tolist()  # no repeated n-gram in the prompt
    # Sampled text from random weights hardly repeats an n-gram either, so prompt lookup finds (almost)
    # no draft and the speculative loop runs plain steps: its own cost, measured against the plain loop.
    warm = jspec.SamplingParams.create(1.0)

    plain = jspec.Decoder(model, eos_ids=())
    first = plain.generate([prompt], tokens, warm)
    timed = plain.generate([prompt], tokens, warm)
    out["compile_s"] = {"plain": first.compile_seconds}
    out["plain_tokens_per_s"] = timed.tokens_per_s
    peak = peak_bandwidth(jax.devices()[0].device_kind)
    per_token_s = 1 / timed.tokens_per_s
    out["hbm_roofline_fraction"] = None if peak is None else out["weight_bytes"] / per_token_s / (peak * 1e9)

    if budget.left():
        spec = jspec.SpeculativeDecoder(model, jspec.make_drafter("ngram", model, num_draft=4), eos_ids=())
        s_first = spec.generate([prompt], tokens, warm)
        s_timed = spec.generate([prompt], tokens, warm)
        out["compile_s"]["speculative"] = s_first.compile_seconds
        steps_plain, steps_spec = tokens, s_timed.target_calls - 1
        out["loop_overhead"] = (s_timed.seconds / steps_spec) / (timed.seconds / steps_plain)
        out["speculative_verify_steps"] = s_timed.verify_steps
    else:
        out["skipped"].append("loop_overhead")

    ks = [1, 2, 4] if args.small else [1, 2, 4, 8, 16, 32, 64]
    if budget.left():
        ms = forward_cost(model, max(ks), context=64 if args.small else 256, repeats=3 if args.small else 7, widths=ks)
        out["forward_ms"] = ms
        out["r"] = {k: v / ms[1] for k, v in ms.items()}
    else:
        out["skipped"].append("r")

    if name in args.eagle3.split(",") or args.small:
        if budget.left():
            out["eagle3"] = eagle3_case(model, args.small, out.get("forward_ms"))
        else:
            out["skipped"].append("eagle3")

    out["batch_tokens_per_s"] = {}
    for b in [1, 2] if args.small else [1, 2, 4, 8, 16, 32, 64]:
        if not budget.left():
            out["skipped"].append(f"batch {b}")
            continue
        prompts = [rng.integers(0, vocab, 64).tolist() for _ in range(b)]
        plain.generate(prompts, tokens)
        out["batch_tokens_per_s"][b] = plain.generate(prompts, tokens).tokens_per_s
    return out


PAPER_TAU = 6.13  # EAGLE-3 paper, LLaMA-3.1-8B-Instruct, MT-bench, T = 0 (dynamic trees)


def eagle3_case(model, small: bool, forward_ms: dict | None) -> dict:
    """A random EAGLE-3 head of the published shapes on ``model``: its cost for a chain and for the paper's
    tree, relative to a one-token step, and the speedup the paper's tau would give at that cost."""
    import numpy as np
    from flax import nnx

    import jspec
    from jspec.heads.eagle import DraftHead, HeadConfig
    from jspec.tune.costs import drafter_cost, forward_cost

    t = model.config
    L = t.num_layers
    k = 64 if small else 32_000
    dtype = model.embed[...].dtype
    layers = (1, L // 2 - 1, L - 4) if L >= 8 else (0, L // 2, L - 1)  # the published default, or tiny's
    config = HeadConfig.for_target(t, "eagle3", draft_vocab_size=k, feature_layers=layers)
    head = DraftHead(config, rngs=nnx.Rngs(1), dtype=dtype)
    head.attach_target(model, np.arange(k))
    tree = jspec.DynamicTreeSpec(top_k=4, depth=3, total=8) if small else jspec.DynamicTreeSpec(10, 6, 60)
    widths = sorted({1, 6, tree.size})
    ms = forward_cost(model, max(widths), context=64 if small else 256, repeats=3 if small else 7, widths=widths)
    out = {"draft_vocab": k, "tree": [tree.top_k, tree.depth, tree.total], "forward_ms": ms, "paper_tau": PAPER_TAU}
    for label, kw, width in [("chain5", {"num_draft": 5}, 6), ("tree", {"tree": tree}, tree.size)]:
        drafter = jspec.make_drafter("eagle3", model, head=head, **kw)
        cost = drafter_cost(model, drafter, context=64 if small else 256, repeats=3 if small else 7)
        c = (cost["propose_ms"] + cost["commit_ms"]) / ms[1]
        r = ms[width] / ms[1]
        out[label] = cost | {"c": c, "r": r, "speedup_at_paper_tau": PAPER_TAU / (r + c)}
    return out


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, out="experiments/out")
    parser.add_argument("--shapes", default="qwen2.5-1.5b,llama-3.1-8b")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds after which nothing new starts")
    parser.add_argument("--small", action="store_true", help="tiny shapes and few sizes: any machine, seconds")
    parser.add_argument("--eagle3", default="llama-3.1-8b", help="shapes that also measure an EAGLE-3 head")
    args = parser.parse_args(argv)
    shapes = ["tiny"] if args.small else args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")

    import jax

    budget = Budget(args.budget)
    device = jax.devices()[0]
    report = {"jax": jax.__version__, "backend": jax.default_backend(), "device_kind": device.device_kind,
              "device_count": jax.device_count(), "peak_hbm_gbps": peak_bandwidth(device.device_kind),
              "shapes": {}}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    for name in shapes:
        if not budget.left():
            report["shapes"][name] = {"skipped": ["everything: the budget ran out"]}
            continue
        report["shapes"][name] = measure(name, args, budget)
        jax.clear_caches()
        # Written after every shape: a lease that ends mid-run still returns what was measured.
        report = save(args.out / "device_check.json", report, args=args, started=started)
    report = save(args.out / "device_check.json", report, args=args, started=started)
    print(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    main()
