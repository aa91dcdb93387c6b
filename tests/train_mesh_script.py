"""Trains one tiny EAGLE-3 head for 20 steps on one device and over meshes of simulated CPU devices, and
prints, per run, how far its losses and parameters are from one device's (tests/test_train_mesh.py).

Args: none (one process, 8 devices), ``--quick`` (the same, only the 2x4 mesh, alone and with accumulation, the
negative control and bfloat16: what `make test` runs), or PROCESS_ID PORT (one of two jax.distributed processes
of 4 devices each, one mesh over both).
"""

import json
import sys

if len(sys.argv) > 2:
    from jspec.loop.sharding import initialize

    initialize(f"localhost:{sys.argv[2]}", 2, int(sys.argv[1]), timeout_s=120)

import jax  # (imported after the runtime joined the other process)
import numpy as np
from test_eagle import _data, _head, _trainer

import jspec.training.trainer as trainer_module
from jspec.loop.sharding import make_mesh
from jspec.models.tiny import tiny_model

STEPS = 20
QUICK = sys.argv[1:] == ["--quick"]
# 8 attention heads of 4, 2 KV heads, MLP 64: a model axis of 2, 4 or 8 splits it.
target = tiny_model("qwen2", seed=0, num_layers=4, num_heads=8, head_dim=4)
data = _data(target, n=32)
ids_only = {k: data[k] for k in ("tokens", "mask")}
layers = _head(target).config.feature_layers


def train(mesh=None, online=False, batch_size=8, accumulate=1, dtype="float32"):
    trainer = _trainer(target, _head(target), num_steps=2, total_steps=STEPS, warmup_steps=2, batch_size=batch_size,
                       accumulate=accumulate, compute_dtype=dtype)  # fmt: skip
    if online:
        trainer.features_online(target, layers)
    if mesh is not None:
        trainer.shard(mesh)
    history = trainer.fit(ids_only if online else data, log_every=1)
    params = [np.asarray(x, np.float64) for x in jax.tree.leaves(trainer.head())]
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves((trainer.params, trainer.opt_state))})
    return np.array([row["total"] for row in history]), params, history, dtypes


def gaps(run, reference):
    """The largest relative difference of the losses (per step) and of the parameters (per array, in norm)."""
    (loss, params, *_), (loss0, params0, *_) = run, reference
    param_gap = max(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30) for a, b in zip(params, params0, strict=True))
    return {"loss": float(np.max(np.abs(loss - loss0) / np.abs(loss0))), "params": float(param_gap)}


out = {}
if len(sys.argv) > 2:  # two processes: one mesh of 2 x 4 over both, against this process's one device
    assert (jax.process_count(), jax.device_count()) == (2, 8)
    for online in (False, True):
        name = "online" if online else "stored"
        out[f"2x4/{name}"] = gaps(train(make_mesh(2, 4), online), train(online=online))
    out["multi_process"] = make_mesh(2, 4).is_multi_process
else:
    assert jax.device_count() == 8
    for online in (False, True):
        name = "online" if online else "stored"
        one = train(online=online)
        for data_axis, model_axis in ((2, 4),) if QUICK else ((1, 8), (2, 4), (8, 1)):
            out[f"{data_axis}x{model_axis}/{name}"] = gaps(train(make_mesh(data_axis, model_axis), online), one)
        if not QUICK:
            out[f"accumulate/{name}"] = gaps(train(batch_size=4, accumulate=2, online=online), one)
        out[f"2x4+accumulate/{name}"] = gaps(train(make_mesh(2, 4), online, batch_size=4, accumulate=2), one)
        if not online:
            # Negative control: each micro-batch averaged over its own tokens (the common shortcut).
            exact = trainer_module.token_counts
            trainer_module.token_counts = lambda mask, num_steps, window: None
            out["own_means"] = gaps(train(batch_size=4, accumulate=2), one)
            trainer_module.token_counts = exact
            bf16 = train(dtype="bfloat16")
            out["bfloat16"] = gaps(bf16, one) | {
                "dtypes": bf16[3],
                "first_last": [float(bf16[0][0]), float(bf16[0][-1])],
                "first_last_f32": [float(one[0][0]), float(one[0][-1])],
            }
            out["log_row"] = sorted(one[2][-1])
            try:  # refused before anything is placed or compiled
                _trainer(target, _head(target), batch_size=4).shard(make_mesh(8, 1))
            except ValueError as e:
                out["refused"] = str(e)
print(json.dumps(out))
