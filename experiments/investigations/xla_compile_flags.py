"""How XLA CPU flags change the compile time of jspec's loops (what the test suite's flags are chosen by).

    python experiments/investigations/xla_compile_flags.py --model tiny --repeats 3 \
        --flags='|--xla_cpu_use_fusion_emitters=false'
    python experiments/investigations/xla_compile_flags.py --model smollm2-135m --repeats 2 \
        --flags='|--xla_cpu_use_fusion_emitters=false'

Each run is a fresh process (XLA reads its flags once) with the compilation cache off and
``--xla_backend_optimization_level=0`` (the tests' level; ``--base=''`` for XLA's default) before the
flags tried (``--flags``: flag sets separated by ``|``, an empty one the base alone). It decodes three
prompts of a tiny Qwen2 model for 24 tokens (plain, prompt lookup N = 4, a one-layer draft model
N = 3), or one prompt of a registered model for 16 tokens (plain, prompt lookup N = 4), checks that
every speculative decode gives the plain tokens, and reports XLA's backend compile seconds per loop
from JAX's own monitoring events, with tracing, lowering and the wall time. The flag sets run in
turn, ``--repeats`` times, so that a drift of the machine's speed falls on all of them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import subprocess
import sys
import time

from jspec.analysis.harness import save

BASE = "--xla_backend_optimization_level=0"


def _compile(model_name: str) -> dict:
    """The decodes, in this process (run with XLA_FLAGS set)."""
    import jax
    import numpy as np

    seconds: collections.Counter = collections.Counter()

    def listen(event: str, duration: float, **kw) -> None:
        name = event.rsplit("/", 1)[-1]
        seconds[name] += duration
        if name == "backend_compile_duration" and kw.get("fun_name") in ("jit(plain_loop)", "jit(speculative_loop)"):
            seconds[kw["fun_name"]] += duration

    jax.monitoring.register_event_duration_secs_listener(listen)
    from jspec.drafters import DraftModel, PromptLookup
    from jspec.loop.decode import Decoder
    from jspec.loop.engine import SpeculativeDecoder

    if model_name == "tiny":
        from jspec.models.tiny import tiny_model

        target = tiny_model("qwen2", seed=0)
        rng = np.random.default_rng(0)
        base = rng.integers(4, 97, 6).tolist()
        prompts, new = [base * 3, rng.integers(4, 97, 9).tolist(), base[:4]], 24
        drafters = [
            PromptLookup(num_draft=4),
            DraftModel.from_model(tiny_model("qwen2", seed=1, num_layers=1), 97, num_draft=3),
        ]
    else:
        from jspec.models.hub import load_model

        target, tok = load_model(model_name)
        prompts, new = [tok.encode("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n")], 16
        drafters = [PromptLookup(num_draft=4)]
    started = time.perf_counter()
    want = Decoder(target).generate(prompts, new).tokens
    for drafter in drafters:
        if SpeculativeDecoder(target, drafter).generate(prompts, new).tokens != want:
            raise SystemExit(f"{type(drafter).__name__} did not give the plain tokens")
    return {"wall_s": time.perf_counter() - started, **{k: v for k, v in seconds.items() if "cache" not in k}}


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="'tiny' or a registered model (default tiny)")
    parser.add_argument("--flags", default="|--xla_cpu_use_fusion_emitters=false",
                        help="flag sets to compare, separated by '|' (an empty one: the base alone)")  # fmt: skip
    parser.add_argument("--base", default=BASE, help=f"flags every run has (default {BASE!r})")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="also write the runs to this JSON file")
    parser.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._child:
        print(json.dumps(_compile(args.model)))
        return {}
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}.")
    runs = []
    for repeat in range(args.repeats):
        for flags in (f.strip() for f in args.flags.split("|")):
            env = dict(os.environ, XLA_FLAGS=f"{args.base} {flags}".strip(), JSPEC_XLA_CACHE="0")
            proc = subprocess.run([sys.executable, __file__, "--model", args.model, "--_child"], env=env,
                                  capture_output=True, text=True)  # fmt: skip
            if proc.returncode != 0:
                raise SystemExit(f"flags {flags!r} failed:\n{proc.stderr[-2000:]}")
            run = {"flags": flags, "repeat": repeat, **json.loads(proc.stdout.splitlines()[-1])}
            runs.append(run)
            loops = (run.get("jit(plain_loop)", 0.0), run.get("jit(speculative_loop)", 0.0))
            print(f"{flags or '(base)':<45} backend compile {run['backend_compile_duration']:6.2f} s  "
                  f"plain {loops[0]:5.2f}  speculative {loops[1]:5.2f}  wall {run['wall_s']:5.1f} s")  # fmt: skip
    report = {"model": args.model, "base": args.base, "runs": runs}
    return save(args.out, report, args=args, started=started) if args.out else report


if __name__ == "__main__":
    main()
