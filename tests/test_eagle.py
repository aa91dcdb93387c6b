"""EAGLE heads on tiny random models: the TTT mask, training equals drafting, exact decoding, training, resuming."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jspec.drafters import EagleDrafter
from jspec.heads.eagle import DraftHead, HeadConfig, draft_vocabulary
from jspec.loop.decode import Decoder
from jspec.loop.engine import SpeculativeDecoder
from jspec.models.tiny import peaked_model, tiny_model
from jspec.training import Recipe, TrainConfig, Trainer, head_loss, teacher_forced_agreement, ttt_forward, ttt_mask
from jspec.training.trainer import batch_order

V = 97


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2", seed=0, num_layers=4)


def _head(target, kind="eagle3", k=40, seed=1):
    config = HeadConfig.for_target(target.config, kind, draft_vocab_size=k)
    head = DraftHead(config, rngs=nnx.Rngs(seed))
    head.attach_target(target, draft_vocabulary(np.arange(V)[::-1], k))  # ids V-1, V-2, ...: a strict subset
    return head


def _features(target, tokens, layers):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    out = target(tokens, positions, target.init_cache(*tokens.shape), hidden_layers=layers)
    return out.hidden_states


def test_ttt_mask_is_the_context_plus_own_earlier_steps():
    t, steps = 5, 3
    for k in range(steps):
        want = np.zeros((t, steps * t), bool)
        for row in range(t):
            want[row, : row + 1] = True  # step 0: the context up to this row
            for j in range(1, k + 1):
                want[row, j * t + row] = True  # its own steps 1..k at this row
        np.testing.assert_array_equal(np.asarray(ttt_mask(t, k, steps)), want)


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_training_time_test_computes_what_drafting_computes(target, kind):
    """Step k of TTT at row r gives the hidden state that drafting step k gives after pairs 0..r were committed."""
    head = _head(target, kind)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (1, 9), 4, V)
    fused = head.fuse(_features(target, tokens, head.config.feature_layers))
    steps = 3
    trained = ttt_forward(head, tokens, fused[:, :-1], steps)
    for r in (0, 3, 5):
        cache = head.init_cache(1, 16)
        pairs = jnp.arange(r + 1)[None, :]
        h, cache = head(tokens[:, 1 : r + 2], fused[:, : r + 1], pairs + 1, cache)  # committed pairs 0..r
        feature = h[:, -1:]
        np.testing.assert_allclose(trained[0][:, r], feature[:, 0], atol=1e-5)
        for k in range(1, steps):
            if r + k + 1 >= tokens.shape[1]:
                break
            feature, cache = head(tokens[:, r + k + 1 : r + k + 2], feature, jnp.array([[r + k + 1]]), cache)
            np.testing.assert_allclose(trained[k][:, r], feature[:, 0], atol=1e-5)


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_eagle_greedy_equals_plain_greedy(target, kind):
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
    drafter = EagleDrafter.from_head(_head(target, kind), target, num_draft=3)
    got = SpeculativeDecoder(target, drafter).generate(prompts, 20)
    assert got.tokens == Decoder(target).generate(prompts, 20).tokens
    assert got.verify_steps + 1 == got.target_calls  # an EAGLE head always drafts


def _data(target, n=24, t=12, seed=0):
    """The target's own greedy continuations of random prompts, with its hidden states."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, V, 4).tolist() for _ in range(n)]
    cont = Decoder(target).generate(prompts, t - 4).tokens
    tokens = np.array([p + c + [0] * (t - 4 - len(c)) for p, c in zip(prompts, cont, strict=True)], np.int32)
    mask = np.zeros((n, t), bool)
    mask[:, 4:] = True
    layers = (2, 2, 1, 3)  # the default feature layers of a 4-layer target, then the top
    hs = _features(target, jnp.asarray(tokens), layers)
    features = np.stack([np.asarray(h, np.float16) for h in hs[:3]], axis=2)
    return {"tokens": tokens, "mask": mask, "features": features, "top": np.asarray(hs[3], np.float16)}


def _trainer(target, head, checkpoint_dir=None, **kw):
    config = TrainConfig(**({"batch_size": 4, "total_steps": 40, "warmup_steps": 5, "learning_rate": 3e-3} | kw))
    return Trainer.for_target(head, target, config, checkpoint_dir)


def test_training_lowers_the_loss_and_raises_agreement():
    target = peaked_model("qwen2", seed=0, num_layers=4, scale=1.0)  # peaked: a target worth imitating
    data = _data(target)
    head = _head(target, "eagle3", k=V)
    trainer = _trainer(target, head, num_steps=2, total_steps=60, learning_rate=1e-2)
    batch = {k: jnp.asarray(v[:8]) for k, v in data.items()}
    norm, rows = trainer.target
    before, m0 = head_loss(head, batch, norm, rows, target.config.rms_eps, 2, 0.8)
    trainer.fit(data)
    after, m1 = head_loss(trainer.head(), batch, norm, rows, target.config.rms_eps, 2, 0.8)
    assert float(after) < float(before) - 1.0  # measured once: about 8.2 -> 6.3 (the target's entropy is about 1 nat)
    assert float(m1["acc"][0]) > float(m0["acc"][0]) + 0.1


def test_a_head_sharing_the_targets_arrays_trains_and_leaves_them_intact(target):
    """A head started from the target's own weights shares their buffers; training donates only its copies."""
    head = _head(target, "eagle3")
    head.final_norm[...] = target.final_norm[...]  # the same array, as a warm start would set it
    before = np.asarray(target.final_norm[...]).copy()
    trainer = _trainer(target, head, total_steps=2, warmup_steps=0, num_steps=2)
    trainer.fit(_data(target, n=8))
    np.testing.assert_array_equal(np.asarray(target.final_norm[...]), before)
    assert not np.array_equal(np.asarray(trainer.head().final_norm[...]), before)


def test_batch_order_is_a_function_of_the_step():
    a = [batch_order(10, 3, s, seed=0).tolist() for s in range(7)]
    assert a == [batch_order(10, 3, s, seed=0).tolist() for s in range(7)]
    epoch = [i for batch in a[:3] for i in batch]
    assert len(epoch) == len(set(epoch))  # one epoch: no example twice
    assert a[:3] != [batch_order(10, 3, s, seed=1).tolist() for s in range(3)]


@pytest.mark.slow  # 22 s; the trainer's resume is tested on Medusa heads, a killed EAGLE run below
def test_resumed_run_ends_where_an_uninterrupted_one_does(target, tmp_path):
    data = _data(target, n=12)
    straight = _trainer(target, _head(target), total_steps=6, num_steps=2)
    straight.fit(data)
    first = _trainer(target, _head(target), tmp_path / "ckpt", total_steps=6, num_steps=2, checkpoint_every=2)
    first.fit(data, until=5)  # "killed" after step 5: the last checkpoint is step 4
    resumed = _trainer(target, _head(target), tmp_path / "ckpt", total_steps=6, num_steps=2, checkpoint_every=2)
    assert resumed.restore() and resumed.step == 5  # fit() saved at its end; see the process-kill test for step 4
    resumed.fit(data)
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_bad_head_options_are_clear_errors(target):
    with pytest.raises(ValueError, match="unknown head kind"):
        HeadConfig.for_target(target.config, "eagle9")
    with pytest.raises(ValueError, match="feature layers"):
        HeadConfig.for_target(target.config, "eagle3", feature_layers=(0, 9))
    with pytest.raises(ValueError, match="draft vocabulary size"):
        HeadConfig.for_target(target.config, "eagle3", draft_vocab_size=V + 1)
    with pytest.raises(ValueError, match="vocabulary of 97"):
        EagleDrafter.from_head(_head(target), tiny_model("qwen2", vocab_size=50), num_draft=3)


_KILLED_RUN = """
import sys
sys.path.insert(0, {tests!r})
from test_eagle import _data, _head, _trainer, tiny_model
target = tiny_model("qwen2", seed=0, num_layers=4)
trainer = _trainer(target, _head(target), {ckpt!r}, total_steps=12, num_steps=2, checkpoint_every=3)
trainer.fit(_data(target, n=12), progress=lambda step, row: print("step", step, flush=True), log_every=1)
"""


def test_killed_training_resumes_from_its_last_checkpoint(target, tmp_path):
    """A run killed (SIGKILL) after step 7 resumes from step 6 and ends where an uninterrupted run ends."""
    import pathlib
    import subprocess
    import sys

    ckpt = tmp_path / "ckpt"
    script = tmp_path / "run.py"
    script.write_text(_KILLED_RUN.format(tests=str(pathlib.Path(__file__).parent), ckpt=str(ckpt)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.strip() == "step 7":
            proc.kill()
            break
    proc.wait()
    assert proc.returncode != 0  # it was killed, not finished
    data = _data(target, n=12)
    resumed = _trainer(target, _head(target), ckpt, total_steps=12, num_steps=2, checkpoint_every=3)
    assert resumed.restore() and resumed.step == 6  # lost one step: less than one interval
    resumed.fit(data)
    straight = _trainer(target, _head(target), total_steps=12, num_steps=2)
    straight.fit(data)
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_saved_head_round_trips_and_a_damaged_file_is_refused(target, tmp_path):
    from jspec.heads.eagle import load_head, save_head

    head = _head(target)
    save_head(head, tmp_path / "h", recipe={"note": "test"})
    loaded = load_head(tmp_path / "h", target)
    tokens = jnp.array([[5, 6, 7]])
    feature = jax.random.normal(jax.random.PRNGKey(0), (1, 3, target.config.hidden_size))
    positions = jnp.arange(1, 4)[None]
    a = head.logits(head(tokens, feature, positions, head.init_cache(1, 8))[0])
    b = loaded.logits(loaded(tokens, feature, positions, loaded.init_cache(1, 8))[0])
    np.testing.assert_allclose(a, b, atol=2e-3)  # weights are stored as float16
    np.testing.assert_array_equal(loaded.d2t[...], head.d2t[...])
    t2d = np.asarray(loaded.t2d[...])  # the map back: every draft id's target id maps to it, the rest to -1
    np.testing.assert_array_equal(t2d[np.asarray(loaded.d2t[...])], np.arange(loaded.config.draft_vocab_size))
    assert (t2d >= 0).sum() == loaded.config.draft_vocab_size
    weights = tmp_path / "h" / "head.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_head(tmp_path / "h", target)


def test_training_prompts_are_deterministic_and_not_evaluation_prompts():
    from jspec.analysis.prompts import load_prompts
    from jspec.training.data import stdlib_prompts

    prompts = stdlib_prompts(200)
    assert len(prompts) == 200 and prompts == stdlib_prompts(200)
    evaluation = [p.text for name in ("mt-bench", "humaneval") for p in load_prompts(name, None, None)]
    heads = {e.strip()[:60] for e in evaluation}
    assert not any(p.strip()[:60] in heads for p in prompts)
    assert not any(e.strip()[:200] in p for e in evaluation for p in prompts if len(e.strip()) > 40)


def test_fast_source_reading_equals_ast_on_awkward_sources():
    """The stdlib prompts read definitions with a one-pass line split and a walk over statements
    only; both must give exactly what ``ast.get_source_segment`` and ``ast.walk`` give."""
    import ast

    from jspec.training.data import _source_lines, _source_segment, _statements

    source = (
        'class A:\r\n    """Docs with ünïcode."""\r\n    def f(self, x):\r\n        return [\r\n'
        "            x]\rdef g(): pass\n"
        "try:\n    def h(): pass\nexcept E:\n    def i(): pass\nmatch v:\n    case 1:\n        def j(): pass\n"
        "if x:\n    class B:\n        def k(self): return lambda: 0\n"
        "def last(): return 'é'"  # no final newline
    )
    tree = ast.parse(source)
    defs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)]
    assert len(defs) == 9
    assert defs == [n for n in _statements(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)]
    lines = _source_lines(source)
    assert all(_source_segment(lines, n) == ast.get_source_segment(source, n) for n in defs)
    # Negative control: splitlines() also splits at a form feed, which ast's offsets do not count.
    with_ff = "x = 1\f\ndef f():\n    return 2\n"
    node = ast.parse(with_ff).body[1]
    assert _source_segment(_source_lines(with_ff), node) == ast.get_source_segment(with_ff, node)
    assert _source_segment(with_ff.splitlines(keepends=True), node) != ast.get_source_segment(with_ff, node)


def test_stdlib_prompts_are_cached_and_a_damaged_cache_is_rebuilt(tmp_path, monkeypatch):
    from jspec.training import data as eagle_data

    builds = []

    def build(root, seed, max_doc_chars):  # the real build takes 5 s; its output is tested above
        builds.append(seed)
        return [f"prompt {i} (seed {seed})" for i in range(100)]

    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(eagle_data, "_build_stdlib_prompts", build)
    first = eagle_data.stdlib_prompts(50)
    assert first == [f"prompt {i} (seed 0)" for i in range(50)]
    assert eagle_data.stdlib_prompts(50) == first and builds == [0]  # read back, not rebuilt
    assert eagle_data.stdlib_prompts(seed=1)[0] == "prompt 0 (seed 1)" and builds == [0, 1]
    (cached,) = [p for p in (tmp_path / "prompts").iterdir() if "seed 0" in p.read_text()]
    cached.write_text(cached.read_text()[:100])  # a damaged file is rebuilt, not half-read
    assert eagle_data.stdlib_prompts(50) == first and builds == [0, 1, 0]


def test_data_shards_round_trip_and_an_unfinished_set_is_refused(tmp_path):
    from jspec.training.data import load_shards, write_shards

    rng = np.random.default_rng(0)
    data = {"tokens": rng.integers(0, V, (5, 8)).astype(np.int32), "mask": rng.random((5, 8)) > 0.5,
            "features": rng.standard_normal((5, 8, 3, 4)).astype(np.float16),
            "top": rng.standard_normal((5, 8, 4)).astype(np.float16), "counts": np.arange(V)}  # fmt: skip
    write_shards(data, tmp_path / "d", {"model": "tiny"}, shard_size=2)
    back, meta = load_shards(tmp_path / "d")
    assert meta["examples"] == 5 and len(meta["shards"]) == 3
    for key, value in data.items():
        np.testing.assert_array_equal(back[key], value)
    (tmp_path / "d" / "meta.json").unlink()
    with pytest.raises(ValueError, match="not finished"):
        load_shards(tmp_path / "d")


class _WordTokenizer:
    """A stand-in tokenizer over the tiny model's ids: every id decodes to one word."""

    eos_token_ids = (3,)

    def apply_chat_template(self, messages):
        return "<user> " + messages[0]["content"] + " <end>"

    def encode(self, text):
        return [5 + ord(c) % 50 for c in text]

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids if i not in self.eos_token_ids)


def test_target_written_prompts_are_whole_distinct_turns_and_skip_evaluation_text(target):
    from jspec.analysis.prompts import load_prompts
    from jspec.training.data import _word_ngrams, evaluation_ngrams, self_instruct_prompts

    tok = _WordTokenizer()
    kw = {"max_tokens": 24, "batch_size": 8, "exclude": set()}
    prompts = self_instruct_prompts(target, tok, 6, **kw)
    assert len(prompts) == 6 and len(set(prompts)) == 6 and prompts == self_instruct_prompts(target, tok, 6, **kw)
    assert all(len(p.split()) >= 4 for p in prompts)
    # Negative control: the same run told that one of its prompts is evaluation text drops it.
    long = next(p for p in prompts if len(p.split()) >= 8)
    again = self_instruct_prompts(target, tok, 6, **(kw | {"exclude": _word_ngrams(long, 8)}))
    assert long not in again and set(prompts) - {long} <= set(again)
    # The default exclusion covers the evaluation sets' text.
    assert _word_ngrams(load_prompts("mt-bench", None, 1)[0].text, 8) <= evaluation_ngrams()


def test_prepared_data_is_reused_only_for_the_recipe_that_made_it(target, tmp_path):
    import dataclasses

    from jspec.heads.eagle import HeadConfig
    from jspec.training.data import write_shards
    from jspec.training.recipe import Recipe, prepare_data

    recipe = dataclasses.replace(Recipe.tiny(), prompt_source="self")
    layers = HeadConfig.for_target(target.config, "eagle3", 1).feature_layers
    data = {"tokens": np.zeros((2, 8), np.int32), "mask": np.ones((2, 8), bool),
            "features": np.zeros((2, 8, 3, 4), np.float16), "top": np.zeros((2, 8, 4), np.float16),
            "counts": np.ones(V, np.int64)}  # fmt: skip
    meta = {"model": "tiny", "prompt_source": "self", "feature_layers": list(layers), "num_prompts": 8,
            "seq_len": 128, "max_new_tokens": 24, "gen_temperature": 0.0}  # fmt: skip
    write_shards(data, tmp_path / "d", meta)  # written before the prompt seed was recorded: seed 0
    got = prepare_data(target, None, recipe, tmp_path / "d", "tiny")
    np.testing.assert_array_equal(got["tokens"], data["tokens"])
    other_seed = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, seed=1))
    with pytest.raises(ValueError, match="another recipe"):  # other target-written prompts
        prepare_data(target, None, other_seed, tmp_path / "d", "tiny")
    with pytest.raises(ValueError, match="another recipe"):
        prepare_data(target, None, dataclasses.replace(recipe, prompt_source="stdlib"), tmp_path / "d", "tiny")


def test_windowed_ttt_mask_is_the_context_plus_own_earlier_steps():
    t, steps, start, w = 9, 3, 2, 4
    size = t + (steps - 1) * w
    for k in range(1, steps):
        want = np.zeros((w, size), bool)
        for i in range(w):
            want[i, : start + i + 1] = True  # step 0: the context up to this row
            for j in range(1, k + 1):
                want[i, t + (j - 1) * w + i] = True  # its own steps 1..k at this window index
        np.testing.assert_array_equal(np.asarray(ttt_mask(t, k, steps, start, w)), want)


@pytest.mark.parametrize("kind", ["eagle3", pytest.param("eagle1", marks=pytest.mark.slow)])  # eagle1: CI time
def test_loss_on_the_window_equals_the_loss_on_every_row(target, kind):
    """Steps after the first, the output layer and the loss run on the loss window only: same loss,
    same gradients, on responses at different offsets (one at the start, one at the very end, and
    two turns with a user's turn between them)."""
    from jspec.training.loss import loss_window

    head, steps = _head(target, kind), 3
    tokens = jax.random.randint(jax.random.PRNGKey(3), (3, 24), 4, V)
    out = target(tokens, jnp.broadcast_to(jnp.arange(24), (3, 24)), target.init_cache(3, 24),
                 hidden_layers=(*head.config.feature_layers, target.config.num_layers - 1))  # fmt: skip
    mask = np.zeros((3, 24), bool)
    mask[0, 2:9], mask[1, 10:24], mask[2, 15:20] = True, True, True
    mask[0, 4:6] = False  # two assistant turns
    batch = {"tokens": tokens, "mask": jnp.asarray(mask), "top": out.hidden_states[-1],
             "features": jnp.stack(out.hidden_states[:-1], axis=2)}  # fmt: skip
    window = loss_window(mask, steps)
    assert window == 16 < 23  # the longest span, 14 tokens, + 2, rounded up to a multiple of 8
    norm, rows = target.final_norm[...], target.output_weights()[head.d2t[...]]
    graphdef, params, rest = nnx.split(head, nnx.Param, ...)

    def loss(params, window):
        h = nnx.merge(graphdef, params, rest)
        return head_loss(h, batch, norm, rows, target.config.rms_eps, steps, 0.8, window=window)

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)  # compiled: eager ops took ~50 s
    (full, m_full), g_full = grad(params, None)
    (win, m_win), g_win = grad(params, window)
    np.testing.assert_allclose(win, full, rtol=1e-5)
    np.testing.assert_allclose(m_win["acc"], m_full["acc"])
    for a, b in zip(jax.tree.leaves(g_win), jax.tree.leaves(g_full), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # Negative control: a window too narrow for the longest response loses rows of its loss.
    (_, _), g_short = grad(params, 8)
    gaps = [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in
            zip(jax.tree.leaves(g_short), jax.tree.leaves(g_full), strict=True)]  # fmt: skip
    assert max(gaps) > 0.05  # 0.45 (EAGLE-3) and 0.65 (EAGLE-1) here; the window's own gaps are ~1e-7
    mask[1, 11:23] = False  # two tokens 13 apart: the span, not the count, sizes the window
    assert loss_window(mask, steps) == 16


@pytest.mark.slow  # 23 s; an evaluation measure, not decoding
def test_teacher_forced_agreement_scores_the_drafts_decoding_would_make(target):
    """A continuation written by the head's own step-0 drafts agrees at every scored row of step 0."""
    head = _head(target, "eagle3")
    d2t = np.asarray(head.d2t[...])
    prompt = [5, 6, 7, 8, 9, 10]
    seq = [*prompt, int(d2t[3])]  # the first continuation token: the target's, never drafted

    @jax.jit
    def step0_drafts(tokens):  # causal: row r's draft reads tokens <= r + 1 only, so later filler is harmless
        fused = head.fuse(_features(target, tokens, head.config.feature_layers))
        return jnp.argmax(head.logits(ttt_forward(head, tokens, fused[:, :-1], 1)[0]), axis=-1)

    for _ in range(7):
        filled = jnp.asarray([seq + [0] * (14 - len(seq))])
        seq.append(int(d2t[int(step0_drafts(filled)[0, len(seq) - 2])]))  # row len - 2 drafts token len
    other = [11, 12, 13] + [int(x) for x in d2t[5:14]]  # padded beside the first in one batch
    counts = teacher_forced_agreement(head, target, [seq, other], [len(prompt), 3], 3)
    alone = teacher_forced_agreement(head, target, [other], [3], 3)
    scored = [len(seq) - len(prompt) - 1 - k for k in range(3)]  # drafts k + 1 after each pending token
    np.testing.assert_array_equal(counts[:, 1] - alone[:, 1], scored)
    assert counts[0, 0] - alone[0, 0] == scored[0] == 7
    with pytest.raises(ValueError, match="prompt length"):
        teacher_forced_agreement(head, target, [seq], [0], 2)


@pytest.mark.parametrize("layer_loop", ["unrolled", "scan"])
def test_warm_started_head_starts_as_the_targets_next_layer(layer_loop):
    """With its random parts zeroed, a warm-started EAGLE-3 head is the target layer after its last feature
    layer, applied to that layer's hidden states, and its draft logits are the target's own (draft vocabulary)."""
    target = tiny_model("llama", layer_loop=layer_loop, seed=0, num_layers=4)  # no qkv biases: the head has none
    config = HeadConfig.for_target(target.config, "eagle3", draft_vocab_size=40, feature_layers=(0, 1, 2))
    head = DraftHead(config, rngs=nnx.Rngs(3))
    head.attach_target(target, draft_vocabulary(np.arange(V)[::-1], 40))
    random_fc = head.fc[...]
    head.warm_start(target)
    h = config.hidden_size
    head.fc[...] = head.fc[...] - random_fc  # what warm_start added to the random fusion
    head.wqkv[...] = head.wqkv[...].at[:, :h].set(0.0)  # the embedding half: its random start, zeroed
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 10), 4, V)
    hidden = _features(target, tokens, (0, 1, 2, 3))
    pairs = jnp.broadcast_to(jnp.arange(1, 10), (2, 9))
    out, _ = head(tokens[:, 1:], head.fuse(hidden[:3])[:, :-1], pairs, head.init_cache(2, 9))
    np.testing.assert_allclose(out, hidden[3][:, :-1], atol=2e-5)  # layer 3 at positions 0..8
    want = target.logits(hidden[3][:, :-1])[..., head.d2t[...]]
    np.testing.assert_allclose(head.logits(out), want, atol=2e-4)
    with pytest.raises(ValueError, match="not both"):
        Recipe(init_from="somewhere", warm_start=True)


def test_warm_start_copies_into_an_eagle1_head(target):
    head = _head(target, "eagle1")
    head.warm_start(target)
    top = target.layer_arrays(target.config.num_layers - 1)
    np.testing.assert_array_equal(head.wqkv[...], top["wqkv"])
    np.testing.assert_array_equal(head.w_down[...], top["w_down"])
