"""The cost profile of one machine: what a target forward over k tokens and each drafter's step cost.

Every speedup prediction divides expected tokens by these costs (``speedup = E / (r(N + 1) + c_N)``
with one plain decoding step as the unit), so they are measured on the machine that decodes:
a k-token forward after a warm cache of ``context`` tokens for k = 1 .. K, and each drafter's
``propose`` and ``commit`` as the engine calls them. All timed callables take turns round by
round after a warm-up round (drift in a shared machine's speed hits all of them alike), and
each cost is the median of its rounds.

A profile is cached as JSON under ``$JSPEC_CACHE/profiles``, keyed by model, backend, device
kind, dtype and batch bucket (:func:`profile_path`); :func:`load_profile` refuses a damaged or
foreign file with a message that names it, and never deletes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import pathlib
import re
import time
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec.core.sampling import SamplingParams
from jspec.drafters.base import Context, Feedback, check_drafter, merge_drafter, split_drafter
from jspec.files import write_text
from jspec.heads.eagle import DraftHead
from jspec.heads.formats import load_eagle
from jspec.loop.batching import bucket
from jspec.loop.decode import jit_forward, prefill
from jspec.loop.sharding import check_mesh, padded_rows, place_model, replicate
from jspec.methods import drafts, label_of, make_drafter, options_of, tuned_families
from jspec.models.hub import cache_root, shipped_head

__all__ = ["PROFILE_VERSION", "CostProfile", "drafter_cost", "ensure_profile", "forward_cost", "load_profile",
           "measure_profile", "prefill_cost", "profile_path", "save_profile", "weights_dtype"]  # fmt: skip

PROFILE_VERSION = 1


def _interleaved_medians(fns: Mapping[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median milliseconds of each callable: a warm-up round (compilation), then ``repeats``
    rounds in which every callable takes its turn."""
    times = {name: [] for name in fns}
    for i in range(repeats + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            if i:
                times[name].append(time.perf_counter() - t0)
    return {name: 1000 * float(np.median(t)) for name, t in times.items()}


def _forward_fns(model, max_k: int, context: int, batch: int, widths=None, mesh=None) -> dict[str, Callable]:
    """A k-token forward per k (1 .. ``max_k``, or ``widths``), each after ``context`` cached tokens per
    row (the cache is donated and rolled back after each call, so every call sees the same cache)."""
    state, forward = jit_forward(model, mesh)
    holder = {"cache": model.init_cache(batch, context + max_k).rollback(jnp.full((batch,), context, jnp.int32))}

    def make(k):
        tokens = jnp.full((batch, k), 5, jnp.int32)
        positions = jnp.broadcast_to(context + jnp.arange(k, dtype=jnp.int32), (batch, k))

        def run():
            logits, cache = forward(state, tokens, positions, holder["cache"])
            holder["cache"] = cache.rollback(jnp.full((batch,), context, jnp.int32))
            return logits

        return run

    return {f"forward:{k}": make(k) for k in (widths or range(1, max_k + 1))}


def forward_cost(model, max_k: int = 16, context: int = 256, repeats: int = 10, batch: int = 1,
                 widths=None) -> dict[int, float]:  # fmt: skip
    """Median milliseconds of a k-token forward (k = 1 .. ``max_k``, or the k in ``widths``) after
    ``context`` cached tokens."""
    ks = sorted(set(widths)) if widths else list(range(1, max_k + 1))
    ms = _interleaved_medians(_forward_fns(model, max(ks), context, batch, ks), repeats)
    return {k: ms[f"forward:{k}"] for k in ks}


def prefill_cost(model, prompt_len: int, capacity: int, repeats: int = 3, batch: int = 1) -> float:
    """Median milliseconds of the target's prefill of ``batch`` prompts padded to ``prompt_len`` into a
    cache of ``capacity`` slots: what every decoder pays once per call before its first step (at a
    large batch of long prompts it is most of a short generation's time)."""
    if capacity < prompt_len:
        raise ValueError(f"capacity {capacity} is smaller than the prompt length {prompt_len}.")
    graphdef, weights = place_model(None, model)
    tokens = jnp.full((batch, prompt_len), 5, jnp.int32)
    lengths = jnp.full((batch,), prompt_len, jnp.int32)
    run = jax.jit(lambda w, t, n: prefill(nnx.merge(graphdef, w), t, n, capacity).logits)
    return _interleaved_medians({"prefill": lambda: run(weights, tokens, lengths)}, repeats)["prefill"]


_CAPACITY_SLACK = 64  # cache slots past the context: any verify width and tree frontier in use


def _prefilled(target, context: int, batch: int, hidden_layers: tuple[int, ...], mesh=None):
    """(tokens int32[B, context], the target's hidden states over them at ``hidden_layers``)."""
    tokens = jax.random.randint(jax.random.PRNGKey(0), (batch, context), 0, target.config.vocab_size)
    lengths = jnp.full((batch,), context, jnp.int32)
    graphdef, weights = place_model(mesh, target)  # weights as an argument: closed over, they become constants

    def run(weights, tokens):
        return prefill(nnx.merge(graphdef, weights), tokens, lengths, context + _CAPACITY_SLACK, hidden_layers)

    return tokens, jax.jit(run)(weights, tokens).hidden_states


def _drafter_fns(target, drafter, context: int, batch: int, prefilled=None, mesh=None) -> dict[str, Callable]:
    """``propose`` and ``commit`` of one step, jitted, on ``context`` random committed tokens per row.

    ``prefilled``: :func:`_prefilled`'s output for the drafter's hidden layers (shared by drafters
    that read the same layers, so the target's prefill compiles once).
    """
    check_drafter(drafter)
    width = _verify_width(drafter)
    if width > _CAPACITY_SLACK // 2:
        raise ValueError(
            f"a step of {width} tokens is more than the profile measures (at most {_CAPACITY_SLACK // 2})."
        )
    greedy = SamplingParams.greedy()
    capacity = context + _CAPACITY_SLACK
    tokens, hidden_states = prefilled or _prefilled(target, context, batch, drafter.hidden_layers, mesh)
    lengths = jnp.full((batch,), context, jnp.int32)
    history = jnp.zeros((batch, capacity), jnp.int32).at[:, :context].set(tokens).at[:, context].set(7)
    ctx = Context(history, lengths + 1, lengths)
    treedef, leaves = split_drafter(drafter)
    leaves = replicate(mesh, leaves)

    def init(leaves, tokens, hidden):
        return merge_drafter(treedef, leaves).init(tokens, ctx, capacity, greedy, hidden)

    state = jax.jit(init)(leaves, tokens, hidden_states)
    n = drafter.num_draft
    hidden = tuple(jnp.broadcast_to(h[:, -1:], (batch, n + 1, h.shape[-1])) for h in hidden_states)
    after = Context(history, ctx.length + n, ctx.cache_length + n)
    accepted = jnp.full((batch,), n - 1, jnp.int32)
    extra = drafter.num_lookahead  # a window's logits to take in (Lookahead decoding)
    window = jnp.zeros((batch, extra, target.config.vocab_size), jnp.float32) if extra else None
    propose = jax.jit(lambda w, s, c: merge_drafter(treedef, w).propose(s, c, jax.random.PRNGKey(1), greedy))
    commit = jax.jit(lambda w, s, c, h, x: merge_drafter(treedef, w).commit(s, c, Feedback(accepted, h, x)))
    return {"propose": lambda: propose(leaves, state, ctx),
            "commit": lambda: commit(leaves, state, after, hidden, window)}  # fmt: skip


def drafter_cost(target, drafter, context: int = 256, repeats: int = 10, batch: int = 1) -> dict[str, float]:
    """Median milliseconds of one ``propose`` and one ``commit`` of ``drafter`` (all N drafts of a step)."""
    ms = _interleaved_medians(_drafter_fns(target, drafter, context, batch), repeats)
    return {"propose_ms": ms["propose"], "commit_ms": ms["commit"]}


def drafter_step_costs(target, drafter, context: int = 256, repeats: int = 10, batch: int = 1) -> dict[str, float]:
    """Median milliseconds of a plain one-token step (``step_ms``), of ``drafter``'s verify forward
    (``verify_ms``: N + 1 tokens, or a tree's nodes) and of its ``propose`` and ``commit``, all measured
    taking turns in one run, so that their ratios (r and c) hold on a busy machine."""
    width = _verify_width(drafter)
    fns = _forward_fns(target, width, context, batch, sorted({1, width})) | _drafter_fns(
        target, drafter, context, batch
    )
    ms = _interleaved_medians(fns, repeats)
    return {"step_ms": ms["forward:1"], "verify_ms": ms[f"forward:{width}"], "propose_ms": ms["propose"],
            "commit_ms": ms["commit"]}  # fmt: skip


@dataclasses.dataclass
class CostProfile:
    """What a step costs on one machine, for one model, dtype and batch bucket.

    Attributes:
      model: the target's registry name or folder.
      backend, device_kind, dtype: where and how it ran (``jax.default_backend()``, the first
        device's kind, the target's weight dtype).
      batch: the batch bucket measured (a power of two).
      context: tokens in the cache before each timed call.
      forward_ms: k -> milliseconds of a k-token target forward (k = 1 .. K).
      drafters: name -> {"propose_ms", "commit_ms"}; names like ``ngram:N=3``, ``eagle3:N=5``,
        ``eagle3:tree=dynamic:4:3:8``.
      seconds: how long measuring took, compilation included.
      created: when (UTC, ISO 8601); version: the profile format.
      mesh: ``"DxM"``, the data and model axes it ran over (:mod:`jspec.loop.sharding`); "" for one device.
    """

    model: str
    backend: str
    device_kind: str
    dtype: str
    batch: int
    context: int
    forward_ms: dict[int, float]
    drafters: dict[str, dict[str, float]]
    seconds: float = 0.0
    created: str = ""
    version: int = PROFILE_VERSION
    mesh: str = ""

    @property
    def step_ms(self) -> float:
        """One plain decoding step: the unit of every relative cost."""
        return self.forward_ms[1]

    def relative_forward(self, k: int) -> float:
        """r(k): a k-token forward over a one-token step."""
        if k not in self.forward_ms:
            raise ValueError(f"the profile measured forwards of {sorted(self.forward_ms)} tokens, not {k}; "
                             "re-measure with that width (jspec tune profile --force --max-k K).")  # fmt: skip
        return self.forward_ms[k] / self.step_ms

    def relative_drafter(self, name: str) -> float:
        """A drafter's propose and commit per step, in plain steps."""
        if name not in self.drafters:
            raise ValueError(f"the profile has no drafter {name!r}; it measured {sorted(self.drafters)}.")
        d = self.drafters[name]
        return (d["propose_ms"] + d["commit_ms"]) / self.step_ms

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"forward_ms": {str(k): v for k, v in self.forward_ms.items()}}

    @classmethod
    def from_json(cls, data: dict, source: str = "profile") -> CostProfile:
        """Refuses, with ``source`` named, anything that is not a complete profile of this format."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"mesh"}  # profiles from before meshes: one device
        if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION or not fields <= data.keys():
            missing = sorted(fields - set(data)) if isinstance(data, dict) else ["everything"]
            raise ValueError(f"{source} is not a jspec cost profile of version {PROFILE_VERSION} (missing or wrong: "
                             f"{missing or ['version']}); re-measure it (jspec tune profile --force).")  # fmt: skip
        try:
            forward = {int(k): float(v) for k, v in data["forward_ms"].items()}
            drafters = {
                str(n): {k: float(d[k]) for k in ("propose_ms", "commit_ms")} for n, d in data["drafters"].items()
            }
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(
                f"{source} has malformed costs ({err}); re-measure it (jspec tune profile --force)."
            ) from err
        if 1 not in forward or any(v <= 0 for v in forward.values()):
            raise ValueError(
                f"{source} lacks a positive one-token step cost; re-measure it (jspec tune profile --force)."
            )
        return cls(**(data | {"forward_ms": forward, "drafters": drafters}))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(text)).strip("_") or "unknown"


def profile_path(model: str, batch: int = 1, *, backend: str | None = None, device_kind: str | None = None,
                 dtype: str = "float32", root: pathlib.Path | None = None, mesh=None) -> pathlib.Path:  # fmt: skip
    """Where the profile of ``model`` at this batch bucket, backend, device kind, dtype (and mesh) is cached."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1; got {batch}.")
    if root is None:
        root = cache_root() / "profiles"
    backend = backend or jax.default_backend()
    device_kind = device_kind or jax.devices()[0].device_kind
    key = "__".join(_slug(x) for x in (model, backend, device_kind, dtype, f"b{bucket(batch, minimum=1)}"))
    key += f"__mesh{mesh_name(mesh)}" if mesh_name(mesh) else ""
    return pathlib.Path(root) / f"{key}.json"


def mesh_name(mesh) -> str:
    """``"DxM"`` for a ``("data", "model")`` mesh; "" for none."""
    return "" if mesh is None else "x".join(str(mesh.shape.get(a, 1)) for a in ("data", "model"))


def load_profile(path) -> CostProfile | None:
    """The profile cached at ``path``, None when there is none; a damaged file is refused (kept on disk)."""
    path = pathlib.Path(path)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is corrupt or truncated ({err}); re-measure it (jspec tune profile --force) "
                         "or delete it.") from err  # fmt: skip
    return CostProfile.from_json(data, str(path))


def weights_dtype(model) -> str:
    """The dtype of a model's weights, as a name (``float32``)."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return str(leaves[0].dtype) if leaves else "float32"


def measure_profile(target, model_name: str, drafters: Mapping[str, object] | None = None, *, batch: int = 1,
                    max_k: int = 8, context: int = 256, repeats: int = 7, mesh=None,
                    widths=None) -> CostProfile:  # fmt: skip
    """Measures a :class:`CostProfile`: forwards of 1..``max_k`` tokens (or of 1 and the ``widths``
    given: each width is a program to compile) and each drafter's step, all interleaved round by
    round after a warm-up round, at the batch bucket of ``batch`` (rounded up to a multiple of the
    mesh's data axis), over ``mesh`` when given."""

    if max_k < 1 or context < 1 or repeats < 1:
        raise ValueError(f"max_k, context and repeats must be >= 1; got {max_k}, {context}, {repeats}.")
    check_mesh(mesh, target.config)
    t0 = time.perf_counter()
    rows = padded_rows(mesh, bucket(batch, minimum=1))
    ks = sorted({1, *widths}) if widths else list(range(1, max_k + 1))
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        fns = _forward_fns(target, max(ks), context, rows, ks, mesh=mesh)
        prefilled = {}
        for name, drafter in (drafters or {}).items():
            layers = tuple(drafter.hidden_layers)
            if layers not in prefilled:
                prefilled[layers] = _prefilled(target, context, rows, layers, mesh)
            for part, fn in _drafter_fns(target, drafter, context, rows, prefilled[layers], mesh).items():
                fns[f"{name}|{part}"] = fn
        ms = _interleaved_medians(fns, repeats)
    forward = {k: ms[f"forward:{k}"] for k in ks}
    costs = {name: {"propose_ms": ms[f"{name}|propose"], "commit_ms": ms[f"{name}|commit"]} for name in drafters or {}}
    return CostProfile(
        model=model_name,
        backend=jax.default_backend(),
        device_kind=jax.devices()[0].device_kind,
        dtype=weights_dtype(target),
        batch=rows,
        context=context,
        forward_ms=forward,
        drafters=costs,
        seconds=time.perf_counter() - t0,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        mesh=mesh_name(mesh),
    )


def save_profile(profile: CostProfile, path) -> pathlib.Path:
    """Writes the profile atomically (a reader sees the old file or the new one, never half)."""
    return write_text(path, json.dumps(profile.to_json(), indent=1))


def ensure_profile(target, model_name: str, drafters: Mapping[str, object], *, batch: int = 1,
                   max_k: int | None = 8, force: bool = False,
                   mesh=None) -> tuple[CostProfile, pathlib.Path, bool]:  # fmt: skip
    """The cached profile when it covers ``drafters`` and forwards of 1..``max_k`` tokens and of
    every drafter's verify width (``max_k`` None: those widths alone, as a quick tune needs), else a
    new one measured and cached; returns (profile, its path, whether it was cached). A damaged
    cached file is refused (and kept), unless ``force``."""
    widths = {1, *(_verify_width(d) for d in drafters.values())} | set(range(1, (max_k or 0) + 1))
    path = profile_path(model_name, batch, dtype=weights_dtype(target), mesh=mesh)
    cached = None if force else load_profile(path)
    if cached is not None and set(drafters) <= set(cached.drafters) and widths <= set(cached.forward_ms):
        return cached, path, True
    profile = measure_profile(target, model_name, drafters, batch=batch, mesh=mesh, widths=widths)
    save_profile(profile, path)
    return profile, path, False


def profile_drafters(target, model_name: str, *, num_drafts=(1, 2, 3, 4, 5, 6, 7), trees=("dynamic",),
                     head=None, draft_model=None) -> dict[str, object]:  # fmt: skip
    """The drafters a profile measures, by name (:func:`jspec.methods.label_of`): every family the tuner
    tries (:func:`jspec.methods.tuned_families`: prompt lookup; the EAGLE head, ``head`` or the one shipped
    for ``model_name``, if any; the draft model, if given) at each N and each tree it drafts."""

    if head is None:
        try:
            head = shipped_head(model_name, "eagle3")
        except ValueError:  # no head ships for this model: nothing to measure
            head = None
    if head is not None:
        head = head if isinstance(head, DraftHead) else load_eagle(head, target)  # read once for every N and tree
    given = {"head": head, "draft_model": draft_model}
    drafters = {}
    for family in tuned_families(head=head, draft_model=draft_model):
        options = {k: v for k, v in given.items() if k in options_of(family)}
        for n in num_drafts:
            drafters[label_of(family, n)] = make_drafter(family, target, num_draft=n, **options)
        for tree in (t for t in trees if drafts(family, t)):
            drafters[label_of(family, tree=tree)] = make_drafter(family, target, tree=tree, **options)
    return drafters


def _verify_width(drafter) -> int:
    """The tokens of one verify forward: a tree's nodes, or N + 1, and any lookahead window."""
    return (drafter.num_nodes or drafter.num_draft + 1) + drafter.num_lookahead
