"""Compile time and speed per model family and dtype, and what streaming costs (issue 18's checks).

    python experiments/costs/families_cost.py [--tokens 64] [--repeats 3] [--out experiments/out/families]

1. Llama 3.x (llama3 RoPE), Qwen3 and Gemma 3 as tiny random models (two layers of 256, built from
   Hugging Face style configs by jspec itself): plain decoding's compile seconds and tokens/s, and
   prompt lookup's (N = 3) beside it.
2. SmolLM2-135M in float32 and bfloat16 on this machine: compile seconds and tokens/s of plain
   decoding and prompt lookup, the two dtypes taking turns.
3. ``jspec generate --stream``'s cost: the same decoders with and without the per-step host
   callback (a printer decoding the text so far into a buffer), taking turns; the ratio per token.

Writes ``families_cost.json`` and ``families_cost.png`` to --out.
"""

from __future__ import annotations

import io
import json
import time

from jspec.analysis.harness import arguments, plot, save

TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)  # fmt: skip
FAMILIES = {
    "llama3": {"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}},
    "qwen3": {"model_type": "qwen3"},
    "gemma3": {"model_type": "gemma3_text", "sliding_window": 32, "query_pre_attn_scalar": 64,
               "layer_types": ["sliding_attention", "full_attention"]},
}  # fmt: skip


def _interleaved(decoders: dict, prompts, tokens, repeats: int, kwargs: dict | None = None) -> dict:
    """name -> {compile_seconds, tokens_per_s (median over repeats), tau}; decoders take turns."""
    kwargs = kwargs or {}
    compile_s = {n: d.generate(prompts, tokens, **kwargs.get(n, {})).compile_seconds for n, d in decoders.items()}
    rates = {n: [] for n in decoders}
    taus = {}
    for i in range(repeats):
        names = list(decoders)[i % len(decoders) :] + list(decoders)[: i % len(decoders)]
        for n in names:
            r = decoders[n].generate(prompts, tokens, **kwargs.get(n, {}))
            rates[n].append(r.tokens_per_s)
            taus[n] = r.tau
    import numpy as np

    return {n: {"compile_seconds": compile_s[n], "tokens_per_s": float(np.median(rates[n])), "tau": taus[n]}
            for n in decoders}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    parser = arguments(__doc__, repeats=3, out="experiments/out/families")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    import jax
    from flax import nnx

    from jspec.cli.common import stream_printer
    from jspec.drafters import PromptLookup
    from jspec.loop.decode import Decoder
    from jspec.loop.engine import SpeculativeDecoder
    from jspec.models.config import ModelConfig
    from jspec.models.hub import load_model
    from jspec.models.llama import Transformer

    report = {"machine": f"{jax.default_backend()}, {jax.device_count()} device(s)", "tokens": args.tokens}
    prompt = [[(7 * i) % 500 + 3 for i in range(24)] * 2]  # a repeated stretch: prompt lookup has matches
    report["families"] = {}
    for name, extra in FAMILIES.items():
        config = ModelConfig.from_hf(TINY | extra)
        model = Transformer(config, rngs=nnx.Rngs(0))
        decoders = {"plain": Decoder(model), "prompt lookup N=3": SpeculativeDecoder(model, PromptLookup(num_draft=3))}
        report["families"][name] = _interleaved(decoders, prompt, args.tokens, args.repeats)
        print(name, json.dumps(report["families"][name]))
        jax.clear_caches()

    models = {dtype: load_model("smollm2-135m", dtype=dtype)[0] for dtype in ("float32", "bfloat16")}
    _, tokenizer = load_model("smollm2-135m")
    text = "Rewrite this with a docstring, keeping the loop:\n\ndef total(xs):\n    s = 0\n    for x in xs:\n        s += x\n    return s"  # noqa: E501
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))]
    decoders = {}
    for dtype, model in models.items():
        decoders[f"{dtype} plain"] = Decoder(model, eos_ids=())
        decoders[f"{dtype} prompt lookup N=3"] = SpeculativeDecoder(model, PromptLookup(num_draft=3))
    report["smollm2_dtypes"] = _interleaved(decoders, ids, args.tokens, args.repeats)
    print("smollm2", json.dumps(report["smollm2_dtypes"]))
    jax.clear_caches()

    model = models["float32"]
    sink = io.StringIO()
    plain, lookup = Decoder(model, eos_ids=()), SpeculativeDecoder(model, PromptLookup(num_draft=3))
    decoders = {"plain": plain, "plain --stream": plain, "prompt lookup": lookup, "prompt lookup --stream": lookup}
    kwargs = {n: {"on_tokens": stream_printer(tokenizer, sink)} for n in decoders if n.endswith("--stream")}
    stream = _interleaved(decoders, ids, args.tokens, max(args.repeats, 5), kwargs)
    for base in ("plain", "prompt lookup"):
        stream[f"{base} --stream"]["cost_per_token"] = (
            stream[base]["tokens_per_s"] / stream[f"{base} --stream"]["tokens_per_s"] - 1
        )
    report["stream"] = stream
    print("stream", json.dumps(stream))
    report = save(args.out / "families_cost.json", report, args=args, started=started)

    with plot(args.out / "families_cost.png", figsize=(10, 3.5)) as fig:
        ax1, ax2 = fig.subplots(1, 2)
        names = list(report["families"])
        ax1.bar(names, [report["families"][n]["plain"]["tokens_per_s"] for n in names])
        ax1.set_ylabel("plain tokens/s (tiny, 2 layers)")
        rows = report["smollm2_dtypes"]
        ax2.bar(list(rows), [rows[n]["tokens_per_s"] for n in rows], color="tab:orange")
        ax2.set_ylabel("SmolLM2 tokens/s")
        ax2.tick_params(axis="x", labelrotation=20, labelsize=7)
    return report


if __name__ == "__main__":
    main()
