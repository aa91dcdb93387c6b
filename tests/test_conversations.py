"""The user's conversations (ShareGPT, OpenAI chat JSONL): templated as at inference, the loss on the
assistant's tokens, bad rows counted and skipped, tokenized once and stored by content."""

import dataclasses
import json
import pathlib

import numpy as np
import pytest

from jspec.training.conversations import load_conversations, tokenize_conversation


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's own tokenizer and ChatML template (fetched once per machine, like the model)."""
    from jspec.models.hub import resolve_model
    from jspec.models.tokenizer import TextTokenizer

    return TextTokenizer.load(resolve_model("smollm2-135m"))


SHAREGPT = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi there"},
                              {"from": "gpt", "value": "Hello! How can I help?"}, {"from": "human", "value": "2+2?"},
                              {"from": "gpt", "value": "4."}]}  # fmt: skip
OPENAI = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                       {"role": "assistant", "content": [{"type": "text", "text": "Hello! How can I help?"}]},
                       {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]}  # fmt: skip


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_both_formats_give_the_same_tokens_and_the_mask_covers_exactly_the_assistant_turns(tokenizer):
    from jspec.training.conversations import parse_row

    share, openai = parse_row(SHAREGPT), parse_row(OPENAI)
    assert share == openai
    ids, mask = tokenize_conversation(tokenizer, share, 512)
    # The independent reading: ChatML as SmolLM2's template writes it, each assistant turn's text and
    # its <|im_end|> (and the newline after) are the masked tokens, nothing else.
    text = tokenizer.apply_chat_template(share, add_generation_prompt=False)
    assert ids.tolist() == tokenizer.encode(text)
    masked = tokenizer.decode(ids[mask].tolist(), skip_special_tokens=False)
    assert masked == "Hello! How can I help?<|im_end|>\n4.<|im_end|>\n"
    unmasked = tokenizer.decode(ids[~mask].tolist(), skip_special_tokens=False)
    assert "Hello" not in unmasked and "2+2?" in unmasked and "Be brief." in unmasked
    assert unmasked.count("<|im_start|>assistant\n") == 2  # the header is the prompt, not the response


def test_bad_rows_are_counted_and_skipped_with_their_line_numbers(tokenizer, tmp_path):
    long = {"messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]}
    rows = [SHAREGPT, "{not json", {"messages": [{"role": "tool", "content": "x"}]}, "", OPENAI,
            {"conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "a"}]},
            {"messages": [{"role": "user", "content": "only a question"}]}, long, {"prompt": "x"},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "tool_calls": []}]},
            ]  # fmt: skip
    data = load_conversations(_write(tmp_path / "mixed.jsonl", rows), tokenizer, 128, root=tmp_path / "store")
    assert len(data.ids) == 2 and data.ids[0].tolist() == data.ids[1].tolist()
    assert data.skipped == {"invalid JSON": [2], "unknown role 'tool'": [3], "an empty turn": [6],
                            "no assistant turn": [7], "longer than --seq-len 128 after templating": [8],
                            "neither 'conversations' (ShareGPT) nor 'messages' (OpenAI chat)": [9],
                            "a turn with fields jspec does not read ('tool_calls')": [10]}  # fmt: skip
    line = data.summary()
    assert line.startswith(f"{tmp_path / 'mixed.jsonl'}: 2 conversations kept") and "7 skipped" in line
    assert "invalid JSON: 1 (line 2)" in line
    with pytest.raises(ValueError, match=r"nothing.jsonl has no usable conversation .*invalid JSON: 2 \(lines 1, 2\)"):
        load_conversations(_write(tmp_path / "nothing.jsonl", ["[", "]"]), tokenizer, 128, root=tmp_path / "store")
    with pytest.raises(ValueError, match="no such file"):
        load_conversations(tmp_path / "missing.jsonl", tokenizer, 128)


def test_a_template_that_rewrites_earlier_turns_is_refused_per_row(tokenizer):
    """Negative control of the turn-by-turn reading: a template that drops all but the last assistant
    turn's text cannot give each turn's tokens."""
    import dataclasses

    rewriting = dataclasses.replace(tokenizer, chat_template=(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] if m['role'] != 'assistant' or loop.last else '' }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))  # fmt: skip
    from jspec.training.conversations import parse_row

    assert (
        tokenize_conversation(rewriting, parse_row(OPENAI), 512) == "the chat template does not render it turn by turn"
    )
    one_turn = parse_row({"messages": OPENAI["messages"][:3]})
    assert isinstance(tokenize_conversation(rewriting, one_turn, 512), tuple)


def test_a_file_is_tokenized_once_stored_by_content_and_a_damaged_store_is_refused(tokenizer, tmp_path, monkeypatch):
    import jspec.training.conversations as conv

    path = _write(tmp_path / "chats.jsonl", [SHAREGPT, OPENAI])
    store = tmp_path / "store"
    first = load_conversations(path, tokenizer, 256, root=store)
    (stored,) = store.glob("*.npz")
    assert stored.stat().st_size < 3 * sum(len(i) for i in first.ids) + 1_500  # uint16 ids, a byte of mask
    monkeypatch.setattr(conv, "tokenize_conversation", lambda *a: pytest.fail("tokenized again"))
    again = load_conversations(tmp_path / "chats.jsonl", tokenizer, 256, root=store)
    assert [i.tolist() for i in again.ids] == [i.tolist() for i in first.ids]
    assert all(np.array_equal(a, b) for a, b in zip(again.masks, first.masks, strict=True))
    monkeypatch.undo()
    assert len(list(store.glob("*.npz"))) == 1
    load_conversations(path, tokenizer, 512, root=store)  # another seq_len: another entry
    _write(path, [OPENAI])  # the file changed: another entry
    assert len(load_conversations(path, tokenizer, 256, root=store).ids) == 1
    assert len(list(store.glob("*.npz"))) == 3
    stored.write_bytes(stored.read_bytes()[:100])
    _write(path, [SHAREGPT, OPENAI])
    with pytest.raises(ValueError, match=r"is damaged .* delete it and run again"):
        load_conversations(path, tokenizer, 256, root=store)


def _word_tokenizer():
    """A word-level tokenizer with a ChatML-like template whose ids fit a tiny model's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from jspec.models.tokenizer import TextTokenizer

    words = ["<pad>", "<eos>", "<s>", "</s>", "user", "assistant", "system", "<unk>"]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(40)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                "{% if add_generation_prompt %}<s> assistant {% endif %}")  # fmt: skip
    return TextTokenizer(tok, (1,), template)


def test_training_data_from_conversations_is_the_targets_features_over_them_and_made_once(tmp_path, monkeypatch):
    import jax.numpy as jnp

    from jspec.heads.eagle import HeadConfig
    from jspec.models.tiny import tiny_model
    from jspec.training import Recipe
    from jspec.training.conversations import parse_row
    from jspec.training.data import feature_forward
    from jspec.training.recipe import prepare_data

    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    tok, target = _word_tokenizer(), tiny_model(vocab_size=48)
    rows = [{"messages": [{"role": "user", "content": " ".join(f"w{(3 * i + j) % 40}" for j in range(1 + i % 4))},
                          {"role": "assistant", "content": " ".join(f"w{(i + j) % 40}" for j in range(2 + i % 3))}]}
            for i in range(5)]  # fmt: skip
    path = _write(tmp_path / "chats.jsonl", rows)
    recipe = Recipe("eagle3", seq_len=24, gen_batch=2, data_files=(str(path),))
    data = prepare_data(target, tok, recipe, tmp_path / "data", "tiny")
    assert data["tokens"].shape == (5, 24) and data["features"].shape[:3] == (5, 24, 3)
    for i, row in enumerate(rows):
        ids, mask = tokenize_conversation(tok, parse_row(row), 24)
        assert data["tokens"][i, : len(ids)].tolist() == ids.tolist() and not data["tokens"][i, len(ids) :].any()
        assert data["mask"][i].tolist() == mask.tolist() + [False] * (24 - len(ids))
    assert int(data["counts"].sum()) == int(data["mask"].sum()) > 0
    layers = HeadConfig.for_target(target.config, "eagle3", 1, None).feature_layers
    hidden, state = feature_forward(target, (*layers, target.config.num_layers - 1))
    alone = hidden(state, jnp.asarray(data["tokens"][4:5]))  # the last batch was padded with an empty row
    assert np.array_equal(np.asarray(alone[-1]), data["top"][4:5])
    again = prepare_data(target, tok, recipe, tmp_path / "data", "tiny")  # read back, not made again
    assert np.array_equal(again["features"], data["features"])
    _write(path, rows[:3])  # the file changed: the folder holds data made from other content
    with pytest.raises(ValueError, match="holds data made by another recipe"):
        prepare_data(target, tok, recipe, tmp_path / "data", "tiny")


def test_regenerated_turns_are_the_targets_own_continuations_turn_by_turn(tmp_path):
    from jspec.loop.decode import Decoder
    from jspec.models.tiny import tiny_model
    from jspec.training.conversations import parse_row, regenerate

    tok, target = _word_tokenizer(), tiny_model(vocab_size=48)
    decoder = Decoder(target, eos_ids=(1,))
    convs = [parse_row({"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w9"},
                                     {"role": "user", "content": "w3"}, {"role": "assistant", "content": "w9"}]}),
             parse_row({"messages": [{"role": "user", "content": " ".join(["w5"] * 20)},
                                     {"role": "assistant", "content": "w9"}]})]  # fmt: skip
    out = regenerate(decoder, tok, convs, 24, batch_size=2, max_new_tokens=4)
    assert out[1] is None  # 26 tokens of prompt: no room within 24
    first, second = out[0][1]["content"], out[0][3]["content"]
    prompt = tok.encode(tok.apply_chat_template(convs[0][:1]))
    want = [t for t in decoder.generate([prompt], 4).tokens[0] if t != 1]
    assert tok.encode(first) == want and len(want) <= 4  # greedy: what the target writes after the prompt
    prompt = tok.encode(tok.apply_chat_template([convs[0][0], {"role": "assistant", "content": first}, convs[0][2]]))
    assert tok.encode(second) == [t for t in decoder.generate([prompt], 4).tokens[0] if t != 1]
    assert out[0][0] == convs[0][0] and out[0][2] == convs[0][2]  # the user's turns are kept
    path = _write(tmp_path / "c.jsonl", [{"messages": c} for c in convs])
    data = load_conversations(
        path,
        tok,
        24,
        root=tmp_path / "store",
        rewrite=lambda cs: regenerate(decoder, tok, cs, 24, max_new_tokens=4),
        rewrite_key="t",
    )
    assert len(data.ids) == 1 and data.skipped == {"no room for an assistant turn within --seq-len": [2]}
    assert len(list((tmp_path / "store").glob("*.npz"))) == 1
    assert len(load_conversations(path, tok, 24, root=tmp_path / "store").ids) == 1  # as written: its own entry
    assert len(list((tmp_path / "store").glob("*.npz"))) == 2


def test_a_hugging_face_dataset_folder_reads_as_its_rows(tokenizer, tmp_path):
    """A dataset saved with save_to_disk (ShareGPT columns here), its train split when there are several."""
    datasets = pytest.importorskip("datasets")

    bad = {"conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]}
    rows = [SHAREGPT, bad, SHAREGPT]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "one"))
    data = load_conversations(tmp_path / "one", tokenizer, 256, root=tmp_path / "store")
    want = load_conversations(_write(tmp_path / "same.jsonl", [SHAREGPT]), tokenizer, 256, root=tmp_path / "store")
    assert [i.tolist() for i in data.ids] == [want.ids[0].tolist()] * 2
    assert data.skipped == {"unknown role 'robot'": [2]} and "(row 2)" in data.summary()
    mixed = [  # plain text contents: Arrow does not mix a string column with OpenAI's lists of parts
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "user", "content": "q", "name": "x"}, {"role": "assistant", "content": "a"}]},
    ]
    datasets.Dataset.from_list(mixed).save_to_disk(str(tmp_path / "mixed"))  # Arrow gives every turn a name: None
    data = load_conversations(tmp_path / "mixed", tokenizer, 256, root=tmp_path / "store")
    assert len(data.ids) == 1 and data.skipped == {"a turn with fields jspec does not read ('name')": [2]}
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "splits"))
    assert len(load_conversations(tmp_path / "splits", tokenizer, 256, root=tmp_path / "store").ids) == 2
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "no_train"))
    with pytest.raises(ValueError, match=r"holds the splits \['test'\] and no 'train'"):
        load_conversations(tmp_path / "no_train", tokenizer, 256, root=tmp_path / "store")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is not a dataset saved with save_to_disk"):
        load_conversations(tmp_path / "empty", tokenizer, 256, root=tmp_path / "store")


def _hub_dataset_in_cache(datasets, cache, repo_id: str, jsonl, revision: str):
    """Lays ``jsonl`` into a ``datasets`` cache as ``load_dataset(repo_id)`` leaves a Hub dataset there,
    built by datasets' own JSON builder: ``<cache>/<owner>___<name>/default/0.0.0/<revision>/`` holding
    ``dataset_info.json`` and ``<name>-train.arrow`` (the layout datasets' offline fallback reads:
    huggingface/datasets, src/datasets/packaged_modules/cache/cache.py, ``_find_hash_in_cache``)."""
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.json.json import Json

    owner, name = repo_id.split("/")
    build = cache / "build" / revision
    files = DataFilesDict.from_patterns({"train": [str(jsonl)]})
    builder = Json(cache_dir=str(build), dataset_name=name, data_files=files)
    builder.download_and_prepare()
    target = cache / f"{owner}___{name}" / "default" / "0.0.0" / revision
    target.parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(builder.cache_dir).rename(target)


def test_a_dataset_by_name_reads_from_the_local_datasets_cache_offline(tokenizer, tmp_path, monkeypatch):
    """--dataset NAME[:SPLIT]: the rows load_dataset finds in the cache with the Hub out of reach, tokenized
    as the same rows in a JSONL file; stored by content; a name or split not there refused by name."""
    datasets = pytest.importorskip("datasets")
    from jspec.training.conversations import DatasetName

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    bad = {"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]}
    plain = {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]}
    (tmp_path / "src").mkdir()
    source = _write(tmp_path / "src" / "train.jsonl", [plain, bad, plain])
    _hub_dataset_in_cache(datasets, tmp_path / "hf", "someone/tiny_chats", source, "rev1")
    data = load_conversations(DatasetName("someone/tiny_chats"), tokenizer, 256, root=tmp_path / "store")
    want = load_conversations(_write(tmp_path / "one.jsonl", [plain]), tokenizer, 256, root=tmp_path / "store")
    assert [i.tolist() for i in data.ids] == [want.ids[0].tolist()] * 2
    assert data.skipped == {"unknown role 'robot'": [2]} and "(row 2)" in data.summary()
    assert data.source == "someone/tiny_chats"
    stored = sorted((tmp_path / "store").glob("*.npz"))
    again = load_conversations(DatasetName("someone/tiny_chats:train"), tokenizer, 256, root=tmp_path / "store")
    assert sorted((tmp_path / "store").glob("*.npz")) == stored and again.sha256 == data.sha256  # read back
    with pytest.raises(ValueError, match=r"--dataset someone/tiny_chats:test: datasets could not load it \(offline"):
        DatasetName("someone/tiny_chats:test").open()
    with pytest.raises(ValueError, match=r"--dataset someone/missing: datasets could not load it \(offline"):
        load_conversations(DatasetName("someone/missing"), tokenizer, 256, root=tmp_path / "store")
    for spec in ("a/b/c", "", "someone/tiny_chats:"):
        with pytest.raises(ValueError, match="give a Hub name, NAME or NAME:SPLIT"):
            DatasetName(spec)
    # A newer revision in the cache (what load_dataset reads) is other content: tokenized afresh.
    _write(source, [plain])
    _hub_dataset_in_cache(datasets, tmp_path / "hf", "someone/tiny_chats", source, "rev2")
    newer = load_conversations(DatasetName("someone/tiny_chats"), tokenizer, 256, root=tmp_path / "store")
    assert len(newer.ids) == 1 and newer.sha256 != data.sha256


def test_a_data_folder_made_from_the_text_as_written_is_not_taken_for_regenerated_or_online_data(tmp_path, monkeypatch):
    from jspec.models.tiny import tiny_model
    from jspec.training import Recipe
    from jspec.training.recipe import prepare_data

    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    tok, target = _word_tokenizer(), tiny_model(vocab_size=48)
    path = _write(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "w1 w2"},
                                                       {"role": "assistant", "content": "w3 w4"}]}])  # fmt: skip
    as_written = Recipe("eagle3", seq_len=24, gen_batch=2, max_new_tokens=4, data_files=(str(path),))
    prepare_data(target, tok, as_written, tmp_path / "data", "tiny")
    for other in ({"regenerate": True}, {"features": "online"}):
        with pytest.raises(ValueError, match="holds data made by another recipe"):
            prepare_data(target, tok, dataclasses.replace(as_written, **other), tmp_path / "data", "tiny")


def test_resuming_checkpoints_of_another_run_or_data_for_another_vocabulary_is_refused(tmp_path, monkeypatch):
    """Other data or options than the checkpoints' run: refused before anything compiles, nothing overwritten."""
    from jspec.models.tiny import tiny_model
    from jspec.training import Recipe, TrainConfig
    from jspec.training.recipe import _check_tokens, train_head

    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    tok, target = _word_tokenizer(), tiny_model(vocab_size=48)
    rows = [{"messages": [{"role": "user", "content": f"w{i} w{i + 1}"},
                          {"role": "assistant", "content": f"w{i + 2} w{i + 3} w{i + 4}"}]}
            for i in range(6)]  # fmt: skip
    train = TrainConfig(num_steps=2, batch_size=2, total_steps=2, warmup_steps=0, checkpoint_every=1)
    recipe = Recipe("eagle3", seq_len=16, gen_batch=2, draft_vocab=16, train=train,
                    data_files=(str(_write(tmp_path / "a.jsonl", rows)),))  # fmt: skip
    run = dict(model_name="tiny", progress=False)
    train_head(target, tok, recipe, tmp_path / "out", data_dir=tmp_path / "data_a", until=1, **run)
    checkpoints = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    other_data = dataclasses.replace(recipe, data_files=(str(_write(tmp_path / "b.jsonl", rows[:4])),))
    with pytest.raises(
        ValueError, match=r"checkpoints of another run \(differs in data_sha256, examples, recipe.data_"
    ):
        train_head(target, tok, other_data, tmp_path / "out", data_dir=tmp_path / "data_b", **run)
    accumulated = dataclasses.replace(recipe, train=dataclasses.replace(train, accumulate=2))
    with pytest.raises(ValueError, match=r"differs in recipe.train\)"):
        train_head(target, tok, accumulated, tmp_path / "out", data_dir=tmp_path / "data_a", **run)
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == checkpoints
    _, report = train_head(target, tok, recipe, tmp_path / "out", data_dir=tmp_path / "data_a", **run)
    assert report["resumed_from"] == 1 and report["steps"] == 2
    with pytest.raises(
        ValueError, match=r"holds token id 60, past this target's vocabulary of 48: .*another tokenizer"
    ):
        _check_tokens({"tokens": np.array([[5, 60]])}, 48, tmp_path / "data_a", [])
