"""Text in, text out: a model, its tokenizer and a drafter behind one call.

>>> import jspec
>>> spec = jspec.Speculator("smollm2-135m", drafter="eagle3")            # doctest: +SKIP
>>> out = spec.generate(["Why is the sky blue?"], chat=True)              # doctest: +SKIP
>>> out.texts[0], out.stats["tau"], out.stats["tokens_per_s"]              # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses

from jspec.decode import Decoder
from jspec.drafters.factory import check_options, make_drafter
from jspec.engine import SpeculativeDecoder
from jspec.results import GenerationResult
from jspec.sampling import SamplingParams

__all__ = ["Completions", "Speculator", "make_decoder"]


def make_decoder(method: str, target, *, eos_ids: tuple[int, ...] = (), mesh=None, adaptive=None, costs=None,
                 **options):  # fmt: skip
    """A :class:`jspec.Decoder` for "ar"; a :class:`jspec.AutoDecoder` for "auto" (``options``: its
    keyword arguments: ``config``, ``model_name``, ``workload``, ``head``, ``draft_model``); else a
    :class:`jspec.SpeculativeDecoder` over :func:`jspec.make_drafter`'s drafter (``options`` are its
    keyword arguments), adaptive when ``adaptive`` and ``costs`` are given."""
    if method == "auto":
        if adaptive is not None or costs is not None:
            raise ValueError("method 'auto' chooses its own adaptive policy; pass no adaptive= or costs=.")
        allowed = {"config", "model_name", "workload", "profile", "head", "draft_model"}
        if set(options) - allowed:
            raise ValueError(f"method 'auto' takes {sorted(allowed)}; got {sorted(set(options) - allowed)} too "
                             "(it chooses N and the tree itself).")  # fmt: skip
        from jspec.auto import AutoDecoder

        return AutoDecoder(target, eos_ids=eos_ids, mesh=mesh, **options)
    if method == "ar":
        check_options([method])
        if adaptive is not None or costs is not None:
            raise ValueError("plain decoding (ar) has no adaptive policy; pass no adaptive= or costs=.")
        return Decoder(target, eos_ids=eos_ids, mesh=mesh)
    drafter = make_drafter(method, target, **options)
    return SpeculativeDecoder(target, drafter, eos_ids=eos_ids, mesh=mesh, adaptive=adaptive, costs=costs)


@dataclasses.dataclass
class Completions:
    """What :meth:`Speculator.generate` returns.

    Attributes:
      texts: the decoded completion of each prompt.
      tokens: the generated ids of each prompt (end-of-sequence included when hit).
      prompt_tokens: the prompts' lengths in tokens, after any chat template.
      result: the run's :class:`jspec.results.GenerationResult` (timings, τ, acceptance).
    """

    texts: list[str]
    tokens: list[list[int]]
    prompt_tokens: list[int]
    result: GenerationResult

    @property
    def stats(self) -> dict:
        return self.result.stats()


class Speculator:
    """A model and its tokenizer with a drafter: ``generate`` takes and returns text.

    Args:
      model: a local Hugging Face folder, a registry name (``"smollm2-135m"``) or a Hub id
        (``"ORG/NAME[@REVISION]"``), loaded with :func:`jspec.load_model`, or a loaded target model
        (then pass ``tokenizer``).
      tokenizer: the model's tokenizer, when ``model`` is a loaded model.
      drafter: a method name (``"eagle3"``, ``"eagle1"``, ``"ngram"``, ``"draft"``; ``"ar"`` or None
        for plain decoding; ``"auto"``: what measured fastest, :class:`jspec.AutoDecoder`, with
        ``config=`` a tuned config) built by :func:`jspec.make_decoder` with ``drafter_options``, or a drafter.
      model_name: the model's registry name, when ``model`` is a loaded model and the method
        should use the head shipped for it.
      mesh: a ``("data", "model")`` mesh (:func:`jspec.sharding.make_mesh`): rows over ``data``, the
        target's weights and KV cache over ``model`` (:mod:`jspec.sharding`).
      drafter_options: :func:`jspec.make_drafter`'s keyword arguments (``num_draft``, ``tree``,
        ``head``, ``draft_model``, ``ngram_min``, ``ngram_max``); for "auto", :class:`jspec.AutoDecoder`'s
        (``config``, ``workload``, ``head``, ``draft_model``).
    """

    def __init__(self, model, tokenizer=None, *, drafter="eagle3", model_name: str | None = None, mesh=None,
                 **drafter_options):  # fmt: skip
        if isinstance(model, str):
            from jspec.models.hub import load_model

            model_name = model_name or model
            model, loaded_tokenizer = load_model(model)
            tokenizer = tokenizer or loaded_tokenizer
        if tokenizer is None:
            raise ValueError("pass the model's tokenizer (load_model returns both), or a registry name as model.")
        self.model, self.tokenizer = model, tokenizer
        eos = tuple(tokenizer.eos_token_ids)
        if drafter is None or isinstance(drafter, str):
            method = drafter or "ar"
            if method == "ar" and drafter_options:
                raise ValueError(f"plain decoding takes no drafter options; got {sorted(drafter_options)}.")
            self.decoder = make_decoder(method, model, eos_ids=eos, mesh=mesh, model_name=model_name, **drafter_options)
        else:
            if drafter_options:
                raise ValueError(f"drafter options {sorted(drafter_options)} are for a method name; this drafter "
                                 "is built already.")  # fmt: skip
            self.decoder = SpeculativeDecoder(model, drafter, eos_ids=eos, mesh=mesh)
        self.method = "ar" if isinstance(self.decoder, Decoder) else (drafter if isinstance(drafter, str) else "custom")

    def generate(self, prompts, *, max_new_tokens: int = 64, chat: bool = False, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> Completions:  # fmt: skip
        """Completes each prompt (a string, or a list of strings: one batch).

        Args:
          chat: wrap each prompt in the model's chat template as a user turn.
          temperature: 0 is greedy; top_k 0 and top_p 1 keep every token.
          seed: the request's PRNG seed.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError("prompts must be a string or a non-empty list of strings; for token ids use "
                             "jspec.Decoder or jspec.SpeculativeDecoder.")  # fmt: skip
        if chat:
            prompts = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        ids = [self.tokenizer.encode(p) for p in prompts]
        sampling = SamplingParams.create(temperature, top_k, top_p)
        result = self.decoder.generate(ids, max_new_tokens, sampling, seed=seed)
        texts = [self.tokenizer.decode(t) for t in result.tokens]
        return Completions(texts, result.tokens, [len(i) for i in ids], result)
