"""``--method auto``: the decoder that chooses how to decode each call from measurements.

With a tuned config (``jspec tune``), each call gets the setting recommended for its temperature
band and the batch size measured nearest its own: plain decoding where nothing won, else the
drafter, its N or tree, and the adaptive fallback if that measured fastest. Without one, it
speculates with the drafter that needs the fewest accepted drafts per step to pay on this
machine (from the cost profile, measured once and cached), with the adaptive fallback, which
decodes plainly where speculation does not pay. Each setting's loop compiles once, on first use.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import numpy as np

from jspec.drafters.base import DEFAULT_NUM_DRAFT
from jspec.loop.adaptive import StepCosts
from jspec.loop.batching import bucket
from jspec.models.hub import load_model, shipped_head
from jspec.tune.costs import load_profile, measure_profile, profile_drafters, profile_path, save_profile, weights_dtype
from jspec.tune.tuned import Setting, TunedConfig, load_tuned, tuned_path
from jspec.tune.workload import available_families

__all__ = ["AutoDecoder", "default_setting"]


def default_setting(profile, families, num_draft: int = DEFAULT_NUM_DRAFT) -> Setting:
    """Without a workload's acceptance: the family whose speculative step costs the fewest plain steps
    beyond its own plain step (the lowest break-even accepted drafts per step), N = ``num_draft``,
    with the adaptive fallback and the profile's step costs."""

    best = None
    for family in families:
        costs = StepCosts.from_profile(profile, f"{family}:N={num_draft}", num_draft + 1)
        spec, plain = costs.speculative.item(), costs.plain.item()
        if best is None or spec / plain < best[0]:
            best = (spec / plain, Setting(family, num_draft=num_draft, adaptive=True, costs=(spec, plain)))
    if best is None:
        raise ValueError("no drafter family to choose from.")
    return best[1]


def _merged(cached, measured):
    """``cached`` with what only ``measured`` holds, rescaled to the cached plain step: the policy reads
    costs relative to a plain step, so each run's own unit is kept."""
    scale = cached.step_ms / measured.step_ms
    forward = {k: ms * scale for k, ms in measured.forward_ms.items()} | cached.forward_ms
    drafters = {k: {m: ms * scale for m, ms in d.items()} for k, d in measured.drafters.items()} | cached.drafters
    return dataclasses.replace(cached, forward_ms=forward, drafters=drafters)


class AutoDecoder:
    """Chooses plain decoding or a drafter per call (temperature band, batch size), from measurements.

    Args:
      target: the target model.
      eos_ids: tokens that end a row.
      config: a :class:`jspec.tune.tuned.TunedConfig` or its file; None reads the one ``jspec tune``
        saved for ``model_name`` and ``workload`` on this machine, if any, else decides from the
        cost profile alone.
      model_name: the target's registry name or folder (the shipped head, the cached profile and
        tuned config are found by it).
      workload: the prompt set the config was tuned on ("mt-bench", "spec-bench:rag"); None: the
        config tuned last for the model.
      profile: a :class:`jspec.tune.CostProfile` for the no-config case (default: cached or measured).
      head, draft_model: the EAGLE head and the draft model, when not the ones the config names.
      mesh: as :class:`jspec.SpeculativeDecoder`.
    """

    def __init__(self, target, *, eos_ids=(), config=None, model_name: str | None = None,
                 workload: str | None = None, profile=None, head=None, draft_model=None, mesh=None):  # fmt: skip

        self.target, self.eos_ids, self.mesh = target, eos_ids, mesh
        self.model_name, self.profile = model_name, profile
        vocab = target.config.vocab_size
        if isinstance(config, str | pathlib.Path):
            config = load_tuned(config, model=model_name, vocab_size=vocab)
        elif isinstance(config, TunedConfig):
            config.check_model(model_name, vocab)
        elif config is None and model_name is not None:
            dtype = weights_dtype(target)
            for key in (workload, None):
                path = tuned_path(model_name, dtype=dtype, workload=key, mesh=mesh)
                if path.is_file():
                    config = load_tuned(path, model=model_name, vocab_size=vocab)
                    break
        elif config is not None:
            raise ValueError(f"config must be a TunedConfig, its file or None; got {type(config).__name__}.")
        self.config = config
        named = (config.workload if config else {}) or {}
        self.head = head if head is not None else named.get("head")
        self.draft_model = draft_model if draft_model is not None else named.get("draft_model")
        self._decoders: dict = {}
        self._default: dict[int, Setting] = {}

    @property
    def source(self) -> str:
        """Where the choices come from: the tuned config's workload, or the cost profile."""
        if self.config is None:
            return "cost profile (no tuned config)"
        w = self.config.workload
        return f"tuned config ({w.get('prompts')}{':' + w['category'] if w.get('category') else ''})"

    def choose(self, temperature: float, batch: int = 1) -> Setting:
        """The setting a call at this temperature and batch size runs."""
        if self.config is not None:
            return self.config.choose(temperature, batch).setting

        rows = bucket(batch, minimum=1)
        if rows not in self._default:
            families = available_families(head=self._head_for_default(), draft_model=self.draft_model)
            profile = self.profile if self.profile is not None and self.profile.batch == rows else None
            self._default[rows] = default_setting(profile or self._profile(rows, families), families)
        return self._default[rows]

    def _head_for_default(self):
        if self.head is not None:
            return self.head

        try:
            return shipped_head(self.model_name, "eagle3") if self.model_name else None
        except ValueError:
            return None

    def _profile(self, rows: int, families):
        name = self.model_name or "model"
        path = profile_path(name, rows, dtype=weights_dtype(self.target), mesh=self.mesh)
        wanted = {f"{f}:N={DEFAULT_NUM_DRAFT}" for f in families}
        cached = load_profile(path)
        if cached is not None and wanted <= set(cached.drafters) and DEFAULT_NUM_DRAFT + 1 in cached.forward_ms:
            return cached
        if cached is not None:  # made by the tuner or an experiment for other drafters: measure only what is missing
            wanted -= set(cached.drafters)
        print(f"auto: no cost profile of {name} at batch {rows} here; measuring one (once) ...", file=sys.stderr)
        draft = self.draft_model
        if isinstance(draft, str):
            draft = load_model(draft)[0]
        drafters = profile_drafters(self.target, name, num_drafts=(DEFAULT_NUM_DRAFT,), trees=(), head=self.head,
                                    draft_model=draft)  # fmt: skip
        drafters = {k: v for k, v in drafters.items() if k in wanted}
        profile = measure_profile(
            self.target, name, drafters, batch=rows, widths=(DEFAULT_NUM_DRAFT + 1,), mesh=self.mesh
        )  # a plain step and a verify step: what default_setting reads
        if cached is not None:
            profile = _merged(cached, profile)
        if self.model_name is not None:  # kept, so that the next process reads it instead of measuring again
            save_profile(profile, path)
        return profile

    def decoder_for(self, setting: Setting):
        """The (cached) decoder that runs ``setting``."""
        if setting not in self._decoders:
            self._decoders[setting] = setting.decoder(self.target, eos_ids=self.eos_ids, mesh=self.mesh,
                                                      model_name=self.model_name, head=self.head,
                                                      draft_model=self.draft_model)  # fmt: skip
        return self._decoders[setting]

    def generate(self, prompts, max_new_tokens: int, sampling=None, seed: int = 0, on_tokens=None, pad_to=None):
        """As :meth:`jspec.SpeculativeDecoder.generate`; the result's ``setting`` names what ran. Rows
        with different temperatures run the setting of the hottest (acceptance falls as T rises)."""
        temperature = 0.0 if sampling is None else float(np.max(np.asarray(sampling.temperature)))
        setting = self.choose(temperature, len(prompts))
        result = self.decoder_for(setting).generate(prompts, max_new_tokens, sampling, seed=seed, on_tokens=on_tokens,
                                                    pad_to=pad_to)  # fmt: skip
        result.setting = setting.name
        return result
