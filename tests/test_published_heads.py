"""Published draft heads: each format written here in its exact layout (random weights), loaded by jspec,
and checked against an independent PyTorch reference of that format's forward.

The references below are written from the formats' facts (docs/head_formats.md, each with its source in
SafeAILab/EAGLE, SpecForge/SGLang, speculators/vLLM and Medusa), not from jspec's code: the features are
read from transformers' own ``output_hidden_states`` of a tiny Llama 3 target that transformers wrote, at
the indices each engine reads, and the draft layer, RoPE, norms and vocabulary map are spelled out in torch.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_hf import write_family

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

import jspec  # noqa: E402
from jspec.core.sampling import SamplingParams  # noqa: E402
from jspec.core.tree import DynamicTreeSpec  # noqa: E402
from jspec.drafters.base import Context  # noqa: E402
from jspec.heads.export import export_head  # noqa: E402
from jspec.heads.formats import detect_format, load_any_head  # noqa: E402

L, H, V, K = 8, 32, 64, 40  # target layers, width, vocabulary; draft vocabulary
HEADS, KV, D, F = 4, 2, 8, 48
PROMPT = [2, 9, 17, 30, 9, 17, 30, 41, 12, 55, 9, 17]
N = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    reference = write_family(folder, "llama3", num_hidden_layers=L)
    model, _ = jspec.load_model(str(folder))
    return reference, model, folder


# ---------------------------------------------------------------------- the formats, written as published


def _rand(rng, *shape, scale=0.3):
    return torch.tensor(scale * rng.standard_normal(shape), dtype=torch.float32)


def _norm(rng, n):
    return 1.0 + _rand(rng, n, scale=0.3)


def _layer(rng, prefix, attn_in, qk_norm=False, input_norm=True):
    a = prefix + "self_attn."
    sd = {a + "q_proj.weight": _rand(rng, HEADS * D, attn_in), a + "k_proj.weight": _rand(rng, KV * D, attn_in),
          a + "v_proj.weight": _rand(rng, KV * D, attn_in), a + "o_proj.weight": _rand(rng, H, HEADS * D),
          prefix + "post_attention_layernorm.weight": _norm(rng, H), prefix + "mlp.gate_proj.weight": _rand(rng, F, H),
          prefix + "mlp.up_proj.weight": _rand(rng, F, H),
          prefix + "mlp.down_proj.weight": _rand(rng, H, F)}  # fmt: skip
    if input_norm:
        sd[prefix + "input_layernorm.weight"] = _norm(rng, H)
    if qk_norm:
        sd |= {a + "q_norm.weight": _norm(rng, D), a + "k_norm.weight": _norm(rng, D)}
    return sd


def _vocab(rng):
    ids = np.sort(rng.choice(V, K, replace=False))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": torch.tensor(ids - np.arange(K), dtype=torch.int64), "t2d": t2d}  # offsets, as published


LLAMA = {"hidden_size": H, "intermediate_size": F, "num_attention_heads": HEADS, "num_key_value_heads": KV,
         "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-5, "vocab_size": V}  # fmt: skip


def write_published(folder, fmt: str) -> dict:
    """Writes a random head of ``fmt`` into ``folder``; returns the facts the reference needs."""
    rng = np.random.default_rng(len(fmt))
    if fmt == "eagle3-safeailab":  # pytorch_model.bin, midlayer, no recorded layers, its own RoPE base
        cfg = LLAMA | {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": K, "rope_theta": 10000.0}
        sd = {"fc.weight": _rand(rng, H, 3 * H), "midlayer.hidden_norm.weight": _norm(rng, H),
              "norm.weight": _norm(rng, H), "lm_head.weight": _rand(rng, K, H, scale=1.0)}  # fmt: skip
        sd |= _layer(rng, "midlayer.", 2 * H) | _vocab(rng)
        torch.save(sd, folder / "pytorch_model.bin")
        facts = dict(capture=[2, L // 2, L - 3], theta=10000.0, prefix="midlayer.")
    elif fmt == "eagle3-specforge":  # safetensors, layer ids recorded as outputs (SGLang adds 1), per-feature norms
        ids = {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}
        cfg = LLAMA | {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": K, "rope_theta": 1000.0,
                       "head_dim": D, "fc_norm": True, "eagle_config": ids}  # fmt: skip
        sd = {"fc.weight": _rand(rng, H, 3 * H), "midlayer.hidden_norm.weight": _norm(rng, H),
              "norm.weight": _norm(rng, H), "lm_head.weight": _rand(rng, K, H, scale=1.0)}  # fmt: skip
        sd |= {f"fc_norm.{i}.weight": _norm(rng, H) for i in range(3)}
        sd |= _layer(rng, "midlayer.", 2 * H) | _vocab(rng)
        save_file(sd, str(folder / "model.safetensors"))
        facts = dict(capture=[2, 4, 6], theta=1000.0, prefix="midlayer.", fc_norm=True)
    elif fmt == "eagle3-speculators":  # layers.0, ids recorded as inputs (vLLM), a Qwen3 layer, its own embedding
        layer = LLAMA | {"model_type": "qwen3", "head_dim": D, "rope_theta": 500000.0}
        cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "draft_vocab_size": K,
               "transformer_layer_config": layer, "norm_before_residual": True, "norm_output": True,
               "eagle_aux_hidden_state_layer_ids": [1, 4, 6],
               "speculators_config": {"algorithm": "eagle3", "proposal_methods": [], "verifier": {}}}  # fmt: skip
        sd = {"fc.weight": _rand(rng, H, 3 * H), "layers.0.hidden_norm.weight": _norm(rng, H),
              "norm.weight": _norm(rng, H), "lm_head.weight": _rand(rng, K, H, scale=1.0),
              "embed_tokens.weight": _rand(rng, V, H, scale=1.0)}  # fmt: skip
        sd |= _layer(rng, "layers.0.", 2 * H, qk_norm=True) | _vocab(rng)
        save_file(sd, str(folder / "model.safetensors"))
        facts = dict(capture=[1, 4, 6], theta=500000.0, prefix="layers.0.", qk_norm=True, before_residual=True,
                     norm_output=True, own_embed=True)  # fmt: skip
    elif fmt == "eagle1-safeailab":  # fc over [embedding, feature] with a bias, layer 0 without an input norm
        cfg = LLAMA | {"architectures": ["LlamaForCausalLM"], "rope_theta": 10000.0}
        sd = {"fc.weight": _rand(rng, H, 2 * H), "fc.bias": _rand(rng, H)} | _layer(
            rng, "layers.0.", H, input_norm=False
        )
        torch.save(sd, folder / "pytorch_model.bin")
        facts = dict(theta=10000.0)
    else:  # medusa1: three heads, each a residual block and its own output layer
        cfg = {"medusa_num_heads": 3, "medusa_num_layers": 1, "base_model_name_or_path": "tiny"}
        sd = {}
        for i in range(3):
            sd |= {f"{i}.0.linear.weight": _rand(rng, H, H), f"{i}.0.linear.bias": _rand(rng, H),
                   f"{i}.1.weight": _rand(rng, V, H, scale=1.0)}  # fmt: skip
        torch.save(sd, folder / "medusa_lm_head.pt")
        facts = {}
    (folder / "config.json").write_text(json.dumps(cfg))
    return facts | {"sd": sd}


FORMATS = ["eagle3-safeailab", "eagle3-specforge", "eagle3-speculators", "eagle1-safeailab", "medusa1"]


@pytest.fixture(scope="module", params=FORMATS)
def published(request, tmp_path_factory, target):
    folder = tmp_path_factory.mktemp(request.param)
    facts = write_published(folder, request.param)
    return request.param, folder, facts, load_any_head(folder, target[1])


# ---------------------------------------------------------------------- the independent reference


def _rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):  # x [T, heads, D]; half-split rotation, as Llama's
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rot = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1)
    return x * cos + rot * sin


class RefLayer:
    """One draft decoder layer with its own KV cache; ``x_attn`` is what q, k, v read."""

    def __init__(self, sd, prefix, theta, qk_norm=False):
        self.sd, self.p, self.theta, self.qk_norm, self.k, self.v = sd, prefix, theta, qk_norm, [], []

    def __call__(self, residual, x_attn, pos):
        sd, a = self.sd, self.p + "self_attn."
        t = x_attn.shape[0]
        q = (x_attn @ sd[a + "q_proj.weight"].T).view(t, HEADS, D)
        k = (x_attn @ sd[a + "k_proj.weight"].T).view(t, KV, D)
        v = (x_attn @ sd[a + "v_proj.weight"].T).view(t, KV, D)
        if self.qk_norm:
            q, k = _rms(q, sd[a + "q_norm.weight"]), _rms(k, sd[a + "k_norm.weight"])
        q, k = _rope(q, pos, self.theta), _rope(k, pos, self.theta)
        past = sum(x.shape[0] for x in self.k)
        self.k.append(k), self.v.append(v)
        keys, vals = (
            torch.cat(self.k).repeat_interleave(HEADS // KV, 1),
            torch.cat(self.v).repeat_interleave(HEADS // KV, 1),
        )
        scores = torch.einsum("thd,shd->hts", q, keys) / D**0.5
        allowed = torch.arange(keys.shape[0])[None, :] <= (past + torch.arange(t))[:, None]
        attn = torch.einsum("hts,shd->thd", scores.masked_fill(~allowed, -torch.inf).softmax(-1), vals)
        h = residual + attn.reshape(t, HEADS * D) @ sd[a + "o_proj.weight"].T
        m, g = self.p + "mlp.", _rms(h, sd[self.p + "post_attention_layernorm.weight"])
        gate, up = g @ sd[m + "gate_proj.weight"].T, g @ sd[m + "up_proj.weight"].T
        return h + (torch.nn.functional.silu(gate) * up) @ sd[m + "down_proj.weight"].T


def reference_chain(fmt, facts, hf_target, prompt, n, forced=None):
    """The format's first draft step after ``prompt``: (target ids drafted greedily, or ``forced``;
    the full-vocabulary draft distributions at temperature 1 [n, V])."""
    sd = facts["sd"]
    with torch.no_grad():
        out = hf_target(torch.tensor([prompt]), output_hidden_states=True)
        top = hf_target.model(torch.tensor([prompt])).last_hidden_state[0]  # after the final norm
        hs = [h[0] for h in out.hidden_states]  # hs[k]: the stream entering layer k
        first = int(out.logits[0, -1].argmax())
        tokens_in = torch.tensor([*prompt[1:], first])  # pair t: (feature of token t, token t + 1)
        pos = torch.arange(len(prompt))
        embed = hf_target.model.embed_tokens.weight
        drafts, dists = [], []
        if fmt == "medusa1":
            for i in range(n):
                y = top[-1] + torch.nn.functional.silu(
                    top[-1] @ sd[f"{i}.0.linear.weight"].T + sd[f"{i}.0.linear.bias"]
                )
                logits = y @ sd[f"{i}.1.weight"].T
                drafts.append(int(logits.argmax()) if forced is None else forced[i]), dists.append(logits.softmax(-1))
            return first, drafts, torch.stack(dists).numpy()
        if fmt == "eagle1-safeailab":
            layer = RefLayer(sd, "layers.0.", facts["theta"])

            def step(tok, feat, p):
                x = torch.cat([embed[tok], feat], -1) @ sd["fc.weight"].T + sd["fc.bias"]
                return layer(x, x, p)  # layer 0: no input norm

            h = step(tokens_in, top, pos)[-1]
            for i in range(n):
                logits = h @ hf_target.lm_head.weight.T  # the target's output layer, no norm
                tok = int(logits.argmax()) if forced is None else forced[i]
                drafts.append(tok), dists.append(logits.softmax(-1))
                h = step(torch.tensor([tok]), h[None], torch.tensor([len(prompt) + i]))[-1]
            return first, drafts, torch.stack(dists).numpy()
        # EAGLE-3
        p = facts["prefix"]
        emb_table = sd["embed_tokens.weight"] if facts.get("own_embed") else embed
        feats = [hs[i] for i in facts["capture"]]
        if facts.get("fc_norm"):
            feats = [_rms(f, sd[f"fc_norm.{i}.weight"]) for i, f in enumerate(feats)]
        fused = torch.cat(feats, -1) @ sd["fc.weight"].T
        layer = RefLayer(sd, p, facts["theta"], facts.get("qk_norm", False))
        ids = torch.arange(K) + sd["d2t"]

        def step(tok, feat, q):
            e, f = _rms(emb_table[tok], sd[p + "input_layernorm.weight"]), _rms(feat, sd[p + "hidden_norm.weight"])
            out = layer(f if facts.get("before_residual") else feat, torch.cat([e, f], -1), q)
            return _rms(out, sd["norm.weight"]) if facts.get("norm_output") else out

        h = step(tokens_in, fused, pos)[-1]
        for i in range(n):
            logits = (h if facts.get("norm_output") else _rms(h, sd["norm.weight"])) @ sd["lm_head.weight"].T
            tok = int(ids[logits.argmax()]) if forced is None else forced[i]
            full = torch.zeros(V)
            full[ids] = logits.softmax(-1)
            drafts.append(tok), dists.append(full)
            h = step(torch.tensor([tok]), h[None], torch.tensor([len(prompt) + i]))[-1]
        return first, drafts, torch.stack(dists).numpy()


def jspec_first_step(drafter, model, prompt, temperature, seed=0):
    """jspec's first speculative step after ``prompt``: (pending token, drafts, draft distributions)."""
    cap = 64
    tokens = jnp.asarray([prompt])
    out = model(tokens, jnp.arange(len(prompt))[None], model.init_cache(1, cap), hidden_layers=drafter.hidden_layers)
    first = int(jnp.argmax(out.logits[0, -1]))
    history = jnp.zeros((1, cap), jnp.int32).at[0, : len(prompt) + 1].set(jnp.asarray([*prompt, first]))
    ctx = Context(history, jnp.array([len(prompt) + 1]), jnp.array([len(prompt)]))
    sampling = SamplingParams.create(temperature=temperature)
    state = drafter.init(tokens, ctx, cap, sampling, out.hidden_states)
    proposal, _ = drafter.propose(state, ctx, jax.random.PRNGKey(seed), sampling)
    probs = None if proposal.probs is None else np.asarray(proposal.probs[0])
    return first, proposal.tokens[0].tolist(), probs


def _method(fmt):
    return "medusa" if fmt == "medusa1" else fmt.split("-")[0]


def parity_gap(fmt, facts, head, target, hidden_layers=None) -> tuple[bool, float]:
    """(same greedy chain, max |draft distribution - reference| at temperature 1) for the first step."""
    reference, model = target[:2]
    n = 3 if fmt == "medusa1" else N
    drafter = jspec.make_drafter(_method(fmt), model, num_draft=n, head=head)
    if hidden_layers is not None:
        drafter = drafter.replace(hidden_layers=hidden_layers)
    first, chain, _ = jspec_first_step(drafter, model, PROMPT, 0.0)
    ref_first, ref_chain, _ = reference_chain(fmt, facts, reference, PROMPT, n)
    assert first == ref_first  # the target agrees with transformers (tests/test_families.py checks more)
    _, sampled, probs = jspec_first_step(drafter, model, PROMPT, 1.0, seed=3)
    _, _, ref_probs = reference_chain(fmt, facts, reference, PROMPT, n, forced=sampled)
    return chain == ref_chain, float(np.abs(probs - ref_probs).max())


def test_each_format_is_detected_and_drafts_what_its_reference_drafts(published, target):
    fmt, folder, facts, head = published
    assert detect_format(folder) == fmt
    same, gap = parity_gap(fmt, facts, head, target)
    assert same and gap < 2e-5


def test_parity_fails_when_a_format_fact_is_broken(target, tmp_path):
    """Negative controls: offsets read as ids, the two input norms swapped, the fused layers off by one
    (SGLang's output ids read as vLLM's input ids): each breaks the parity the test above demands."""
    fmt = "eagle3-specforge"
    facts = write_published(tmp_path, fmt)
    good = load_any_head(tmp_path, target[1])
    assert parity_gap(fmt, facts, good, target) == (True, pytest.approx(0, abs=2e-5))

    offsets = load_any_head(tmp_path, target[1])
    raw = np.asarray(facts["sd"]["d2t"])
    offsets.attach_target(target[1], np.where(raw >= 0, raw, 0) % V)  # the d2t tensor taken as target ids
    swapped = load_any_head(tmp_path, target[1])
    swapped.emb_norm[...], swapped.feat_norm[...] = good.feat_norm[...], good.emb_norm[...]
    for head, layers in [(offsets, None), (swapped, None), (good, tuple(k - 1 for k in good.config.feature_layers))]:
        same, gap = parity_gap(fmt, facts, head, target, hidden_layers=layers)
        assert not same or gap > 1e-3


# ~23 s each; the three EAGLE-3 formats load into one head class, so one of them runs in make test
# (each format's drafts equal its reference's in test_each_format_is_detected_...).
_ONE_EAGLE3 = [pytest.param(f, marks=pytest.mark.slow if f in ("eagle3-safeailab", "eagle3-speculators") else ())
               for f in FORMATS]  # fmt: skip


@pytest.mark.parametrize("published", _ONE_EAGLE3, indirect=True)
def test_greedy_output_equals_plain_decoding_with_every_loaded_head(published, target):
    """Chains for every format; EAGLE-2 dynamic trees for the EAGLE heads, a static tree for Medusa."""
    fmt, _, _, head = published
    model = target[1]
    prompts = [PROMPT, [5, 6, 7, 8, 9, 10, 11]]
    plain = jspec.Decoder(model).generate(prompts, 12).tokens
    tree = "2,2" if fmt == "medusa1" else DynamicTreeSpec(top_k=2, depth=3, total=6)
    for kw in ({"num_draft": 3}, {"tree": tree}):
        drafter = jspec.make_drafter(_method(fmt), model, head=head, **kw)
        got = jspec.SpeculativeDecoder(model, drafter).generate(prompts, 12)
        assert got.tokens == plain, (fmt, kw)


def test_sampling_through_a_loaded_eagle3_head_keeps_the_targets_distribution(target, tmp_path):
    """T = 1, 600 rows: speculative and plain samples of tokens 2 and 3 agree (two-sample chi-square)."""
    from stats_util import LEVEL, sampled_p_value

    model = target[1]
    write_published(tmp_path, "eagle3-safeailab")
    drafter = jspec.make_drafter("eagle3", model, num_draft=3, head=str(tmp_path))
    prompts = [PROMPT] * 600
    t1 = SamplingParams.create(temperature=1.0)
    spec = np.array(jspec.SpeculativeDecoder(model, drafter).generate(prompts, 4, t1, seed=1).tokens)
    plain = np.array(jspec.Decoder(model).generate(prompts, 4, t1, seed=2).tokens)
    assert sampled_p_value(spec, plain, V, positions=(1, 2, 3)) > LEVEL


@pytest.mark.parametrize("fmt", ["specforge", "speculators", "eagle"])
def test_a_jspec_head_exported_drafts_the_same_through_the_reference_and_back_in_jspec(target, tmp_path, fmt):
    from flax import nnx

    from jspec.heads.eagle import DraftHead, HeadConfig

    model = target[1]
    layers = (1, L // 2 - 1, L - 4) if fmt == "eagle" else (2, L // 2, L - 3)  # jspec's default: outputs 2, L/2, L-3
    config = HeadConfig.for_target(model.config, "eagle3", draft_vocab_size=K, feature_layers=layers)
    head = DraftHead(config, rngs=nnx.Rngs(7))
    head.attach_target(model, np.arange(V)[::-1][:K].copy())
    for name in ("emb_norm", "feat_norm", "mlp_norm", "final_norm"):
        getattr(head, name)[...] = 1 + 0.3 * jax.random.normal(jax.random.PRNGKey(len(name)), (H,))
    head.lm_head[...] = head.lm_head[...] * 30  # peaked drafts: the chains mean something
    out = export_head(head, fmt, tmp_path / fmt, verifier="tiny")
    back = load_any_head(out, model)
    want = jspec_first_step(jspec.make_drafter("eagle3", model, num_draft=N, head=head), model, PROMPT, 0.0)
    got = jspec_first_step(jspec.make_drafter("eagle3", model, num_draft=N, head=back), model, PROMPT, 0.0)
    assert got[:2] == want[:2]
    from safetensors.torch import load_file

    sd = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    if fmt == "speculators":
        facts = dict(capture=cfg["eagle_aux_hidden_state_layer_ids"], prefix="layers.0.")
        theta = cfg["transformer_layer_config"]["rope_theta"]
    else:
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        facts = dict(capture=[2, L // 2, L - 3] if ids is None else [k + 1 for k in ids], prefix="midlayer.")
        theta = cfg["rope_theta"]
    facts |= {"sd": sd, "theta": theta}
    _, ref_chain, _ = reference_chain("eagle3", facts, target[0], PROMPT, N)
    assert ref_chain == want[1]


def test_heads_that_do_not_fit_the_target_or_the_files_are_refused_by_name(target, tmp_path, monkeypatch):
    model = target[1]
    write_published(tmp_path, "eagle3-specforge")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cases = [
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        ({"num_hidden_layers": 2}, "num_hidden_layers = 2"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 9]}}, r"reads target layers \[1, 3, 9\]"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"norm_before_residual": True}, "norm_before_residual = True"),
    ]
    for change, needle in cases:
        (tmp_path / "config.json").write_text(json.dumps(cfg | change))
        with pytest.raises(ValueError, match=needle):
            load_any_head(tmp_path, model)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from jspec.models.tiny import tiny_model

    with pytest.raises(ValueError, match="a vocabulary of 64; the target has 97"):  # checked before compiling
        load_any_head(tmp_path, tiny_model("llama", num_layers=L))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_any_head(tmp_path, model)
    eagle1 = tmp_path / "eagle1"
    eagle1.mkdir()
    sd = write_published(eagle1, "eagle1-safeailab")["sd"]
    torch.save({k: v for k, v in sd.items() if k != "fc.bias"}, eagle1 / "pytorch_model.bin")
    with pytest.raises(ValueError, match="bias = 'absent \\(True\\)'"):  # SafeAILab's default: a bias
        load_any_head(eagle1, model)
    with monkeypatch.context() as m:  # a .bin without PyTorch installed: said, not a traceback
        m.setitem(__import__("sys").modules, "torch", None)
        with pytest.raises(ValueError, match="PyTorch checkpoint and PyTorch is not installed"):
            load_any_head(eagle1, model)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["MysteryDrafter"]}))
    save_file({"w": torch.zeros(2)}, str(other / "model.safetensors"))
    with pytest.raises(ValueError, match="unknown draft head layout"):
        load_any_head(other, model)


def test_medusa_heads_export_and_load_back_to_the_same_drafts(target, tmp_path):
    model = target[1]
    (tmp_path / "src").mkdir()
    write_published(tmp_path / "src", "medusa1")
    heads = load_any_head(tmp_path / "src", model)
    back = load_any_head(export_head(heads, "medusa", tmp_path / "out"), model)
    drafts = [jspec_first_step(jspec.make_drafter("medusa", model, head=h), model, PROMPT, 0.0) for h in (heads, back)]
    assert drafts[0][:2] == drafts[1][:2]


def test_export_head_command(target, tmp_path):
    """`jspec export-head` on a head jspec saved: the folder an engine loads, and a clear error for a format
    the head cannot be stated in."""
    from flax import nnx

    from jspec.cli.main import main
    from jspec.heads.eagle import DraftHead, HeadConfig, save_head

    model, folder = target[1], target[2]
    config = HeadConfig.for_target(model.config, "eagle3", draft_vocab_size=K)
    head = DraftHead(config, rngs=nnx.Rngs(1))
    head.attach_target(model, np.arange(K))
    save_head(head, tmp_path / "head")
    args = ["export-head", str(tmp_path / "head"), "--model", str(folder), "--out", str(tmp_path / "sp")]
    assert main([*args, "--format", "speculators", "--json"]) == 0
    assert detect_format(tmp_path / "sp") == "eagle3-speculators"
    assert main([*args, "--format", "eagle"]) == 2  # jspec's default layers are not SafeAILab's


def test_speculator_takes_a_hub_model_and_a_hub_head(target, tmp_path, monkeypatch):
    """`Speculator("ORG/MODEL", drafter="eagle3", head="ORG/HEAD")`, both from a cache in the Hub's layout
    (offline), decodes what plain decoding does."""
    from tiny_hf import lay_out_hub_cache

    head = tmp_path / "head"
    head.mkdir()
    write_published(head, "eagle3-specforge")
    lay_out_hub_cache(tmp_path / "hub", "tiny-org/tiny-llama3", target[2])
    lay_out_hub_cache(tmp_path / "hub", "tiny-org/tiny-llama3-eagle3", head)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = jspec.Speculator("tiny-org/tiny-llama3", drafter="eagle3", head="tiny-org/tiny-llama3-eagle3", num_draft=3)
    plain = jspec.Speculator("tiny-org/tiny-llama3", drafter=None)
    prompt = "w9 w17 w30 w9 w17"
    assert spec.generate(prompt, max_new_tokens=10).tokens == plain.generate(prompt, max_new_tokens=10).tokens
