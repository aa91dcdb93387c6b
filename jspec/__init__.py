"""jspec: exact speculative decoding in JAX."""

from jspec.sampling import SamplingParams, check_distribution, probs_from_logits, sample
from jspec.speedup import best_num_draft, expected_alpha, expected_tokens, speedup
from jspec.verify import (
    ChainVerdict,
    acceptance_probability,
    residual_distribution,
    verify_chain,
    verify_chain_batch,
)

__version__ = "0.1.0"

__all__ = [
    "ChainVerdict",
    "SamplingParams",
    "acceptance_probability",
    "best_num_draft",
    "check_distribution",
    "expected_alpha",
    "expected_tokens",
    "probs_from_logits",
    "residual_distribution",
    "sample",
    "speedup",
    "verify_chain",
    "verify_chain_batch",
]
