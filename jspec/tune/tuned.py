"""A tuned config: what ``jspec tune`` recommends for one model, machine and workload, as a file.

The recommendation is one :class:`Setting` (plain decoding, or a drafter with its N or tree, with
or without the adaptive fallback) per temperature band and batch size measured. ``--method auto``
reads it (:class:`jspec.tune.auto.AutoDecoder`); :func:`load_tuned` refuses a damaged file, another
format, or a config made for another model or vocabulary, naming the file and what is wrong.

Temperature bands (temperature-aware switching): greedy (T = 0), low (0 < T <= 0.7) and high
(T > 0.7). Acceptance falls as T rises, so one workload can want a drafter when greedy and plain
decoding when sampling hot.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import pathlib

import jax

from jspec.files import write_text
from jspec.loop.adaptive import Adaptive, StepCosts
from jspec.methods import TUNED, label_of, options_of, parse
from jspec.models.hub import cache_root
from jspec.tune.costs import _slug, mesh_name

__all__ = ["BANDS", "TUNED_VERSION", "Recommendation", "Setting", "TunedConfig", "band_of", "load_tuned",
           "save_tuned", "tuned_path"]  # fmt: skip

TUNED_VERSION = 1
BANDS = {"greedy": "T = 0", "low": "0 < T <= 0.7", "high": "T > 0.7"}
LOW_BAND_MAX = 0.7


def band_of(temperature: float) -> str:
    """The band of a temperature: "greedy", "low" or "high"."""
    t = float(temperature)
    if not t >= 0:
        raise ValueError(f"temperature must be >= 0; got {temperature}.")
    return "greedy" if t == 0 else "low" if t <= LOW_BAND_MAX else "high"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One way to decode: plain ("ar") or a drafter with N drafts or a tree, optionally adaptive.

    Attributes:
      method: a method the tuner measures (:data:`jspec.methods.TUNED`).
      num_draft: N for a chain (None for plain decoding and trees).
      tree: a tree as :func:`jspec.methods.parse_tree` reads it ("dynamic", "2,2,1"), or None.
      adaptive: fall back to plain steps where speculation does not pay (needs ``costs``).
      costs: (speculative, plain) step costs in plain steps for the adaptive policy
        (:class:`jspec.loop.adaptive.StepCosts`), from the machine's cost profile.
    """

    method: str
    num_draft: int | None = None
    tree: str | None = None
    adaptive: bool = False
    costs: tuple[float, float] | None = None

    def __post_init__(self):
        if self.method not in TUNED:
            raise ValueError(f"unknown method {self.method!r} for a tuned setting; the tuner chooses among "
                             f"{', '.join(TUNED)}.")  # fmt: skip
        if "num_draft" not in options_of(self.method):  # plain decoding
            if self.num_draft is not None or self.tree is not None or self.adaptive:
                raise ValueError(f"{self.method} takes no num_draft, tree or adaptive fallback.")
            return
        if (self.num_draft is None) == (self.tree is None):
            raise ValueError(f"{self.method} needs exactly one of num_draft (a chain) and tree; got "
                             f"num_draft={self.num_draft}, tree={self.tree!r}.")  # fmt: skip
        if self.num_draft is not None and (not isinstance(self.num_draft, int) or self.num_draft < 1):
            raise ValueError(f"num_draft must be a whole number >= 1; got {self.num_draft!r}.")
        if self.adaptive != (self.costs is not None):
            raise ValueError("an adaptive setting needs its step costs (speculative, plain), and only it has them.")
        if self.costs is not None and not (len(self.costs) == 2 and all(float(c) > 0 for c in self.costs)):
            raise ValueError(f"step costs must be two numbers > 0; got {self.costs!r}.")

    @property
    def shape(self) -> str:
        """The profile's name for this drafter and shape ("ngram:N=3", "eagle3:tree=dynamic"); "ar"."""
        return label_of(self.method, self.num_draft, self.tree)

    @property
    def name(self) -> str:
        return self.shape + ("+adaptive" if self.adaptive else "")

    def decoder(self, target, *, eos_ids=(), mesh=None, model_name: str | None = None, head=None, draft_model=None):
        """The decoder that runs this setting: its method's spec (:mod:`jspec.methods`) with the head or
        draft model where the method takes one, adaptive with its step costs when the setting is."""
        given = {"num_draft": self.num_draft, "tree": self.tree, "head": head, "draft_model": draft_model}
        spec = parse(self.method, **{k: v for k, v in given.items() if k in options_of(self.method)})
        adaptive = (Adaptive(), StepCosts.create(*self.costs)) if self.adaptive else (None, None)
        return spec.decoder(target, eos_ids=eos_ids, mesh=mesh, adaptive=adaptive[0], costs=adaptive[1],
                            model_name=model_name)  # fmt: skip

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"costs": list(self.costs) if self.costs else None}

    @classmethod
    def from_json(cls, data) -> Setting:
        if not isinstance(data, dict) or "method" not in data:
            raise ValueError(f"a setting is an object with a method; got {data!r}.")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"a setting has no fields {sorted(unknown)}.")
        costs = data.get("costs")
        return cls(**(data | {"costs": tuple(float(c) for c in costs) if costs else None}))


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """The setting to use in one temperature band at one batch size, with what was measured for it."""

    band: str
    batch: int
    setting: Setting
    temperature: float
    measured_speedup: float
    predicted_speedup: float
    speedup_interval: tuple[float, float] | None = None  # 95%, paired over the tuning prompts

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"setting": self.setting.to_json()}

    @classmethod
    def from_json(cls, data) -> Recommendation:
        if not isinstance(data, dict):
            raise ValueError(f"a recommendation is an object; got {data!r}.")
        missing = {f.name for f in dataclasses.fields(cls) if f.name != "speedup_interval"} - set(data)
        if missing:
            raise ValueError(f"a recommendation lacks {sorted(missing)}.")
        if data["band"] not in BANDS:
            raise ValueError(f"unknown temperature band {data['band']!r}; bands: {', '.join(BANDS)}.")
        if not isinstance(data["batch"], int) or data["batch"] < 1:
            raise ValueError(f"a recommendation's batch must be a whole number >= 1; got {data['batch']!r}.")
        interval = data.get("speedup_interval")  # configs tuned before intervals were measured lack it
        if interval is not None and (not isinstance(interval, list | tuple) or len(interval) != 2):
            raise ValueError(f"a recommendation's speedup_interval is [low, high]; got {interval!r}.")
        return cls(data["band"], data["batch"], Setting.from_json(data["setting"]), float(data["temperature"]),
                   float(data["measured_speedup"]), float(data["predicted_speedup"]),
                   None if interval is None else (float(interval[0]), float(interval[1])))  # fmt: skip


@dataclasses.dataclass
class TunedConfig:
    """``jspec tune``'s result for one model on one machine and workload.

    Attributes:
      model: the target's registry name or folder; vocab_size: its vocabulary (a config is refused
        for a model with another one).
      backend, device_kind, dtype: where it was measured.
      workload: the prompt set, category, skip, limit and max_new_tokens it ran.
      recommendations: one per (band, batch) measured.
      candidates: every candidate's prediction and measurement, per band and batch (the report).
      seconds, created, version: how long tuning took, when, and the file format.
    """

    model: str
    vocab_size: int
    backend: str
    device_kind: str
    dtype: str
    workload: dict
    recommendations: list[Recommendation]
    candidates: list[dict] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    created: str = dataclasses.field(
        default_factory=lambda: datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    )
    version: int = TUNED_VERSION

    def choose(self, temperature: float, batch: int = 1) -> Recommendation:
        """The recommendation for a temperature's band at the measured batch size nearest ``batch``.

        Raises:
          ValueError: the config measured nothing in that band.
        """
        band = band_of(temperature)
        options = [r for r in self.recommendations if r.band == band]
        if not options:
            have = ", ".join(sorted({BANDS[r.band] for r in self.recommendations})) or "none"
            raise ValueError(f"this tuned config for {self.model} has no samples for temperature {temperature} "
                             f"(band {BANDS[band]}; it measured {have}); tune again with a temperature in that band, "
                             f"e.g. jspec tune --model {self.model} --temperature {temperature} ...")  # fmt: skip

        return min(options, key=lambda r: (abs(math.log2(r.batch) - math.log2(max(batch, 1))), r.batch))

    def check_model(self, model: str | None, vocab_size: int | None = None, source: str = "tuned config") -> None:
        """Refuses a config made for another model (when ``model`` is given) or another vocabulary."""
        if vocab_size is not None and int(vocab_size) != self.vocab_size:
            raise ValueError(f"{source} was tuned for {self.model} (vocabulary {self.vocab_size}); this model has a "
                             f"vocabulary of {vocab_size}. Tune for this model: jspec tune --model ...")  # fmt: skip
        if model is not None and _same_model(model) != _same_model(self.model):
            raise ValueError(f"{source} was tuned for {self.model}, not {model}; tune for it: "
                             f"jspec tune --model {model} --prompts ...")  # fmt: skip

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"recommendations": [r.to_json() for r in self.recommendations]}

    @classmethod
    def from_json(cls, data, source: str = "tuned config") -> TunedConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        if (
            not isinstance(data, dict)
            or data.get("version") != TUNED_VERSION
            or not (fields - {"candidates"}) <= set(data)
        ):
            missing = sorted(fields - set(data)) if isinstance(data, dict) else ["everything"]
            raise ValueError(f"{source} is not a jspec tuned config of version {TUNED_VERSION} (missing or wrong: "
                             f"{missing or ['version']}); make one with jspec tune --out FILE.")  # fmt: skip
        try:
            recs = [Recommendation.from_json(r) for r in data["recommendations"]]
            if not isinstance(data["vocab_size"], int):
                raise ValueError(f"vocab_size must be a whole number; got {data['vocab_size']!r}")
        except (TypeError, ValueError, KeyError) as err:
            raise ValueError(f"{source} is malformed: {err}. Make it again with jspec tune.") from err
        if not recs:
            raise ValueError(f"{source} holds no recommendations; make it again with jspec tune.")
        return cls(**(data | {"recommendations": recs}))


def _same_model(name: str) -> str:
    path = pathlib.Path(name)
    return str(path.resolve()) if path.exists() else name


def tuned_path(model: str, *, backend: str | None = None, device_kind: str | None = None, dtype: str = "float32",
               workload: str | None = None, root: pathlib.Path | None = None, mesh=None) -> pathlib.Path:  # fmt: skip
    """Where ``jspec tune`` keeps its last config for a model on this machine (and ``mesh``): one per
    workload (``workload``: the prompt set and category) and ``latest`` (whatever was tuned last)."""

    if root is None:
        root = cache_root() / "tuned"
    backend = backend or jax.default_backend()
    device_kind = device_kind or jax.devices()[0].device_kind
    folder = "__".join(_slug(x) for x in (model, backend, device_kind, dtype))
    folder += f"__mesh{mesh_name(mesh)}" if mesh is not None else ""
    return pathlib.Path(root) / folder / f"{_slug(workload) if workload else 'latest'}.json"


def load_tuned(path, *, model: str | None = None, vocab_size: int | None = None) -> TunedConfig:
    """Reads a tuned config; refuses a missing, damaged or foreign file, or one for another model."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"no tuned config at {path}; make one with jspec tune --model M --prompts SET --out {path}.")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is corrupt or truncated ({err}); make it again with jspec tune.") from err
    config = TunedConfig.from_json(data, str(path))
    config.check_model(model, vocab_size, str(path))
    return config


def save_tuned(config: TunedConfig, path) -> pathlib.Path:
    """Writes atomically: a reader sees the old file or the new one, never half of one."""
    return write_text(path, json.dumps(config.to_json(), indent=1))
