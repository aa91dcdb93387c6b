"""Architecture of a Llama-family target model (Llama layout and Qwen2)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

__all__ = ["ModelConfig"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static shape facts of a model; hashable, so it can be a static jit argument.

    Attributes:
      family: "llama" or "qwen2" (Qwen2 has QKV biases).
      vocab_size: V.
      hidden_size: H.
      intermediate_size: F, the SwiGLU width.
      num_layers: L.
      num_heads: query heads.
      num_kv_heads: key/value heads (grouped-query attention).
      head_dim: D.
      rope_theta: RoPE base.
      rms_eps: RMSNorm epsilon.
      qkv_bias: whether q, k and v projections carry a bias.
      tie_embeddings: whether the output layer reuses the token embedding.
      max_position: the context length the model was trained for.
      bos_token_id / eos_token_ids: from the model's metadata.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10_000.0
    rms_eps: float = 1e-5
    qkv_bias: bool = False
    tie_embeddings: bool = True
    max_position: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.family not in ("llama", "qwen2"):
            raise ValueError(f"unknown model family {self.family!r}; jspec knows 'llama' and 'qwen2'.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}).")

    @property
    def num_params(self) -> int:
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        bias = d * (self.num_heads + 2 * self.num_kv_heads) if self.qkv_bias else 0
        per_layer = attn + bias + 3 * h * f + 2 * h
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head

    # ------------------------------------------------------------ HF config.json

    def to_hf(self) -> dict:
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.family]
        eos = list(self.eos_token_ids)
        return {
            "architectures": [arch],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_position,
            "hidden_act": "silu",
            "attention_bias": self.qkv_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "torch_dtype": "float32",
        }

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in ("llama", "qwen2"):
            raise ValueError(f"config.json has model_type {model_type!r}; jspec loads 'llama' and 'qwen2' models.")
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10_000.0)
        return cls(
            family=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(rope),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position=int(cfg.get("max_position_embeddings", 8192)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
        )

    @classmethod
    def from_json_file(cls, path: str | pathlib.Path) -> ModelConfig:
        return cls.from_hf(json.loads(pathlib.Path(path).read_text()))
