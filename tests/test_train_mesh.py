"""Training over meshes (jax.sharding), with gradient accumulation and in bfloat16: the parallel step is one
device's step. Each run trains a tiny EAGLE-3 head for 20 steps (tests/train_mesh_script.py); a gap is the
largest relative difference from one device's run, of the losses (per step) or of the parameters (per array,
in norm)."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
from conftest import xla_flags

TESTS = pathlib.Path(__file__).parent
EXACT = 1e-5  # float32: what a split sum's other order of adding leaves (measured: at most 2.3e-7)


def _script(*args, devices=8):
    env = dict(os.environ, XLA_FLAGS=xla_flags(devices), PYTHONPATH=str(TESTS))
    return subprocess.Popen([sys.executable, str(TESTS / "train_mesh_script.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip


def _result(proc):
    stdout, stderr = proc.communicate(timeout=1800)
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])  # Gloo prints its own lines before it


@pytest.fixture(scope="module")
def runs():
    """The 2x4 mesh (both axes), alone and with accumulation, stored and online; the rest in `all_runs`."""
    return _result(_script("--quick"))


@pytest.fixture(scope="module")
def all_runs():
    return _result(_script())


# make test: a mesh with both axes, alone and accumulating (8 of 15 runs; the suite's longest fixture, 85-108 s
# with all). make test-slow: the model axis alone (1x8), the data axis alone (8x1), accumulation on one device.
_LAYOUTS = [pytest.param(layout, marks=() if layout.startswith("2x4") else pytest.mark.slow)
            for layout in ("1x8", "2x4", "8x1", "accumulate", "2x4+accumulate")]  # fmt: skip


@pytest.mark.parametrize("features", ["stored", "online"])
@pytest.mark.parametrize("layout", _LAYOUTS)
def test_a_mesh_or_accumulated_step_trains_one_devices_head(request, layout, features):
    """Meshes data x model over 8 devices (online: the target's weights split over the model axis too);
    a batch of 8 as 2 micro-batches of 4, on one device and on a 2x4 mesh."""
    runs = request.getfixturevalue("runs" if layout.startswith("2x4") else "all_runs")
    gap = runs[f"{layout}/{features}"]
    assert gap["loss"] < EXACT and gap["params"] < EXACT, gap


def test_micro_batches_averaged_over_their_own_tokens_are_not_the_batch_step(runs):
    """Negative control: the accumulation shortcut (each micro-batch's mean over its own tokens) is caught."""
    assert runs["own_means"]["params"] > 10 * EXACT  # measured 5.2e-4


def test_bfloat16_compute_keeps_float32_weights_and_trains_like_float32(runs):
    bf16 = runs["bfloat16"]
    assert bf16["dtypes"] == ["float32", "int32"]  # master weights and optimizer state (and Adam's count)
    assert EXACT < bf16["params"] < 0.05  # computed in bfloat16 (not float32), close to it (measured 0.006)
    first, last = bf16["first_last"]
    assert last < first and abs(last - bf16["first_last_f32"][1]) < 1e-2 * last


def test_a_batch_that_does_not_split_over_the_data_axis_or_no_micro_batch_is_refused(runs):
    from jspec.training import TrainConfig

    assert (
        "batch of 4 rows (a micro-batch, with accumulation) does not split over the mesh's data axis of 8"
        in (runs["refused"])
    )
    with pytest.raises(ValueError, match="accumulate must be >= 1; got 0"):
        TrainConfig(accumulate=0)
    with pytest.raises(ValueError, match="compute_dtype must be one of float32, bfloat16; got 'float16'"):
        TrainConfig(compute_dtype="float16")


def test_every_logged_step_says_its_throughput(runs):
    assert {"seconds", "tokens_per_s", "peak_fraction"} <= set(runs["log_row"])


def test_a_steps_flops_are_counted_from_its_program_and_peaks_are_known_for_accelerators_only():
    """The numerator and denominator of the log's peak_fraction: XLA's count of the lowered step, which
    doubles with the batch; the data sheets' peaks (none for a CPU)."""
    import types

    import jax
    from test_eagle import _data, _head, _trainer

    from jspec.models.tiny import tiny_model
    from jspec.training.trainer import peak_flops

    target = tiny_model("qwen2", seed=0, num_layers=4)
    data = _data(target, n=8, t=8)
    flops = [_trainer(target, _head(target), batch_size=b).step_flops({k: v[:b] for k, v in data.items()}, 8)
             for b in (4, 8)]  # fmt: skip
    assert flops[0] > 1e6 and 1.8 < flops[1] / flops[0] < 2.1  # measured 1.95 (the optimizer's share is fixed)
    assert peak_flops(jax.devices("cpu")[0]) is None
    assert peak_flops(types.SimpleNamespace(device_kind="NVIDIA H200")) == 989e12
    assert peak_flops(types.SimpleNamespace(device_kind="TPU v5 lite")) == 197e12


@pytest.mark.slow  # ~100 s; the step over a mesh is the 8-device tests above, jax.distributed is test_sharding's
def test_two_processes_over_one_mesh_train_one_devices_head():
    """jax.distributed: two processes of 4 devices, one 2x4 mesh over both."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = str(s.getsockname()[1])
    procs = [_script(str(i), port, devices=4) for i in range(2)]
    first, second = (_result(p) for p in procs)
    assert first == second and first.pop("multi_process")
    for name, gap in first.items():
        assert gap["loss"] < EXACT and gap["params"] < EXACT, (name, gap)


@pytest.mark.slow  # ~100 s; the mesh and accumulation steps themselves are the tests above
def test_the_command_line_trains_over_a_mesh_with_accumulation_and_reports_one_json(tmp_path):
    env = dict(os.environ, XLA_FLAGS=xla_flags(2))
    argv = [sys.executable, "-m", "jspec.cli.main", "train", "eagle3", "--tiny", "--mesh", "data=2", "--accumulate",
            "2", "--eval-prompts", "0", "--json", "--out", str(tmp_path / "head")]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["head"] == str(tmp_path / "head") and (tmp_path / "head" / "head.safetensors").exists()
    assert out["steps"] == 12 and out["final_loss"] > 0 and out["tokens_per_s"] > 0
    assert out["recipe"]["train"]["accumulate"] == 2
