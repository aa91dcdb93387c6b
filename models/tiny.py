"""Tiny random-weight models: for tests, notebooks and experiments that need a model in seconds (claims about
speed or acceptance are measured on the real models instead)."""

import numpy as np
from flax import nnx

from jspec.models.config import ModelConfig
from jspec.models.llama import Transformer
from jspec.models.loading import build_model


def tiny_config(family="llama", **kw) -> ModelConfig:
    base = dict(
        family=family,
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qkv_bias=family == "qwen2",
        tie_embeddings=family == "llama",
        max_position=256,
        eos_token_ids=(3,),
    )
    return ModelConfig(**(base | kw))


def tiny_model(family="llama", layer_loop="unrolled", seed=0, **kw) -> Transformer:
    return Transformer(tiny_config(family, **kw), rngs=nnx.Rngs(seed), layer_loop=layer_loop)


def peaked_model(family="qwen2", seed=0, scale=0.4, layer_loop="unrolled", **kw) -> Transformer:
    """A tiny model with large random weights: its next-token distributions are far from uniform,
    so two such models disagree often (what statistical tests with negative controls need)."""

    c = tiny_config(family, **kw)
    rng = np.random.default_rng(seed)
    L, H, F, D = c.num_layers, c.hidden_size, c.intermediate_size, c.head_dim
    qd, kvd = c.num_heads * D, c.num_kv_heads * D
    shapes = {
        "embed": (c.vocab_size, H), "lm_head": (c.vocab_size, H),
        "wq": (L, qd, H), "wk": (L, kvd, H), "wv": (L, kvd, H), "wo": (L, H, qd),
        "bq": (L, qd), "bk": (L, kvd), "bv": (L, kvd), "w_gate": (L, F, H), "w_up": (L, F, H), "w_down": (L, H, F),
    }  # fmt: skip
    params = {k: (scale * rng.standard_normal(v)).astype(np.float32) for k, v in shapes.items()}
    params |= {"attn_norm": np.ones((L, H), np.float32), "mlp_norm": np.ones((L, H), np.float32)}
    params["final_norm"] = np.ones((H,), np.float32)
    return build_model(c, params, layer_loop=layer_loop)
