"""Drafters behind one protocol (:mod:`jspec.drafters.base`), one per file.

====================  ==========================================================
``PromptLookup``      prompt lookup (n-gram): the text's own earlier continuations
``DraftModel``        a separate small model with the target's tokenizer
``EagleDrafter``      an EAGLE-1 or EAGLE-3 head on the target's hidden states
``MedusaDrafter``     Medusa heads on the target's last hidden state
``LookaheadDecoding`` Jacobi iterations' n-grams, no second model (Lookahead decoding)
====================  ==========================================================

:func:`jspec.make_drafter` builds any of them from a method name and its options (:mod:`jspec.methods`).
"""

from jspec.drafters.base import ChainProposal, Context, Drafter, Feedback, Lookahead, TreeProposal, check_drafter
from jspec.drafters.draft_model import DraftModel
from jspec.drafters.eagle import EagleDrafter
from jspec.drafters.lookahead import LookaheadDecoding
from jspec.drafters.medusa import MedusaDrafter
from jspec.drafters.prompt_lookup import PromptLookup

__all__ = [
    "ChainProposal",
    "Context",
    "DraftModel",
    "Drafter",
    "EagleDrafter",
    "Feedback",
    "Lookahead",
    "LookaheadDecoding",
    "MedusaDrafter",
    "PromptLookup",
    "TreeProposal",
    "check_drafter",
]
