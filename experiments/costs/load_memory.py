"""Peak host memory and time of loading a Hugging Face folder with jspec, on random weights of real shapes.

    python experiments/costs/load_memory.py [--shape llama-3.2-1b] [--dtype float32|bfloat16] [--folder DIR]
        [--shard-mb 1000] [--out experiments/results/load_memory.json]

Writes (once, kept in ``--folder``) a folder as transformers lays it out: ``config.json``, bfloat16
safetensors shards of at most ``--shard-mb`` MB and their ``model.safetensors.index.json``, a word-level
tokenizer; the weights are random (the loader's memory does not depend on the values). Then loads it in
a fresh process with ``jspec.load_model`` and reports the peak resident memory (``VmHWM``) of that
process against the loaded weights' size, the process's resident memory after ``import jax`` (its
baseline), and the load time. A loader that held every tensor twice would peak near 2x.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

from jspec.analysis.harness import append

SHAPES = {  # published configurations' shapes (Meta's config.json for Llama-3.2-1B)
    "llama-3.2-1b": dict(vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                         rope_theta=500_000.0, rms_norm_eps=1e-5, rope_scaling={
                             "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rope_theta=10_000.0, rms_norm_eps=1e-5),
}  # fmt: skip


def write_folder(folder: pathlib.Path, shape: dict, shard_mb: int) -> int:
    """Writes the random bfloat16 folder; returns the number of parameters."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models

    s = shape
    H, F, L, D = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["head_dim"]
    qd, kvd = s["num_attention_heads"] * D, s["num_key_value_heads"] * D
    names = {"model.embed_tokens.weight": (s["vocab_size"], H), "model.norm.weight": (H,)}
    for i in range(L):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                  p + "self_attn.q_proj.weight": (qd, H), p + "self_attn.k_proj.weight": (kvd, H),
                  p + "self_attn.v_proj.weight": (kvd, H), p + "self_attn.o_proj.weight": (H, qd),
                  p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H),
                  p + "mlp.down_proj.weight": (H, F)}  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    shard, shard_bytes, weight_map, count = {}, 0, {}, 0

    def flush():
        nonlocal shard, shard_bytes
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard, shard_bytes = {}, 0

    for name, dims in names.items():
        value = (0.02 * rng.standard_normal(dims, dtype=np.float32)).astype(ml_dtypes.bfloat16)
        if name.endswith("norm.weight"):
            value = np.ones(dims, ml_dtypes.bfloat16)
        if shard and shard_bytes + value.nbytes > shard_mb * 1e6:
            flush()
        shard[name], shard_bytes, count = value, shard_bytes + value.nbytes, count + value.size
    flush()
    total = {"total_size": sum((folder / f).stat().st_size for f in set(weight_map.values()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": total, "weight_map": weight_map}))
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
              "max_position_embeddings": 131072, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
              **shape}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {f"w{i}": i for i in range(shape["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2", "bos_token": "w1"}))
    return count


# Peak from /proc/self/status (VmHWM): it starts afresh at exec, where ru_maxrss keeps the parent's peak.
_CHILD = """
import json, re, sys, time
import jax
def status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
base = status("VmRSS")
import jspec
t0 = time.perf_counter()
model, _ = jspec.load_model(sys.argv[1], dtype=sys.argv[2])
jax.block_until_ready(jax.tree.leaves(jax.tree.map(lambda x: x, __import__("flax").nnx.state(model))))
seconds = time.perf_counter() - t0
nbytes = sum(x.nbytes for x in jax.tree.leaves(__import__("flax").nnx.state(model)))
print(json.dumps({"load_seconds": seconds, "weights_bytes": nbytes, "peak_rss_bytes": status("VmHWM"),
                  "baseline_rss_bytes": base}))
"""


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--folder", default=None, help="where the random folder is kept (default /tmp/jspec-load-SHAPE)")
    p.add_argument("--shard-mb", type=int, default=1000)
    p.add_argument("--out", default=None, help="append the result to this JSON list")
    args = p.parse_args(argv)
    folder = pathlib.Path(args.folder or f"/tmp/jspec-load-{args.shape}")
    if not (folder / "config.json").exists():
        t0 = time.perf_counter()
        params = write_folder(folder, SHAPES[args.shape], args.shard_mb)
        print(f"wrote {params / 1e9:.3f} B random parameters to {folder} in {time.perf_counter() - t0:.0f} s")
    child = subprocess.run([sys.executable, "-c", _CHILD, str(folder), args.dtype], capture_output=True, text=True)
    if child.returncode:
        sys.exit(child.stderr[-3000:])
    r = json.loads(child.stdout.strip().splitlines()[-1])
    files = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    r |= {
        "shape": args.shape,
        "dtype": args.dtype,
        "files_bytes": files,
        "peak_over_weights": r["peak_rss_bytes"] / r["weights_bytes"],
        "peak_above_baseline_over_weights": (r["peak_rss_bytes"] - r["baseline_rss_bytes"]) / r["weights_bytes"],
    }
    print(json.dumps(r))
    if args.out:
        r = append(args.out, r, args=args, started=started)[-1]
    return r


if __name__ == "__main__":
    main()
