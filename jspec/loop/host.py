"""What the plain and the speculative decoders share on the host: one request's path from token lists to
a :class:`~jspec.loop.results.GenerationResult`."""

from __future__ import annotations

import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jspec.core.sampling import SamplingParams
from jspec.loop.batching import Batch, CompiledLoops, batch_inputs, compile_request, drive
from jspec.loop.results import GenerationResult
from jspec.loop.sharding import check_mesh, place_model, to_host


class HostDecoder:
    """A model placed once (on ``mesh``: :func:`jspec.loop.sharding.place_model`), each request checked
    and bucketed (:func:`jspec.loop.batching.batch_inputs`), its loop compiled once per bucket, run to the
    end and streamed to the request's own ``on_tokens``.

    A decoder says which jitted loop it runs (:meth:`loop_fn`), that loop's static part and arguments for
    a request (:meth:`request`), and what its final state reports (:meth:`result`).
    """

    def _place(self, model: nnx.Module, eos_ids, mesh: Mesh | None, max_position: int | None = None) -> None:
        config = getattr(model, "config", None)
        check_mesh(mesh, config)
        self.mesh = mesh
        self.graphdef, self.weights = place_model(mesh, model)
        if isinstance(eos_ids, int | np.integer):
            eos_ids = (eos_ids,)
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.max_position = max_position or getattr(config, "max_position", None)
        self.vocab_size = getattr(config, "vocab_size", None)
        self._compiled = CompiledLoops()

    def loop_fn(self):
        raise NotImplementedError

    def request(self, batch: Batch) -> tuple[object, tuple]:
        """(the loop's static part, its arguments) for ``batch``."""
        raise NotImplementedError

    def result(self, final, rows: int, compile_seconds: float, seconds: float) -> GenerationResult:
        """The result of the first ``rows`` rows of the final state (on the host)."""
        raise NotImplementedError

    def run(self, prompts, max_new_tokens: int, sampling: SamplingParams | None = None, seed: int = 0,
            on_tokens=None, pad_to: int | None = None):  # fmt: skip
        """(the loop's final state, compile seconds, run seconds), for tools reading its state;
        :meth:`generate` is the usual call."""
        batch = batch_inputs(prompts, max_new_tokens, self.vocab_size, self.max_position, self.mesh, sampling, seed,
                             on_tokens, pad_to)  # fmt: skip
        loop, args = self.request(batch)
        run, compile_s = compile_request(self._compiled, batch.rows, loop, self.loop_fn(), args, self.mesh, on_tokens)
        t0 = time.perf_counter()
        final = jax.block_until_ready(drive(run, args, on_tokens))
        return final, compile_s, time.perf_counter() - t0

    def generate(self, prompts, max_new_tokens: int, sampling: SamplingParams | None = None, seed: int = 0,
                 on_tokens=None, pad_to: int | None = None) -> GenerationResult:  # fmt: skip
        """Generates for a batch of prompts of any lengths.

        Args:
          prompts: token ids per row.
          max_new_tokens: the budget of every row.
          sampling: temperature/top-k/top-p (default greedy); scalars or per row.
          seed: PRNG seed.
          on_tokens: ``f(tokens, counts)`` called on the host after every step with each row's
            tokens so far (streaming: :func:`jspec.loop.batching.drive`); this request's alone.
          pad_to: size the loop for prompts of this many tokens or more (:func:`jspec.loop.batching.batch_inputs`).
        """
        final, compile_s, seconds = self.run(prompts, max_new_tokens, sampling, seed, on_tokens, pad_to)
        return self.result(to_host(final), len(prompts), compile_s, seconds)
