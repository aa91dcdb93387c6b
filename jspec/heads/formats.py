"""Draft heads as other projects publish them, read into jspec's heads; jspec's heads written in their layouts.

Formats, detected from the files (``docs/head_formats.md`` gives every fact below with its source):

* ``eagle3-safeailab``: SafeAILab/EAGLE's EAGLE-3 (``yuhuili/EAGLE3-*``): ``pytorch_model.bin``, ``midlayer.*``;
* ``eagle3-specforge``: what SpecForge writes for SGLang (``LlamaForCausalLMEagle3``, ``model.safetensors``,
  ``midlayer.*``, the layer ids in ``eagle_config``);
* ``eagle3-speculators``: vllm-project/speculators (``speculators_config``, ``layers.0.*``);
* ``eagle1-safeailab``: SafeAILab/EAGLE's EAGLE-1/2 (``yuhuili/EAGLE-*``): ``layers.0.*`` over ``[embedding, feature]``;
* ``medusa1``: FasterDecoding/Medusa (``medusa_lm_head.pt`` or ``.safetensors``, an output layer per head);
* ``jspec``: what ``jspec train`` saves (``head.json`` or ``medusa.json``).

Layer ids: jspec's ``feature_layers`` name the layers whose *output* a head reads. SGLang (and so SpecForge)
records outputs too; vLLM (and so speculators) records the layer whose *input* is read (one more); SafeAILab
records nothing and reads the inputs of layers 2, L//2 and L-3. Each loader converts; each exporter
(:mod:`jspec.heads.export`) states jspec's layers in the format's own convention, or refuses when it cannot.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
from flax import nnx

from jspec.heads.eagle import HEAD_META, DraftHead, HeadConfig, load_head
from jspec.heads.medusa import META as MEDUSA_META
from jspec.heads.medusa import MedusaConfig, MedusaHeads, load_medusa
from jspec.models.config import RopeScaling
from jspec.models.hub import hub_snapshot, parse_hub_id
from jspec.models.safetensors_folder import SafetensorsFolder
from jspec.models.torch_state import read_torch_state

__all__ = [
    "FORMATS",
    "check_against_target",
    "detect_format",
    "load_any_head",
    "load_eagle",
    "load_medusa_heads",
    "resolve_head",
]

FORMATS = ("jspec", "eagle3-safeailab", "eagle3-specforge", "eagle3-speculators", "eagle1-safeailab", "medusa1")
HEAD_FILES = (
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "medusa_lm_head.pt",
    HEAD_META,
    MEDUSA_META,
)
_TORCH_FILES = ("pytorch_model.bin", "medusa_lm_head.pt")


def resolve_head(source) -> pathlib.Path:
    """The folder of a head named by a local folder or a Hub id ``ORG/NAME[@REVISION]`` (in that order)."""
    path = pathlib.Path(source).expanduser()
    if path.is_dir():
        return path
    hub = parse_hub_id(str(source))
    if hub is None:
        raise ValueError(
            f"head {str(source)!r}: no such folder, and not a Hub id ORG/NAME[@REVISION]; pass a head's "
            "folder or Hub id."
        )
    return hub_snapshot(*hub, allow_patterns=HEAD_FILES, what="draft head")


# ---------------------------------------------------------------------- reading


def _read_weights(folder: pathlib.Path) -> dict:
    for name in _TORCH_FILES:
        if (folder / name).exists():
            return read_torch_state(folder / name)
    tensors = SafetensorsFolder(folder)  # checks every file against its header (a truncated file is refused)
    return {k: np.asarray(tensors[k]) for k in tensors.where}


def _config(folder: pathlib.Path) -> dict:
    path = folder / "config.json"
    if not path.exists():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); refusing the head.") from err
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a JSON object; refusing the head.")
    return cfg


def detect_format(folder, tensors: dict | None = None) -> str:
    """One of :data:`FORMATS`, read from the folder's files (``tensors``: its weights when already read, so
    that a ``.bin`` is not loaded twice); an unknown layout is refused by name."""
    folder = pathlib.Path(folder)
    if (folder / HEAD_META).exists() or (folder / MEDUSA_META).exists():
        return "jspec"
    if (folder / "medusa_lm_head.pt").exists() or (folder / "medusa_lm_head.safetensors").exists():
        return "medusa1"
    cfg = _config(folder)
    if "speculators_config" in cfg or "speculators_model_type" in cfg:
        kind = cfg.get("speculators_model_type")
        if kind != "eagle3":
            raise ValueError(f"{folder}: a speculators {kind!r} head; jspec reads speculators' eagle3 heads only.")
        return "eagle3-speculators"
    if not cfg:
        files = ", ".join(sorted(p.name for p in folder.iterdir())[:8]) or "nothing"
        raise ValueError(f"{folder} holds no draft head jspec knows ({files}); it reads {', '.join(FORMATS)}.")
    if tensors is not None:
        names = set(tensors)
    elif (folder / "pytorch_model.bin").exists():
        names = set(read_torch_state(folder / "pytorch_model.bin"))
    else:
        names = set(SafetensorsFolder(folder).where)  # the headers only
    if any(n.startswith("midlayer.") for n in names):
        return "eagle3-safeailab" if (folder / "pytorch_model.bin").exists() else "eagle3-specforge"
    if "fc.weight" in names and any(n.startswith("layers.0.") for n in names):
        return "eagle1-safeailab"
    arch = cfg.get("architectures")
    raise ValueError(
        f"{folder}: unknown draft head layout (architectures {arch}, tensors e.g. {sorted(names)[:3]}); "
        f"jspec reads {', '.join(FORMATS)}."
    )


def _refuse(folder, field: str, value, why: str):
    raise ValueError(
        f"{folder}/config.json: {field} = {value!r}: {why}; jspec does not implement it and will not "
        "draft with it ignored."
    )


def _layer_facts(cfg: dict, folder, fmt: str) -> dict:
    """HeadConfig fields of the draft's decoder layer, from a Llama/Qwen3-style config dict."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        _refuse(folder, "hidden_act", act, "the draft layer's MLP would use another activation")
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        _refuse(folder, "num_hidden_layers", cfg["num_hidden_layers"], "jspec's heads have one decoder layer")
    for field in ("mlp_bias", "norm_before_fc", "use_sliding_window"):
        if cfg.get(field):
            _refuse(folder, field, cfg[field], "it changes the draft's computation")
    if fmt == "eagle3-speculators" and cfg.get("attention_bias"):
        _refuse(folder, "attention_bias", True, "the layer's projections would carry biases")
    H, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    # SafeAILab's heads compute head_dim as hidden_size // heads whatever the config says; the others read it.
    head_dim = H // heads if fmt.endswith("safeailab") else int(cfg.get("head_dim") or H // heads)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    return dict(
        hidden_size=H,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        intermediate_size=int(cfg["intermediate_size"]),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=RopeScaling.from_hf(rope, "rope_scaling"),
        qk_norm=cfg.get("model_type") == "qwen3",
    )


def _feature_layers(ids, target_layers: int, convention: str, folder) -> tuple[int, ...]:
    """jspec's feature layers (outputs) from a file's recorded ids; None: the published default, the inputs of
    layers 2, L//2 and L-3 (SafeAILab's, SGLang's and vLLM's default alike)."""
    L = target_layers
    if ids is None:
        ids, convention = [2, L // 2, L - 3], "input"
    ids = [int(i) for i in ids]
    out = [i - 1 for i in ids] if convention == "input" else ids
    if any(not 0 <= i < L for i in out):
        raise ValueError(
            f"{folder}: the head reads target layers {ids} ({convention}s of layers), which a "
            f"{L}-layer target does not have (jspec cannot read the embedding as a feature)."
        )
    return tuple(out)


def _vocab_ids(w: dict, K: int, V: int, folder) -> np.ndarray:
    """int32[K] target ids of the draft vocabulary: ``d2t`` holds offsets (target = draft + d2t[draft]); the
    ``t2d`` mask, when present, must mark exactly those ids."""
    if "d2t" not in w:
        if K != V:
            raise ValueError(f"{folder}: a draft vocabulary of {K} < {V} tokens without its d2t map; refusing it.")
        return np.arange(V, dtype=np.int32)
    if w["d2t"].shape != (K,):
        raise ValueError(f"{folder}: d2t has shape {w['d2t'].shape}; the draft vocabulary is {K}. Refusing it.")
    ids = np.arange(K, dtype=np.int64) + np.asarray(w["d2t"], np.int64)
    if ids.min() < 0 or ids.max() >= V or len(np.unique(ids)) != K:
        raise ValueError(f"{folder}: d2t does not map {K} draft ids to distinct target ids below {V}; refusing it.")
    if "t2d" in w:
        t2d = np.asarray(w["t2d"]).astype(bool).reshape(-1)
        if t2d.shape != (V,) or t2d.sum() != K or not t2d[ids].all():
            raise ValueError(f"{folder}: t2d and d2t disagree on the draft vocabulary; refusing it.")
    return ids.astype(np.int32)


class _Weights:
    """A head's tensors by name; :meth:`take` refuses a missing or misshapen one, :meth:`rest` what was never
    taken (a tensor the loader would silently leave out)."""

    def __init__(self, tensors: dict, folder):
        self.tensors, self.folder, self.taken = tensors, folder, set()

    def __contains__(self, name):
        return name in self.tensors

    def take(self, name: str, shape=None) -> np.ndarray:
        if name not in self.tensors:
            raise ValueError(f"{self.folder}: tensor {name!r} is missing; the file is not a complete head.")
        value = self.tensors[name]
        if shape is not None and tuple(value.shape) != tuple(shape):
            raise ValueError(f"{self.folder}: tensor {name!r} is {tuple(value.shape)}, the config implies {shape}.")
        self.taken.add(name)
        return value

    def rest(self) -> list[str]:
        return sorted(set(self.tensors) - self.taken)


def _fill_layer(head: DraftHead, w: _Weights, prefix: str, attn_in: int) -> None:
    """The decoder layer's weights from Hugging Face names under ``prefix`` (``midlayer.`` or ``layers.0.``)."""
    c = head.config
    H, D, F = c.hidden_size, c.head_dim, c.intermediate_size
    qd, kvd = c.num_heads * D, c.num_kv_heads * D
    a = prefix + "self_attn."
    head.wqkv[...] = np.concatenate(
        [
            w.take(a + "q_proj.weight", (qd, attn_in)),
            w.take(a + "k_proj.weight", (kvd, attn_in)),
            w.take(a + "v_proj.weight", (kvd, attn_in)),
        ]
    )
    if c.qkv_bias:
        head.bqkv[...] = np.concatenate([w.take(a + f"{n}_proj.bias") for n in "qkv"])
    if c.qk_norm:
        head.q_norm[...], head.k_norm[...] = w.take(a + "q_norm.weight", (D,)), w.take(a + "k_norm.weight", (D,))
    head.wo[...] = w.take(a + "o_proj.weight", (H, qd))
    head.mlp_norm[...] = w.take(prefix + "post_attention_layernorm.weight", (H,))
    m = prefix + "mlp."
    head.w_gate_up[...] = np.concatenate([w.take(m + "gate_proj.weight", (F, H)), w.take(m + "up_proj.weight", (F, H))])
    head.w_down[...] = w.take(m + "down_proj.weight", (H, F))


def _eagle3(folder, fmt: str, cfg: dict, tensors: dict, target) -> DraftHead:
    t = target.config
    layer_cfg = cfg.get("transformer_layer_config", cfg) if fmt == "eagle3-speculators" else cfg
    facts = _layer_facts(layer_cfg, folder, fmt)
    if fmt == "eagle3-speculators":
        ids, convention = cfg.get("eagle_aux_hidden_state_layer_ids"), "input"  # vLLM: the stream entering layer k
        feedback, logits_norm = bool(cfg.get("norm_output", False)), True
    else:
        eagle_cfg = cfg.get("eagle_config") or {}
        ids = None if fmt == "eagle3-safeailab" else eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
        convention = "output"  # SGLang captures the output of layer k (it adds 1 to the recorded id)
        feedback, logits_norm = False, bool(cfg.get("norm_output", True)) if fmt == "eagle3-specforge" else True
        if cfg.get("norm_before_residual"):
            _refuse(folder, "norm_before_residual", True, "SGLang's and SafeAILab's EAGLE-3 layers have no such switch")
    w = _Weights(tensors, folder)
    own = "embed_tokens.weight" in w
    target_hidden = int(cfg.get("target_hidden_size") or t.hidden_size)
    vocab = len(tensors["t2d"]) if "t2d" in tensors else int(cfg.get("vocab_size") or layer_cfg.get("vocab_size"))
    config = HeadConfig(
        kind="eagle3",
        vocab_size=vocab,
        draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab),
        feature_layers=_feature_layers(ids, t.num_layers, convention, folder),
        num_target_layers=t.num_layers,
        target_hidden_size=target_hidden,
        fc_norm=bool(cfg.get("fc_norm", False)),
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        logits_norm=logits_norm,
        feedback_norm=feedback,
        own_embed=own,
        **facts,
    )
    check_against_target(config, target, folder)
    head = DraftHead(config, rngs=None)
    H, n, K = config.hidden_size, len(config.feature_layers), config.draft_vocab_size
    prefix = "layers.0." if fmt == "eagle3-speculators" else "midlayer."
    head.fc[...] = w.take("fc.weight", (H, n * target_hidden))
    if config.fc_norm:
        head.fc_norms[...] = np.stack([w.take(f"fc_norm.{i}.weight", (target_hidden,)) for i in range(n)])
    head.emb_norm[...] = w.take(prefix + "input_layernorm.weight", (H,))
    head.feat_norm[...] = w.take(prefix + "hidden_norm.weight", (H,))
    _fill_layer(head, w, prefix, 2 * H)
    head.final_norm[...] = w.take("norm.weight", (H,))
    head.lm_head[...] = w.take("lm_head.weight", (K, H))
    ids = _vocab_ids({k: w.take(k) for k in ("d2t", "t2d") if k in w}, K, config.vocab_size, folder)
    return _finish(head, w, target, ids)


def _eagle1(folder, cfg: dict, tensors: dict, target) -> DraftHead:
    t = target.config
    facts = _layer_facts(cfg, folder, "eagle1-safeailab")
    w = _Weights(tensors, folder)
    bias = bool(cfg.get("bias", True))  # SafeAILab's EaModel: the fusion has a bias unless the config says not
    if bias and "fc.bias" not in w:
        _refuse(folder, "bias", cfg.get("bias", "absent (True)"), "the fusion's bias is missing from the weights")
    config = HeadConfig(
        kind="eagle1",
        vocab_size=t.vocab_size,
        draft_vocab_size=t.vocab_size,
        feature_layers=(t.num_layers - 1,),
        num_target_layers=t.num_layers,
        fc_bias=bias,
        qkv_bias=bool(cfg.get("qkv_bias", False)),
        attn_norm="layers.0.input_layernorm.weight" in w,
        logits_norm=False,
        feature_norm=True,
        own_embed="embed_tokens.weight" in w,
        **facts,
    )
    check_against_target(config, target, folder)
    head = DraftHead(config, rngs=None)
    H = config.hidden_size
    head.fc[...] = w.take("fc.weight", (H, 2 * H))
    if config.fc_bias:
        head.fc_b[...] = w.take("fc.bias", (H,))
    if config.attn_norm:
        head.attn_norm[...] = w.take("layers.0.input_layernorm.weight", (H,))
    _fill_layer(head, w, "layers.0.", H)
    return _finish(head, w, target, np.arange(t.vocab_size, dtype=np.int32))


def _finish(head: DraftHead, w: _Weights, target, ids) -> DraftHead:
    head.attach_target(target, ids)
    if head.config.own_embed:
        head.embed[...] = w.take("embed_tokens.weight", (head.config.vocab_size, head.config.hidden_size))
    left = [n for n in w.rest() if not n.endswith("rotary_emb.inv_freq")]
    if left:
        raise ValueError(
            f"{w.folder} holds {len(left)} tensor(s) a {head.config.kind} head of this config does not "
            f"use, e.g. {left[0]!r}; refusing to draft with them left out."
        )
    return head


def check_against_target(config: HeadConfig, target, folder) -> None:
    """Refuses, before anything compiles, a head that cannot run on ``target``: vocabulary, width, layers."""
    t = target.config
    if config.vocab_size != t.vocab_size:
        raise ValueError(
            f"{folder}: the head is for a vocabulary of {config.vocab_size}; the target has "
            f"{t.vocab_size}. Pass the head published for this target."
        )
    if config.target_hidden_size != t.hidden_size:
        raise ValueError(
            f"{folder}: the head reads features {config.target_hidden_size} wide; the target's "
            f"are {t.hidden_size}. Pass the head published for this target."
        )
    if max(config.feature_layers) >= t.num_layers:
        raise ValueError(
            f"{folder}: the head reads layer {max(config.feature_layers)}; the target has "
            f"{t.num_layers} layers. Pass the head published for this target."
        )


def _medusa1(folder, cfg: dict, tensors: dict, target) -> MedusaHeads:
    layers = int(cfg.get("medusa_num_layers", 1))
    if layers != 1:
        _refuse(folder, "medusa_num_layers", layers, "jspec's Medusa heads have one residual block each")
    # Medusa's own loader sizes the heads from what the file holds (its configs undercount them).
    k = len({n.split(".")[0] for n in tensors if n.endswith(".0.linear.weight")})
    t = target.config
    H, V = t.hidden_size, t.vocab_size
    config = MedusaConfig(k, H, V, t.rms_eps, t.num_layers, untied=True)
    heads = MedusaHeads(config, rngs=nnx.Rngs(0))
    w = _Weights(tensors, folder)
    heads.w[...] = np.stack([w.take(f"{i}.0.linear.weight", (H, H)) for i in range(k)])
    heads.b[...] = np.stack([w.take(f"{i}.0.linear.bias", (H,)) for i in range(k)])
    heads.head_out[...] = np.stack([w.take(f"{i}.1.weight", (V, H)) for i in range(k)])
    if w.rest():
        raise ValueError(f"{folder} holds tensors Medusa-1 heads do not use, e.g. {w.rest()[0]!r}; refusing them.")
    heads.attach_target(target)
    return heads


def load_any_head(source, target) -> DraftHead | MedusaHeads:
    """An EAGLE head or Medusa heads from a folder or Hub id in any of :data:`FORMATS`, attached to ``target``
    and checked against it before anything compiles."""
    folder = resolve_head(source)
    if (folder / HEAD_META).exists() or (folder / MEDUSA_META).exists():
        return load_head(folder, target) if (folder / HEAD_META).exists() else load_medusa(folder, target)
    cfg = _config(folder)
    if not cfg:
        detect_format(folder)  # from the file names alone: refuses a folder that holds no head, before reading
    tensors = _read_weights(folder)  # read once: detection and loading share it
    fmt = detect_format(folder, tensors)
    if fmt == "medusa1":
        return _medusa1(folder, cfg, tensors, target)
    if fmt == "eagle1-safeailab":
        return _eagle1(folder, cfg, tensors, target)
    return _eagle3(folder, fmt, cfg, tensors, target)


def load_eagle(source, target) -> DraftHead:
    head = load_any_head(source, target)
    if not isinstance(head, DraftHead):
        raise ValueError(f"{source} holds Medusa heads, not an EAGLE head: use method medusa.")
    return head


def load_medusa_heads(source, target) -> MedusaHeads:
    heads = load_any_head(source, target)
    if not isinstance(heads, MedusaHeads):
        raise ValueError(f"{source} holds an EAGLE head, not Medusa heads: use method {heads.config.kind}.")
    return heads
