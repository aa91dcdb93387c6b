"""Held-out agreement of EAGLE heads with the target, teacher-forced, per draft position.

    python experiments/ablations/head_agreement.py --heads HEAD_DIR[,HEAD_DIR...] [--model smollm2-135m]
        [--prompts mt-bench,humaneval] [--limit 8] [--max-new-tokens 64] [--steps 5] [--out DIR]

The target writes greedy responses to the first ``--limit`` prompts of each set once; each
head then drafts every position of those responses from the true prefix
(:func:`jspec.training.loss.teacher_forced_agreement`: one target forward and one head pass per
head, no decoding loop). At temperature 0 the agreement at draft position k is the chance a
chain's draft k is accepted when drafts 1 .. k - 1 were, so 1 + a1 + a1 a2 + ... estimates a
chain's τ. Compares heads (data sizes, recipes) on the same text in minutes. Writes
``head_agreement.json`` to --out.
"""

from __future__ import annotations

import pathlib
import time

from jspec.analysis.harness import arguments, save


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, model="smollm2-135m", prompts="mt-bench,humaneval", limit=8,
                       max_new_tokens=64, out="experiments/out")  # fmt: skip
    parser.add_argument("--heads", required=True, help="comma-separated head folders (written by jspec train)")
    parser.add_argument("--steps", type=int, default=5, help="draft positions scored (TTT steps)")
    args = parser.parse_args(argv)
    heads = [pathlib.Path(h) for h in args.heads.split(",") if h]
    for h in heads:
        if not (h / "head.json").exists():
            parser.error(f"--heads: {h} holds no head.json; pass folders written by jspec train.")

    from jspec.analysis.prompts import load_prompts
    from jspec.heads.eagle import load_head
    from jspec.loop.decode import Decoder
    from jspec.models.hub import load_model
    from jspec.training.loss import teacher_forced_agreement

    model, tokenizer = load_model(args.model)
    decoder = Decoder(model, eos_ids=tokenizer.eos_token_ids)
    texts = {}
    for name in args.prompts.split(","):
        prompts = [
            tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p.text}]))
            for p in load_prompts(name, None, args.limit)
        ]
        responses = decoder.generate(prompts, args.max_new_tokens).tokens
        texts[name] = ([p + list(r) for p, r in zip(prompts, responses, strict=True)], [len(p) for p in prompts])
    report = {"args": vars(args) | {"out": str(args.out)}, "heads": {}}
    for folder in heads:
        head = load_head(folder, model)
        rows = {}
        for name, (sequences, prompt_lengths) in texts.items():
            counts = teacher_forced_agreement(head, model, sequences, prompt_lengths, args.steps)
            agree = (counts[:, 0] / counts[:, 1].clip(1)).tolist()
            tau, reach = 1.0, 1.0
            for a in agree:
                reach *= a
                tau += reach
            rows[name] = {"agreement": agree, "drafts_scored": counts[:, 1].astype(int).tolist(), "chain_tau": tau}
            print(f"{folder} {name}: agreement {' '.join(f'{a:.3f}' for a in agree)}, "
                  f"chain-{args.steps} tau ~ {tau:.2f}", flush=True)  # fmt: skip
        report["heads"][str(folder)] = rows
    report = save(args.out / "head_agreement.json", report, args=args, started=started)
    return report


if __name__ == "__main__":
    main()
