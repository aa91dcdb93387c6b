"""Tiny random models that transformers writes, in Hugging Face's own folder layout, with a word-level
tokenizer: the targets of the family-parity, Hub-id and published-head tests."""

import hashlib
import json
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, bos_token_id=2, eos_token_id=1, pad_token_id=0,
)  # fmt: skip
WINDOW = 5
FAMILIES = {
    # original context 16: the frequencies below, between and above the llama3 ramp all occur
    "llama3": ("LlamaConfig", dict(tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False)),
    # untied: a weak random model with Gemma's scaled, tied embedding repeats its input token forever
    "gemma3": ("Gemma3TextConfig", dict(
        tie_word_embeddings=False, sliding_window=WINDOW, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}  # fmt: skip
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def write_tokenizer(folder, chat_template=None):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "user", "model"]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(len(words), VOCAB)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"eos_token": "<eos>", "bos_token": "<bos>", "add_bos_token": True, "chat_template": chat_template}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def write_family(folder, family: str, noise: float = 0.3, **overrides):
    """A tiny random ``family`` model written by transformers into ``folder``; returns the torch model."""
    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**(COMMON | extra | overrides))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for p in model.parameters():  # no norm at the identity, no zero bias
            p.add_(noise * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    write_tokenizer(folder, GEMMA_TEMPLATE if family == "gemma3" else None)
    return model


REVISION = "0123456789abcdef0123456789abcdef01234567"  # a commit hash, as the Hub names snapshots


def lay_out_hub_cache(cache, repo_id: str, folder, revision: str = REVISION, refs=("main",)) -> None:
    """Copies ``folder`` into ``cache`` exactly as huggingface_hub stores a download: each file once under
    ``blobs/`` by its hash, the snapshot of ``revision`` as relative links to the blobs, ``refs/NAME``
    holding the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    for f in sorted(folder.iterdir()):
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / blob)
        (snap / f.name).symlink_to(f"../../blobs/{blob}")
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(revision)
