"""Text in, text out: a model, its tokenizer and a drafter behind one call.

>>> import jspec
>>> spec = jspec.Speculator("smollm2-135m", drafter="eagle3")            # doctest: +SKIP
>>> out = spec.generate(["Why is the sky blue?"], chat=True)              # doctest: +SKIP
>>> out.texts[0], out.stats["tau"], out.stats["tokens_per_s"]              # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses

from jspec.core.sampling import SamplingParams
from jspec.loop.decode import Decoder
from jspec.loop.engine import SpeculativeDecoder
from jspec.loop.results import GenerationResult
from jspec.methods import AutoSpec, parse
from jspec.models.hub import load_model
from jspec.tune.auto import AutoDecoder

__all__ = ["Completions", "Speculator", "make_decoder"]


def make_decoder(method, target, *, eos_ids: tuple[int, ...] = (), mesh=None, adaptive=None, costs=None,
                 model_name: str | None = None, **options):  # fmt: skip
    """The decoder of a method (a name with ``options``, or a :mod:`jspec.methods` spec): a
    :class:`jspec.Decoder` for "ar", a :class:`jspec.AutoDecoder` for "auto" (options ``config``,
    ``workload``, ``profile``, ``head``, ``draft_model``), else a :class:`jspec.SpeculativeDecoder` over
    the method's drafter, adaptive when ``adaptive`` and ``costs`` are given. ``model_name``: the
    target's registry name or folder (the shipped head, auto's profile and tuned config)."""
    spec = parse(method, **options)
    if not isinstance(spec, AutoSpec):
        return spec.decoder(target, eos_ids=eos_ids, mesh=mesh, adaptive=adaptive, costs=costs, model_name=model_name)
    if adaptive is not None or costs is not None:
        raise ValueError("method 'auto' chooses its own adaptive policy; pass no adaptive= or costs=.")
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    return AutoDecoder(target, eos_ids=eos_ids, mesh=mesh, model_name=model_name, **fields)


@dataclasses.dataclass
class Completions:
    """What :meth:`Speculator.generate` returns.

    Attributes:
      texts: the decoded completion of each prompt.
      tokens: the generated ids of each prompt (end-of-sequence included when hit).
      prompt_tokens: the prompts' lengths in tokens, after any chat template.
      result: the run's :class:`jspec.loop.results.GenerationResult` (timings, τ, acceptance).
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
      mesh: a ``("data", "model")`` mesh (:func:`jspec.loop.sharding.make_mesh`): rows over ``data``, the
        target's weights and KV cache over ``model`` (:mod:`jspec.loop.sharding`).
      drafter_options: the method's options (:mod:`jspec.methods`: ``num_draft``, ``tree``, ``head``,
        ``draft_model``, ``ngram_min``, ``ngram_max``, Lookahead's ``window``...; for "auto" ``config``,
        ``workload``, ``head``, ``draft_model``); one the method does not take is refused by name.
    """

    def __init__(self, model, tokenizer=None, *, drafter="eagle3", model_name: str | None = None, mesh=None,
                 **drafter_options):  # fmt: skip
        if isinstance(model, str):
            model_name = model_name or model
            model, loaded_tokenizer = load_model(model)
            tokenizer = tokenizer or loaded_tokenizer
        if tokenizer is None:
            raise ValueError("pass the model's tokenizer (load_model returns both), or a registry name as model.")
        self.model, self.tokenizer = model, tokenizer
        eos = tuple(tokenizer.eos_token_ids)
        if drafter is None or isinstance(drafter, str):
            self.decoder = make_decoder(drafter or "ar", model, eos_ids=eos, mesh=mesh, model_name=model_name,
                                        **drafter_options)  # fmt: skip
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
