"""Architecture of a target model: Llama layout (Llama 2/3.x, SmolLM2), Qwen2, Qwen3 and Gemma 3 (text).

One frozen config describes every family through the handful of switches in which they differ
(QKV bias, query/key norms, (1 + w) norms, sandwich norms, GeGLU, a scaled embedding, sliding-window
layers, RoPE scaling). :meth:`ModelConfig.from_hf` reads a Hugging Face ``config.json`` (the
transformers 4.x and 5.x spellings) and refuses, naming the field, anything that would change the
computation and that jspec does not implement: it never decodes other tokens than the model's
authors did without saying so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import numpy as np

__all__ = ["FAMILIES", "ModelConfig", "RopeScaling"]

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}  # fmt: skip
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}

# config.json fields that never change the logits (training, bookkeeping, ids that generation reads apart).
_INERT = {
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "initializer_range", "attention_dropout", "pad_token_id", "bos_token_id", "eos_token_id", "pretraining_tp",
    "max_position_embeddings", "output_attentions", "output_hidden_states", "return_dict", "tie_word_embeddings",
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "attention_bias", "hidden_act", "hidden_activation", "layer_types", "sliding_window", "use_sliding_window",
    "max_window_layers", "query_pre_attn_scalar", "rope_local_base_freq", "sliding_window_pattern",
    "_sliding_window_pattern", "cache_implementation", "final_logit_softcapping", "attn_logit_softcapping",
    "mlp_bias", "use_bidirectional_attention", "chunk_size_feed_forward", "problem_type", "id2label", "label2id",
    "keys_to_ignore_at_inference", "generation_config", "embedding_dropout", "residual_dropout", "resid_pdrop",
    "embd_pdrop", "attn_pdrop", "tokenizer_class", "is_decoder", "gradient_checkpointing",
}  # fmt: skip


def _refuse(field: str, value, why: str) -> None:
    raise ValueError(
        f"config.json field {field!r} = {value!r}: {why}. jspec does not implement it and will not decode "
        "with it ignored (the tokens would differ from the model's); use a model without it."
    )


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency scaling: ``"linear"`` (positions divided by ``factor``) or ``"llama3"``.

    Llama 3.x keeps the high frequencies, divides the low ones (wavelengths above
    ``original_max_position / low_freq_factor``) by ``factor`` and interpolates between the two.
    """

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        if self.kind not in ("linear", "llama3"):
            raise ValueError(f"RoPE scaling {self.kind!r} is not implemented; jspec knows 'linear' and 'llama3'.")
        if self.factor <= 0:
            raise ValueError(f"RoPE scaling factor must be positive; got {self.factor}.")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError("llama3 RoPE scaling needs high_freq_factor > low_freq_factor.")

    def apply(self, inv_freq: np.ndarray) -> np.ndarray:
        if self.kind == "linear":
            return inv_freq / self.factor
        wavelength = 2 * math.pi / inv_freq
        long_edge = self.original_max_position / self.low_freq_factor  # longer wavelengths: scaled fully
        short_edge = self.original_max_position / self.high_freq_factor  # shorter: kept
        ramp = (self.original_max_position / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - ramp) * inv_freq / self.factor + ramp * inv_freq
        out = np.where(wavelength > long_edge, inv_freq / self.factor, inv_freq)
        return np.where((wavelength <= long_edge) & (wavelength >= short_edge), blended, out)

    @classmethod
    def from_hf(cls, params: dict | None, field: str) -> RopeScaling | None:
        """None for default RoPE; refuses the kinds jspec does not implement (yarn, dynamic, longrope, ...)."""
        if not params:
            return None
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind == "default":
            return None
        if kind not in ("linear", "llama3"):
            _refuse(f"{field}.rope_type", kind, "this RoPE scaling changes the positions' frequencies")
        if kind == "linear":
            return cls("linear", float(params["factor"]))
        return cls(
            "llama3",
            float(params["factor"]),
            float(params.get("low_freq_factor", 1.0)),
            float(params.get("high_freq_factor", 4.0)),
            int(params["original_max_position_embeddings"]),
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static shape facts of a model; hashable, so it can be a static jit argument.

    Attributes:
      family: one of :data:`FAMILIES`.
      vocab_size: V.  hidden_size: H.  intermediate_size: F, the gated MLP's width.
      num_layers: L.  num_heads: query heads.  num_kv_heads: key/value heads (grouped-query attention).
      head_dim: D.
      rope_theta: RoPE base of the global (full-attention) layers; rope_scaling: their scaling.
      rms_eps: RMSNorm epsilon.
      qkv_bias: q, k and v projections carry a bias (Qwen2).
      qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3, Gemma 3).
      norm_offset: RMSNorm multiplies by (offset + w): 0 (Llama, Qwen) or 1 (Gemma).
      post_norms: a norm on the attention output and on the MLP output before each joins the
        residual stream (Gemma 3's four norms per layer).
      activation: the MLP's gate, "silu" (SwiGLU) or "gelu_tanh" (GeGLU).
      embed_scale: the token embedding is multiplied by sqrt(H) (Gemma).
      query_scale: the attention's query scaling; None means D ** -0.5.
      sliding_window: W of the local layers (a token sees itself and the W - 1 before it).
      layer_types: per layer "full" or "sliding"; () means all full.
      rope_local_theta: RoPE base of the sliding layers (unscaled).
      tie_embeddings: the output layer reuses the token embedding.
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
    rope_scaling: RopeScaling | None = None
    qk_norm: bool = False
    norm_offset: float = 0.0
    post_norms: bool = False
    activation: str = "silu"
    embed_scale: bool = False
    query_scale: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float = 10_000.0

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; jspec knows {', '.join(FAMILIES)}.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}).")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation must be 'silu' or 'gelu_tanh'; got {self.activation!r}.")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers.")
        if set(self.layer_types) - {"full", "sliding"}:
            raise ValueError(f"layer_types must be 'full' or 'sliding'; got {sorted(set(self.layer_types))}.")
        if "sliding" in self.layer_types and not (self.sliding_window or 0) > 0:
            raise ValueError("sliding layers need a positive sliding_window.")

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding"

    def inv_freq(self, layer: int | None = None) -> np.ndarray:
        """float32[D/2]: the RoPE inverse frequencies of ``layer`` (None: a global layer)."""
        local = layer is not None and self.is_sliding(layer)
        theta = self.rope_local_theta if local else self.rope_theta
        # float32 throughout, as the reference implementation computes them
        exponent = np.arange(0, self.head_dim, 2).astype(np.float32) / np.float32(self.head_dim)
        inv = (np.float32(1.0) / np.float32(theta) ** exponent).astype(np.float32)
        if self.rope_scaling is not None and not local:
            inv = self.rope_scaling.apply(inv).astype(np.float32)
        return inv

    @property
    def num_params(self) -> int:
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        bias = d * (self.num_heads + 2 * self.num_kv_heads) if self.qkv_bias else 0
        norms = (4 if self.post_norms else 2) * h + (2 * d if self.qk_norm else 0)
        per_layer = attn + bias + 3 * h * f + norms
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head

    # ------------------------------------------------------------ HF config.json

    def to_hf(self) -> dict:
        """config.json as transformers 5 writes it (jspec writes Llama and Qwen2 folders from GGUF files)."""
        if self.family in ("qwen3", "gemma3"):
            raise ValueError(f"jspec reads {self.family} folders but does not write them; copy the original folder.")
        eos = list(self.eos_token_ids)
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            s = self.rope_scaling
            rope = {"rope_theta": self.rope_theta, "rope_type": s.kind, "factor": s.factor}
            if s.kind == "llama3":
                rope |= {"low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                         "original_max_position_embeddings": s.original_max_position}  # fmt: skip
        return {
            "architectures": [_ARCHITECTURES[self.family]],
            "model_type": "gemma3_text" if self.family == "gemma3" else self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_parameters": rope,
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
        if model_type not in _MODEL_TYPES:
            arch = (cfg.get("architectures") or [model_type])[0]
            raise ValueError(
                f"config.json describes a {arch!r} (model_type {model_type!r}); jspec loads "
                f"{', '.join(_ARCHITECTURES[f] for f in FAMILIES)} (model_type {', '.join(_MODEL_TYPES)})."
            )
        family = _MODEL_TYPES[model_type]
        # Keys with a leading underscore are transformers' own bookkeeping (names, attention backend).
        unknown = sorted(
            k for k in cfg if k not in _INERT and not k.startswith("_") and cfg[k] not in (None, False, 0, [], {})
        )
        if unknown:
            _refuse(unknown[0], cfg[unknown[0]], "jspec does not know this field, so it cannot tell whether it matters")
        for field in ("final_logit_softcapping", "attn_logit_softcapping"):
            if cfg.get(field) is not None:
                _refuse(field, cfg[field], "logit soft-capping changes the logits")
        for field in ("mlp_bias", "use_bidirectional_attention"):
            if cfg.get(field):
                _refuse(field, cfg[field], "it changes the layers' computation")
        if cfg.get("use_sliding_window") and family != "gemma3":
            _refuse("use_sliding_window", True, "sliding-window attention is implemented for Gemma 3 only")
        act_field = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
        act = cfg.get(act_field) or ("gelu_pytorch_tanh" if family == "gemma3" else "silu")
        if act not in _ACTIVATIONS or (_ACTIVATIONS[act] == "silu") != (family != "gemma3"):
            _refuse(act_field, act, f"a {family} model with this activation is not implemented")

        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        rope, local_rope = _rope_fields(cfg, family)
        scaling = RopeScaling.from_hf(rope, "rope_parameters")
        if RopeScaling.from_hf(local_rope, "rope_parameters.sliding_attention") is not None:
            _refuse("rope_parameters.sliding_attention", local_rope, "scaled RoPE on sliding layers")
        layers = cfg["num_hidden_layers"]
        layer_types = _layer_types(cfg, family, layers)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        gemma = family == "gemma3"
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rope_theta=float(rope.get("rope_theta", 10_000.0)),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            max_position=int(cfg.get("max_position_embeddings", 8192)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            rope_scaling=scaling,
            qk_norm=family in ("qwen3", "gemma3"),
            norm_offset=1.0 if gemma else 0.0,
            post_norms=gemma,
            activation=_ACTIVATIONS[act],
            embed_scale=gemma,
            query_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
            sliding_window=int(cfg["sliding_window"]) if "sliding" in layer_types else None,
            layer_types=layer_types if "sliding" in layer_types else (),
            rope_local_theta=float(local_rope.get("rope_theta", 10_000.0)),
        )

    @classmethod
    def from_json_file(cls, path: str | pathlib.Path) -> ModelConfig:
        return cls.from_hf(json.loads(pathlib.Path(path).read_text()))


def _rope_fields(cfg: dict, family: str) -> tuple[dict, dict]:
    """(global, local) RoPE parameters from either spelling: transformers 5's ``rope_parameters``
    (per layer type for Gemma 3) or 4.x's ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``."""
    params = cfg.get("rope_parameters")
    if params and "full_attention" in params:
        return dict(params["full_attention"] or {}), dict(params.get("sliding_attention") or {})
    if params:
        return dict(params), {"rope_theta": 10_000.0}
    rope = dict(cfg.get("rope_scaling") or {})
    rope["rope_theta"] = cfg.get("rope_theta") or (1_000_000.0 if family == "gemma3" else 10_000.0)
    return rope, {"rope_theta": cfg.get("rope_local_base_freq") or 10_000.0}


def _layer_types(cfg: dict, family: str, layers: int) -> tuple[str, ...]:
    names = {"full_attention": "full", "sliding_attention": "sliding"}
    if cfg.get("layer_types"):
        bad = sorted(set(cfg["layer_types"]) - set(names))
        if bad:
            _refuse("layer_types", bad, "jspec knows full_attention and sliding_attention layers")
        if len(cfg["layer_types"]) != layers:
            raise ValueError(f"config.json: layer_types has {len(cfg['layer_types'])} entries for {layers} layers.")
        types = tuple(names[t] for t in cfg["layer_types"])
    elif family == "gemma3":  # transformers 4.x: every sliding_window_pattern-th layer is global
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        types = tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(layers))
    else:
        types = ("full",) * layers
    if "sliding" in types and family != "gemma3":
        _refuse("layer_types", "sliding_attention", "sliding-window attention is implemented for Gemma 3 only")
    if "sliding" in types and not cfg.get("sliding_window"):
        raise ValueError("config.json: sliding_attention layers but no sliding_window.")
    return types
