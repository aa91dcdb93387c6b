"""jspec: exact speculative decoding in JAX.

The usual entry points::

    import jspec

    spec = jspec.Speculator("smollm2-135m", drafter="eagle3")        # text in, text out
    out = spec.generate(["Why is the sky blue?"], chat=True)

    model, tokenizer = jspec.load_model("smollm2-135m")              # token ids in, token ids out
    drafter = jspec.make_drafter("ngram", model, num_draft=4)
    result = jspec.SpeculativeDecoder(model, drafter, eos_ids=tokenizer.eos_token_ids).generate([ids], 64)

    auto = jspec.Speculator("smollm2-135m", drafter="auto", config="tuned.json")  # from `jspec tune --out`

The math (verification, speedup) is exported too. ``jspec.models`` (the ``models/`` folder of
the repository, installed under jspec's name) holds the target model families and loaders.
"""

from jspec.analysis.speedup import best_num_draft, expected_alpha, expected_tokens, speedup
from jspec.api import Completions, Speculator, make_decoder
from jspec.core.sampling import SamplingParams, check_distribution, probs_from_logits, sample
from jspec.core.tree import DynamicTreeSpec, StaticTree
from jspec.core.verify import (
    ChainVerdict,
    acceptance_probability,
    residual_distribution,
    verify_chain,
    verify_chain_batch,
    verify_chain_batch_logits,
    verify_chain_logits,
)
from jspec.drafters import Drafter, DraftModel, EagleDrafter, PromptLookup
from jspec.loop.decode import Decoder
from jspec.loop.engine import SpeculativeDecoder
from jspec.loop.results import GenerationResult
from jspec.methods import make_drafter
from jspec.models.hub import load_model as _load
from jspec.tune.auto import AutoDecoder
from jspec.tune.tuned import Setting, TunedConfig, load_tuned

__version__ = "0.1.0"


def load_model(name_or_path: str, *, layer_loop: str | None = None, dtype=None):
    """(model, tokenizer) for a local Hugging Face folder (Llama 2/3.x, Qwen2, Qwen3, Gemma 3), a registry
    name (fetched, SHA-256 verified, converted once) or a Hub id ``ORG/NAME[@REVISION]`` (its config,
    tokenizer and safetensors downloaded into the Hub's cache), tried in that order; ``dtype`` "float32" or "bfloat16"
    (default: float32 on CPU, bfloat16 on an accelerator); see :func:`jspec.models.hub.load_model`."""

    return _load(name_or_path, layer_loop=layer_loop, dtype=dtype)


__all__ = [
    "AutoDecoder",
    "ChainVerdict",
    "Completions",
    "Decoder",
    "DraftModel",
    "Drafter",
    "DynamicTreeSpec",
    "EagleDrafter",
    "GenerationResult",
    "PromptLookup",
    "SamplingParams",
    "Setting",
    "SpeculativeDecoder",
    "Speculator",
    "StaticTree",
    "TunedConfig",
    "acceptance_probability",
    "best_num_draft",
    "check_distribution",
    "expected_alpha",
    "expected_tokens",
    "load_model",
    "load_tuned",
    "make_decoder",
    "make_drafter",
    "probs_from_logits",
    "residual_distribution",
    "sample",
    "speedup",
    "verify_chain",
    "verify_chain_batch",
    "verify_chain_batch_logits",
    "verify_chain_logits",
]
