"""The persistent compilation cache: loops are kept and found again, a bad entry or folder costs a warning."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

# A process per round (within one, JAX finds a program it compiled in memory, never on disk): a
# plain and a speculative loop, the cache's hits counted by JAX's own monitoring events.
ROUNDS = r"""
import json, pathlib, sys
import jax
from jax import monitoring
hits = []
monitoring.register_event_listener(lambda event, **_: hits.append(event) if event.endswith("cache_hits") else None)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # the tiny loops compile in < 1 s
sys.path.insert(0, "tests")
from jspec.models.tiny import tiny_model
from jspec.loop.xla_cache import enable_compilation_cache
from jspec.loop.decode import Decoder
from jspec.drafters import PromptLookup
from jspec.loop.engine import SpeculativeDecoder
model = tiny_model()
folder = enable_compilation_cache()
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
entries = sorted(p for p in pathlib.Path(folder).iterdir() if p.name.endswith("-cache")) if folder else []
corrupted = entries[::2] if sys.argv[1] == "corrupt" else []  # every other entry: garbage of the same length
for p in corrupted:
    p.write_bytes(bytes(reversed(p.read_bytes())))
plain = Decoder(model).generate([[5, 6, 7]], 8, on_tokens=lambda t, c: None)
spec = SpeculativeDecoder(model, PromptLookup(num_draft=3)).generate([[5, 6, 7, 5, 6]], 8)
print(json.dumps({"folder": str(folder), "hits": len(hits), "entries": len(entries), "corrupted": len(corrupted),
                  "tokens": [plain.tokens, spec.tokens]}))
"""


def _rounds(tmp_path, actions: str, cache: str) -> tuple[list[dict], list[str]]:
    # conftest's XLA_FLAGS: each round compiles in less time, and every round the same programs.
    env = {"JSPEC_XLA_CACHE": cache, "JSPEC_CACHE": str(tmp_path / "home"), "PATH": "/usr/bin:/bin",
           "XLA_FLAGS": os.environ["XLA_FLAGS"]}  # fmt: skip
    rounds, errs = [], []
    for action in actions.split(","):
        proc = subprocess.run([sys.executable, "-c", ROUNDS, action], capture_output=True, text=True, env=env,
                              cwd=pathlib.Path(__file__).parent.parent, timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        rounds.append(json.loads(proc.stdout.splitlines()[-1]))
        errs.append(proc.stderr)
    return rounds, errs


def test_loops_are_found_in_the_cache_and_a_corrupt_entry_is_compiled_afresh_with_one_line(tmp_path):
    """Round 1 compiles and writes both loops' programs (no host callback in them, even streamed:
    a program with one is never written); round 2 finds every other entry corrupted: it reads the
    sound ones back (cache hits, no word said), says so once per corrupted entry in one line,
    compiles those afresh and gives the same tokens."""
    (first, second), (_, err) = _rounds(tmp_path, "first,corrupt", str(tmp_path / "xla"))
    assert first["folder"] == str(tmp_path / "xla") and first["hits"] == 0
    assert second["entries"] >= 3  # plain streamed: start and resume; speculative: whole (and small eager ops)
    assert first["tokens"] == second["tokens"]
    lines = [line for line in err.splitlines() if "compilation cache" in line]
    assert second["hits"] >= 1 and 1 <= len(lines) <= second["corrupted"], err  # each entry read has its word
    assert all(line.startswith("jspec: warning: Error reading") for line in lines), err
    assert "Traceback" not in err


def test_a_folder_that_cannot_be_written_means_no_cache_and_one_line(tmp_path):
    """Running as root, a read-only folder is still writable; a file where the folder should be
    is the unwritable folder every user can make."""
    (tmp_path / "blocked").write_text("not a folder")
    rounds, errs = _rounds(tmp_path, "first", str(tmp_path / "blocked" / "xla"))
    assert [(r["folder"], r["hits"]) for r in rounds] == [("None", 0)]
    lines = [line for line in errs[0].splitlines() if "compilation cache" in line]
    assert len(lines) == 1 and "cannot be written" in lines[0] and "JSPEC_XLA_CACHE=0" in lines[0], errs[0]


@pytest.mark.parametrize("value, where", [(None, "home"), ("1", "home"), ("0", None), ("off", None), ("own", "own")])
def test_the_cache_switch(monkeypatch, tmp_path, value, where):
    import jax

    from jspec.loop.xla_cache import enable_compilation_cache

    before = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    if value is None:
        monkeypatch.delenv("JSPEC_XLA_CACHE", raising=False)
    else:
        monkeypatch.setenv("JSPEC_XLA_CACHE", str(tmp_path / "own") if value == "own" else value)
    try:
        folder = enable_compilation_cache(force=True)
        want = {"home": tmp_path / "xla", "own": tmp_path / "own", None: None}[where]
        assert folder == want
        assert jax.config.jax_compilation_cache_dir == (str(want) if want else before)
    finally:  # set back before anything compiles, so no later test uses the cache
        jax.config.update("jax_compilation_cache_dir", before)
