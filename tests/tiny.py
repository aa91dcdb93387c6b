"""Tiny random-weight models for unit tests (real-model tests use SmolLM2)."""

from flax import nnx

from jspec.models.config import ModelConfig
from jspec.models.llama import Transformer


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
