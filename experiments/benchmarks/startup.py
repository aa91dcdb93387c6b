"""Time to first token: each method in a fresh process, cold (an empty compilation cache) and warm.

    python experiments/benchmarks/startup.py [--methods ar,ngram,eagle3,eagle3-tree,medusa,lookahead,auto]
        [--draft-pair] [--api ar,ngram,eagle3] [--tokens 16] [--layer-loop unrolled|scan]
        [--stream-cost] [--out experiments/results/startup.json]

For every method, ``jspec generate --json`` runs twice in new processes with the same compilation
cache folder (``JSPEC_XLA_CACHE``), empty before the first: cold, then warm. Each run reports the
seconds from starting the process to the command's start (Python and the imports), the model load,
the compilation of the loop, the first token (since the command began; ``generate`` streams every
run to its printer) and the whole process. ``--draft-pair`` adds the draft-model method on the Qwen
pair (1.5B target, 0.5B drafter). ``--api`` times the same through ``jspec.Speculator`` (import,
construction with the model load, the first ``generate`` with its compilation), cold and warm.
The Medusa head is random (compilation does not depend on the weights), written once in --work.
``auto`` runs with a tuned config of its own, made once in --work as ``make demo`` makes it
(``jspec tune --quick`` on MT-bench prompts 9-16 at T = 0, about two minutes, not counted; like the
demo's, it is also saved as this machine's latest config for SmolLM2): not whatever this machine tuned
last, which may have measured another temperature band and then be refused.
``--stream-cost`` also measures, in this process, what streaming costs per token: plain decoding
and prompt lookup on SmolLM2 with and without a listener (a loop resumed one step at a time, the
next step queued, against one ``lax.while_loop`` to the end), interleaved, 96 tokens on four
MT-bench prompts, five rounds. Results go to --out (JSON), one line per run to stdout.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from jspec.analysis.harness import append, arguments, runs

PROMPT = "Explain in three sentences why speculative decoding can be exact."
METHODS = {  # name: (model, generate's method options)
    "ar": ("smollm2-135m", ["--method", "ar"]),
    "ngram": ("smollm2-135m", ["--method", "ngram"]),
    "eagle3": ("smollm2-135m", ["--method", "eagle3"]),
    "eagle3-tree": ("smollm2-135m", ["--method", "eagle3", "--tree", "dynamic"]),
    "medusa": ("smollm2-135m", ["--method", "medusa", "--tree", "2,2,1"]),  # + --head (random, made once)
    "lookahead": ("smollm2-135m", ["--method", "lookahead"]),
    "auto": ("smollm2-135m", ["--method", "auto"]),
    "draft": ("qwen2.5-coder-1.5b", ["--method", "draft", "--draft-model", "qwen2.5-coder-0.5b"]),
}
API = r"""
import json, sys, time
t0 = time.time()
import jspec
t1 = time.time()
method = sys.argv[1]
s = jspec.Speculator("smollm2-135m", drafter=None if method == "ar" else method)
t2 = time.time()
c = s.generate(sys.argv[2], max_new_tokens=int(sys.argv[3]), chat=True)
t3 = time.time()
print(json.dumps({"import_s": t1 - t0, "construct_s": t2 - t1, "first_generate_s": t3 - t2,
                  "compile_s": c.result.compile_seconds, "started_at": t0}))
"""


def medusa_head(work: pathlib.Path) -> pathlib.Path:
    """A random four-head Medusa model for SmolLM2 (jspec's layout), written once."""
    folder = work / "medusa-random"
    if not (folder / "config.json").exists():
        from flax import nnx

        from jspec.heads.medusa import MedusaConfig, MedusaHeads, save_medusa
        from jspec.models.hub import load_model

        target, _ = load_model("smollm2-135m")
        save_medusa(MedusaHeads(MedusaConfig.for_target(target.config, 4), rngs=nnx.Rngs(0)), folder)
    return folder


def tuned_config(work: pathlib.Path, env: dict) -> pathlib.Path:
    """A tuned config for ``auto`` on SmolLM2 at T = 0, made once with ``make demo``'s command."""
    path = work / "tuned-smollm2-mt-bench.json"
    if not path.exists():
        subprocess.run([*launcher(), "tune", "--quick", "--model", "smollm2-135m", "--prompts", "mt-bench", "--skip",
                        "8", "--temperature", "0", "--out", str(path)], check=True, env=env, cwd=work)  # fmt: skip
    return path


def launcher() -> list[str]:
    """The installed ``jspec`` command, else the module."""
    script = pathlib.Path(sys.executable).with_name("jspec")
    return [str(script)] if script.exists() else [sys.executable, "-m", "jspec.cli.main"]


def run_cli(method: str, xla: pathlib.Path, tokens: int, env: dict, work: pathlib.Path) -> dict:
    model, options = METHODS[method]
    if method == "medusa":
        options = [*options, "--head", str(medusa_head(work))]
    if method == "auto":
        options = [*options, "--config", str(tuned_config(work, env))]
    launch = launcher()
    cmd = [*launch, "generate", "--model", model, "--chat",
           "--max-new-tokens", str(tokens), "--json", "--prompt", PROMPT, *options]  # fmt: skip
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env | {"JSPEC_XLA_CACHE": str(xla)}, cwd=xla)
    wall = time.time() - t0
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:], "wall_s": wall}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    stats, startup = out["stats"], out["stats"]["startup"]
    return {
        "import_s": round(startup["started_at"] - t0, 2),
        "load_s": startup["load_s"],
        "compile_s": startup["compile_s"],
        "first_token_s": startup["first_token_s"],  # since the command began (after the imports)
        "first_token_since_launch_s": round(startup["started_at"] - t0 + startup["first_token_s"], 2),
        "wall_s": round(wall, 2),
        "tokens_per_s": stats.get("tokens_per_s"),
        "setting": stats.get("setting"),
    }


def run_api(method: str, xla: pathlib.Path, tokens: int, env: dict) -> dict:
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", API, method, PROMPT, str(tokens)], capture_output=True, text=True,
                          env=env | {"JSPEC_XLA_CACHE": str(xla)}, cwd=xla)  # fmt: skip
    wall = time.time() - t0
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:], "wall_s": wall}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["python_start_s"] = out.pop("started_at") - t0
    return {k: round(v, 2) for k, v in out.items()} | {"wall_s": round(wall, 2)}


def stream_cost(rounds: int = 5, tokens: int = 96) -> dict:
    """Seconds per token with and without a listener, per method (medians over rounds, interleaved)."""
    import statistics

    from jspec.analysis.prompts import load_prompts
    from jspec.api import make_decoder
    from jspec.models.hub import load_model

    model, tok = load_model("smollm2-135m")
    prompts = load_prompts("mt-bench", None, 4)
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p.text}])) for p in prompts]
    out = {}
    for method in ("ar", "ngram"):
        decoder = make_decoder(method, model, eos_ids=tok.eos_token_ids)
        decoder.generate([ids[0]], tokens)  # compiled and run once
        per = {"whole": [], "streamed": []}
        for _ in range(rounds):
            for kind in per:
                listener = (lambda t, c: None) if kind == "streamed" else None
                runs = [decoder.generate([i], tokens, on_tokens=listener) for i in ids]
                per[kind].append(sum(r.seconds for r in runs) / sum(len(r.tokens[0]) for r in runs))
        whole, streamed = statistics.median(per["whole"]), statistics.median(per["streamed"])
        out[method] = {"ms_per_token_whole": 1e3 * whole, "ms_per_token_streamed": 1e3 * streamed,
                       "streamed_over_whole": streamed / whole, "rounds": per}  # fmt: skip
        print(f"stream cost {method}: {1e3 * whole:.2f} ms/token whole, {1e3 * streamed:.2f} streamed "
              f"({streamed / whole:.3f}x)", flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, out="experiments/results/startup.json")
    parser.add_argument("--methods", default="ar,ngram,eagle3,eagle3-tree,medusa,lookahead,auto")
    parser.add_argument("--draft-pair", action="store_true", help="add the draft model on the Qwen pair")
    parser.add_argument("--api", default="ar,ngram,eagle3", help="methods timed through jspec.Speculator ('' none)")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--layer-loop", choices=("unrolled", "scan"), default=None)
    parser.add_argument("--stream-cost", action="store_true", help="also measure streaming's cost per token")
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path("experiments/out/startup"))
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m] + (["draft"] if args.draft_pair else [])
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    args.work = args.work.resolve()  # the runs start in their own folders: a checkout's jspec/ never shadows the
    args.work.mkdir(parents=True, exist_ok=True)  # installed package (python -m and -c put the working folder first)
    env = dict(os.environ) | {"JSPEC_PROGRESS": "0"}
    if args.layer_loop:
        env["JSPEC_LAYER_LOOP"] = args.layer_loop
    result = {
        "layer_loop": args.layer_loop or "the backend's default",
        "tokens": args.tokens,
        "cli": {},
        "api": {},
    }
    previous = runs(args.out)

    def save():  # after every run: a process stopped by a time limit keeps what it measured
        append(args.out, result, args=args, started=started, previous=previous)

    for kind, names in (("cli", methods), ("api", [m for m in args.api.split(",") if m])):
        for method in names:
            xla = pathlib.Path(tempfile.mkdtemp(prefix=f"xla-{kind}-{method}-", dir=args.work))
            try:
                for phase in ("cold", "warm"):
                    run = run_cli(method, xla, args.tokens, env, args.work) if kind == "cli" else \
                        run_api(method, xla, args.tokens, env)  # fmt: skip
                    result[kind].setdefault(method, {})[phase] = run
                    print(kind, method, phase, json.dumps(run), flush=True)
                    save()
            finally:
                shutil.rmtree(xla, ignore_errors=True)
    if args.stream_cost:
        result["stream_cost"] = stream_cost()
    save()
    return result


if __name__ == "__main__":
    main()
