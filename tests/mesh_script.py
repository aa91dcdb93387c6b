"""Runs in a fresh process with 8 simulated devices (the device count is fixed when JAX starts):
every method on one device and on meshes 1x8, 2x4, 4x2, 8x1; prints one JSON line for
tests/test_sharding.py. ``--quick`` (what ``make test`` runs): plain decoding and EAGLE-3's
dynamic tree on one device and meshes 2x4 and 4x2 (both axes, KV heads split and whole)."""

import json
import sys

import jax
import numpy as np
from flax import nnx

from jspec.core.sampling import SamplingParams
from jspec.core.tree import DynamicTreeSpec
from jspec.drafters import DraftModel, EagleDrafter, LookaheadDecoding, PromptLookup
from jspec.heads.eagle import DraftHead, HeadConfig, draft_vocabulary
from jspec.heads.medusa import MedusaConfig, MedusaHeads
from jspec.loop.decode import Decoder
from jspec.loop.engine import SpeculativeDecoder
from jspec.loop.sharding import MEGATRON, make_mesh, place_model
from jspec.methods import make_drafter
from jspec.models.tiny import tiny_model

assert jax.device_count() == 8, jax.devices()
MESHES = {"1x8": (1, 8), "2x4": (2, 4), "4x2": (4, 2), "8x1": (8, 1)}
V = 96  # divisible by 8: the output layer is split by vocabulary on every model axis
# 8 heads over 2 KV heads: model=2 splits the KV heads, model=4 and 8 keep them whole (a multiple).
LOOP = "scan" if "scan" in sys.argv else "unrolled"
target = tiny_model("qwen2", seed=0, num_heads=8, num_kv_heads=2, vocab_size=V, layer_loop=LOOP)
rng = np.random.default_rng(0)
base = rng.integers(4, V, 6).tolist()
prompts = [base * 3, rng.integers(4, V, 9).tolist(), base[:4]]  # 3 rows: filler rows on data = 2, 4, 8


def eagle(kind, tree):
    config = HeadConfig.for_target(target.config, kind, draft_vocab_size=40)
    head = DraftHead(config, rngs=nnx.Rngs(1))
    head.attach_target(target, draft_vocabulary(np.arange(V)[::-1], 40))
    return EagleDrafter.from_head(head, target, tree=tree, num_draft=None if tree else 3)


drafters = {
    "ngram": lambda: PromptLookup(num_draft=3),
    "draft": lambda: DraftModel.from_model(tiny_model("llama", seed=4, vocab_size=V), V, num_draft=3),
    "eagle3_tree": lambda: eagle("eagle3", DynamicTreeSpec(top_k=3, depth=3, total=8)),
    "eagle1": lambda: eagle("eagle1", None),
    "medusa_tree": lambda: make_drafter(
        "medusa", target, head=MedusaHeads(MedusaConfig.for_target(target.config, 3), rngs=nnx.Rngs(2)), tree="2,2,1"),
    "lookahead": lambda: LookaheadDecoding(window=2, level=3, guesses=2, pool_size=8),
}  # fmt: skip
QUICK = {"eagle3_tree": drafters["eagle3_tree"]}


def shard_shapes(state):
    flat = dict(nnx.to_flat_state(state))
    return {".".join(map(str, p)): list(v[...].sharding.shard_shape(v[...].shape)) for p, v in flat.items()
            if str(p[-1]) in ("wq", "wk", "wo", "w_gate", "w_down", "embed", "lm_head", "attn_norm")}  # fmt: skip


ENGINES = {}  # the last run's engines by mesh name


def run(make_engine, meshes):
    out = {}
    for name, sizes in meshes.items():
        engine = ENGINES[name] = make_engine(None if sizes is None else make_mesh(*sizes))
        for temperature in (0.0, 1.0):
            r = engine.generate(prompts, 16, SamplingParams.create(temperature=temperature), seed=5)
            stats = {k: getattr(r, k) for k in ("tokens", "accept_hist", "cache_lengths", "live_row_steps")
                     if getattr(r, k) is not None}  # fmt: skip
            out[f"{name}/{temperature}"] = stats
    return out


def main(drafters, meshes):
    out = {"plain": run(lambda mesh: Decoder(target, mesh=mesh), {"one": None} | meshes)}
    for method, make in drafters.items():
        out[method] = run(lambda mesh, make=make: SpeculativeDecoder(target, make(), mesh=mesh), {"one": None} | meshes)

    # Where things live on a 2x4 and a 4x2 mesh: the weights (Megatron), and the caches after a run
    # (the last method's engines, run again: compiled already).
    place = {}
    for name in ("2x4", "4x2"):
        mesh = make_mesh(*MESHES[name])
        place[name] = shard_shapes(place_model(mesh, target)[1])
        final, _, _ = ENGINES[name].run(prompts, 16)
        place[name + "/cache"] = list(final.cache.k.sharding.shard_shape(final.cache.k.shape))
        place[name + "/cache_whole"] = list(final.cache.k.shape)
    # Negative control for the placement check: a wrong rule (the attention output split by output).
    place["2x4/wrong_rule"] = shard_shapes(place_model(make_mesh(2, 4), target, rules=MEGATRON | {"wo": -2})[1])
    out["placement"] = place

    # Negative control for the token comparison: a wrong layout (each layer's k and v parts swapped).
    decoder = Decoder(target, mesh=make_mesh(2, 4))
    flat = dict(nnx.to_flat_state(decoder.weights))
    for path in [p for p in flat if str(p[-1]) == "wk"]:
        other = (*path[:-1], "wv")
        flat[path], flat[other] = flat[path].replace(flat[other][...]), flat[other].replace(flat[path][...])
    decoder.weights = nnx.from_flat_state(flat)
    out["swapped_kv"] = decoder.generate(prompts, 16, SamplingParams.greedy(), seed=5).tokens
    # Negative control for the statistics: a filler row counted as a real one would change them.
    r = SpeculativeDecoder(target, QUICK["eagle3_tree"]()).generate(prompts + prompts[:1], 16, seed=5)
    out["filler_counted"] = {"accept_hist": r.accept_hist, "live_row_steps": r.live_row_steps}

    # The tuner's cost profile measured over a mesh, cached apart from one device's.
    from jspec.tune.costs import measure_profile, profile_path

    mesh = make_mesh(2, 4)
    profile = measure_profile(target, "tiny", {"ngram:N=1": PromptLookup(num_draft=1)}, batch=1, max_k=1, repeats=1,
                              mesh=mesh)  # fmt: skip
    out["profile"] = {
        "mesh": profile.mesh,
        "batch": profile.batch,
        "forward": sorted(profile.forward_ms),
        "path": profile_path("tiny", 1, mesh=mesh).name,
        "one_device_path": profile_path("tiny", 1).name,
    }

    # Bad meshes: refused before anything is placed.
    def refusal(make):
        try:
            make()
        except ValueError as e:
            return str(e)
        return None

    smol_like = tiny_model("llama", num_heads=9, num_kv_heads=3, hidden_size=36, head_dim=4, intermediate_size=72)
    out["refusals"] = {
        "model_8_on_9_heads": refusal(lambda: Decoder(smol_like, mesh=make_mesh(1, 8))),
        "model_3_on_9_heads": refusal(lambda: Decoder(smol_like, mesh=make_mesh(2, 3, jax.devices()[:6]))),
        "unknown_axis": refusal(lambda: Decoder(target, mesh=jax.sharding.Mesh(np.asarray(jax.devices()), ("batch",)))),
        "product": refusal(lambda: make_mesh(3, 2)),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    if "--quick" in sys.argv:
        main(QUICK, {k: MESHES[k] for k in ("2x4", "4x2")})
    else:
        main(drafters, MESHES)
