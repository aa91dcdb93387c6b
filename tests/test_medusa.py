"""Medusa heads: exact drafting (greedy equality, a chi-square at T = 1 with a negative control), the
heads' files, training with resume, and the inputs refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from stats_util import LEVEL, sampled_p_value

from jspec.core.tree import DynamicTreeSpec, StaticTree
from jspec.drafters import MedusaDrafter
from jspec.heads.medusa import MedusaConfig, MedusaHeads, load_medusa, save_medusa
from jspec.loop.decode import Decoder
from jspec.loop.engine import SpeculativeDecoder
from jspec.models.tiny import peaked_model, tiny_model

V = 97
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28]]


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2", seed=0, num_layers=3)


def random_heads(target, k=4, seed=1, scale=0.3):
    heads = MedusaHeads(MedusaConfig.for_target(target.config, k), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(seed)
    heads.w[...] = jnp.asarray(scale * rng.standard_normal(heads.w[...].shape), jnp.float32)
    heads.b[...] = jnp.asarray(scale * rng.standard_normal(heads.b[...].shape), jnp.float32)
    heads.attach_target(target)
    return heads


def test_untrained_heads_repeat_the_targets_prediction(target):
    """W = 0 at the start: every head's logits are the target's own at that position."""
    heads = MedusaHeads(MedusaConfig.for_target(target.config, 3), rngs=nnx.Rngs(0))
    heads.attach_target(target)
    ids = jnp.asarray([PROMPTS[0]])
    out = target(ids, jnp.arange(6)[None], target.init_cache(1, 8), hidden_layers=(2,))
    got = heads.logits(out.hidden_states[0])  # [1, 6, K, V]
    for k in range(3):
        np.testing.assert_allclose(np.asarray(got[:, :, k]), np.asarray(out.logits), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_medusa_greedy_equals_plain_greedy(target, shape):
    tree = StaticTree.from_branching([3, 2, 1]) if shape == "tree" else None
    drafter = MedusaDrafter.from_heads(random_heads(target), target, tree=tree, num_draft=None if tree else 3)
    got = SpeculativeDecoder(target, drafter).generate(PROMPTS, 24)
    assert got.tokens == Decoder(target).generate(PROMPTS, 24).tokens
    assert drafter.num_draft == 3 and got.verify_steps > 0


def test_a_fixed_loop_whose_drafter_always_drafts_compiles_no_plain_step(target, monkeypatch):
    """Medusa's rows always have drafts (``has_draft`` None): a fixed loop verifies every step, so it
    traces the target's prefill and its verify forward (widths P and N + 1) and no one-token forward
    for a plain step that could never run (the loop runs while a row is live). Prompt lookup, whose
    rows may have none, and an adaptive loop keep theirs: the count sees a plain step where there is
    one. (Negative control: the code before this test, 2026-12-08, traces width 1 for Medusa too. What
    it saves on SmolLM2: docs/log, 2026-12-08.)"""
    from jspec.drafters import PromptLookup
    from jspec.loop.adaptive import Adaptive, StepCosts

    widths = []
    forward = type(target).__call__

    def counted(self, tokens, *args, **kwargs):  # called while tracing: once per forward in the program
        widths.append(tokens.shape[1])
        return forward(self, tokens, *args, **kwargs)

    monkeypatch.setattr(type(target), "__call__", counted)
    medusa = MedusaDrafter.from_heads(random_heads(target), target, num_draft=3)
    traced = {}
    for name, engine in {
        "medusa": SpeculativeDecoder(target, medusa),
        "lookup": SpeculativeDecoder(target, PromptLookup(num_draft=3)),
        "adaptive": SpeculativeDecoder(target, medusa, adaptive=Adaptive(), costs=StepCosts.create(speculative=2.0)),
    }.items():
        widths.clear()
        engine.generate(PROMPTS, 7)  # a shape no other test of this module compiles (caches clear between modules)
        traced[name] = sorted(set(widths))
    prompt = traced["medusa"][-1]
    assert traced == {"medusa": [4, prompt], "lookup": [1, 4, prompt], "adaptive": [1, 4, prompt]}


def test_medusa_sampling_has_the_target_distribution_with_negative_control():
    """T = 1, 6000 rows: tokens 2-4 against plain sampling's, with the real chain verifier and with
    one that skips the residual (which must fail)."""
    from jspec.analysis.check import verify_chain_without_residual
    from jspec.core.sampling import SamplingParams
    from jspec.core.verify import verify_chain

    prompts = [[7, 8, 9, 10]] * 6000
    params = SamplingParams.create(temperature=1.0)
    target = peaked_model(seed=5)
    plain = np.array(Decoder(target).generate(prompts, 4, params, seed=1).tokens)
    drafter = MedusaDrafter.from_heads(random_heads(target, k=3, seed=2, scale=0.5), target)

    def p_value(verifier):
        result = SpeculativeDecoder(target, drafter, verifier=jax.vmap(verifier)).generate(prompts, 4, params, seed=2)
        assert sum(result.accept_hist[1:]) > 0 and result.accept_hist[0] > 0  # accepts and rejects both happen
        return sampled_p_value(np.array(result.tokens), plain, V)

    assert p_value(verify_chain) > LEVEL
    assert p_value(verify_chain_without_residual) < LEVEL


def test_medusa_heads_save_load_and_refuse_bad_files(target, tmp_path):
    heads = random_heads(target)
    save_medusa(heads, tmp_path / "m", recipe={"note": "test"})
    loaded = load_medusa(tmp_path / "m", target)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, target.config.hidden_size))
    np.testing.assert_allclose(np.asarray(loaded.logits(x)), np.asarray(heads.logits(x)), rtol=2e-2, atol=2e-2)
    other = tiny_model("llama", seed=0, hidden_size=48, head_dim=12)
    with pytest.raises(ValueError, match="built for hidden"):
        load_medusa(tmp_path / "m", other)
    weights = tmp_path / "m" / "medusa.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_medusa(tmp_path / "m", target)
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "head.json").write_text("{}")
    with pytest.raises(ValueError, match="EAGLE head"):
        load_medusa(tmp_path / "e", target)


def test_medusa_options_are_refused_clearly(target, tmp_path):
    with pytest.raises(ValueError, match="at least one head"):
        MedusaConfig.for_target(target.config, 0)
    heads = random_heads(target, k=2)
    with pytest.raises(ValueError, match="only 2 Medusa heads"):
        MedusaDrafter.from_heads(heads, target, tree=StaticTree.from_branching([2, 2, 2]))
    with pytest.raises(ValueError, match="needs 3 Medusa heads"):
        MedusaDrafter.from_heads(heads, target, num_draft=3)
    with pytest.raises(ValueError, match="static trees"):
        MedusaDrafter.from_heads(heads, target, tree=DynamicTreeSpec(top_k=2, depth=2, total=5))
    from jspec.core.tree import MeasuredTree
    from jspec.methods import parse

    with pytest.raises(ValueError, match="method 'ngram' drafts chains or trees of several continuations"):
        parse("ngram", tree="measured")
    with pytest.raises(ValueError, match="holds no measured rank rates"):  # saved without a training report
        MedusaDrafter.from_heads(save_medusa(heads, tmp_path / "h"), target, tree=MeasuredTree(8))


def test_tree_children_are_each_heads_top_tokens(target):
    """Medusa choices: below every node of depth d - 1, head d's k_d most likely tokens, best first."""
    from jspec.analysis.trace import first_step

    heads = random_heads(target, k=3)
    drafter = MedusaDrafter.from_heads(heads, target, tree=StaticTree.from_branching([3, 2]))
    trace = first_step(target, drafter, PROMPTS[0])
    out = target(jnp.asarray([PROMPTS[0]]), jnp.arange(6)[None], target.init_cache(1, 8), hidden_layers=(2,))
    logits = np.asarray(heads.logits(out.hidden_states[0][:, -1]))[0]  # [K, V] after the prompt
    top = np.argsort(-logits, axis=-1)
    for j in range(1, len(trace.tokens)):
        d = trace.depths[j]
        siblings = [i for i in range(1, len(trace.tokens)) if trace.parents[i] == trace.parents[j]]
        assert trace.tokens[j] == top[d - 1, siblings.index(j)]
    assert (trace.depths == 1).sum() == 3 and (trace.depths == 2).sum() == 6


def _medusa_trainer(heads, checkpoint_dir=None, **kw):
    from jspec.training import TrainConfig, Trainer

    config = {"num_steps": heads.config.num_heads, "batch_size": 4, "total_steps": 40, "warmup_steps": 5,
              "learning_rate": 1e-2}  # fmt: skip
    return Trainer.for_medusa(heads, TrainConfig(**(config | kw)), checkpoint_dir)


def _zero_heads(target, k=3):
    heads = MedusaHeads(MedusaConfig.for_target(target.config, k), rngs=nnx.Rngs(0))
    heads.attach_target(target)
    return heads


def test_medusa_training_lowers_the_loss_and_raises_agreement():
    from test_eagle import _data

    from jspec.training.medusa import medusa_loss

    target = peaked_model("qwen2", seed=0, num_layers=4, scale=1.0)  # peaked: a target worth imitating
    data = _data(target)
    heads = _zero_heads(target)
    trainer = _medusa_trainer(heads, total_steps=150)
    batch = {k: jnp.asarray(v[:8]) for k, v in data.items()}
    before, m0 = medusa_loss(heads, batch, 0.8)
    trainer.fit(data)
    after, m1 = medusa_loss(trainer.head(), batch, 0.8)
    assert float(after) < float(before) - 1.0
    assert float(m1["acc"][0]) > float(m0["acc"][0]) + 0.1
    with pytest.raises(ValueError, match="must equal the number of Medusa heads"):
        _medusa_trainer(heads, num_steps=2)


def test_stopped_medusa_training_resumes_where_an_uninterrupted_run_ends(tmp_path):
    """Stopped after step 5 (checkpoints every 2 steps; ``fit`` saves its last step too): the next trainer
    restores step 5 and ends where one that never stopped ends. (A run killed with SIGKILL restores its
    last interval's checkpoint: the same restore, tested on EAGLE heads in test_eagle.py.)"""
    from test_eagle import _data

    target = tiny_model("qwen2", seed=0, num_layers=4)
    data = _data(target, n=12)
    first = _medusa_trainer(_zero_heads(target), tmp_path / "ckpt", total_steps=8, checkpoint_every=2)
    first.fit(data, until=5)
    resumed = _medusa_trainer(_zero_heads(target), tmp_path / "ckpt", total_steps=8, checkpoint_every=2)
    assert resumed.restore() and resumed.step == 5
    resumed.fit(data)
    straight = _medusa_trainer(_zero_heads(target), total_steps=8)
    straight.fit(data)
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_best_branching_is_the_best_tree_within_the_node_budget():
    """Against every branching by brute force, and by hand: the top-1 chain when deeper heads are
    sure, a wide first level when the first head's top token is often wrong."""
    import itertools

    from jspec.drafters.medusa import best_branching, expected_accepted

    rng = np.random.default_rng(0)
    for _ in range(20):
        rates = rng.dirichlet(np.ones(6), size=3)[:, :5] * rng.uniform(0.3, 1.0, (3, 1))
        budget = int(rng.integers(2, 20))
        shapes = [b for d in (1, 2, 3) for b in itertools.product(range(1, 6), repeat=d)
                  if sum(np.prod(b[: i + 1]) for i in range(d)) <= budget - 1]  # fmt: skip
        want = max(expected_accepted(rates, b) for b in shapes)
        assert expected_accepted(rates, best_branching(rates, budget)) == pytest.approx(want)
    sure = np.array([[0.9, 0.05], [0.9, 0.05], [0.9, 0.05]])
    assert best_branching(sure, 4) == (1, 1, 1)
    unsure = np.array([[0.3, 0.3], [0.9, 0.05], [0.9, 0.05]])
    assert best_branching(unsure, 5) == (2, 1)  # 0.6 + 0.54 beats the chain's 0.3 + 0.27 + 0.24
    assert expected_accepted(unsure, (2, 1)) == pytest.approx(0.6 + 0.6 * 0.9)
    with pytest.raises(ValueError, match="max_nodes >= 2"):
        best_branching(sure, 1)
    with pytest.raises(ValueError, match="rank rates"):
        best_branching([[0.9, 0.5]], 4)


@pytest.mark.slow  # 11 s; a tool that picks a tree from measured rates, not decoding
def test_rank_rates_agree_with_the_loss_and_choose_the_measured_tree():
    """Rank 1's rate is the loss's top-1 agreement on the same rows; a measured tree is the best
    branching of those rates; without rates it is refused."""
    from test_eagle import _data

    from jspec.core.tree import MeasuredTree
    from jspec.drafters.medusa import best_branching
    from jspec.training.medusa import medusa_loss, rank_rates

    target = tiny_model("qwen2", seed=0, num_layers=4)  # _data's feature layers need 4
    heads = random_heads(target, k=3)
    data = _data(target, n=6)
    rates = rank_rates(heads, data, width=4, chunk=4)
    _, metrics = medusa_loss(heads, {k: jnp.asarray(data[k]) for k in ("tokens", "mask", "top")}, 0.8)
    np.testing.assert_allclose(rates[:, 0], metrics["acc"], atol=1e-6)
    assert rates.shape == (3, 4) and (rates.sum(1) <= 1 + 1e-9).all()
    drafter = MedusaDrafter.from_heads(heads, target, tree=MeasuredTree(8), rates=rates)
    assert drafter.tree == StaticTree.from_branching(best_branching(rates, 8))
    with pytest.raises(ValueError, match="needs the heads' rank rates"):
        MedusaDrafter.from_heads(heads, target, tree=MeasuredTree(8))
    with pytest.raises(ValueError, match="for 2 heads; these heads are 3"):
        MedusaDrafter.from_heads(heads, target, tree=MeasuredTree(8), rates=rates[:2])


@pytest.mark.slow  # ~70 s; Medusa training, resuming, trees and greedy equality run on tiny models above
def test_tiny_medusa_run_on_smollm2_then_greedy_equals_plain(smollm2, tmp_path, capsys):
    """`jspec train medusa --tiny` stopped halfway and run again (it resumes), then the saved heads
    draft chains and the Medusa tree chosen from their held-out rank rates on the real model through
    the command line, token for token the plain greedy output."""
    import json

    from jspec.cli.main import main

    out = tmp_path / "medusa"
    argv = ["train", "medusa", "--tiny", "--out", str(out), "--eval-prompts", "0", "--json"]
    assert main([*argv, "--stop-after", "6"]) == 0
    assert not (out / "medusa.json").exists()  # not finished: nothing saved yet
    capsys.readouterr()
    assert main(argv) == 0
    resumed = capsys.readouterr()
    report = json.loads(resumed.out.strip().splitlines()[-1])["report"]
    assert f"resuming training at step 6 of 12 from {out / 'checkpoints'} (data: {out / 'data'}" in resumed.err
    assert report["resumed_from"] == 6 and report["steps"] == 12 and len(report["final"]["acc"]) == 3
    assert np.asarray(report["rank_rates"]).shape == (3, 8) and report["held_out_examples"] >= 1
    prompt = ["generate", "--prompt", "Write a haiku about the sea.", "--chat", "--max-new-tokens", "24", "--json"]
    runs = {}
    for name, extra in {"ar": [], "chain": ["--method", "medusa", "--head", str(out)],
                        "tree": ["--method", "medusa", "--head", str(out), "--tree", "measured"]}.items():  # fmt: skip
        assert main([*prompt, *extra]) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    assert runs["chain"]["tokens"] == runs["ar"]["tokens"] == runs["tree"]["tokens"]
    assert runs["chain"]["stats"]["target_calls"] < runs["ar"]["stats"]["target_calls"] + 1
    assert main(["train", "medusa", "--tiny", "--out", str(tmp_path / "x"), "--draft-vocab", "512"]) == 2
    assert "EAGLE option" in capsys.readouterr().err
