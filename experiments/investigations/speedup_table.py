"""Speedup math: the (α, c) table, the N sweep, and simulation against E(α, N).

    python experiments/investigations/speedup_table.py [--verify-slope 0.3] [--out experiments/out] [--tiny]

Prints the table of best N, E and speedup over α ∈ {0.6, 0.7, 0.8, 0.9, 0.95}
and several drafter cost ratios c, for the classic verify cost r = 1 (an
accelerator, where a forward over N + 1 tokens costs what one token costs) and
for r(N) = 1 + S N (a CPU; the default S = 0.3 makes a six-token forward cost
2.5 one-token steps, as seen on this 2-core machine; fit S for your model).
Sweeps N = 1..10 at α = 0.9, c = 0.04. Runs the real verifier on toy
distributions of known overlap and compares the measured tokens per verify and
acceptance rate with the formulas. Writes ``speedup.json`` and
``speedup.png`` to --out.
"""

from __future__ import annotations

import pathlib
import time

from jspec.analysis.harness import arguments, plot, save
from jspec.analysis.simulate import simulate_chain
from jspec.analysis.speedup import best_num_draft, estimate, linear_verify_cost

ALPHAS = (0.6, 0.7, 0.8, 0.9, 0.95)
COST_RATIOS = (0.0, 0.01, 0.04, 0.1, 0.2, 0.5)


def table(verify_cost) -> list[dict]:
    rows = []
    for alpha in ALPHAS:
        for c in COST_RATIOS:
            best = best_num_draft(alpha, c, verify_cost, max_draft=64)
            rows.append(
                {
                    "alpha": alpha,
                    "cost_ratio": c,
                    "verify_cost": best.verify_cost,
                    "best_n": best.num_draft,
                    "expected_tokens": best.expected_tokens,
                    "speedup": best.speedup,
                }
            )
    return rows


def sweep(alpha: float, c: float, verify_cost, n_max: int = 10) -> list[dict]:
    return [
        {
            "n": n,
            "verify_cost": (e := estimate(alpha, n, c, verify_cost)).verify_cost,
            "expected_tokens": e.expected_tokens,
            "time_per_token": e.time_per_token,
            "speedup": e.speedup,
        }
        for n in range(1, n_max + 1)
    ]


def print_table(rows: list[dict], label: str) -> None:
    print(f"\nBest N (1..64), E and speedup, verify cost r = {label}")
    header = "alpha  " + "".join(f"{'c=' + str(c):>22}" for c in COST_RATIOS)
    print(header)
    for alpha in ALPHAS:
        cells = []
        for c in COST_RATIOS:
            row = next(r for r in rows if r["alpha"] == alpha and r["cost_ratio"] == c)
            cells.append(f"N={row['best_n']:>2} E={row['expected_tokens']:5.2f} {row['speedup']:5.2f}x")
        print(f"{alpha:<6} " + "".join(f"{cell:>22}" for cell in cells))


def _plot(rows_by_r: dict, sweeps: dict, path: pathlib.Path) -> None:
    with plot(path, figsize=(11, 4.2), dpi=110) as fig:
        ax0, ax1 = fig.subplots(1, 2)
        first = next(iter(sweeps.values()))
        ns = [row["n"] for row in first]
        ax0.plot(ns, [row["expected_tokens"] for row in first], "ko-", label="tokens per verify E")
        ax0.set_ylabel("tokens per verify")
        ax0.set_xlabel("N (drafts per step)")
        ax0.set_title("α = 0.9, c = 0.04")
        ax0.grid(alpha=0.3)
        twin = ax0.twinx()
        for r, rows in sweeps.items():
            twin.plot(ns, [row["time_per_token"] for row in rows], "s--", label=f"time per token, r = {r}")
        twin.set_ylabel("time per token (plain decoding = 1)")
        twin.set_ylim(0, 1.1)
        lines = ax0.get_legend_handles_labels()
        more = twin.get_legend_handles_labels()
        ax0.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="lower right")

        for r, rows in rows_by_r.items():
            for c, style in ((0.04, "-"), (0.2, ":")):
                pts = [row for row in rows if row["cost_ratio"] == c]
                ax1.plot(
                    [row["alpha"] for row in pts],
                    [row["speedup"] for row in pts],
                    "o" + style,
                    label=f"r = {r}, c = {c}",
                )
        ax1.axhline(1.0, color="grey", lw=0.8)
        ax1.set_xlabel("α (acceptance rate)")
        ax1.set_ylabel("speedup at the best N")
        ax1.set_title("Best-N speedup over plain decoding")
        ax1.legend(fontsize=8)
        ax1.grid(alpha=0.3)


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, out="experiments/out")
    parser.add_argument("--verify-slope", type=float, default=0.3, help="S in r(N) = 1 + S N (CPU-like)")
    parser.add_argument("--tiny", action="store_true", help="fewer simulated steps (tests, Colab)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    costs = {c.label: c for c in (linear_verify_cost(1.0), linear_verify_cost(1.0, args.verify_slope))}
    rs = tuple(costs)
    rows_by_r = {r: table(costs[r]) for r in rs}
    for r in rs:
        print_table(rows_by_r[r], r)
    print("(at c = 0 and r = 1 the speedup keeps growing toward 1 / (1 - alpha); the search stops at 64)")

    sweeps = {r: sweep(0.9, 0.04, costs[r]) for r in rs}
    print("\nSweep at alpha = 0.9, c = 0.04")
    print(f"{'N':>3} {'tokens/verify':>14}" + "".join(f"{'time/token, r = ' + r:>26}" for r in rs))
    for i, row in enumerate(sweeps[rs[0]]):
        times = "".join(f"{sweeps[r][i]['time_per_token']:>26.4f}" for r in rs)
        print(f"{row['n']:>3} {row['expected_tokens']:>14.4f}{times}")

    steps = 4_000 if args.tiny else 20_000
    sims = []
    print(f"\nSimulated verify steps ({steps} each) against the formulas")
    print(f"{'alpha':>6} {'N':>3} {'a(p,q)':>8} {'a meas':>8} {'E':>8} {'E meas':>8} {'rel err':>8}")
    for alpha in ALPHAS:
        for n in (1, 4, 8):
            run = simulate_chain(alpha, n, steps=steps, seed=n)
            rel = run.measured_tokens / run.expected_tokens - 1
            sims.append({**run.__dict__, "relative_error": rel})
            print(
                f"{alpha:>6} {n:>3} {run.alpha_from_pq:8.4f} {run.measured_alpha:8.4f} "
                f"{run.expected_tokens:8.4f} {run.measured_tokens:8.4f} {rel:+8.4f}"
            )
    worst = max(abs(s["relative_error"]) for s in sims)
    print(f"largest |measured / expected - 1| of tokens per verify: {worst:.4f}")

    result = {
        "tables": rows_by_r,
        "sweep_alpha_0.9_c_0.04": sweeps,
        "simulation": sims,
    }
    result = save(args.out / "speedup.json", result, args=args, started=started)
    _plot(rows_by_r, sweeps, args.out / "speedup.png")
    print(f"\nwrote {args.out / 'speedup.json'} and {args.out / 'speedup.png'}")
    return result


if __name__ == "__main__":
    main()
