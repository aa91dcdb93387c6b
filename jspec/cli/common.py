"""What several ``jspec`` commands share: model options, a streaming printer, plots."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

from jspec.analysis.speedup import estimate
from jspec.loop.sharding import initialize, make_mesh, parse_mesh

__all__ = [
    "DEFAULTS_SHOWN", "Parser", "add_mesh_options", "add_model_options", "figure", "interrupt_hooks", "mesh_from_args",
    "on_interrupt", "plot_bench", "plot_speedup", "stream_printer",
]  # fmt: skip

interrupt_hooks: list = []  # run by ``jspec``'s main on Ctrl-C, newest first, before it exits with 130


@contextlib.contextmanager
def on_interrupt(hook):
    """While the block runs, a Ctrl-C calls ``hook()`` (e.g. to print what was generated) before the exit."""
    interrupt_hooks.append(hook)
    try:
        yield
    finally:
        interrupt_hooks.remove(hook)


class DEFAULTS_SHOWN(argparse.ArgumentDefaultsHelpFormatter):  # noqa: N801 (argparse's naming)
    """``--help`` with every default (argparse's own formatter, minus "(default: None)" noise)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """The ``jspec`` parser: every subcommand's ``--help`` shows the defaults (subparsers take this class)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DEFAULTS_SHOWN)
        super().__init__(*args, **kwargs)

    def error(self, message):
        """Bad input: one line (what was wrong, where to read more), exit status 2; no usage block."""
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def add_model_options(p: argparse.ArgumentParser, default: str = "smollm2-135m") -> None:
    p.add_argument(
        "--model",
        default=default,
        help="a local Hugging Face model folder, a registry name, or a Hub id ORG/NAME[@REVISION] "
        "(tried in that order; HF_HUB_OFFLINE, HF_HUB_CACHE, HF_TOKEN honoured)",
    )
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="weights' dtype (default: float32 on CPU, bfloat16 on an accelerator)")  # fmt: skip


def add_mesh_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", default=None, metavar="data=D,model=M",
                   help="run over D x M devices: rows split over data, weights and KV heads over model "
                        "(jax.sharding; default: one device)")  # fmt: skip
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="several processes (jax.distributed): process 0's address; with --num-processes and "
                        "--process-id, the mesh spans every process's devices")  # fmt: skip
    p.add_argument("--num-processes", type=int, default=None, help="with --coordinator: how many processes")
    p.add_argument("--process-id", type=int, default=None, help="with --coordinator: this process, 0..N-1")


def mesh_from_args(args):
    """The mesh ``--mesh`` asks for (None without it), joining the other processes first when
    ``--coordinator`` is given; bad values are refused before any model loads."""

    distributed = (args.coordinator, args.num_processes, args.process_id)
    if any(v is not None for v in distributed):
        if None in distributed:
            raise ValueError("several processes need all of --coordinator HOST:PORT, --num-processes N and "
                             "--process-id I.")  # fmt: skip
        if args.mesh is None:
            raise ValueError("--coordinator runs one generation over every process's devices: give --mesh too.")
        initialize(*distributed)
    return None if args.mesh is None else make_mesh(**parse_mesh(args.mesh))


class _StreamPrinter:
    """``on_tokens`` for ``generate``: prints row 0's new text as it is accepted.

    Text is decoded from all tokens so far and only the part past what was printed is written,
    held back while it ends in a partial character (a byte-level token can split one).
    """

    def __init__(self, tokenizer, out=None, show: bool = True):
        self.tokenizer, self.out, self.shown, self.show = tokenizer, out or sys.stdout, "", show
        self.latest: list[int] = []  # row 0's tokens so far: what an interrupted run still prints
        self.first_at: float | None = None  # time.time() when row 0's first token arrived

    def _show(self, text: str) -> None:
        if text.startswith(self.shown) and not text.endswith("\ufffd"):
            self.out.write(text[len(self.shown) :])
            self.out.flush()
            self.shown = text

    def __call__(self, tokens, counts) -> None:
        self.latest = tokens[0, : counts[0]].tolist()
        if self.first_at is None and self.latest:
            self.first_at = time.time()
        if self.show:
            self._show(self.tokenizer.decode(self.latest))

    def interrupted(self) -> None:
        """Ctrl-C: the text generated so far that was not shown yet, and a newline."""
        self.finish(self.tokenizer.decode(self.latest))

    def finish(self, completion: str) -> None:
        """The rest of the completion (tokens past an end of sequence are never shown) and a newline."""
        if not completion.startswith(self.shown):  # cannot happen for a prefix-stable decode; say it whole
            self.out.write("\n")
            self.shown = ""
        self.out.write(completion[len(self.shown) :] + "\n")
        self.out.flush()


def stream_printer(tokenizer, out=None, show: bool = True) -> _StreamPrinter:
    """``on_tokens`` that prints row 0's text as it comes (``show``) or only keeps it (for a Ctrl-C)."""
    return _StreamPrinter(tokenizer, out, show)


def figure(**kwargs):
    """A matplotlib Figure of its own: drawn and saved without pyplot, so the caller's backend (a
    notebook's inline plots) is never switched."""
    from matplotlib.figure import Figure  # imported here: matplotlib adds start-up time; only plots need it

    return Figure(**kwargs)


def plot_bench(out: dict, path: str) -> None:
    """Bars of tokens/s per method (speedup over plain decoding written above each) and tau beside."""
    names = list(out["methods"])
    rates = [out["methods"][n]["tokens_per_s"] for n in names]
    taus = [out["methods"][n]["tau"] for n in names]
    fig = figure(figsize=(9, 3.5))
    ax1, ax2 = fig.subplots(1, 2)
    bars = ax1.bar(names, rates, color="tab:blue")
    for bar, name in zip(bars, names, strict=True):
        speedup = out["methods"][name].get("speedup")
        if speedup is not None:
            ax1.annotate(f"{speedup:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                         va="bottom", fontsize=8)  # fmt: skip
    ax1.set_ylabel("tokens/s")
    ax1.set_title(f"{out['model']}, {out['num_prompts']} {out['prompts']} prompts, T = {out['temperature']}")
    ax2.bar(names, taus, color="tab:orange")
    ax2.set_ylabel("tau (tokens per target forward)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_speedup(alpha: float, cost_ratio: float, verify_cost, max_n: int, path: str) -> None:
    """Speedup and expected tokens per target forward against N for one (alpha, c, r)."""

    ns = list(range(1, max_n + 1))
    ests = [estimate(alpha, n, cost_ratio, verify_cost) for n in ns]
    fig = figure(figsize=(6, 3.5))
    ax1 = fig.subplots()
    ax1.plot(ns, [e.speedup for e in ests], "o-", color="tab:blue", label="speedup")
    ax1.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax1.set_xlabel("N (drafts per step)")
    ax1.set_ylabel("speedup over plain decoding", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(ns, [e.expected_tokens for e in ests], "s-", color="tab:orange", label="tokens per call")
    ax2.set_ylabel("expected tokens per target forward", color="tab:orange")
    ax1.set_title(f"alpha = {alpha}, c = {cost_ratio}, r = {verify_cost.label}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
