"""The whole recipe of a trained head: data made once by the target, the draft vocabulary, the head,
training with checkpoints, the saved head."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import sys
import time

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from tqdm import tqdm

from jspec.core.sampling import SamplingParams
from jspec.files import write_text
from jspec.heads.eagle import KINDS, DraftHead, HeadConfig, draft_vocabulary, load_head, save_head
from jspec.heads.medusa import MedusaConfig, MedusaHeads, save_medusa
from jspec.loop.decode import Decoder
from jspec.training.conversations import DatasetName, load_conversations, regenerate
from jspec.training.data import (
    generate_examples,
    load_shards,
    self_instruct_prompts,
    sequence_examples,
    stdlib_prompts,
    write_shards,
)
from jspec.training.medusa import rank_rates
from jspec.training.run_record import check_same_run
from jspec.training.trainer import TrainConfig, Trainer

__all__ = ["PROMPT_SOURCES", "Recipe", "load_extra_data", "prepare_data", "train_head"]


PROMPT_SOURCES = {
    "stdlib": "Python standard library docstrings and sources (jspec.training.data.stdlib_prompts)",
    "self": "written by the target from its chat template (jspec.training.data.self_instruct_prompts, Magpie)",
}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything that decides a trained head besides the target: data, head and training options."""

    kind: str = "eagle3"
    prompt_source: str = "stdlib"  # "stdlib" (standard-library docs) or "self" (written by the target)
    num_prompts: int = 2000
    seq_len: int = 256
    max_new_tokens: int = 192
    gen_batch: int = 16
    gen_temperature: float = 0.0
    draft_vocab: int = 8192
    feature_layers: tuple[int, ...] | None = None
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    init_from: str | None = None  # a saved head to start from (its draft vocabulary is kept)
    warm_start: bool = False  # a new head starts from the target's weights (DraftHead.warm_start)
    data_files: tuple[str, ...] = ()  # the user's conversations (JSONL), trained on instead of prompts
    datasets: tuple[str, ...] = ()  # and datasets by Hub name, NAME[:SPLIT] (conversations.DatasetName)
    regenerate: bool = False  # the target rewrites the data files' assistant turns first (max_new_tokens each)
    features: str = "stored"  # "stored": the target's features kept per token; "online": made in each step

    def __post_init__(self):
        if self.kind not in (*KINDS, "medusa"):
            raise ValueError(f"unknown head kind {self.kind!r}; choose from {', '.join((*KINDS, 'medusa'))}.")
        if self.kind == "medusa" and (self.init_from or self.warm_start):
            raise ValueError("Medusa heads start at zero (each repeats the target); init_from and warm_start are "
                             "for EAGLE heads.")  # fmt: skip
        if self.prompt_source not in PROMPT_SOURCES:
            raise ValueError(f"unknown prompt source {self.prompt_source!r}; choose from {', '.join(PROMPT_SOURCES)}.")
        if self.features not in ("stored", "online"):
            raise ValueError(f"features must be 'stored' or 'online'; got {self.features!r}.")
        if self.features == "online" and self.kind == "medusa":
            raise ValueError("features='online' is implemented for EAGLE heads; Medusa heads train on stored "
                             "features (--features stored).")  # fmt: skip
        if self.regenerate and not (self.data_files or self.datasets):
            raise ValueError("regenerate rewrites the data files' assistant turns; it needs data_files (--data-file) "
                             "or datasets (--dataset).")  # fmt: skip
        if self.init_from and self.warm_start:
            raise ValueError("a recipe starts from a saved head (init_from) or from the target (warm_start), not both.")

    @classmethod
    def tiny(cls, kind: str = "eagle3") -> Recipe:
        """Small enough for tests and notebooks (8 prompts, 12 steps); the head it makes is not useful.
        (``train.num_steps``: TTT steps for EAGLE-3; for Medusa, the number of heads.)"""
        steps = {"eagle3": 2, "eagle1": 1, "medusa": 3}.get(kind, 1)
        train = TrainConfig(num_steps=steps, batch_size=4, total_steps=12, warmup_steps=2,
                            checkpoint_every=4, learning_rate=1e-3)  # fmt: skip
        return cls(kind, num_prompts=8, seq_len=128, max_new_tokens=24, gen_batch=8, draft_vocab=512, train=train)


def prepare_data(target, tokenizer, recipe: Recipe, folder: pathlib.Path, model_name: str, bars=None) -> dict:
    """The training set in ``folder``: loaded when a complete one made by the same recipe is there, else made.

    ``bars``: a factory ``(description, total) -> progress callback or None``, called when each stage starts.
    """
    layers = HeadConfig.for_target(target.config, "eagle3", 1, recipe.feature_layers).feature_layers
    want = {"model": model_name, "prompt_source": recipe.prompt_source, "feature_layers": list(layers),
            "num_prompts": recipe.num_prompts, "seq_len": recipe.seq_len, "max_new_tokens": recipe.max_new_tokens,
            "gen_temperature": recipe.gen_temperature}  # fmt: skip
    if recipe.prompt_source == "self":  # the seed picks which prompts the target writes
        want["prompt_seed"] = recipe.train.seed
    stored = None if recipe.features == "online" else layers  # online: ids and masks only
    conversations = []
    if recipe.data_files or recipe.datasets:  # the files' contents, not their names, decide the data
        rewrite, how = None, ""
        if recipe.regenerate:
            decoder = Decoder(target, eos_ids=tokenizer.eos_token_ids)
            sampling = SamplingParams.create(recipe.gen_temperature)
            rewrite = lambda convs: regenerate(decoder, tokenizer, convs, recipe.seq_len,  # noqa: E731
                                               batch_size=recipe.gen_batch, max_new_tokens=recipe.max_new_tokens,
                                               sampling=sampling, seed=recipe.train.seed)  # fmt: skip
            how = f"regenerated by {model_name} T={recipe.gen_temperature} max_new={recipe.max_new_tokens} " \
                  f"seed={recipe.train.seed}"  # fmt: skip
        conversations = [load_conversations(f, tokenizer, recipe.seq_len, rewrite=rewrite, rewrite_key=how)
                         for f in (*recipe.data_files, *map(DatasetName, recipe.datasets))]  # fmt: skip
        for c in conversations:
            print(c.summary(), file=sys.stderr)
        want = {k: v for k, v in want.items() if k in ("model", "feature_layers", "seq_len")}
        want["data_files"] = [c.sha256 for c in conversations]
        if recipe.regenerate:
            want["regenerated"] = how
    if recipe.features == "online":
        want["features"] = "online"
    defaults = {"prompt_source": "stdlib", "prompt_seed": 0}  # data sets written before these were recorded
    folder = pathlib.Path(folder)
    if (folder / "meta.json").exists():
        data, meta = load_shards(folder)
        if {k: meta.get(k, defaults.get(k)) for k in want} == want:
            return data
        raise ValueError(f"{folder} holds data made by another recipe ({meta}); choose another data folder.")
    t0 = time.perf_counter()
    if conversations:
        ids = [i for c in conversations for i in c.ids]
        data = sequence_examples(target, ids, [m for c in conversations for m in c.masks], stored,
                                 seq_len=recipe.seq_len, batch_size=recipe.gen_batch,
                                 progress=bars and bars("target features", len(ids)))  # fmt: skip
        sources = [{"file": c.source, "sha256": c.sha256, "conversations": len(c.ids), "skipped": c.skipped}
                   for c in conversations]  # fmt: skip
        write_shards(data, folder, want | {"sources": sources, "seconds": time.perf_counter() - t0})
        return data
    work = _unfinished_work(folder, want | {"gen_batch": recipe.gen_batch})
    if recipe.prompt_source == "self":  # short user turns (<= 64 tokens): every one leaves room for a response
        if (work / "prompts.json").exists():
            prompts = json.loads((work / "prompts.json").read_text())
        else:
            prompts = self_instruct_prompts(target, tokenizer, recipe.num_prompts, seed=recipe.train.seed,
                                            progress=bars and bars("writing prompts", recipe.num_prompts))  # fmt: skip
            write_text(work / "prompts.json", json.dumps(prompts))
    else:
        prompts = stdlib_prompts()
    data = generate_examples(target, tokenizer, prompts, stored, seq_len=recipe.seq_len,
                             max_new_tokens=recipe.max_new_tokens, batch_size=recipe.gen_batch,
                             temperature=recipe.gen_temperature, limit=recipe.num_prompts,
                             progress=bars and bars("generating responses", recipe.num_prompts),
                             resume_dir=work)  # fmt: skip
    meta = want | {"prompts": PROMPT_SOURCES[recipe.prompt_source], "seconds": time.perf_counter() - t0}
    write_shards(data, folder, meta)
    shutil.rmtree(work, ignore_errors=True)
    return data


def _unfinished_work(folder: pathlib.Path, want: dict) -> pathlib.Path:
    """``FOLDER/.unfinished``: what a killed run of the same recipe finished (its prompts, its batches),
    made if absent. Work of another recipe is refused, not thrown away."""
    work = folder / ".unfinished"
    recorded = work / "recipe.json"
    if recorded.exists():
        had = json.loads(recorded.read_text())
        if had != want:
            raise ValueError(f"{work} holds the unfinished data of another recipe ({had}); choose another data "
                             "folder, or delete that folder to start this recipe's data there.")  # fmt: skip
        done = len(list(work.glob("batch_*.npz")))
        print(f"resuming the data in {folder}: {done} batch(es) of {want['gen_batch']} prompts already made",
              file=sys.stderr)  # fmt: skip
    else:
        write_text(recorded, json.dumps(want))
    return work


def load_extra_data(folders, data: dict, meta_keys: dict) -> tuple[dict, list[dict]]:
    """``data`` joined with the prepared data sets in ``folders`` (made by earlier runs for the same
    model, feature layers and sequence length; refused otherwise). Returns (data, their metas)."""
    parts, metas = [data], []
    for folder in folders:
        extra, meta = load_shards(pathlib.Path(folder))
        wrong = {k: meta.get(k) for k, v in meta_keys.items() if meta.get(k) != v}
        if wrong:
            raise ValueError(
                f"extra data set {folder} was made for {wrong}, not {meta_keys}; it cannot join this data."
            )
        parts.append(extra)
        metas.append({k: v for k, v in meta.items() if k != "shards"} | {"folder": str(folder)})
    keys = [k for k in ("tokens", "mask", "features", "top") if k in data]
    if any(set(keys) - set(p) for p in parts):
        raise ValueError("an extra data set without the target's features cannot join stored-features data; "
                         "train with --features online, or make that data set with stored features.")  # fmt: skip
    joined = {k: np.concatenate([p[k] for p in parts]) for k in keys}
    joined["counts"] = sum(p["counts"] for p in parts)
    return joined, metas


def train_head(target, tokenizer, recipe: Recipe, out_dir, *, model_name: str, data_dir=None, extra_data=(),
               progress: bool = True, until: int | None = None, mesh=None) -> tuple[DraftHead, dict]:  # fmt: skip
    """Data (made once), draft vocabulary, head, training with checkpoints (resumed when present), saved head.

    Args:
      extra_data: folders of data sets prepared by earlier runs, trained on beside ``data_dir``'s.
      mesh: train over this ``("data", "model")`` mesh (:meth:`Trainer.shard`). Over several processes
        (``jax.distributed``) process 0 makes the data and saves the head; every process trains.

    Returns the head and a report: data size, per-step loss and accuracy at the end, seconds.
    """
    out_dir = pathlib.Path(out_dir)
    data_dir = pathlib.Path(data_dir) if data_dir else out_dir / "data"
    bar = _progress_bar(progress)
    t0 = time.perf_counter()
    first = jax.process_index() == 0
    if first:  # over several processes the first one makes the data; the others read it when it is there
        data = prepare_data(target, tokenizer, recipe, data_dir, model_name, bars=bar)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jspec train: data ready")
        if not first:
            data = prepare_data(target, tokenizer, recipe, data_dir, model_name)
    data_seconds = time.perf_counter() - t0
    if recipe.kind == "medusa":  # the data's top layer only; the target's whole vocabulary (tied output)
        layers = HeadConfig.for_target(target.config, "eagle3", 1, recipe.feature_layers).feature_layers
        same = {"model": model_name, "feature_layers": list(layers), "seq_len": recipe.seq_len}
        data, extra_metas = load_extra_data(extra_data, data, same)
        held = max(1, len(data["tokens"]) // 20)  # held out: the rank rates a measured tree is chosen from
        heldout = {k: data[k][-held:] for k in ("tokens", "mask", "top")}
        data = {k: v if k == "counts" else v[:-held] for k, v in data.items()}
        head = MedusaHeads(MedusaConfig.for_target(target.config, recipe.train.num_steps), rngs=nnx.Rngs(0))
        head.attach_target(target)
        d2t = np.arange(target.config.vocab_size)
        trainer = Trainer.for_medusa(head, recipe.train, out_dir / "checkpoints")
    else:
        head, d2t, extra_metas, data = _eagle_head(target, recipe, data, extra_data, model_name)
        trainer = Trainer.for_target(head, target, recipe.train, out_dir / "checkpoints")
        if recipe.features == "online":
            trainer.features_online(target, head.config.feature_layers)
    _check_tokens(data, target.config.vocab_size, data_dir, extra_data)
    check_same_run(out_dir / "checkpoints", recipe, data, model_name)  # every process: each refuses (no one waits)
    if mesh is not None:
        trainer.shard(mesh)
    resumed_from = trainer.step if trainer.restore() else None
    if resumed_from is not None:
        print(f"resuming training at step {resumed_from} of {recipe.train.total_steps} from {out_dir / 'checkpoints'} "
              f"(data: {data_dir}, {len(data['tokens'])} examples)", file=sys.stderr)  # fmt: skip
    t1 = time.perf_counter()
    tick = bar("training", recipe.train.total_steps, start=trainer.step)
    history = trainer.fit(data, until=until, progress=tick, log_every=1)
    head = trainer.head()
    covered = float(data["counts"][d2t].sum() / max(data["counts"].sum(), 1))
    report = {
        "examples": len(data["tokens"]),
        "response_tokens": int(data["mask"].sum()),
        "extra_data": extra_metas,
        "draft_vocab_coverage": covered,
        "data_seconds": data_seconds,
        "train_seconds": time.perf_counter() - t1,
        "tokens_per_s": (trainer.step - (resumed_from or 0))
        * recipe.train.batch_size
        * recipe.train.accumulate
        * recipe.seq_len
        / max(time.perf_counter() - t1, 1e-9),
        "resumed_from": resumed_from,
        "steps": trainer.step,
        "final": history[-1] if history else None,
        "step_seconds": [row["seconds"] for row in history],  # each step's wall time, the first compiling
    }
    if recipe.kind == "medusa" and trainer.step >= recipe.train.total_steps:
        report["held_out_examples"] = len(heldout["tokens"])
        report["rank_rates"] = np.round(rank_rates(head, heldout), 5).tolist()
    if trainer.step >= recipe.train.total_steps and first:
        recipe_dict = dataclasses.asdict(recipe) | {"model": model_name}
        save = save_medusa if recipe.kind == "medusa" else save_head
        save(head, out_dir, recipe=recipe_dict | {"report": report})
    return head, report


def _check_tokens(data: dict, vocab_size: int, data_dir, extra_data) -> None:
    """Refuses data holding token ids the target does not have (made for another tokenizer)."""
    top = int(data["tokens"].max(initial=0))
    if top >= vocab_size:
        folders = ", ".join(map(str, [data_dir, *extra_data]))
        raise ValueError(f"the training data ({folders}) holds token id {top}, past this target's vocabulary of "
                         f"{vocab_size}: it was made for another tokenizer. Make the data for this model.")  # fmt: skip


def _eagle_head(target, recipe: Recipe, data: dict, extra_data, model_name: str):
    """(a new or fine-tuned EAGLE head, its draft vocabulary map, the extra data sets' metas, the joined data)."""
    config = HeadConfig.for_target(target.config, recipe.kind, recipe.draft_vocab, recipe.feature_layers)
    same = {"model": model_name, "feature_layers": list(config.feature_layers), "seq_len": recipe.seq_len}
    data, extra_metas = load_extra_data(extra_data, data, same)
    if recipe.init_from:  # fine-tuning keeps the starting head's draft vocabulary
        head = load_head(recipe.init_from, target)
        if head.config != config:
            raise ValueError(f"the head to start from, {recipe.init_from}, was made as {head.config}, not {config}; "
                             "match the kind, draft vocabulary and feature layers to it.")  # fmt: skip
        d2t = np.asarray(head.d2t[...])
    else:
        d2t = draft_vocabulary(data["counts"], recipe.draft_vocab)
        head = DraftHead(config, rngs=nnx.Rngs(recipe.train.seed))
        head.attach_target(target, d2t)
        if recipe.warm_start:
            head.warm_start(target)
    return head, d2t, extra_metas, data


def _progress_bar(enabled: bool):
    """A factory of progress callbacks: tqdm bars on stderr, or nothing."""

    def make(desc, total, start=0):
        if not enabled:
            return None

        bar = tqdm(total=total, initial=start, desc=desc, leave=False)
        state = {"n": start}

        def update(n, info):
            bar.update(n - state["n"])
            state["n"] = n
            if isinstance(info, dict):
                loss = " ".join(f"{x:.2f}" for x in info["loss"])
                acc = " ".join(f"{x:.2f}" for x in info["acc"])
                speed = f" {info['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in info else ""
                bar.set_postfix_str(f"loss/step [{loss}] acc/step [{acc}]{speed}")
            if n >= total:
                bar.close()

        return update

    return make
