"""Draft trees: shapes, the ancestor mask, EAGLE-2's selection, and exact tree verification on toy chains."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jspec.core.sampling import sample
from jspec.core.tree import StaticTree, ancestor_mask, verify_tree, verify_tree_batch
from jspec.core.verify import verify_chain
from jspec.drafters.unroll import grow_dynamic_tree, select_dynamic_tree

V = 6  # toy vocabulary


def test_static_tree_shapes():
    tree = StaticTree.from_branching([2, 2, 2])
    assert tree.size == 15 and tree.num_leaves == 8 and tree.max_depth == 3
    assert tree.parents[:7] == (0, 0, 0, 1, 1, 2, 2)
    assert StaticTree.chain(4).parents == (0, 0, 1, 2, 3)
    assert StaticTree.from_branching([3, 1]).depths == (0, 1, 1, 1, 2, 2, 2)
    # Fed to the drafter, a depth at a time: every depth but the deepest (the root is already in).
    assert tree.fed_per_depth == (2, 4) and StaticTree.chain(5).fed_per_depth == (1, 1, 1, 1)
    assert StaticTree.from_branching([3, 1]).fed_per_depth == (3,) and StaticTree.chain(1).fed_per_depth == ()
    with pytest.raises(ValueError, match="positive ints"):
        StaticTree.from_branching([2, 0])
    with pytest.raises(ValueError, match="earlier node"):
        StaticTree((0, 2, 1))


def test_ancestor_mask_matches_walking_up_by_hand():
    tree = StaticTree.from_branching([2, 1, 3])
    parents, _ = tree.arrays()
    want = np.zeros((tree.size, tree.size), bool)
    for i in range(tree.size):
        j = i
        want[i, j] = True
        while j != 0:
            j = parents[j]
            want[i, j] = True
    got = np.asarray(ancestor_mask(jnp.asarray(parents), tree.max_depth))
    np.testing.assert_array_equal(got, want)
    # One step short of the depth misses the root for the deepest nodes.
    assert not np.array_equal(np.asarray(ancestor_mask(jnp.asarray(parents), tree.max_depth - 1)), want)


def test_select_dynamic_tree_keeps_best_and_their_ancestors():
    rng = np.random.default_rng(0)
    c = 40
    parents = np.array([0] + [rng.integers(0, i) for i in range(1, c)], np.int32)
    scores = np.zeros(c, np.float32)
    for i in range(1, c):
        scores[i] = scores[parents[i]] + np.log(rng.uniform(0.05, 1.0))
    scores[0] = np.inf
    keep, new_parents = select_dynamic_tree(jnp.asarray(scores), jnp.asarray(parents), 12)
    keep, new_parents = np.asarray(keep), np.asarray(new_parents)
    assert set(keep) == set(np.argsort(-scores, kind="stable")[:12])
    assert list(keep) == sorted(keep) and keep[0] == 0
    for i in range(1, 12):  # each kept node's parent is kept and renumbered
        assert keep[new_parents[i]] == parents[keep[i]] and new_parents[i] < i


# ------------------------------------------------------------------- exactness on toy Markov chains
#
# The target is a Markov chain Q[current, next] and the drafter another one, P.
# From a fixed root token r, the first two emitted tokens must be distributed as
# Q[r, a] * Q[a, b]: a step that emits one token is followed by a second step
# rooted at that token, as the engine does.


def _chains(seed):
    rng = np.random.default_rng(seed)
    q = rng.dirichlet(np.ones(V), size=V)
    p = 0.5 * q + 0.5 * rng.dirichlet(np.full(V, 0.5), size=V)  # related, not equal
    return jnp.asarray(q, jnp.float32), jnp.asarray(p, jnp.float32)


def _static_tree_draft(tree, p, root, key, mode):
    """(tokens, draft_probs) of a static tree: children the top-k of P (one-hot) or sampled from P."""
    parents, _ = tree.arrays()
    rank = np.zeros(tree.size, int)
    for i in range(1, tree.size):
        rank[i] = sum(1 for j in range(1, i) if parents[j] == parents[i])
    tokens = [jnp.asarray(root, jnp.int32)]
    probs = [jnp.zeros((V,))]
    for i in range(1, tree.size):
        dist = p[tokens[parents[i]]]
        if mode == "top-k":
            tok = jnp.argsort(-dist)[rank[i]].astype(jnp.int32)
            probs.append(jax.nn.one_hot(tok, V))
        else:
            tok = sample(jax.random.fold_in(key, i), dist).astype(jnp.int32)
            probs.append(dist)
        tokens.append(tok)
    return jnp.stack(tokens), jnp.stack(probs), jnp.asarray(parents)


def _toy_expand(p):
    def expand(state, tokens, parent_slot, d):
        return jnp.log(p[tokens]), state

    return expand


def _step(q, p, root, key, tree_kind, verifier):
    """One verify step; kinds ending in "scalar" pass draft_probs=None (the one-hot fast path)."""
    k_draft, k_verify = jax.random.split(key)
    scalar = str(tree_kind).endswith("scalar")
    if str(tree_kind).startswith("dynamic"):
        tree, _ = grow_dynamic_tree(_toy_expand(p), (), root[None], jnp.log(p[root])[None], top_k=2, depth=3, total=8)
        tokens, parents, used = tree.tokens[0], tree.parents[0], jnp.ones((8,), bool)
        draft_probs = jax.nn.one_hot(tokens, V)
        max_depth = 3
    else:
        shape, mode = tree_kind
        static = StaticTree.from_branching(shape)
        tokens, draft_probs, parents = _static_tree_draft(static, p, root, k_draft, mode.removesuffix("-scalar"))
        used = jnp.ones((static.size,), bool)
        max_depth = static.max_depth
    return verifier(tokens, parents, used, None if scalar else draft_probs, q[tokens], k_verify, max_depth)


def _first_two(q, p, tree_kind, verifier, n, root=0, seed=1):
    @jax.jit
    def one(key):
        k1, k2 = jax.random.split(key)
        v1 = _step(q, p, jnp.int32(root), k1, tree_kind, verifier)
        v2 = _step(q, p, v1.tokens[0], k2, tree_kind, verifier)
        second = jnp.where(v1.num_emitted >= 2, v1.tokens[1], v2.tokens[0])
        return v1.tokens[0], second, v1.num_accepted

    a, b, acc = jax.vmap(one)(jax.random.split(jax.random.PRNGKey(seed), n))
    return np.asarray(a), np.asarray(b), np.asarray(acc)


def _joint_pvalue(q, a, b, root=0):
    q = np.asarray(q, np.float64)
    joint = (q[root][:, None] * q).reshape(-1)
    expected = joint / joint.sum() * len(a)
    observed = np.bincount(a * V + b, minlength=V * V).astype(np.float64)
    small = expected < 5
    exp_b = np.append(expected[~small], expected[small].sum())
    obs_b = np.append(observed[~small], observed[small].sum())
    return stats.chisquare(obs_b, exp_b).pvalue


def _verify_without_residual(tokens, parents, used, draft_probs, target_probs, key, max_depth):
    """A broken verifier: after all children are rejected it samples the node's q, not the residual."""
    v = verify_tree(tokens, parents, used, draft_probs, target_probs, key, max_depth)
    node = v.path[v.num_accepted]
    redraw = sample(jax.random.fold_in(key, 7), target_probs[node])
    rejected_at_node = jnp.any((parents == node) & used & (jnp.arange(tokens.shape[0]) > 0))
    fixed = jnp.where(rejected_at_node, redraw, v.tokens[v.num_accepted])
    return v.replace(tokens=v.tokens.at[v.num_accepted].set(fixed))


TREES = [
    ((2, 2, 2), "top-k"), ((2, 2, 2), "top-k-scalar"), ((2, 2, 2), "sampled"), ((3, 1), "sampled"),
    ((1, 1, 1), "sampled"), "dynamic", "dynamic-scalar",
]  # fmt: skip


@pytest.mark.parametrize("tree_kind", TREES, ids=str)
def test_tree_verification_is_exact(tree_kind):
    q, p = _chains(0)
    a, b, acc = _first_two(q, p, tree_kind, verify_tree, 40_000)
    assert _joint_pvalue(q, a, b) > 1e-3
    assert acc.mean() > 0.3  # the tree did accept drafts, so acceptance was exercised


NEGATIVE = [((2, 2, 2), "top-k"), ((2, 2, 2), "top-k-scalar"), ((2, 2, 2), "sampled"), "dynamic-scalar"]


@pytest.mark.parametrize("tree_kind", NEGATIVE, ids=str)
def test_tree_verification_negative_control(tree_kind):
    q, p = _chains(0)
    a, b, _ = _first_two(q, p, tree_kind, _verify_without_residual, 40_000)
    assert _joint_pvalue(q, a, b) < 1e-6


def test_sibling_rule_accepts_each_child_with_its_target_mass():
    """Deterministic children: P(child i accepted) = q(x_i), whatever came before it."""
    q, p = _chains(3)
    tree = StaticTree.from_branching([3])
    tokens, probs, parents = _static_tree_draft(tree, p, 0, None, "top-k")
    keys = jax.random.split(jax.random.PRNGKey(0), 40_000)
    run = jax.jit(jax.vmap(lambda k: verify_tree(tokens, parents, jnp.ones(4, bool), probs, q[tokens], k, 1).path[1]))
    paths = np.asarray(run(keys))
    qs = np.asarray(q[0])[np.asarray(tokens[1:])]
    for i in range(3):
        frac = np.mean(paths == i + 1)
        assert abs(frac - qs[i]) < 4 * np.sqrt(qs[i] * (1 - qs[i]) / len(keys)) + 1e-3, (i, frac, qs[i])


@pytest.mark.parametrize("tree_kind", [((2, 2, 2), "top-k"), "dynamic", "dynamic-scalar"], ids=str)
def test_greedy_tree_follows_the_target_argmax(tree_kind):
    """With a one-hot target the walk accepts the child equal to the argmax and the output is the greedy chain."""
    q, p = _chains(1)
    greedy = jax.nn.one_hot(jnp.argmax(q, axis=-1), V)
    p_close = 0.7 * greedy + 0.3 * p  # the drafter's top choices usually include the argmax
    v = jax.jit(lambda k: _step(greedy, p_close, jnp.int32(2), k, tree_kind, verify_tree))(jax.random.PRNGKey(0))
    want, tok = [], 2
    for _ in range(int(v.num_emitted)):
        tok = int(np.argmax(np.asarray(q)[tok]))
        want.append(tok)
    assert np.asarray(v.tokens)[: int(v.num_emitted)].tolist() == want
    assert int(v.num_accepted) == 3  # the drafter's top-1 is the argmax everywhere here


def test_dynamic_tree_grows_the_likeliest_paths():
    _, p = _chains(2)
    logp = jnp.log(p)
    tree, _ = grow_dynamic_tree(_toy_expand(p), (), jnp.zeros((1,), jnp.int32), logp[:1], top_k=3, depth=3, total=10)
    tokens, parents, depths, scores = (np.asarray(x[0]) for x in (tree.tokens, tree.parents, tree.depths, tree.scores))
    lp = np.asarray(logp)
    for i in range(1, 10):
        assert parents[i] < i and depths[i] == depths[parents[i]] + 1
        np.testing.assert_allclose(scores[i], scores[parents[i]] + lp[tokens[parents[i]], tokens[i]], rtol=1e-5)
    # Depth 1 holds the root's top-3 children, in the drafter's order of likelihood.
    assert set(tokens[depths == 1]) <= set(np.argsort(-lp[0])[:3])
    with pytest.raises(ValueError, match="total"):
        grow_dynamic_tree(_toy_expand(p), (), jnp.zeros((1,), jnp.int32), logp[:1], top_k=2, depth=2, total=8)


# ---------------------------------------------------------------- the verifiers' own contracts


def _three_node_chain():
    """root -> node 1 (token 1) -> node 2 (token 2); q after the root is one-hot on 1, after node 1 {0: .5, 2: .5}."""
    tokens, parents, used = jnp.array([0, 1, 2]), jnp.array([0, 0, 1]), jnp.ones(3, bool)
    q = jnp.array([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    return tokens, parents, used, q


def test_a_max_depth_below_the_trees_depth_is_refused_before_anything_runs():
    tokens, parents, used, q = _three_node_chain()
    key = jax.random.PRNGKey(0)
    with pytest.raises(ValueError, match="max_depth is 1 but the tree has a used node at depth 2"):
        verify_tree(tokens, parents, used, None, q, key, 1)
    with pytest.raises(ValueError, match="max_depth is 1 but"):
        verify_tree_batch(tokens[None], parents[None], used[None], None, q[None], key[None], 1)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="max_depth must be a positive int"):
            verify_tree(tokens, parents, used, None, q, key, bad)
    with pytest.raises(ValueError, match="parent must come before it"):
        verify_tree(tokens, jnp.array([0, 2, 1]), used, None, q, key, 2)
    verify_tree(tokens, parents, used.at[2].set(False), None, q, key, 1)  # the unused deep node does not count


def test_a_walk_cut_short_inside_jit_draws_the_bonus_from_q_not_from_an_untried_childs_residual():
    """Traced arrays cannot be checked; a max_depth below the tree's depth then verifies the tree cut at that
    depth, exactly: the next token after node 1 is q's {0: .5, 2: .5}, not 'q without node 2's token' (always 0,
    the bias the peers' conformance run found)."""
    tokens, parents, used, q = _three_node_chain()
    run = jax.jit(jax.vmap(lambda k, t, p, u: verify_tree(t, p, u, None, q, k, 1).tokens, (0, None, None, None)))
    out = np.asarray(run(jax.random.split(jax.random.PRNGKey(0), 4000), tokens, parents, used))
    assert np.all(out[:, 0] == 1)
    assert stats.binomtest(int(np.sum(out[:, 1] == 2)), len(out), 0.5).pvalue > 1e-3


def test_tree_verdicts_pad_with_the_given_id_and_mark_what_was_accepted():
    tokens, parents, used, q = _three_node_chain()
    keys = jax.random.split(jax.random.PRNGKey(1), 64)
    for probs in (None, jax.nn.one_hot(tokens, 3)):
        v = jax.vmap(lambda k, probs=probs: verify_tree(tokens, parents, used, probs, q, k, 2, pad_id=-1))(keys)
        slots = np.arange(3)
        emitted = slots[None] < np.asarray(v.num_emitted)[:, None]
        assert np.all(np.asarray(v.tokens)[~emitted] == -1) and np.all(np.asarray(v.tokens)[emitted] >= 0)
        np.testing.assert_array_equal(np.asarray(v.accepted), slots[None, :2] < np.asarray(v.num_accepted)[:, None])
        assert 0 < np.asarray(v.num_accepted).mean() < 2  # both ends of the walk were exercised


def test_a_draft_its_drafter_gives_probability_zero_is_never_accepted():
    """A placeholder: not drawn from p. Chain and tree reject it whatever q gives it."""
    p = jnp.array([[0.5, 0.0, 0.5]])
    q = jnp.array([[0.1, 0.8, 0.1], [1 / 3, 1 / 3, 1 / 3]])
    keys = jax.random.split(jax.random.PRNGKey(2), 500)
    chain = jax.vmap(lambda k: verify_chain(jnp.array([1]), p, q, k))(keys)
    assert int(np.asarray(chain.num_accepted).max()) == 0
    tree = jax.vmap(lambda k: verify_tree(jnp.array([0, 1]), jnp.array([0, 0]), jnp.ones(2, bool),
                                          jnp.concatenate([p, p]), q, k, 1))(keys)  # fmt: skip
    assert int(np.asarray(tree.num_accepted).max()) == 0
