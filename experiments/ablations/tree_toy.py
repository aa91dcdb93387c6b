"""Draft trees against chains on toy distributions: acceptance per leaf, tokens per verifier call.

    python experiments/ablations/tree_toy.py [--vocab 32] [--trials 20000] [--mix 0.3,0.6,0.9] [--out experiments/out]

The target is a Markov chain Q[current, next] over a small vocabulary and the
drafter another chain P = mix * Q + (1 - mix) * noise, so ``mix`` sets how
often the drafter agrees. From random root tokens, each trial drafts one tree
(children of a node: the top-k of P below it, one-hot, or samples from P) and
verifies it with :func:`jspec.core.tree.verify_tree`, at temperature 1 (Q itself).
Reported per drafter quality:

* α, the chance one draft token drawn from P is accepted against Q
  (1 - total variation, averaged over the root states), and a chain's
  expected tokens per call from it, (1 - α^(N+1)) / (1 - α);
* tokens per verifier call (accepted drafts + the correction or bonus token)
  for a chain of 3 (same depth as the tree), the [2, 2, 2] tree (14 drafts), a
  chain of 14 (the same number of verified tokens as the tree: equal target
  compute where a forward's cost grows with its tokens) and a [4, 2, 1] tree;
* for [2, 2, 2], how often the accepted path reaches each of its 8 leaves, and
  how often each depth is reached.

Writes ``tree_toy.json`` to --out and prints the tables the log (docs/log/) keeps.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.analysis.harness import arguments, save
from jspec.core.sampling import sample
from jspec.core.tree import StaticTree, verify_tree


def chains(vocab: int, mix: float, seed: int = 0):
    """(Q, P): a peaked random target chain and a drafter that agrees with it by ``mix``."""
    rng = np.random.default_rng(seed)
    q = rng.dirichlet(np.full(vocab, 0.1), size=vocab)  # peaked, as language models are
    noise = rng.dirichlet(np.full(vocab, 0.1), size=vocab)
    p = mix * q + (1 - mix) * noise
    return jnp.asarray(q, jnp.float32), jnp.asarray(p, jnp.float32)


def alpha(q, p) -> float:
    """Mean over states of sum_x min(P, Q): the acceptance rate of one sampled draft."""
    return float(jnp.mean(jnp.sum(jnp.minimum(q, p), axis=-1)))


def _sibling_rank(tree: StaticTree) -> np.ndarray:
    parents, _ = tree.arrays()
    rank = np.zeros(tree.size, int)
    for i in range(1, tree.size):
        rank[i] = sum(1 for j in range(1, i) if parents[j] == parents[i])
    return rank


def draft_tree(tree: StaticTree, p, root, key, mode: str):
    """(tokens int32[T], draft_probs float32[T, V] or None) of one static tree below ``root``."""
    parents, _ = tree.arrays()
    rank = _sibling_rank(tree)
    tokens = [root]
    probs = [jnp.zeros(p.shape[-1])]
    for i in range(1, tree.size):
        dist = p[tokens[parents[i]]]
        if mode == "top-k":
            tokens.append(jnp.argsort(-dist)[rank[i]].astype(jnp.int32))
        else:
            tokens.append(sample(jax.random.fold_in(key, i), dist).astype(jnp.int32))
        probs.append(dist)
    return jnp.stack(tokens), (None if mode == "top-k" else jnp.stack(probs))


def run_tree(tree: StaticTree, q, p, mode: str, trials: int, seed: int = 0):
    """Per trial: (accepted path int32[D + 1], tokens emitted int32[])."""
    parents = jnp.asarray(tree.arrays()[0])
    used = jnp.ones((tree.size,), bool)
    vocab = q.shape[0]

    @jax.jit
    @jax.vmap
    def one(key):
        k_root, k_draft, k_verify = jax.random.split(key, 3)
        root = jax.random.randint(k_root, (), 0, vocab)
        tokens, draft_probs = draft_tree(tree, p, root, k_draft, mode)
        v = verify_tree(tokens, parents, used, draft_probs, q[tokens], k_verify, tree.max_depth)
        return v.path, v.num_emitted

    path, emitted = one(jax.random.split(jax.random.PRNGKey(seed), trials))
    return np.asarray(path), np.asarray(emitted)


def leaf_rates(tree: StaticTree, path: np.ndarray) -> list[float]:
    """For each leaf (in node order), the fraction of trials whose accepted path ends there."""
    parents, depths = tree.arrays()
    leaves = [i for i in range(tree.size) if i not in set(parents[1:].tolist()) and i > 0]
    last = path[:, -1]  # a full-depth path ends at a leaf of the deepest level
    return [float(np.mean(last == leaf)) for leaf in leaves if depths[leaf] == tree.max_depth]


SHAPES = {"chain 3": [1, 1, 1], "[2,2,2]": [2, 2, 2], "chain 14": [1] * 14, "[4,2,1]": [4, 2, 1]}


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, out="experiments/out")
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--trials", type=int, default=20_000)
    parser.add_argument("--mix", default="0.3,0.6,0.9", help="drafter agreement levels")
    args = parser.parse_args(argv)
    results = {"vocab": args.vocab, "trials": args.trials, "rows": []}
    for mix in (float(m) for m in args.mix.split(",")):
        q, p = chains(args.vocab, mix)
        a = alpha(q, p)
        row = {"mix": mix, "alpha": a, "chain_formula": {n: (1 - a ** (n + 1)) / (1 - a) for n in (3, 14)}}
        for mode in ("sampled", "top-k"):
            for name, branching in SHAPES.items():
                tree = StaticTree.from_branching(branching)
                path, emitted = run_tree(tree, q, p, mode, args.trials)
                depth_reached = [float(np.mean(emitted > d)) for d in range(1, tree.max_depth + 1)]
                cell = {"nodes": tree.size, "tokens_per_call": float(emitted.mean()), "depth_reached": depth_reached}
                if name == "[2,2,2]":
                    cell["leaf_rates"] = leaf_rates(tree, path)
                row[f"{mode} {name}"] = cell
        results["rows"].append(row)

    print(f"vocabulary {args.vocab}, {args.trials} trials per cell, temperature 1")
    print("tokens per verifier call (verified tokens incl. the root in brackets):")
    head = " | ".join(f"{n} ({StaticTree.from_branching(b).size})" for n, b in SHAPES.items())
    print(f"| mix | α | drafts | {head} | chain formula 3 / 14 |")
    for row in results["rows"]:
        for mode in ("sampled", "top-k"):
            cells = " | ".join(f"{row[f'{mode} {n}']['tokens_per_call']:.2f}" for n in SHAPES)
            f3, f14 = row["chain_formula"][3], row["chain_formula"][14]
            print(f"| {row['mix']} | {row['alpha']:.2f} | {mode} | {cells} | {f3:.2f} / {f14:.2f} |")
    print("\n[2,2,2]: fraction of calls whose accepted path reaches each leaf (node order), and each depth:")
    for row in results["rows"]:
        for mode in ("sampled", "top-k"):
            cell = row[f"{mode} [2,2,2]"]
            leaves = " ".join(f"{r:.3f}" for r in cell["leaf_rates"])
            depths = " ".join(f"{r:.2f}" for r in cell["depth_reached"])
            print(f"| {row['mix']} | {mode} | {leaves} | {depths} |")
    results = save(args.out / "tree_toy.json", results, args=args, started=started)
    return results


if __name__ == "__main__":
    main()
