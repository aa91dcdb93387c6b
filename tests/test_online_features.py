"""Online target features: the target's hidden states computed inside the training step from the
batch's token ids (the data holds ids and masks only) train a head as the stored features do."""

import jax
import numpy as np
from test_eagle import _data, _features, _head, _trainer

from jspec.models.tiny import tiny_model

RUN = {"num_steps": 2, "total_steps": 5, "warmup_steps": 1}


def test_online_features_train_a_head_as_the_stored_ones_with_negative_control():
    target = tiny_model("qwen2", seed=0, num_layers=4)
    data = _data(target)
    ids_only = {k: data[k] for k in ("tokens", "mask")}
    layers = _head(target).config.feature_layers
    # Stored features as the online step makes them: in the target's float32, not rounded to float16.
    hs = [np.asarray(h) for h in _features(target, jax.numpy.asarray(data["tokens"]), (*layers, 3))]
    data = data | {"features": np.stack(hs[:-1], axis=2), "top": hs[-1]}
    stored = _trainer(target, _head(target), **RUN)
    online = _trainer(target, _head(target), **RUN).features_online(target, layers)
    assert online.data_keys == ("tokens", "mask")
    a, b = stored.fit(data, log_every=1), online.fit(ids_only, log_every=1)
    assert all(r["tokens_per_s"] > 0 and r["seconds"] > 0 for r in a + b)  # the throughput line of every step
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(y["loss"], x["loss"], rtol=1e-4)
    for x, y in zip(jax.tree.leaves(stored.params), jax.tree.leaves(online.params), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-3, atol=1e-5)
    # Negative control: features from other layers train another head.
    wrong = _trainer(target, _head(target), **RUN).features_online(target, (1, 1, 1))
    wrong.fit(ids_only, log_every=1)

    def gap(trainer):
        pairs = zip(jax.tree.leaves(stored.params), jax.tree.leaves(trainer.params), strict=True)
        return max(float(np.max(np.abs(np.asarray(y) - np.asarray(x)))) for x, y in pairs)

    assert gap(wrong) > 100 * gap(online)
