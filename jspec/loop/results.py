"""One statistics structure for every generation result and every benchmark entry.

Plain decoding is the case with no drafts: τ (tokens per row per target forward
after prefill) is 1, and there is no acceptance to report. Benchmarks sum
results with :meth:`GenerationResult.total` and report :meth:`GenerationResult.stats`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["GenerationResult", "acceptance_by_position"]


def acceptance_by_position(accept_hist) -> list[float]:
    """Per draft position i, the fraction of rows that reached i whose draft i was accepted.

    Args:
      accept_hist: [N + 1] counts of verify rows by number of drafts accepted.
    """
    hist = np.asarray(accept_hist)
    reached = hist[::-1].cumsum()[::-1]  # rows with at least i accepted
    return [float(reached[i + 1] / reached[i]) if reached[i] else 0.0 for i in range(len(hist) - 1)]


@dataclasses.dataclass
class GenerationResult:
    """Host-side result of one batch, plain or speculative.

    Attributes:
      tokens: per row, the generated ids (end-of-sequence included when hit).
      seconds: wall time of the run, compilation excluded.
      compile_seconds: time spent compiling for this call (0 when cached).
      target_calls: target forwards, prefill included.
      num_draft: N, the most drafts one step can accept (0 for plain decoding).
      verify_steps: target forwards over drafts.
      plain_steps: one-token steps (plain decoding, or no row had a draft).
      emitted_in_verify: tokens emitted by verify steps (live rows).
      live_row_steps: the sum over verify steps of live rows.
      accept_hist: [N + 1] live verify rows by number of drafts accepted.
      cache_lengths: target tokens committed per row at the end (speculative runs).
      fallback_steps: plain steps an adaptive loop chose over speculating (in ``plain_steps`` too).
      setting: what ran, when a decoder chose it (``--method auto``: "ar", "ngram:N=4+adaptive", ...).
      drafts_verified: the live rows' drafts verified, summed over verify steps (chains: N per row
        and step, fewer where a row's count or an adaptive draft length cut the chain).
    """

    tokens: list[list[int]]
    seconds: float
    compile_seconds: float
    target_calls: int
    num_draft: int = 0
    verify_steps: int = 0
    plain_steps: int = 0
    emitted_in_verify: int = 0
    live_row_steps: int = 0
    accept_hist: list[int] = dataclasses.field(default_factory=list)
    cache_lengths: list[int] = dataclasses.field(default_factory=list)
    fallback_steps: int = 0
    setting: str | None = None
    drafts_verified: int = 0

    def __post_init__(self):
        broken = [i for i, row in enumerate(self.tokens) if any(t < 0 for t in row)]
        if broken:
            raise ValueError(
                f"the model produced NaN or infinite logits (rows {broken}): the output is not valid text, so "
                "none is returned. Check the weights (a damaged or mis-converted file) and the dtype "
                "(float16 overflows; use float32 or bfloat16)."
            )

    @property
    def speculative(self) -> bool:
        return self.num_draft > 0

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("inf")

    @property
    def tau(self) -> float:
        """Tokens emitted per row per verify forward, the bonus token counted (1 for plain decoding)."""
        if not self.speculative:
            return 1.0
        return self.emitted_in_verify / self.live_row_steps if self.live_row_steps else 0.0

    def acceptance_by_position(self) -> list[float]:
        return acceptance_by_position(self.accept_hist) if self.accept_hist else []

    def stats(self) -> dict:
        out = {
            "new_tokens": self.new_tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens_per_s if self.seconds > 0 else 0.0,
            "compile_seconds": self.compile_seconds,
            "target_calls": self.target_calls,
            "tau": self.tau,
        }
        if self.setting is not None:
            out["setting"] = self.setting
        if self.speculative:
            out |= {
                "acceptance_by_position": self.acceptance_by_position(),
                "verify_steps": self.verify_steps,
                "plain_steps": self.plain_steps,
                "emitted_in_verify": self.emitted_in_verify,
                "live_row_steps": self.live_row_steps,
                "fallback_steps": self.fallback_steps,
                "num_draft": self.num_draft,
                "drafts_per_verify": self.drafts_verified / self.live_row_steps if self.live_row_steps else 0.0,
            }
        return out

    @classmethod
    def total(cls, results: Sequence[GenerationResult]) -> GenerationResult:
        """The runs of one decoder summed (rows joined, times and counts added)."""
        if not results:
            raise ValueError("no results to sum.")
        hists = [np.asarray(r.accept_hist) for r in results if r.accept_hist]
        return cls(
            tokens=[row for r in results for row in r.tokens],
            seconds=sum(r.seconds for r in results),
            compile_seconds=sum(r.compile_seconds for r in results),
            target_calls=sum(r.target_calls for r in results),
            num_draft=max(r.num_draft for r in results),
            verify_steps=sum(r.verify_steps for r in results),
            plain_steps=sum(r.plain_steps for r in results),
            emitted_in_verify=sum(r.emitted_in_verify for r in results),
            live_row_steps=sum(r.live_row_steps for r in results),
            accept_hist=np.sum(hists, axis=0).tolist() if hists else [],
            cache_lengths=[n for r in results for n in r.cache_lengths],
            fallback_steps=sum(r.fallback_steps for r in results),
            setting=" / ".join(dict.fromkeys(r.setting for r in results if r.setting)) or None,
            drafts_verified=sum(r.drafts_verified for r in results),
        )
