"""Hugging Face safetensors folders: one file or shards with their index, read tensor by tensor.

:class:`SafetensorsFolder` checks every file against the size its header promises and a sharded
folder against its index, keeps each tensor in its stored dtype (bfloat16 too), and records what was
read, so that :func:`jspec.models.loading.load_folder` can refuse weights its model would leave out.
:func:`hf_lookup` maps jspec's parameter names to the checkpoints' per family.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

import ml_dtypes
import numpy as np
from safetensors import safe_open

__all__ = ["INDEX", "SafetensorsFolder", "hf_lookup"]

_HF_LAYER_NAMES = {  # jspec's names, same [out, in] layout as the checkpoint's
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
# Gemma's four norms: its post_attention_layernorm normalizes the attention's output.
_GEMMA_LAYER_NAMES = _HF_LAYER_NAMES | {
    "post_attn_norm": "post_attention_layernorm.weight",
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}
INDEX = "model.safetensors.index.json"


def _header(path: pathlib.Path) -> tuple[int, dict] | None:
    """(where the data starts, the JSON header) of a safetensors file; None if unreadable."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return None
        n = int.from_bytes(raw, "little")
        try:
            return 8 + n, json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            return None


def _expected_size(path: pathlib.Path) -> int:
    """The file size a safetensors header promises (8-byte length, JSON header, data); -1 if unreadable."""
    read = _header(path)
    if read is None:
        return -1
    start, header = read
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    return start + max(ends, default=0)


def _numpy_dtype(code: str):
    if code == "BF16":  # numpy has no bfloat16; ml_dtypes (a JAX dependency) does
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
                     "U8": "u1", "BOOL": "?"}[code])  # fmt: skip


def _shard_files(folder: pathlib.Path) -> tuple[list[pathlib.Path], dict | None]:
    """The weight files and, for a sharded folder, its index's ``weight_map`` (tensor -> file)."""
    index = folder / INDEX
    if not index.exists():
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {folder}.")
        return files, None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{index} is not a safetensors index (no readable weight_map): {err}.") from err
    names = sorted(set(weight_map.values()))
    missing = [n for n in names if not (folder / n).exists()]
    if missing:
        raise ValueError(
            f"{folder} misses shard {missing[0]} listed in {INDEX} ({len(missing)} of {len(names)} shards missing); "
            "download the whole folder."
        )
    return [folder / n for n in names], weight_map


class SafetensorsFolder:
    """Reads tensors one at a time from a folder's safetensors files, one file or shards listed in
    ``model.safetensors.index.json`` (never all in memory), in their stored dtype (bfloat16 too).

    Every file is checked against its header's promised size, and a sharded folder against its
    index (each listed tensor in its listed shard, nothing else). :attr:`used` records which tensors
    were read, so the loader can refuse weights that its model would silently leave out.
    """

    def __init__(self, folder: pathlib.Path):
        folder = pathlib.Path(folder)
        files, weight_map = _shard_files(folder)
        self.where, self.used, self._headers = {}, set(), {}
        for f in files:
            size, expected = f.stat().st_size, _expected_size(f)
            if size != expected:
                raise ValueError(
                    f"{f} is corrupt or truncated ({size} bytes, its header promises {expected}); refusing to load it."
                )
            try:
                handle = safe_open(str(f), "numpy")
            except Exception as err:  # safetensors raises its own error types on bad files
                raise ValueError(f"{f} is corrupt or truncated ({err}); refusing to load it.") from err
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if weight_map is not None and weight_map.get(name) != f.name:
                    raise ValueError(
                        f"shard {f.name} holds tensor {name!r}, which {INDEX} places in "
                        f"{weight_map.get(name, 'no shard')}: the shards do not match the index."
                    )
                self.where[name] = (f, handle)
        if weight_map is not None:
            absent = sorted(set(weight_map) - set(self.where))
            if absent:
                raise ValueError(
                    f"{INDEX} places tensor {absent[0]!r} in {weight_map[absent[0]]}, which does not hold it: "
                    "the shards do not match the index."
                )

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, from its file's header (nothing read)."""
        if name not in self.where:
            raise ValueError(f"missing tensor {name!r}: the weights do not match config.json.")
        return tuple(self.where[name][1].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype ("F32", "BF16", ...)."""
        return self.where[name][1].get_slice(name).get_dtype()

    def __getitem__(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype (bfloat16 too), read straight from the file into memory of its own,
        64-byte aligned so that JAX on CPU can take the buffer as it is instead of copying it: a loader holds
        at most the tensor in hand beside what it has placed. (Not a memory map: JAX would use an aligned map
        in place, and a file rewritten later would change the model's weights under it.)"""
        if name not in self.where:
            raise ValueError(f"missing tensor {name!r}: the weights do not match config.json.")
        self.used.add(name)
        path, _ = self.where[name]
        if path not in self._headers:
            self._headers[path] = _header(path)
        start, header = self._headers[path]
        entry = header[name]
        lo, hi = entry["data_offsets"]
        shape = tuple(entry["shape"])
        raw = np.empty(hi - lo + 64, np.uint8)
        skip = -raw.ctypes.data % 64
        buf = raw[skip : skip + hi - lo]
        with open(path, "rb") as f:
            f.seek(start + lo)
            if f.readinto(memoryview(buf)) != hi - lo:
                raise ValueError(f"{path} ends inside tensor {name!r}; refusing the truncated file.")
        return buf.view(_numpy_dtype(entry["dtype"])).reshape(shape)

    def unused(self, tied: bool) -> list[str]:
        """Tensors never read (RoPE tables that old checkpoints store are not weights)."""
        skip = {"lm_head.weight"} if tied else set()
        return sorted(n for n in set(self.where) - self.used - skip if not n.endswith("rotary_emb.inv_freq"))


def hf_lookup(tensors, family: str = "llama") -> Callable[[str, int | None], np.ndarray]:
    """``lookup(name, layer)`` over Hugging Face tensor names ([out, in] layout).

    ``tensors`` maps names to arrays (a dict or a :class:`SafetensorsFolder`);
    the result gives jspec's parameter ``name`` for one layer, or a global one
    when ``layer`` is None.
    """
    layer_names = _GEMMA_LAYER_NAMES if family == "gemma3" else _HF_LAYER_NAMES

    def lookup(name: str, layer: int | None) -> np.ndarray:
        if layer is None:
            if name == "embed":
                return tensors["model.embed_tokens.weight"]
            if name == "final_norm":
                return tensors["model.norm.weight"]
            if name == "lm_head":
                key = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
                return tensors[key]
            raise ValueError(f"unknown parameter {name!r}.")
        return tensors[f"model.layers.{layer}.{layer_names[name]}"]

    return lookup
