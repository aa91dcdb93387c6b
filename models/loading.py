"""Weights in and out: GGUF files, Hugging Face folders, and the converted-model cache.

Every model ends up as a Hugging Face style folder (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``), which is
also what Colab users already have. A GGUF file is dequantized once with the
``gguf`` package into such a folder; :func:`load_folder` reads any such folder
into a :class:`~jspec.models.llama.Transformer`.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file
from tqdm import tqdm

from jspec.files import temporary_dir
from jspec.models.config import ModelConfig
from jspec.models.llama import FUSED, Transformer
from jspec.models.safetensors_folder import SafetensorsFolder, hf_lookup
from jspec.models.tokenizer import TextTokenizer, tokenizer_from_gguf_metadata

__all__ = [
    "DTYPES",
    "convert_gguf",
    "file_sha256",
    "gguf_metadata",
    "hf_lookup",
    "load_folder",
    "resolve_dtype",
]

MANIFEST = "jspec_manifest.json"


def file_sha256(path: pathlib.Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def progress(iterable, desc: str, total: int | None = None):
    """A tqdm bar on stderr: shown where stderr is a terminal or JSPEC_PROGRESS=1, never with JSPEC_PROGRESS=0
    (what ``--json`` sets)."""

    flag = os.environ.get("JSPEC_PROGRESS", "")
    disable = flag == "0" or not (sys.stderr.isatty() or flag)
    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, disable=disable, leave=False)


# ---------------------------------------------------------------------- GGUF


def gguf_metadata(reader) -> dict:
    """All key/values of a ``gguf.GGUFReader`` as Python values."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def _config_from_gguf(meta: dict, tensor_names: set[str]) -> ModelConfig:
    arch = meta["general.architecture"]
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported; jspec loads 'llama' and 'qwen2'.")
    heads = int(meta[f"{arch}.attention.head_count"])
    hidden = int(meta[f"{arch}.embedding_length"])
    vocab = int(meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"]))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = [] if eos is None else [int(eos)]
    # Instruct models end a turn with <|im_end|> (ChatML) even when the file names another EOS.
    tokens = meta["tokenizer.ggml.tokens"]
    for extra in ("<|im_end|>", "<|endoftext|>"):
        if extra in tokens and tokens.index(extra) not in eos_ids:
            eos_ids.append(tokens.index(extra))
    return ModelConfig(
        family=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
        num_layers=int(meta[f"{arch}.block_count"]),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length") or hidden // heads),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10_000.0)),
        rms_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        tie_embeddings="output.weight" not in tensor_names,
        max_position=int(meta.get(f"{arch}.context_length", 8192)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(eos_ids),
    )


def _unpermute_llama(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation (interleaved RoPE pairs → half-split).

    w: [heads * D, in] in PyTorch layout.
    """
    out, inp = w.shape
    return w.reshape(num_heads, out // num_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


_GGUF_TO_HF = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def convert_gguf(gguf_path: pathlib.Path, out_dir: pathlib.Path, extra_manifest: dict | None = None) -> pathlib.Path:
    """Dequantizes a GGUF file into a Hugging Face style folder (float32 safetensors).

    The folder is written next to its final place and renamed into it, so an
    interrupted conversion never leaves a half-written model behind.
    """

    gguf_path, out_dir = pathlib.Path(gguf_path), pathlib.Path(out_dir)
    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as err:  # gguf raises assorted errors on bad files
        raise ValueError(f"{gguf_path} is not a readable GGUF file ({err}); delete it and fetch again.") from err
    meta = gguf_metadata(reader)
    names = {t.name for t in reader.tensors}
    config = _config_from_gguf(meta, names)
    tokenizer = TextTokenizer(
        tokenizer=tokenizer_from_gguf_metadata(meta),
        eos_token_ids=config.eos_token_ids,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token_id=config.bos_token_id,
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    )

    tensors = {}
    for t in progress(reader.tensors, f"dequantizing {gguf_path.name}"):
        w = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if t.name == "token_embd.weight":
            tensors["model.embed_tokens.weight"] = w
        elif t.name == "output.weight":
            tensors["lm_head.weight"] = w
        elif t.name == "output_norm.weight":
            tensors["model.norm.weight"] = w
        elif t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            if config.family == "llama" and rest == "attn_q.weight":
                w = _unpermute_llama(w, config.num_heads)
            elif config.family == "llama" and rest == "attn_k.weight":
                w = _unpermute_llama(w, config.num_kv_heads)
            if rest not in _GGUF_TO_HF:
                raise ValueError(f"unexpected tensor {t.name} in {gguf_path.name}.")
            tensors[f"model.layers.{layer}.{_GGUF_TO_HF[rest]}"] = w
        else:
            raise ValueError(f"unexpected tensor {t.name} in {gguf_path.name}.")

    with temporary_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config.to_hf(), indent=1))
        tokenizer.save(tmp)
        manifest = {
            "source": gguf_path.name,
            "model.safetensors": {
                "size": (tmp / "model.safetensors").stat().st_size,
                "sha256": file_sha256(tmp / "model.safetensors"),
            },
            **(extra_manifest or {}),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        for f in tmp.iterdir():  # the files reach the disk before the folder's name does
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    return out_dir


# ---------------------------------------------------------------------- HF folders


def _check_manifest(folder: pathlib.Path) -> None:
    """Refuses a converted folder whose weights file changed since conversion."""
    path = folder / MANIFEST
    if not path.exists():
        return
    manifest = json.loads(path.read_text())
    entry = manifest.get("model.safetensors")
    target = folder / "model.safetensors"
    if entry and target.exists():
        size = target.stat().st_size
        if size != entry["size"]:
            raise ValueError(
                f"{target} has {size} bytes, the conversion wrote {entry['size']}: the file is truncated or "
                "changed. Delete the folder and run `jspec fetch` again."
            )


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_dtype(dtype):
    """The dtype to hold weights in: ``dtype`` ("float32", "bfloat16" or a jnp dtype) or, when None,
    float32 on CPU (bfloat16 is several times slower there) and bfloat16 on an accelerator, whatever the
    folder stores (a float32 folder, such as a dequantized GGUF, would take twice the memory and bandwidth
    there; pass "float32" to keep it)."""
    if dtype is None:
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; jspec holds weights in {' or '.join(DTYPES)}.")
        return DTYPES[dtype]
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"unknown dtype {jnp.dtype(dtype).name!r}; jspec holds weights in {' or '.join(DTYPES)}.")
    return dtype


def load_folder(
    folder: str | pathlib.Path, *, layer_loop: str | None = None, dtype=None
) -> tuple[Transformer, TextTokenizer]:
    """Loads a Hugging Face style model folder (one safetensors file or shards with their index)
    into a Transformer and its tokenizer.

    Args:
      dtype: "float32", "bfloat16" or None: float32 on CPU, the folder's ``torch_dtype`` elsewhere.
    """
    folder = pathlib.Path(folder)
    if not (folder / "config.json").exists():
        raise ValueError(f"{folder} has no config.json; pass a Hugging Face model folder.")
    _check_manifest(folder)
    raw = json.loads((folder / "config.json").read_text())
    dtype = resolve_dtype(dtype)
    config = ModelConfig.from_hf(raw)
    tokenizer = TextTokenizer.load(folder, config.eos_token_ids)
    if config.eos_token_ids == () and tokenizer.eos_token_ids:
        config = ModelConfig(**{**config.__dict__, "eos_token_ids": tokenizer.eos_token_ids})
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding only "
            f"{config.vocab_size}: they do not belong together."
        )
    tensors = SafetensorsFolder(folder)
    lookup = hf_lookup(tensors, config.family)
    embed_shape = tensors.shape("model.embed_tokens.weight")  # from the header: the tensor is read once, below
    if embed_shape != (config.vocab_size, config.hidden_size):
        raise ValueError(
            f"embedding is {embed_shape}, config.json says vocab {config.vocab_size} x hidden {config.hidden_size}."
        )
    model = build_model(config, lookup, layer_loop=layer_loop, dtype=dtype)
    unused = tensors.unused(config.tie_embeddings)
    if unused:
        raise ValueError(
            f"{folder} holds {len(unused)} tensor(s) that a {config.family} model with this config.json does not "
            f"use, e.g. {unused[0]!r}: the weights and the config disagree (or the architecture has parts jspec "
            "does not implement); refusing to load it with them left out."
        )
    return model, tokenizer


def build_model(config: ModelConfig, weights, *, layer_loop: str | None = None, dtype=jnp.float32):
    """A Transformer holding the given weights; no random initialization is materialized.

    Args:
      weights: a dict of jspec parameters (layer weights stacked [L, ...]) or a
        ``lookup(name, layer)`` function such as :func:`hf_lookup` returns,
        which lets each tensor be read and placed one at a time.
    """
    if isinstance(weights, dict):
        params = weights

        def lookup(name, layer):
            if name not in params:
                raise ValueError(f"no weights for parameter {name!r}.")
            return params[name] if layer is None else params[name][layer]
    else:
        lookup = weights

    def layer_value(name, layer):
        if name in FUSED:
            return np.concatenate([lookup(part, layer) for part in FUSED[name]], axis=0)
        return lookup(name, layer)

    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=dtype, layer_loop=layer_loop))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    for path, var in progress(flat.items(), "loading weights", total=len(flat)):
        name = path[-1]
        if path[0] == "layers" and len(path) == 3:  # unrolled: one layer's arrays
            value = layer_value(name, path[1])
        elif path[0] == "layers":  # scanned: stacked along L
            value = np.stack([layer_value(name, i) for i in range(config.num_layers)])
        else:
            value = lookup(name, None)
        if tuple(value.shape) != tuple(var.shape):
            raise ValueError(f"parameter {name!r}: weights have shape {value.shape}, the model wants {var.shape}.")
        flat[path] = var.replace(jax.device_put(jnp.asarray(value, dtype)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
