"""Tokenizers (the ``tokenizers`` library) and chat templates.

A Hugging Face folder carries ``tokenizer.json``; a GGUF file carries the BPE
vocabulary, merges and pre-tokenizer name in its metadata, from which
:func:`tokenizer_from_gguf_metadata` builds the same tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

__all__ = ["TextTokenizer", "tokenizer_from_gguf_metadata"]

# llama.cpp's pre-tokenizer names → the split that the original tokenizer.json does.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(name: str):
    if name == "qwen2":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if name in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if name in ("gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raise ValueError(f"GGUF pre-tokenizer {name!r} is not supported; known: qwen2, smollm, starcoder, refact, gpt2.")


def tokenizer_from_gguf_metadata(meta: dict) -> Tokenizer:
    """Builds a byte-level BPE tokenizer from GGUF ``tokenizer.ggml.*`` fields.

    Args:
      meta: the GGUF key/values, with ``tokenizer.ggml.tokens``,
        ``token_type``, ``merges`` and ``pre`` as Python lists and strings.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; jspec reads byte-level BPE ('gpt2').")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "gpt2"))
    tok.decoder = decoders.ByteLevel()
    # Control (3) and user-defined (4) tokens match whole, before BPE.
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k == 3]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=True) if k == 4]
    tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    return tok


@dataclasses.dataclass
class TextTokenizer:
    """A tokenizer plus what generation needs: end-of-sequence ids and the chat template."""

    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    chat_template: str | None = None
    bos_token_id: int | None = None
    add_bos: bool = False

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        # A chat template that writes the BOS itself (Gemma, Llama 3) gets no second one.
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Renders the model's own (Jinja) chat template."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass the raw prompt instead of chat messages.")

        # A sandbox: the template is data that came with untrusted model files.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        template = env.from_string(self.chat_template)
        special = {
            "bos_token": "" if self.bos_token_id is None else self.tokenizer.id_to_token(self.bos_token_id),
            "eos_token": self.tokenizer.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else "",
        }
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=None, **special)

    # ------------------------------------------------------------------ files

    def save(self, folder: pathlib.Path) -> None:
        self.tokenizer.save(str(folder / "tokenizer.json"))
        eos = [self.tokenizer.id_to_token(i) for i in self.eos_token_ids]
        cfg = {
            "chat_template": self.chat_template,
            "eos_token": eos[0] if eos else None,
            "bos_token": None if self.bos_token_id is None else self.tokenizer.id_to_token(self.bos_token_id),
            "add_bos_token": self.add_bos,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "jspec_eos_token_ids": list(self.eos_token_ids),
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))

    @classmethod
    def load(cls, folder: pathlib.Path, eos_token_ids: tuple[int, ...] = ()) -> TextTokenizer:
        folder = pathlib.Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise ValueError(f"no tokenizer.json in {folder}; a Hugging Face model folder needs one.")
        tok = Tokenizer.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        eos = tuple(cfg.get("jspec_eos_token_ids") or ())
        if not eos:
            named = cfg.get("eos_token")
            named = named.get("content") if isinstance(named, dict) else named
            eos = tuple(eos_token_ids) or ((tok.token_to_id(named),) if named else ())
        template = cfg.get("chat_template")
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        bos = cfg.get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        return cls(
            tokenizer=tok,
            eos_token_ids=tuple(int(e) for e in eos if e is not None),
            chat_template=template,
            bos_token_id=tok.token_to_id(bos) if bos else None,
            add_bos=bool(cfg.get("add_bos_token", False)),
        )


def _raise_template_error(message):
    raise ValueError(f"chat template: {message}")
