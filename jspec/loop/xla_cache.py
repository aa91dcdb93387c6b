"""JAX's persistent compilation cache for jspec's loops: on by default, one folder, one-line warnings."""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile
import warnings
from collections.abc import Callable

import jax

from jspec.models.hub import cache_root

__all__ = ["CACHE_BYTES", "enable_compilation_cache"]

_CACHE_CHECKED = [False]
CACHE_BYTES = 2 * 1024**3  # the cap; a SmolLM2 program takes 0.5-1.2 MB (the whole fresh-cache demo: 27 MB)
_OFF = ("0", "off", "false", "no")


def enable_compilation_cache(force: bool = False) -> pathlib.Path | None:
    """Keeps compiled loops on disk, so that a second process finds them instead of compiling again
    (a warm ``jspec generate`` reads its loops back instead of compiling them).

    On by default: every loop's first compilation calls it (once per process). The folder is
    ``$JSPEC_CACHE/xla``; ``JSPEC_XLA_CACHE`` set to a folder uses that one, and to ``0`` turns the
    cache off (the test suite does, so that what a test compiles never depends on earlier runs). A
    folder chosen with ``jax.config.update("jax_compilation_cache_dir", ...)`` before is kept.
    A folder that cannot be written is skipped with a one-line warning; an unreadable or foreign
    entry is compiled afresh (JAX checks every entry's key) with a one-line warning. Returns the
    folder in use, or None. The folder is capped at :data:`CACHE_BYTES`.
    """
    if _CACHE_CHECKED[0] and not force:
        current = jax.config.jax_compilation_cache_dir
        return pathlib.Path(current) if current else None
    _CACHE_CHECKED[0] = True
    current = jax.config.jax_compilation_cache_dir
    if current and not force:
        return pathlib.Path(current)  # the user's own choice
    setting = os.environ.get("JSPEC_XLA_CACHE", "1").strip()
    if setting.lower() in _OFF:
        return None

    folder = cache_root() / "xla" if setting.lower() in ("", "1", "on", "true", "yes") else pathlib.Path(setting)
    try:  # JAX would warn at every write; one line here, and no cache
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".writable-"):
            pass
    except OSError as err:
        print(f"jspec: warning: the compilation cache folder {folder} cannot be written ({err.strerror or err}); "
              "compiling without it (JSPEC_XLA_CACHE=<folder> picks another, JSPEC_XLA_CACHE=0 turns it off).",
              file=sys.stderr)  # fmt: skip
        return None
    warnings.formatwarning = _one_line_cache_warnings(warnings.formatwarning)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    jax.config.update("jax_compilation_cache_max_size", CACHE_BYTES)  # least recently used entries go first
    return folder


def _one_line_cache_warnings(default: Callable) -> Callable:
    """JAX's warning about a cache entry it could not read or write, as one line."""
    if getattr(default, "jspec_cache_lines", False):
        return default

    def formatwarning(message, category, filename, lineno, line=None):
        text = str(message)
        if "persistent compilation cache" in text:
            return f"jspec: warning: {text.splitlines()[0]} (compiled afresh)\n"
        return default(message, category, filename, lineno, line)

    formatwarning.jspec_cache_lines = True
    return formatwarning
