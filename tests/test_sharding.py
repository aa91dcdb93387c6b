"""Rows split over devices with jax.sharding give the same tokens and statistics as one device."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.sampling import SamplingParams
from jspec.sharding import batch_mesh, padded_rows, shard_rows

TESTS = pathlib.Path(__file__).parent

# Runs in a fresh process: the device count is fixed when JAX starts, and this process has one.
SCRIPT = r"""
import json, sys
import numpy as np
from flax import nnx
from tiny import tiny_model
from jspec.decode import Decoder
from jspec.drafters import DraftModel, EagleDrafter, PromptLookup
from jspec.engine import SpeculativeDecoder
from jspec.heads import DraftHead, HeadConfig, draft_vocabulary
from jspec.tree import DynamicTreeSpec
from jspec.sampling import SamplingParams
from jspec.sharding import batch_mesh

import jax
assert jax.device_count() == 2, jax.devices()
mesh = batch_mesh()
V = 97
target = tiny_model("qwen2", seed=0)
rng = np.random.default_rng(0)
base = rng.integers(4, V, 6).tolist()
prompts = [base * 3, rng.integers(4, V, 9).tolist(), base[:4]]  # 3 rows: one filler row on 2 devices
config = HeadConfig.for_target(target.config, "eagle3", draft_vocab_size=40)
head = DraftHead(config, rngs=nnx.Rngs(1))
head.attach_target(target, draft_vocabulary(np.arange(V)[::-1], 40))
drafters = {
    "ngram": lambda: PromptLookup(num_draft=3),
    "draft": lambda: DraftModel.from_model(target, V, num_draft=3),  # the target drafting: every draft accepted
    "eagle_tree": lambda: EagleDrafter.from_head(head, target, tree=DynamicTreeSpec(top_k=3, depth=3, total=8)),
}
out = {}
# Decoders made once: the temperature is an array, so each compiles one loop for both temperatures.
plain = {n: Decoder(target, mesh=mesh if n == 2 else None) for n in (1, 2)}
engines = {(name, n): SpeculativeDecoder(target, make(), mesh=mesh if n == 2 else None)
           for name, make in drafters.items() for n in (1, 2)}
filler_engine = SpeculativeDecoder(target, drafters["draft"]())
for temperature in (0.0, 1.0):
    sampling = SamplingParams.create(temperature=temperature)
    for device_count in (1, 2):
        dec = plain[device_count]
        out[f"plain/{temperature}/{device_count}"] = {"tokens": dec.generate(prompts, 20, sampling, seed=5).tokens}
    for name, make in drafters.items():
        for device_count in (1, 2):
            engine = engines[(name, device_count)]
            r = engine.generate(prompts, 20, sampling, seed=5)
            ((rows, _),) = engine._compiled
            shards = len({d for x in jax.tree.leaves(engine.tweights) for d in x.devices()})
            out[f"{name}/{temperature}/{device_count}"] = {
                "tokens": r.tokens, "accept_hist": r.accept_hist, "cache_lengths": r.cache_lengths,
                "live_row_steps": r.live_row_steps, "rows": rows, "weight_devices": shards,
            }
    # Sensitivity: the filler row counted as a real one changes the statistics compared above.
    r = filler_engine.generate(prompts + [prompts[0]], 20, sampling, seed=5)
    out[f"draft_with_filler_counted/{temperature}"] = {"accept_hist": r.accept_hist, "live_row_steps": r.live_row_steps}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def two_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONPATH=str(TESTS))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("temperature", ["0.0", "1.0"])
@pytest.mark.parametrize("method", ["plain", "ngram", "draft", "eagle_tree"])
def test_two_devices_give_the_single_device_result(two_devices, method, temperature):
    one, two = two_devices[f"{method}/{temperature}/1"], two_devices[f"{method}/{temperature}/2"]
    assert len(one["tokens"]) == 3 and all(len(t) == 20 for t in one["tokens"])
    if method != "plain":
        assert (one["rows"], two["rows"]) == (3, 4)  # one filler row makes the split even
        assert (one["weight_devices"], two["weight_devices"]) == (1, 2)  # replicated on both devices
    assert two == {**one, **{k: two[k] for k in ("rows", "weight_devices") if k in two}}
    if method == "draft":  # every draft accepted: the comparison covers commits of whole chains
        assert one["accept_hist"][-1] == sum(one["accept_hist"]) > 0


@pytest.mark.parametrize("temperature", ["0.0", "1.0"])
def test_a_counted_filler_row_would_show_in_the_statistics(two_devices, temperature):
    """Negative control for the comparison above: it would notice a filler row that is not dropped."""
    sharded = two_devices[f"draft/{temperature}/2"]
    counted = two_devices[f"draft_with_filler_counted/{temperature}"]
    assert counted["live_row_steps"] != sharded["live_row_steps"]


def test_shard_rows_pads_per_row_arrays_and_replicates_the_rest():
    mesh = batch_mesh(jax.devices()[:1])
    params = SamplingParams.create(temperature=np.array([0.0, 0.5, 1.0]), top_k=5)
    got = shard_rows(mesh, params, 3, 5)
    np.testing.assert_array_equal(got.temperature, [0.0, 0.5, 1.0, 1.0, 1.0])
    assert got.top_k.shape == () and int(got.top_k) == 5
    assert got.temperature.sharding.spec == jax.sharding.PartitionSpec(("batch",))
    assert padded_rows(None, 3) == 3 and padded_rows(mesh, 3) == 3
    assert shard_rows(None, jnp.arange(3), 3, 4).tolist() == [0, 1, 2, 2]


def test_a_mesh_that_is_not_one_is_a_clear_error():
    from tiny import tiny_model

    from jspec.decode import Decoder

    with pytest.raises(ValueError, match=r"must be a jax\.sharding\.Mesh"):
        Decoder(tiny_model("qwen2", seed=0), mesh=jax.devices())
