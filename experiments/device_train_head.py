"""SmolLM2's EAGLE-3 head trained on an accelerator within a time budget, scored against the shipped head.

The shipped head saw ~250 K target-written tokens (what this CPU could make); public heads see
10^2-10^3 times more. On an H100/H200 the target writes millions of tokens in minutes. The
device takes at most 64 MiB of files per call, so the model travels in parts and the head comes
back in parts:

    # here: the verified SmolLM2 GGUF (94 MB) cut into parts of at most 60 MiB, with their hashes
    python experiments/device_train_head.py split --out experiments/out/smollm2-parts
    # on the device: carry one part per call into the same folder, then (the last call)
    python experiments/device_train_head.py train --parts experiments/out/smollm2-parts --out "$OUT" \\
        --budget-s 480
    # here: the head rejoined from its parts (at most 16 MiB each) and checked
    python experiments/device_train_head.py join --parts OUT/head_parts --out experiments/out/device-head

``train`` assembles the parts and checks the GGUF's SHA-256 against the registry, converts it,
has the target write responses to standard-library prompts (never an evaluation set) until the
data budget is spent, times a few training steps to size the run to the time left (the
learning-rate schedule is sized once, not cut short), trains, scores the new head and the
shipped one held out with ``experiments/ablations/head_agreement.py`` (MT-bench and HumanEval, teacher
forced), says whether the new one is better, and writes the head in parts with a manifest.
``--tiny`` runs the same path in about a minute on CPU (``tests/test_experiments.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import statistics
import sys
import time

from jspec.analysis.harness import load_script, save

MODEL = "smollm2-135m"
MIB = 1 << 20


def _sha256(path: pathlib.Path) -> str:
    from jspec.models.loading import file_sha256

    return file_sha256(path)


def split_file(path: pathlib.Path, out: pathlib.Path, part_mib: float) -> dict:
    """``path`` cut into ``out/NAME.partNN`` of at most ``part_mib`` MiB and ``out/NAME.parts.json``."""
    out.mkdir(parents=True, exist_ok=True)
    size, limit = path.stat().st_size, int(part_mib * MIB)
    parts = []
    with open(path, "rb") as f:
        for i in range(-(-size // limit)):
            part = out / f"{path.name}.part{i:02d}"
            part.write_bytes(f.read(limit))
            parts.append({"file": part.name, "bytes": part.stat().st_size, "sha256": _sha256(part)})
    manifest = {"name": path.name, "bytes": size, "sha256": _sha256(path), "parts": parts}
    (out / f"{path.name}.parts.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def join_file(parts: pathlib.Path, name: str, dest: pathlib.Path) -> pathlib.Path:
    """The file ``name`` rebuilt from ``parts`` into ``dest``; refused (nothing left at ``dest``) unless
    every part and the whole match the manifest."""
    manifest_path = parts / f"{name}.parts.json"
    if not manifest_path.is_file():
        raise SystemExit(f"{parts} holds no {manifest_path.name}; pass the folder `split` wrote.")
    manifest = json.loads(manifest_path.read_text())
    missing = [p["file"] for p in manifest["parts"] if not (parts / p["file"]).is_file()]
    if missing:
        raise SystemExit(f"{parts} lacks {missing}: carry every part there before joining.")
    tmp = dest.with_name(dest.name + ".joining")
    with open(tmp, "wb") as out:
        for p in manifest["parts"]:
            data = (parts / p["file"]).read_bytes()
            if len(data) != p["bytes"] or hashlib.sha256(data).hexdigest() != p["sha256"]:
                tmp.unlink()
                raise SystemExit(f"{parts / p['file']} is not the part the manifest records (size or SHA-256).")
            out.write(data)
    if _sha256(tmp) != manifest["sha256"]:
        tmp.unlink()
        raise SystemExit(f"{name} rebuilt from {parts} does not have the recorded SHA-256; refusing it.")
    os.replace(tmp, dest)
    return dest


def _cmd_split(args) -> dict:
    from jspec.models.hub import ensure_gguf

    return split_file(ensure_gguf(MODEL), args.out, args.part_mib)


def _cmd_join(args) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    join_file(args.parts, "head.safetensors", args.out / "head.safetensors")
    shutil.copy(args.parts / "head.json", args.out / "head.json")
    from jspec.heads.eagle import load_head
    from jspec.models.hub import load_model

    load_head(args.out, load_model(MODEL)[0])  # a head that does not load is not a head
    return {"head": str(args.out)}


def _recipe(args, total_steps: int):
    from jspec.training.recipe import Recipe
    from jspec.training.trainer import TrainConfig

    if args.tiny:
        tiny = Recipe.tiny("eagle3")
        train = TrainConfig(**{**tiny.train.__dict__, "total_steps": total_steps})
        return Recipe("eagle3", num_prompts=args.num_prompts or 8, seq_len=128, max_new_tokens=24, gen_batch=8,
                      draft_vocab=512, train=train)  # fmt: skip
    import jax

    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"  # float32 master weights either way
    train = TrainConfig(num_steps=5, batch_size=args.batch_size, learning_rate=1e-3, warmup_steps=100,
                        total_steps=total_steps, checkpoint_every=500, seed=1, compute_dtype=dtype)  # fmt: skip
    return Recipe("eagle3", prompt_source="stdlib", num_prompts=args.num_prompts or 12000, seq_len=256,
                  max_new_tokens=192, gen_batch=args.gen_batch, draft_vocab=8192, train=train)  # fmt: skip


def _cmd_train(args) -> dict:
    started, t0 = time.time(), time.perf_counter()
    work = args.work or args.out / "work"
    os.environ["JSPEC_CACHE"] = str(work / "cache")  # a cache of its own: the GGUF goes in verified
    from jspec.models.hub import load_model, shipped_head
    from jspec.models.registry import get_source
    from jspec.training.recipe import prepare_data, train_head

    manifest = args.parts / f"{MODEL}.gguf.parts.json"
    if manifest.is_file() and json.loads(manifest.read_text()).get("sha256") != get_source(MODEL).sha256:
        raise SystemExit(f"the parts in {args.parts} make a file that is not the registry's {MODEL}; refusing them.")
    gguf = work / "cache" / "gguf" / f"{MODEL}.gguf"
    gguf.parent.mkdir(parents=True, exist_ok=True)
    join_file(args.parts, f"{MODEL}.gguf", gguf)  # every part and the whole checked against the manifest
    target, tokenizer = load_model(MODEL)
    report = {"backend": __import__("jax").default_backend(), "device": str(__import__("jax").devices()[0]),
              "load_s": time.perf_counter() - t0}  # fmt: skip

    # Data: the target writes responses (made once; a rerun after a kill resumes batch by batch).
    t1 = time.perf_counter()
    data = prepare_data(target, tokenizer, _recipe(args, 10**6), work / "data", MODEL)
    report |= {"data_s": time.perf_counter() - t1, "examples": len(data["tokens"]),
               "response_tokens": int(data["mask"].sum())}  # fmt: skip

    # Steps that fit: one throwaway run of 2 + P steps, timed step by step by the trainer (the first
    # step compiles), then the real run sized once, its own compilation counted. (Two runs of different
    # lengths, differenced, measured nothing: the second compiled from the persistent cache, so on the
    # first H200 run the difference came out negative and 20,000 steps "fit" a 330-second budget.)
    probe = work / "probe"
    shutil.rmtree(probe, ignore_errors=True)
    _, rep = train_head(target, tokenizer, _recipe(args, 10**6), probe, model_name=MODEL, data_dir=work / "data",
                        progress=False, until=2 + args.probe_steps)  # fmt: skip
    steady = rep["step_seconds"][2:]
    step_s = statistics.median(steady)
    compile_s = rep["step_seconds"][0]
    left = args.budget_s - (time.perf_counter() - t0) - args.reserve_s - compile_s
    total = max(args.min_steps, min(args.max_steps, int(left / step_s)))
    report |= {"step_s": step_s, "probe_step_seconds": rep["step_seconds"], "compile_s": compile_s,
               "total_steps": total}  # fmt: skip
    print(f"training: {step_s * 1000:.1f} ms per step, {total} steps fit the budget", file=sys.stderr)

    t2 = time.perf_counter()
    head_dir = work / "head"
    _, rep = train_head(target, tokenizer, _recipe(args, total), head_dir, model_name=MODEL, data_dir=work / "data",
                        progress=False)  # fmt: skip
    final = rep["final"] or {}
    report |= {"train_s": time.perf_counter() - t2, "final": rep["final"], "tokens_per_s": rep["tokens_per_s"],
               "peak_fraction": final.get("peak_fraction")}  # fmt: skip

    # Held out: MT-bench and HumanEval, teacher forced, the new head beside the shipped one.
    head_agreement = load_script(pathlib.Path(__file__).parent / "ablations" / "head_agreement.py")
    shipped = shipped_head(MODEL, "eagle3")
    scores = head_agreement.main(["--heads", f"{head_dir},{shipped}", "--model", MODEL, "--limit", str(args.eval_limit),
                                  "--max-new-tokens", str(args.eval_tokens), "--out", str(args.out)])  # fmt: skip

    def tau(folder):
        rows = scores["heads"][str(folder)].values()
        return sum(r["chain_tau"] for r in rows) / len(rows)

    report |= {"tau_new": tau(head_dir), "tau_shipped": tau(shipped)}
    report["better_than_shipped"] = report["tau_new"] > report["tau_shipped"]

    parts = args.out / "head_parts"
    split_file(head_dir / "head.safetensors", parts, args.head_part_mib)
    shutil.copy(head_dir / "head.json", parts / "head.json")
    report |= {"head_parts": str(parts), "seconds": time.perf_counter() - t0}
    report = save(args.out / "device_train_head.json", report, args=args, started=started)
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("split", help="here: the SmolLM2 GGUF in parts for the device")
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--part-mib", type=float, default=60.0)
    p = sub.add_parser("train", help="on the device: data, training, scoring, the head in parts")
    p.add_argument("--parts", type=pathlib.Path, required=True, help="the folder split wrote, every part carried in")
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--work", type=pathlib.Path, default=None, help="data, checkpoints, cache (default OUT/work)")
    p.add_argument("--budget-s", type=float, default=480.0, help="the whole run, loading to the head's parts")
    p.add_argument("--reserve-s", type=float, default=90.0, help="kept for scoring and writing after training")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts the target answers (default 12,000)")
    p.add_argument("--gen-batch", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64, help="training sequences per step")
    p.add_argument("--probe-steps", type=int, default=10)
    p.add_argument("--min-steps", type=int, default=20)
    p.add_argument("--max-steps", type=int, default=20000)
    p.add_argument("--eval-limit", type=int, default=8)
    p.add_argument("--eval-tokens", type=int, default=64)
    p.add_argument("--head-part-mib", type=float, default=16.0)
    p.add_argument("--tiny", action="store_true", help="tests: the tiny recipe, on CPU in about a minute")
    p = sub.add_parser("join", help="here: the head rebuilt from its parts and loaded once")
    p.add_argument("--parts", type=pathlib.Path, required=True)
    p.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "train" and args.probe_steps < 1:  # the steady steps' median needs one at least
        parser.error(f"--probe-steps must be at least 1; got {args.probe_steps}.")
    report = {"split": _cmd_split, "train": _cmd_train, "join": _cmd_join}[args.command](args)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
