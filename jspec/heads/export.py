"""jspec's heads written in the layouts that serving engines load: SGLang (``specforge``), vLLM
(``speculators``), SafeAILab/EAGLE (``eagle``) and FasterDecoding/Medusa (``medusa``).

The writer of each layout is the inverse of its reader in :mod:`jspec.heads.formats` (an export read back
drafts what the head drafts); ``docs/head_formats.md`` gives each layout's facts with their sources.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
from safetensors.numpy import save_file

from jspec.files import temporary_dir
from jspec.heads.eagle import DraftHead, HeadConfig
from jspec.heads.medusa import MedusaHeads

__all__ = ["EXPORTS", "export_head"]

EXPORTS = ("specforge", "speculators", "eagle", "medusa")


def _llama_config(c: HeadConfig, **extra) -> dict:
    rope = (
        None
        if c.rope_scaling is None
        else {"rope_type": c.rope_scaling.kind, "factor": c.rope_scaling.factor}
        | (
            {}
            if c.rope_scaling.kind == "linear"
            else {
                "low_freq_factor": c.rope_scaling.low_freq_factor,
                "high_freq_factor": c.rope_scaling.high_freq_factor,
                "original_max_position_embeddings": c.rope_scaling.original_max_position,
            }
        )
    )
    return {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": float(np.format_float_positional(np.float32(c.rms_eps))),
        "rope_theta": c.rope_theta,
        "rope_scaling": rope,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "float32",
    } | extra


def _layer_tensors(head: DraftHead, prefix: str) -> dict:
    c = head.config
    qd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    wqkv, gate_up = np.asarray(head.wqkv[...]), np.asarray(head.w_gate_up[...])
    a, m = prefix + "self_attn.", prefix + "mlp."
    return {
        a + "q_proj.weight": wqkv[:qd],
        a + "k_proj.weight": wqkv[qd : qd + kvd],
        a + "v_proj.weight": wqkv[qd + kvd :],
        a + "o_proj.weight": head.wo[...],
        prefix + "post_attention_layernorm.weight": head.mlp_norm[...],
        m + "gate_proj.weight": gate_up[: c.intermediate_size],
        m + "up_proj.weight": gate_up[c.intermediate_size :],
        m + "down_proj.weight": head.w_down[...],
    }


def export_head(
    head: DraftHead | MedusaHeads,
    fmt: str,
    out,
    *,
    verifier: str | None = None,
    verifier_architecture: str = "LlamaForCausalLM",
    num_draft: int = 3,
) -> pathlib.Path:
    """Writes ``head`` into ``out`` in a published layout (:data:`EXPORTS`) that SGLang (``specforge``), vLLM
    (``speculators``), SafeAILab/EAGLE (``eagle``) or FasterDecoding/Medusa (``medusa``) load. Refuses, naming
    the reason, a head the format cannot state (another computation, layers its convention cannot name)."""

    if fmt not in EXPORTS:
        raise ValueError(f"unknown export format {fmt!r}; choose from {', '.join(EXPORTS)}.")
    if isinstance(head, MedusaHeads) != (fmt == "medusa"):
        kind = "Medusa heads" if isinstance(head, MedusaHeads) else f"an {head.config.kind} head"
        raise ValueError(
            f"format {fmt!r} does not hold {kind}; Medusa heads export as 'medusa', EAGLE-3 heads as "
            "'specforge', 'speculators' or 'eagle'."
        )
    if fmt == "medusa":
        tensors, meta = (
            _medusa_tensors(head),
            {"medusa_num_heads": head.config.num_heads, "medusa_num_layers": 1, "base_model_name_or_path": verifier},
        )
        name = "medusa_lm_head.safetensors"
    else:
        tensors, meta = _eagle3_export(head, fmt, (verifier, verifier_architecture), num_draft)
        name = "model.safetensors"
    with temporary_dir(pathlib.Path(out)) as tmp:
        save_file(
            {k: np.ascontiguousarray(np.asarray(v)) for k, v in tensors.items()},
            str(tmp / name),
            metadata={"format": "pt"},
        )
        (tmp / "config.json").write_text(json.dumps(meta, indent=1))
    return pathlib.Path(out)


def _medusa_tensors(heads: MedusaHeads) -> dict:
    out = heads.head_out[...] if heads.config.untied else [heads.lm_head[...]] * heads.config.num_heads
    tensors = {}
    for i in range(heads.config.num_heads):
        tensors |= {
            f"{i}.0.linear.weight": np.asarray(heads.w[...][i], np.float32),
            f"{i}.0.linear.bias": np.asarray(heads.b[...][i], np.float32),
            f"{i}.1.weight": np.asarray(out[i]),
        }
    return tensors


def _eagle3_export(head: DraftHead, fmt: str, verifier, num_draft: int) -> tuple[dict, dict]:
    c = head.config
    if c.kind != "eagle3":
        raise ValueError(
            "only EAGLE-3 heads have a published layout jspec writes; jspec's EAGLE-1 predicts the "
            "pre-norm feature, SafeAILab's EAGLE-1 the normalized one, so neither states the other."
        )
    odd = [
        f.name
        for f in dataclasses.fields(c)
        if f.name in ("fc_bias", "qkv_bias", "qk_norm", "feature_norm") and getattr(c, f.name)
    ]
    L = c.num_target_layers
    if fmt == "eagle" and (c.feature_layers != (1, L // 2 - 1, L - 4) or c.head_dim * c.num_heads != c.hidden_size):
        raise ValueError(
            f"SafeAILab's EAGLE-3 reads the outputs of layers {(1, L // 2 - 1, L - 4)} (the inputs of 2, "
            f"L//2, L-3) and records no others; this head reads {c.feature_layers}. Export it as "
            "'specforge' or 'speculators', or train with --feature-layers 1,L/2-1,L-4."
        )
    if fmt == "eagle" and (c.fc_norm or not c.logits_norm or c.rope_scaling is not None or c.own_embed):
        odd += ["fc_norm" if c.fc_norm else "logits_norm" if not c.logits_norm else "RoPE scaling or own embedding"]
    if fmt != "speculators" and (c.norm_before_residual or c.feedback_norm):
        odd += ["norm_before_residual" if c.norm_before_residual else "feedback_norm"]
    if fmt == "speculators" and not c.logits_norm:
        odd += ["logits_norm"]
    if odd:
        raise ValueError(f"format {fmt!r} cannot state this head's {', '.join(odd)}; choose another format.")
    K = c.draft_vocab_size
    ids = np.asarray(head.d2t[...], np.int64)
    t2d = np.zeros((c.vocab_size,), bool)
    t2d[ids] = True
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    tensors = {
        "fc.weight": head.fc[...],
        prefix + "input_layernorm.weight": head.emb_norm[...],
        prefix + "hidden_norm.weight": head.feat_norm[...],
        "norm.weight": head.final_norm[...],
        "lm_head.weight": head.lm_head[...],
        "d2t": ids - np.arange(K),
        "t2d": t2d,
    } | _layer_tensors(head, prefix)
    if c.fc_norm:
        tensors |= {f"fc_norm.{i}.weight": head.fc_norms[...][i] for i in range(len(c.feature_layers))}
    if c.own_embed:
        tensors["embed_tokens.weight"] = head.embed[...]
    extra = {"draft_vocab_size": K} | ({"target_hidden_size": c.target_hidden_size} if c.own_embed else {})
    extra |= {"fc_norm": True} if c.fc_norm else {}
    if fmt == "speculators":
        layer = _llama_config(c)
        meta = {
            "speculators_model_type": "eagle3",
            "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": layer,
            "norm_before_residual": c.norm_before_residual,
            "norm_output": c.feedback_norm,
            "eagle_aux_hidden_state_layer_ids": [k + 1 for k in c.feature_layers],
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_draft}],
                "verifier": {"name_or_path": verifier[0], "architectures": [verifier[1]]},
            },
        } | extra
    elif fmt == "specforge":
        meta = _llama_config(
            c,
            architectures=["LlamaForCausalLMEagle3"],
            norm_output=c.logits_norm,
            eagle_config={"eagle_aux_hidden_state_layer_ids": list(c.feature_layers), "use_aux_hidden_state": True},
            **extra,
        )
    else:
        meta = _llama_config(c, architectures=["LlamaForCausalLMEagle3"], **extra)
        meta.pop("head_dim")
    return {
        k: np.asarray(v, np.float32) if np.asarray(v).dtype.kind == "f" else np.asarray(v) for k, v in tensors.items()
    }, meta
