"""The user's own conversations as training data: ShareGPT and OpenAI chat JSONL files, or Hugging
Face datasets (a ``save_to_disk`` folder, or a dataset by name from the local cache or the Hub).

A row is one conversation, in either of the two formats people have:

- ShareGPT: ``{"conversations": [{"from": "system" | "human" | "gpt", "value": "..."}, ...]}``
- OpenAI chat: ``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}``
  (``content`` a string, or a list of ``{"type": "text", "text": ...}`` parts).

Each conversation is rendered with the target's chat template, as at inference, and tokenized;
the loss mask covers the assistant's turns (their text and the template's end of turn), found
by rendering the conversation turn by turn. Rows that cannot be used (invalid JSON, an unknown
role, a turn with other fields (tool calls, names, weights), an empty turn, no assistant turn,
longer than ``seq_len`` tokens after templating, a template that refuses them or does not render
turn by turn) are counted and skipped; one line names the file and the first offending line
numbers per reason; a file with no usable row is refused.

The result is stored as token ids and masks (3 bytes a token for a vocabulary under 65,536),
content-addressed by the file's SHA-256, the tokenizer, the chat template and ``seq_len``, under
``$JSPEC_CACHE/data/conversations``: a second run never tokenizes the file again.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import pathlib
import zipfile

import numpy as np
from jinja2 import TemplateError

from jspec.files import atomic_write
from jspec.models.hub import cache_root

__all__ = [
    "Conversations", "DatasetName", "load_conversations", "parse_row", "read_rows", "regenerate",
    "tokenize_conversation",
]  # fmt: skip

FORMAT = 1  # raise when what is stored for a file changes
ROLES = {
    "conversations": ("from", "value", {"system": "system", "human": "user", "gpt": "assistant"}),
    "messages": ("role", "content", {"system": "system", "user": "user", "assistant": "assistant"}),
}
_SHOWN = 5  # line numbers shown per reason


@dataclasses.dataclass
class Conversations:
    """Tokenized conversations of one file.

    Attributes:
      ids: per conversation, int32 token ids (chat-templated).
      masks: per conversation, bool: the tokens the loss is taken on (the assistant's).
      skipped: reason -> line (or dataset row) numbers, 1-based, of the rows left out.
      source: the file; sha256: its content hash.
    """

    ids: list[np.ndarray]
    masks: list[np.ndarray]
    skipped: dict[str, list[int]]
    source: str
    sha256: str
    unit: str = "line"  # what the numbers count: JSONL lines, or a dataset's rows

    def summary(self) -> str:
        """One line: what was kept, and per reason how many rows were skipped and the first lines."""
        line = f"{self.source}: {len(self.ids)} conversations kept ({sum(int(m.sum()) for m in self.masks)} " \
               f"assistant tokens)"  # fmt: skip
        if self.skipped:
            parts = [f"{reason}: {len(lines)} ({self.unit}{'s' if len(lines) > 1 else ''} "
                     f"{', '.join(map(str, lines[:_SHOWN]))}{', ...' if len(lines) > _SHOWN else ''})"
                     for reason, lines in self.skipped.items()]  # fmt: skip
            line += f"; {sum(len(v) for v in self.skipped.values())} skipped: " + "; ".join(parts)
        return line


def _text(content):
    """A message's text: a string, or OpenAI's list of text parts; None for anything else."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else [None]
    if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        return "".join(p["text"] for p in parts)
    return None


def parse_row(row) -> list[dict] | str:
    """One JSON row as ``[{"role", "content"}, ...]``, or the reason it cannot be used."""
    if not isinstance(row, dict):
        return "not a JSON object"
    found = [key for key in ROLES if row.get(key) is not None]  # a dataset's missing column reads as None
    if len(found) != 1:
        return "neither 'conversations' (ShareGPT) nor 'messages' (OpenAI chat)" if not found else "both formats"
    role_key, text_key, roles = ROLES[found[0]]
    turns = row[found[0]]
    if not isinstance(turns, list) or not turns:
        return f"'{found[0]}' is not a non-empty list"
    out = []
    for turn in turns:
        if not isinstance(turn, dict):
            return "a turn that is not an object"
        extra = sorted(k for k in set(turn) - {role_key, text_key} if turn[k] is not None)
        if extra:  # tool calls, names, weights: each would change what is trained on, and none is read
            return f"a turn with fields jspec does not read ({', '.join(map(repr, extra))})"
        role = turn.get(role_key)
        if role not in roles:
            return f"unknown role {role!r}" if isinstance(role, str) else f"a turn without '{role_key}'"
        text = _text(turn.get(text_key))
        if text is None:
            return f"a turn whose '{text_key}' is not text"
        if not text.strip():
            return "an empty turn"
        out.append({"role": roles[role], "content": text})
    if not any(m["role"] == "assistant" for m in out):
        return "no assistant turn"
    return out


@dataclasses.dataclass(frozen=True)
class DatasetName:
    """A dataset by its Hub name: ``NAME`` or ``NAME:SPLIT`` (the ``train`` split by default), read as
    ``datasets.load_dataset(NAME, split=SPLIT)`` finds it: from the local ``datasets`` cache
    (``HF_DATASETS_CACHE``), else downloaded, unless ``HF_HUB_OFFLINE=1`` or ``HF_DATASETS_OFFLINE=1``
    keep it to the cache. A dataset with several configurations is refused (save the one you mean
    with ``save_to_disk`` and pass its folder to ``--data-file``)."""

    spec: str

    def __post_init__(self):
        name, _, split = self.spec.partition(":")
        if not name or name.count("/") > 1 or (":" in self.spec and not split):
            raise ValueError(f"--dataset {self.spec!r}: give a Hub name, NAME or NAME:SPLIT "
                             "(e.g. HuggingFaceH4/ultrachat_200k:train_sft).")  # fmt: skip

    @property
    def name(self) -> str:
        return self.spec.partition(":")[0]

    @property
    def split(self) -> str:
        return self.spec.partition(":")[2] or "train"

    def __str__(self) -> str:
        return self.spec

    @functools.cached_property
    def dataset(self):
        """:meth:`open`'s dataset, loaded once (hashing and reading share it)."""
        return self.open()

    def open(self):
        """The split as a ``datasets.Dataset`` backed by its cache files."""
        datasets = _datasets_package(f"--dataset {self}")
        try:
            ds = datasets.load_dataset(self.name, split=self.split)
        except Exception as err:  # datasets raises a dozen kinds here, each the user's to read
            offline = " (offline: only the local cache was read)" if datasets.config.HF_HUB_OFFLINE else ""
            raise ValueError(f"--dataset {self}: datasets could not load it{offline}: {type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''}") from err  # fmt: skip
        if not ds.cache_files:
            raise ValueError(f"--dataset {self} has no cache files to address it by; save it with save_to_disk "
                             "and pass the folder to --data-file.")  # fmt: skip
        return ds


def read_rows(path) -> tuple[list[tuple[int, list[dict]]], dict[str, list[int]]]:
    """(usable rows as (line number, messages), reason -> line numbers of the others); blank lines
    skipped. A folder is a Hugging Face ``datasets`` folder (``save_to_disk``), a :class:`DatasetName`
    a dataset by name; their rows are numbered from 1."""
    rows, skipped = [], collections.defaultdict(list)
    for number, parsed in _parsed(path if isinstance(path, DatasetName) else pathlib.Path(path)):
        if isinstance(parsed, str):
            skipped[parsed].append(number)
        else:
            rows.append((number, parsed))
    return rows, dict(skipped)


def _parsed(path):
    if isinstance(path, DatasetName) or path.is_dir():
        for number, row in enumerate(path.dataset if isinstance(path, DatasetName) else _dataset(path), 1):
            yield number, parse_row(row)
        return
    with open(path, encoding="utf-8", errors="strict") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield number, parse_row(json.loads(line))
                except json.JSONDecodeError:
                    yield number, "invalid JSON"


def _datasets_package(what: str):
    try:
        import datasets  # optional: the jspec[datasets] extra
    except ImportError as err:
        raise ValueError(f"{what}: reading a Hugging Face dataset needs the datasets package "
                         "(pip install 'jspec[datasets]').") from err  # fmt: skip
    return datasets


def _dataset(folder: pathlib.Path):
    """A ``datasets`` folder's rows (its ``train`` split when it holds several)."""
    datasets = _datasets_package(f"--data-file {folder} is a folder (a dataset saved with save_to_disk)")
    try:
        ds = datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(f"--data-file {folder} is not a dataset saved with save_to_disk ({err}).") from err
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"--data-file {folder} holds the splits {sorted(ds)} and no 'train'; save the split to "
                             "train on alone.")  # fmt: skip
        ds = ds["train"]
    return iter(ds)


def _content_hash(path) -> str:
    """SHA-256 of a file, of a folder's files (names and bytes, in name order), or of a named dataset's
    split (its name and its cache files' bytes)."""
    if isinstance(path, DatasetName):
        files = [pathlib.Path(f["filename"]) for f in path.dataset.cache_files]
        return _files_hash({f"{path.split}/{i}": f for i, f in enumerate(files)})
    if not path.is_dir():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    return _files_hash({f.relative_to(path).as_posix(): f for f in sorted(p for p in path.rglob("*") if p.is_file())})


def _files_hash(files: dict[str, pathlib.Path]) -> str:
    h = hashlib.sha256()
    for name, f in files.items():
        h.update(name.encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def tokenize_conversation(tokenizer, messages: list[dict], seq_len: int) -> tuple[np.ndarray, np.ndarray] | str:
    """(token ids, mask over the assistant's tokens) of one conversation templated as at inference,
    or the reason it cannot be used.

    Turn i of the assistant covers the tokens between the conversation rendered up to turn i with
    the generation prompt (the assistant header) and rendered through turn i: its text and the
    template's end of turn. Both renderings must be prefixes of the whole one in tokens; a template
    that rewrites earlier turns (or merges tokens across a turn's edge) is refused for that row.
    """

    try:
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=False))
        if len(ids) > seq_len:
            return "longer than --seq-len after templating"
        mask = np.zeros(len(ids), bool)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = tokenizer.encode(tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True))
            through = tokenizer.encode(tokenizer.apply_chat_template(messages[: i + 1], add_generation_prompt=False))
            if ids[: len(before)] != before or ids[: len(through)] != through or len(through) <= len(before):
                return "the chat template does not render it turn by turn"
            mask[len(before) : len(through)] = True
    except (ValueError, TypeError, TemplateError) as err:  # the template's own raise_exception, or jinja's
        return f"the chat template refused it ({str(err).splitlines()[0][:80]})"
    return np.asarray(ids, np.int32), mask


def regenerate(decoder, tokenizer, conversations: list[list[dict]], seq_len: int, *, batch_size: int = 8,
               max_new_tokens: int | None = None, sampling=None, seed: int = 0) -> list[list[dict] | None]:  # fmt: skip
    """The conversations with every assistant turn rewritten by the target (the EAGLE-3 practice: the
    head learns the target's own continuations), turn by turn, each from the conversation so far
    (earlier turns already rewritten), with the user's turns kept. A turn ends at the target's end of
    sequence, after ``max_new_tokens``, or where the conversation would pass ``seq_len`` tokens; a
    conversation with no room
    left for a turn keeps its remaining turns out (it ends after its last rewritten one); one with no
    room for its first is None (the list stays aligned with ``conversations``).

    ``decoder``: a :class:`jspec.loop.decode.Decoder` of the target with its end-of-sequence ids.
    """
    out = [list(c) for c in conversations]
    longest = max((sum(m["role"] == "assistant" for m in c) for c in out), default=0)
    for turn in range(longest):
        todo = []  # (conversation, message index, prompt ids)
        for c, msgs in enumerate(out):
            where = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
            if turn < len(where):
                i = where[turn]
                ids = tokenizer.encode(tokenizer.apply_chat_template(msgs[:i], add_generation_prompt=True))
                if len(ids) < seq_len:
                    todo.append((c, i, ids))
                else:
                    out[c] = msgs[:i]  # no room: the conversation ends before this turn
        todo.sort(key=lambda t: len(t[2]))  # similar lengths together: one long prompt does not cut the rest
        for start in range(0, len(todo), batch_size):
            part = todo[start : start + batch_size]
            budget = min(seq_len - max(len(t[2]) for t in part), max_new_tokens or seq_len)
            result = decoder.generate([t[2] for t in part], budget, sampling, seed=seed + turn * 100_003 + start)
            for (c, i, _), tokens in zip(part, result.tokens, strict=True):
                if tokens and tokens[-1] in decoder.eos_ids:  # the template writes the end of turn itself
                    tokens = tokens[:-1]
                out[c][i] = {"role": "assistant", "content": tokenizer.decode(tokens)}
    return [c if any(m["role"] == "assistant" for m in c) else None for c in out]


def _tokenizer_key(tokenizer) -> str:
    inner = getattr(tokenizer, "tokenizer", None)
    text = inner.to_str() if hasattr(inner, "to_str") else repr(tokenizer)
    return hashlib.sha256(f"{text}\0{getattr(tokenizer, 'chat_template', None)}".encode()).hexdigest()


def _cache_path(sha: str, tokenizer, seq_len: int, root: pathlib.Path | None, how: str = "") -> pathlib.Path:
    if root is None:
        root = cache_root() / "data" / "conversations"
    key = f"{FORMAT}\0{sha}\0{_tokenizer_key(tokenizer)}\0{seq_len}\0{how}"
    key = hashlib.sha256(key.encode()).hexdigest()[:24]
    return pathlib.Path(root) / f"{key}.npz"


def load_conversations(path, tokenizer, seq_len: int, *, root=None, rewrite=None,
                       rewrite_key: str = "") -> Conversations:  # fmt: skip
    """The conversations of ``path`` (a JSONL file, a ``save_to_disk`` folder or a :class:`DatasetName`)
    tokenized for ``tokenizer`` within ``seq_len`` tokens, read back from
    the store when this file (by content), tokenizer, template and ``seq_len`` (and ``rewrite_key``)
    were seen before.

    ``rewrite``: ``f(list of conversations) -> list of conversations`` applied to the usable rows
    before tokenizing (:func:`regenerate`); ``rewrite_key`` names what it does (the target, the
    sampling, the seed): part of the stored form's key.

    Raises ValueError naming the file when it is missing, not UTF-8, or has no usable row, and when
    its stored form is damaged (delete that file to tokenize again).
    """
    named = isinstance(path, DatasetName)
    path = path if named else pathlib.Path(path)
    flag, unit = ("--dataset", "row") if named else ("--data-file", "row" if path.is_dir() else "line")
    if not named and not path.exists():
        raise ValueError(f"--data-file {path}: no such file.")
    sha = _content_hash(path)
    stored = _cache_path(sha, tokenizer, seq_len, root, rewrite_key if rewrite else "")
    if stored.exists():
        return _read_stored(stored, str(path), sha, unit)
    try:
        rows, skipped = read_rows(path)
    except UnicodeDecodeError as err:
        raise ValueError(f"--data-file {path} is not UTF-8 text ({err}); save it as UTF-8 JSONL.") from err
    ids, masks = [], []
    if rewrite is not None and rows:
        numbers = [n for n, _ in rows]
        rewritten = rewrite([m for _, m in rows])
        dropped = [n for n, m in zip(numbers, rewritten, strict=True) if m is None]
        if dropped:
            skipped["no room for an assistant turn within --seq-len"] = dropped
        rows = [(n, m) for n, m in zip(numbers, rewritten, strict=True) if m is not None]
    for number, messages in rows:
        got = tokenize_conversation(tokenizer, messages, seq_len)
        if isinstance(got, str):
            skipped.setdefault(got.replace("--seq-len", f"--seq-len {seq_len}"), []).append(number)
        else:
            ids.append(got[0])
            masks.append(got[1])
    skipped = {reason: sorted(lines) for reason, lines in skipped.items()}
    data = Conversations(ids, masks, skipped, str(path), sha, unit)
    if not ids:
        raise ValueError(f"{flag} {path} has no usable conversation ({data.summary().split('; ', 1)[-1]}); "
                         "rows are ShareGPT {'conversations': [{'from', 'value'}]} or OpenAI chat "
                         "{'messages': [{'role', 'content'}]} with an assistant turn.")  # fmt: skip
    _write_stored(stored, data)
    return data


def _write_stored(stored: pathlib.Path, data: Conversations) -> None:
    lengths = np.asarray([len(i) for i in data.ids], np.int64)
    flat = np.concatenate(data.ids)
    dtype = np.uint16 if flat.max(initial=0) < 2**16 else np.int32
    meta = json.dumps({"format": FORMAT, "sha256": data.sha256, "skipped": data.skipped})
    stored.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(stored) as tmp, open(tmp, "wb") as f:
        np.savez(f, ids=flat.astype(dtype), mask=np.concatenate(data.masks), lengths=lengths, meta=np.asarray(meta))


def _read_stored(stored: pathlib.Path, source: str, sha: str, unit: str) -> Conversations:
    try:
        with np.load(stored) as z:
            flat, mask, lengths, meta = z["ids"], z["mask"], z["lengths"], json.loads(str(z["meta"]))
        if meta.get("format") != FORMAT or meta.get("sha256") != sha or not len(flat) == len(mask) == lengths.sum():
            raise ValueError("its contents do not match its name")
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(f"{stored} (the tokenized {source}) is damaged ({err}); delete it and run again "
                         "(the file is tokenized afresh).") from err  # fmt: skip
    cuts = np.cumsum(lengths)[:-1]
    ids = [a.astype(np.int32) for a in np.split(flat, cuts)]
    return Conversations(ids, list(np.split(mask.astype(bool), cuts)), meta["skipped"], source, sha, unit)
