"""Soak: one process serves many mixed requests through long-lived decoders, and nothing is lost, wrong
or growing.

    python experiments/investigations/soak.py [--model smollm2-135m] [--requests 500] [--warmup 100] [--seed 0]
        [--out experiments/out] [--tiny]

Each request is a batch of 1-8 prompts (real MT-bench and HumanEval prompts cut to random lengths; random
ids with --tiny), a random budget, temperature 0 or 1, a seed, and one of several methods (plain decoding,
prompt lookup, Lookahead, and the shipped EAGLE-3 head or, with --tiny, a small draft model), served by
decoders made once. The default lengths (prompts of 24-32 tokens, budgets of 9-16) vary within one length
bucket each, so that the shape classes are the batch sizes times the methods: wider ranges multiply them,
and past ``JSPEC_MAX_COMPILED`` live loops the least recently used is dropped and compiled again on return.
Checks:

- every greedy output equals plain decoding's output for the same batch;
- every sampled request is served again later in the stream with the same seed and gives the same tokens;
- compilations: the loops compiled in the warm-up and in the stream (a request whose loop was not live)
  and every XLA compilation (JAX's monitoring events) are counted; a request never compiles its loop
  when a request of the same shape class (method, rows, prompt bucket, budget bucket, cache slots) was
  served before, until the cap on live loops (``JSPEC_MAX_COMPILED``) first drops one;
- resident memory and the process's memory mappings grow by at most 5% from the end of the warm-up
  (one request per method and batch size, as a server warms its shapes, then ``--warmup`` requests of
  the stream) to the end;
- every request answered exactly once, each row with at most its budget of tokens.

Writes ``soak.json`` (the figures, the per-request trace) to --out; exits 1 when a check fails.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from jspec.analysis.harness import arguments, save


def memory() -> tuple[float, int]:
    """(resident MiB, memory mappings) of this process (Linux /proc; psutil elsewhere, mappings -1)."""
    maps = -1
    try:
        with open("/proc/self/maps") as f:
            maps = sum(1 for _ in f)
        with open("/proc/self/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except OSError:
        import psutil

        rss = psutil.Process().memory_info().rss / 2**20
    return rss, maps


class CompileCounter:
    """Counts XLA compilations through JAX's monitoring events."""

    def __init__(self):
        import jax

        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


def span(text: str) -> tuple[int, int]:
    """ "A-B" (inclusive) as (A, B)."""
    try:
        lo, hi = (int(x) for x in text.split("-"))
    except ValueError:
        raise SystemExit(f"expected a range A-B, got {text!r}.") from None
    if not 1 <= lo <= hi:
        raise SystemExit(f"a range A-B needs 1 <= A <= B; got {text!r}.")
    return lo, hi


def make_requests(n: int, seed: int, pool: list[list[int]], methods: list[str], rows, lengths, budgets) -> list[dict]:
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(n):
        prompts = []
        for _ in range(int(rng.integers(rows[0], rows[1] + 1))):
            source = pool[int(rng.integers(len(pool)))]
            prompts.append(source[: int(rng.integers(lengths[0], lengths[1] + 1))])
        requests.append({"id": i, "method": methods[int(rng.integers(len(methods)))], "prompts": prompts,
                         "max_new": int(rng.integers(budgets[0], budgets[1] + 1)),
                         "temperature": float(rng.choice([0.0, 1.0])), "seed": i})  # fmt: skip
    return requests


def schedule(requests: list[dict], seed: int) -> list[tuple[int, bool]]:
    """(request id, is a replay): every sampled request comes back once, at a random later point."""
    rng = np.random.default_rng(seed + 1)
    order = [(r["id"], False) for r in requests]
    for r in requests:
        if r["temperature"] > 0:
            at = int(rng.integers(order.index((r["id"], False)) + 1, len(order) + 1))
            order.insert(at, (r["id"], True))
    return order


def shape_class(request: dict) -> tuple:
    from jspec.loop.batching import bucket, cache_slots

    longest = max(len(p) for p in request["prompts"])
    p, m = bucket(longest), bucket(request["max_new"])
    return request["method"], len(request["prompts"]), p, m, cache_slots(p, m, longest, request["max_new"])


def build(args):
    """(target, decoders by method, prompt pool, vocabulary size)."""
    import jspec
    from jspec.loop.decode import Decoder

    if args.tiny:
        from jspec.models.tiny import tiny_model

        target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=1, num_layers=1)
        rng = np.random.default_rng(args.seed)
        pool = [rng.integers(4, 97, 60).tolist() for _ in range(32)]
        methods = {"draft": jspec.make_drafter("draft", target, draft_model=draft, num_draft=3)}
        eos = ()
    else:
        from jspec.analysis.prompts import load_prompts
        from jspec.models.hub import load_model, shipped_head

        target, tok = load_model(args.model)
        texts = [p.text for p in load_prompts("mt-bench", None, 40)] + [
            p.text for p in load_prompts("humaneval", None, 40)
        ]
        pool = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
        methods = {"eagle3": jspec.make_drafter("eagle3", target, head=str(shipped_head(args.model)), num_draft=4)}
        eos = tok.eos_token_ids
    methods |= {
        "ngram": jspec.make_drafter("ngram", target, num_draft=4),
        "lookahead": jspec.make_drafter("lookahead", target),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    decoders = {"ar": Decoder(target, eos_ids=eos)}
    decoders |= {name: jspec.SpeculativeDecoder(target, d, eos_ids=eos) for name, d in methods.items()}
    return target, decoders, pool


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, model="smollm2-135m", seed=0, out="experiments/out")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=100, help="requests before memory is measured")
    parser.add_argument("--rows", type=span, default=(1, 8), help="batch sizes A-B")
    parser.add_argument("--prompt-lengths", type=span, default=(24, 32), help="prompt lengths A-B (tokens)")
    parser.add_argument("--budgets", type=span, default=(9, 16), help="max_new_tokens A-B")
    parser.add_argument("--methods", default=None, help="a subset of ar,ngram,lookahead,eagle3|draft (default all)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model and a tiny draft model (tests)")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.requests:
        raise SystemExit(f"--warmup must lie in [0, --requests); got {args.warmup}.")

    from jspec.core.sampling import SamplingParams
    from jspec.loop.batching import loops_compiled, max_compiled

    counter = CompileCounter()
    _, decoders, pool = build(args)
    if args.methods:
        unknown = set(args.methods.split(",")) - set(decoders)
        if unknown or "ar" not in args.methods.split(","):
            raise SystemExit(f"--methods: {sorted(unknown)} unknown (have {sorted(decoders)}); ar is needed.")
        decoders = {k: v for k, v in decoders.items() if k in args.methods.split(",")}
    pool = [p for p in pool if len(p) >= args.prompt_lengths[1]]
    requests = make_requests(args.requests, args.seed, pool, sorted(decoders), args.rows, args.prompt_lengths,
                             args.budgets)  # fmt: skip
    # Warm-up, as a server does before it takes traffic: one request per method and batch size compiles
    # every shape class the stream can bring (the default lengths keep to one bucket each).
    warm = make_requests(len(decoders) * (args.rows[1] - args.rows[0] + 1), args.seed + 7, pool, ["ar"],
                         args.rows, args.prompt_lengths, args.budgets)  # fmt: skip
    t_warm, warm_compiles = time.perf_counter(), loops_compiled()
    for i, (method, rows) in enumerate((m, b) for m in sorted(decoders) for b in range(args.rows[0], args.rows[1] + 1)):
        prompts = (warm[i]["prompts"] * rows)[:rows]
        decoders[method].generate(prompts, warm[i]["max_new"], SamplingParams.greedy())
    warm_compiles = loops_compiled() - warm_compiles
    warm_seconds = time.perf_counter() - t_warm
    by_id = {r["id"]: r for r in requests}
    answers, replays, failures, trace = {}, {}, [], []
    seen_classes, t0, loop_compiles, dropped_any = set(), time.perf_counter(), 0, False
    plain_refs: dict[int, list] = {}
    for step, (rid, replay) in enumerate(schedule(requests, args.seed)):
        r = by_id[rid]
        sampling = SamplingParams.create(r["temperature"])
        cls = shape_class(r)
        before = counter.count
        live_before = sum(len(d._compiled) for d in decoders.values())
        loops_before = loops_compiled()
        result = decoders[r["method"]].generate(r["prompts"], r["max_new"], sampling, seed=r["seed"])
        compiled = loops_compiled() > loops_before  # this request's loop was compiled (not found live)
        loop_compiles += compiled
        tokens = result.tokens
        if cls in seen_classes and compiled and not dropped_any:
            failures.append(f"request {rid}: compiled in a shape class served before, no loop ever dropped")
        seen_classes.add(cls)
        dropped_any |= sum(len(d._compiled) for d in decoders.values()) < live_before + compiled
        if replay:
            replays[rid] = tokens
            if tokens != answers[rid]:
                failures.append(f"request {rid}: a sampled replay with the same seed gave other tokens")
        else:
            if rid in answers:
                failures.append(f"request {rid}: answered twice")
            answers[rid] = tokens
            if len(tokens) != len(r["prompts"]) or any(len(t) > r["max_new"] or not t for t in tokens):
                failures.append(f"request {rid}: {len(tokens)} rows of lengths {[len(t) for t in tokens]}")
            if r["temperature"] == 0:
                if r["method"] == "ar":
                    ref = tokens
                else:
                    loops_before = loops_compiled()
                    ref = decoders["ar"].generate(r["prompts"], r["max_new"]).tokens
                    loop_compiles += loops_compiled() > loops_before
                plain_refs[rid] = ref
                if tokens != ref:
                    failures.append(f"request {rid}: {r['method']} greedy output differs from plain decoding")
        rss, maps = memory()
        trace.append({"step": step, "id": rid, "replay": replay, "method": r["method"], "rows": len(r["prompts"]),
                      "compiled": bool(compiled), "xla_compiles": counter.count - before, "rss_mib": round(rss, 1),
                      "maps": maps, "seconds": round(time.perf_counter() - t0, 2)})  # fmt: skip
        if len(answers) % 50 == 0 and not replay:
            print(f"{len(answers)} requests, {loop_compiles} loops compiled, RSS {rss:.0f} MiB, {maps} mappings, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)  # fmt: skip

    missing = sorted(set(by_id) - set(answers))
    if missing:
        failures.append(f"requests never answered: {missing[:10]}")
    first = next(t for t in trace if not t["replay"] and t["id"] == args.warmup - 1) if args.warmup else trace[0]
    last = trace[-1]
    growth = {k: last[k] / first[k] - 1 for k in ("rss_mib", "maps") if first[k] > 0}
    for k, g in growth.items():
        if g > 0.05:
            failures.append(f"{k} grew {g:.1%} after the warm-up ({first[k]} -> {last[k]})")
    report = {
        "model": "tiny" if args.tiny else args.model,
        "requests": args.requests,
        "replays": len(replays),
        "greedy_checked": len(plain_refs),
        "methods": sorted(decoders),
        "max_compiled": max_compiled(),
        "warmup_compilations": warm_compiles,
        "loop_compilations": loop_compiles,
        "xla_compilations": counter.count,
        "loops_dropped": dropped_any,
        "shape_classes": len(seen_classes),
        "after_warmup": {k: first[k] for k in ("rss_mib", "maps")},
        "end": {k: last[k] for k in ("rss_mib", "maps")},
        "growth_after_warmup": growth,
        "warmup_seconds": round(warm_seconds, 1),
        "seconds": round(time.perf_counter() - t0, 1),
        "failures": failures,
        "trace": trace,
    }
    report = save(args.out / "soak.json", report, args=args, started=started)
    summary = {k: v for k, v in report.items() if k != "trace"}
    print(json.dumps(summary, indent=1))
    return report


if __name__ == "__main__":
    sys.exit(1 if main()["failures"] else 0)
