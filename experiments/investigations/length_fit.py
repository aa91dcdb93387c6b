"""A sampled cell's speedup apart from its answers' lengths: prefill per prompt, cost per token per decoder.

    python experiments/investigations/length_fit.py JOURNAL [--decoders ar,ngram:N=3,ngram:N=7,auto]
        [--out experiments/results/length_fit.json]

At T = 1 every decoder samples its own answer, so on one prompt the end of text comes after 5 tokens for
one and 48 for another; where the prompt's prefill is a large part of the time, a rate ratio (tokens /
seconds, prefill included) then measures mostly the answers' lengths (docs/log, 2026-12-07, RAG T = 1).
This reads a :func:`jspec.analysis.bench.run_interleaved` journal (one JSON line per prompt, all
decoders' runs at batch 1) and fits, by least squares over every (prompt, decoder) run,

    seconds = prefill[prompt] + per_token[decoder] * tokens

(the decoders named share the target's prefill, so leave out a draft model, whose own prefill differs).
Reports the prefills, each decoder's cost per token and plain over it (the speedup per token), the
speedup per request at the mean prefill and the mean answer, and the residual's SD. A point estimate:
no interval. What the tuner, ``auto_cells.py`` and ``jspec bench`` report is the pairwise form with an
interval, :func:`jspec.analysis.paired.speedup_interval` (:func:`jspec.analysis.paired.matched_seconds`);
this script stays to read all of a journal's decoders in one fit.
"""

from __future__ import annotations

import json
import pathlib
import time

import numpy as np

from jspec.analysis.harness import arguments, save


def fit(rows: list[dict], decoders: list[str]) -> dict:
    """The least-squares fit above over ``rows`` (journal lines: ``{"batch", "results": {name: run}}``)."""
    design, seconds = [], []
    for i, row in enumerate(rows):
        for j, name in enumerate(decoders):
            run = row["results"][name]
            if len(run["tokens"]) != 1:
                raise SystemExit(f"length_fit.py fits batch-1 journals; prompt {i} has {len(run['tokens'])} rows.")
            x = np.zeros(len(rows) + len(decoders))
            x[i], x[len(rows) + j] = 1.0, len(run["tokens"][0])
            design.append(x)
            seconds.append(run["seconds"])
    design, seconds = np.array(design), np.array(seconds)
    coef = np.linalg.lstsq(design, seconds, rcond=None)[0]
    prefill, per_token = coef[: len(rows)], dict(zip(decoders, coef[len(rows) :].tolist(), strict=True))
    tokens = np.mean([len(r["results"][n]["tokens"][0]) for r in rows for n in decoders])
    plain = per_token[decoders[0]]
    return {
        "prompts": len(rows), "prefill_seconds": prefill.tolist(), "per_token_seconds": per_token,
        "speedup_per_token": {n: plain / c for n, c in per_token.items()},
        "mean_prefill_seconds": float(prefill.mean()), "mean_tokens": float(tokens),
        "speedup_per_request": {n: (prefill.mean() + tokens * plain) / (prefill.mean() + tokens * c)
                                for n, c in per_token.items()},
        "residual_sd_seconds": float(np.std(seconds - design @ coef)),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, out="experiments/results/length_fit.json")
    parser.add_argument("journal", type=pathlib.Path)
    parser.add_argument("--decoders", default="ar,ngram:N=3,ngram:N=7,auto", help="plain first; sharing its prefill")
    args = parser.parse_args(argv)
    lines = [json.loads(line) for line in args.journal.read_text().splitlines() if line.strip()]
    rows = [line for line in lines if "results" in line]
    decoders = args.decoders.split(",")
    missing = sorted({n for r in rows for n in decoders if n not in r["results"]})
    if not rows or missing:
        raise SystemExit(f"{args.journal}: no prompts, or no runs of {', '.join(missing)}; name its decoders.")
    report = fit(rows, decoders)
    for name in decoders:
        print(f"{name}: {report['per_token_seconds'][name]:.3f} s a token, {report['speedup_per_token'][name]:.3f}x "
              f"per token, {report['speedup_per_request'][name]:.3f}x per request")  # fmt: skip
    print(f"{report['prompts']} prompts; prefill {min(report['prefill_seconds']):.1f}-"
          f"{max(report['prefill_seconds']):.1f} s; residual SD {report['residual_sd_seconds']:.2f} s")  # fmt: skip
    save(args.out, report, args=args, started=started)
    return report


if __name__ == "__main__":
    main()
