"""Whether two versions of jspec compile the same decoding loops (for changes that must not change them).

    python experiments/investigations/same_program.py dump --out DIR      # once per version (checkout or commit)
    python experiments/investigations/same_program.py compare DIR_A DIR_B

``dump`` runs tiny greedy and sampled decodes of every kind of proposal (prompt lookup's chain, Lookahead's
window, an EAGLE-3 head's chain and dynamic tree, the adaptive loop) on a random tiny target, with XLA's
HLO dump on, and keeps each speculative loop's optimized HLO and the tokens. ``compare`` puts both in
one form (debug metadata and the source tables dropped, instruction names renumbered in order of
appearance) and says per loop whether the programs are the same, else how many lines differ and the
first ones; and whether the tokens are. Same programs run at the same speed on the same machine, which
no timing here can resolve as finely.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

from jspec.analysis.harness import save

LOOP = "jit_speculative_loop"


def _decode(out: pathlib.Path) -> None:
    """The decodes (run with XLA_FLAGS set: jax reads them once)."""
    import numpy as np
    from flax import nnx

    import jspec
    from jspec.heads.eagle import DraftHead, HeadConfig
    from jspec.loop.adaptive import Adaptive, StepCosts
    from jspec.models.tiny import tiny_model

    target = tiny_model("llama")
    config = target.config
    head = DraftHead(HeadConfig.for_target(config, "eagle3", draft_vocab_size=32, feature_layers=(0, 1, 2)),
                     rngs=nnx.Rngs(1))  # fmt: skip
    head.attach_target(target, np.arange(32))
    cases = {
        "prompt lookup": (jspec.make_drafter("ngram", target, num_draft=3), {}),
        "lookahead": (jspec.make_drafter("lookahead", target), {}),
        "eagle3 chain": (jspec.make_drafter("eagle3", target, head=head, num_draft=3), {}),
        "eagle3 tree": (jspec.make_drafter("eagle3", target, head=head, tree=jspec.DynamicTreeSpec(2, 2, 4)), {}),
    }
    adaptive = {"adaptive": Adaptive(), "costs": StepCosts.create(1.5)}
    cases["adaptive"] = (jspec.make_drafter("ngram", target, num_draft=3), adaptive)
    prompt = [[5, 6, 7, 5, 6, 7, 5, 6]]
    tokens = {}
    for name, (drafter, options) in cases.items():
        decoder = jspec.SpeculativeDecoder(target, drafter, eos_ids=(), **options)
        tokens[name] = decoder.generate(prompt, 8, jspec.SamplingParams.create(1.0), seed=3).tokens
    (out / "tokens.json").write_text(json.dumps({"order": list(cases), "tokens": tokens}, indent=1))


def dump(out: pathlib.Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "xla"
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={raw} --xla_dump_hlo_as_text", JSPEC_XLA_CACHE="0")
    subprocess.run([sys.executable, __file__, "_decode", "--out", str(out)], env=env, check=True)
    order = json.loads((out / "tokens.json").read_text())["order"]
    loops = sorted(raw.glob(f"module_*.{LOOP}.*after_optimizations.txt"))
    if len(loops) != len(order):
        raise SystemExit(f"expected {len(order)} speculative loops in {raw}, found {len(loops)}")
    for name, path in zip(order, loops, strict=True):  # compiled in the order the cases ran
        (out / (name.replace(" ", "_") + ".hlo")).write_text(path.read_text())
    return {"out": str(out), "loops": order}


def canonical(text: str) -> list[str]:
    """The module's instructions without debug information, names renumbered by first appearance."""
    names: dict[str, str] = {}

    def rename(m):
        return names.setdefault(m.group(0), f"%v{len(names)}")

    lines = []
    for line in text.splitlines():
        if re.match(r'^\s*\d+ (\{|")', line) or re.match(r"^(FileNames|FunctionNames|FileLocations|StackFrames)", line):
            continue
        line = re.sub(r",? ?(metadata=\{[^}]*\}|stack_frame_id=\d+)", "", line)
        lines.append(re.sub(r"%[\w.\-]+", rename, line))
    return lines


def compare(a: pathlib.Path, b: pathlib.Path) -> dict:
    ta, tb = (json.loads((d / "tokens.json").read_text()) for d in (a, b))
    report = {}
    for name in ta["order"]:
        file = name.replace(" ", "_") + ".hlo"
        la, lb = canonical((a / file).read_text()), canonical((b / file).read_text())
        differ = [(x, y) for x, y in zip(la, lb, strict=False) if x != y]
        report[name] = {"same_program": la == lb, "lines": [len(la), len(lb)], "differing_lines": len(differ),
                        "same_tokens": ta["tokens"][name] == tb["tokens"].get(name),
                        "first_differences": [[x[:160], y[:160]] for x, y in differ[:3]]}  # fmt: skip
        r = report[name]
        print(f"{name:<14} program {'same' if r['same_program'] else 'DIFFERS'} ({r['differing_lines']} of "
              f"{len(la)} lines), tokens {'same' if r['same_tokens'] else 'DIFFER'}")  # fmt: skip
    return report


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("dump").add_argument("--out", type=pathlib.Path, required=True)
    sub.add_parser("_decode").add_argument("--out", type=pathlib.Path, required=True)
    p = sub.add_parser("compare")
    p.add_argument("a", type=pathlib.Path)
    p.add_argument("b", type=pathlib.Path)
    p.add_argument("--out", type=pathlib.Path, default=None, help="also write the comparison to this JSON file")
    args = parser.parse_args(argv)
    if args.command == "_decode":
        return _decode(args.out) or {}
    if args.command == "dump":
        return dump(args.out)
    report = compare(args.a, args.b)
    return save(args.out, report, args=args, started=started) if args.out else report


if __name__ == "__main__":
    main()
