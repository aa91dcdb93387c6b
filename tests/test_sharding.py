"""Meshes with data and model axes (jax.sharding) give the same tokens and statistics as one device."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import xla_flags

from jspec.core.sampling import SamplingParams
from jspec.loop.sharding import batch_mesh, padded_rows, shard_rows

TESTS = pathlib.Path(__file__).parent


def _mesh_run(*args):
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), PYTHONPATH=str(TESTS))
    proc = subprocess.run([sys.executable, str(TESTS / "mesh_script.py"), *args], capture_output=True, text=True,
                          env=env, timeout=3000)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def meshes():
    """Plain decoding and EAGLE-3's dynamic tree on one device and on meshes 2x4 and 4x2."""
    return _mesh_run("unrolled", "--quick")


def _same_as_one_device(runs):
    assert len(runs) > 2
    for name, got in runs.items():
        one = runs["one/" + name.split("/")[1]]
        assert len(one["tokens"]) == 3 and all(len(t) == 16 for t in one["tokens"])
        assert got == one, name


@pytest.mark.parametrize("method", ["plain", "eagle3_tree"])
def test_meshes_with_data_and_model_axes_give_the_single_device_tokens(meshes, method):
    """Greedy and sampled (seed fixed) tokens, acceptance histograms, cache lengths and live-row counts."""
    _same_as_one_device(meshes[method])


def test_a_wrong_layout_changes_the_tokens(meshes):
    """Negative control for the comparison: k and v swapped in a 2x4 mesh's weights."""
    assert meshes["swapped_kv"] != meshes["plain"]["one/0.0"]["tokens"]
    counted, sharded = meshes["filler_counted"], meshes["eagle3_tree"]["4x2/0.0"]  # 3 rows + 1 filler
    assert counted["live_row_steps"] != sharded["live_row_steps"]


def _megatron(shapes, model, rows, kv_split):
    """The Megatron split of the tiny target (H 32, 8 heads x 8, 2 KV heads, MLP 64, V 96) on a model axis."""
    kv = 16 // model if kv_split else 16
    for layer in range(3):
        p = f"layers.{layer}."
        assert shapes[p + "wq"] == [64 // model, 32] and shapes[p + "wk"] == [kv, 32]
        assert shapes[p + "wo"] == [32, 64 // model]  # row-parallel: split by input
        assert shapes[p + "w_gate"] == [64 // model, 32] and shapes[p + "w_down"] == [32, 64 // model]
        assert shapes[p + "attn_norm"] == [32]
    assert shapes["embed"] == shapes["lm_head"] == [96 // model, 32]


def test_weights_and_caches_are_split_megatron_style(meshes):
    place = meshes["placement"]
    _megatron(place["2x4"], 4, 2, kv_split=False)  # 2 KV heads on a model axis of 4: whole on every device
    _megatron(place["4x2"], 2, 1, kv_split=True)
    assert place["2x4/cache_whole"] == [3, 4, 56, 2, 8]  # [L, B (3 rows + 1 filler), S, KV heads, D]
    assert place["2x4/cache"] == [3, 2, 56, 2, 8] and place["4x2/cache"] == [3, 1, 56, 1, 8]
    with pytest.raises(AssertionError):  # negative control: the attention output split by output
        _megatron(place["2x4/wrong_rule"], 4, 2, kv_split=False)


def test_bad_meshes_are_refused_before_anything_is_placed(meshes):
    refused = meshes["refusals"]
    assert "mesh model=8 does not split this model (9 attention heads, 3 KV heads" in refused["model_8_on_9_heads"]
    assert "Sizes that fit: model=1, 3, 9" in refused["model_8_on_9_heads"]
    assert refused["model_3_on_9_heads"] is None  # a size that fits is taken
    assert "mesh axes ['batch'] are not jspec's" in refused["unknown_axis"]
    assert "a mesh data=3 x model=2 needs 6 devices; 8 are visible" in refused["product"]


def _two_processes(*extra, counts=(2, 2)):
    """Runs tests/distributed_script.py as processes 0 and 1 on a free localhost port; their last JSON lines."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, XLA_FLAGS=xla_flags(4), PYTHONPATH=str(TESTS))
    procs = [subprocess.Popen([sys.executable, str(TESTS / "distributed_script.py"), str(i), port, str(n), *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i, n in enumerate(counts)]  # fmt: skip
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))  # Gloo prints its own lines before it
    return outs


def test_two_processes_over_one_mesh_give_the_one_process_tokens(meshes):
    """jax.distributed: two processes of 4 devices, one 2x4 mesh over both; each reads the whole result
    (plain decoding here; the slow test adds EAGLE-3's tree)."""
    first, second = _two_processes()
    assert first["multi_process"] and first == second
    for temperature in ("0.0", "1.0"):  # what differs from one process is placement and reading back, not the method
        assert first["plain"][f"2x4/{temperature}"] == meshes["plain"][f"one/{temperature}"]


def test_a_process_count_that_does_not_match_the_coordinator_is_refused():
    first, second = _two_processes("--join-only", counts=(2, 3))
    assert first == {"joined": 2}
    assert "runs 2 processes, not the 3 this one was given" in second["refused"]


def test_bad_distributed_arguments_are_refused_before_joining():
    from jspec.loop.sharding import initialize

    with pytest.raises(ValueError, match="host:port"):
        initialize("localhost", 2, 0)
    with pytest.raises(ValueError, match=r"process id must be in 0\.\.1 for 2 processes; got 2"):
        initialize("localhost:1234", 2, 2)


def test_the_cost_profile_is_measured_over_the_mesh(meshes):
    profile = meshes["profile"]
    assert profile["mesh"] == "2x4" and profile["batch"] == 2  # batch 1 runs as 2 rows over data = 2
    assert profile["forward"] == [1]
    assert profile["path"].endswith("__mesh2x4.json") and "mesh" not in profile["one_device_path"]


def test_mesh_sizes_from_text():
    from jspec.loop.sharding import make_mesh, parse_mesh

    assert parse_mesh("data=2,model=4") == {"data": 2, "model": 4} and parse_mesh("model=2") == {"model": 2}
    for bad in ("data=2,tensor=4", "data=0", "model=x", "data=2,data=2", "4"):
        with pytest.raises(ValueError, match="--mesh"):
            parse_mesh(bad)
    with pytest.raises(ValueError, match="needs 2 devices; 1 are visible"):
        make_mesh(data=2)
    with pytest.raises(ValueError, match="mesh model must be a positive integer"):
        make_mesh(model=0)


@pytest.mark.slow
@pytest.mark.parametrize("layer_loop", ["unrolled", "scan"])
def test_every_method_on_meshes_1x8_2x4_4x2_8x1(layer_loop):
    """Every method, greedy and sampled, on one device and the four meshes of 8 devices (~10 minutes here)."""
    runs = _mesh_run(layer_loop)
    for method in ("plain", "ngram", "draft", "eagle3_tree", "eagle1", "medusa_tree", "lookahead"):
        _same_as_one_device(runs[method])
    assert runs["swapped_kv"] != runs["plain"]["one/0.0"]["tokens"]
    if layer_loop == "unrolled":  # two processes, EAGLE-3's tree too
        first, second = _two_processes("--with-tree")
        assert first == second
        for method in ("plain", "eagle3_tree"):
            for temperature in ("0.0", "1.0"):
                assert first[method][f"2x4/{temperature}"] == runs[method][f"one/{temperature}"]


def test_shard_rows_pads_per_row_arrays_and_replicates_the_rest():
    mesh = batch_mesh(jax.devices()[:1])
    params = SamplingParams.create(temperature=np.array([0.0, 0.5, 1.0]), top_k=5)
    got = shard_rows(mesh, params, 3, 5)
    np.testing.assert_array_equal(got.temperature, [0.0, 0.5, 1.0, 1.0, 1.0])
    assert got.top_k.shape == () and int(got.top_k) == 5
    assert got.temperature.sharding.spec == jax.sharding.PartitionSpec("data")
    assert padded_rows(None, 3) == 3 and padded_rows(mesh, 3) == 3
    assert shard_rows(None, jnp.arange(3), 3, 4).tolist() == [0, 1, 2, 2]


def test_a_mesh_that_is_not_one_is_a_clear_error():
    from jspec.loop.decode import Decoder
    from jspec.models.tiny import tiny_model

    with pytest.raises(ValueError, match=r"must be a jax\.sharding\.Mesh"):
        Decoder(tiny_model("qwen2", seed=0), mesh=jax.devices())


@pytest.mark.parametrize("layer_loop", ["unrolled", "scan"])
def test_unfused_weights_compute_what_the_fused_ones_do(layer_loop):
    """What a model split over heads holds (q, k, v and gate, up apart) gives the fused model's logits."""
    from jspec.models.tiny import tiny_model

    fused = tiny_model("qwen2", seed=0, layer_loop=layer_loop)  # with q, k, v biases
    parts = fused.unfused()
    assert parts.unfused() is parts and not parts.fused
    assert "wqkv" not in parts.layer_arrays(0) and parts.layer_arrays(0)["bk"].shape[-1] == 16
    tokens = jnp.arange(5, 11)[None]
    positions = jnp.arange(6)[None]
    want = fused(tokens, positions, fused.init_cache(1, 8)).logits
    got = parts(tokens, positions, parts.init_cache(1, 8)).logits
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(want).max()) > 0.05  # not trivially equal
