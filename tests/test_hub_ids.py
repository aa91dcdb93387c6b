"""Hugging Face Hub ids, through huggingface_hub's real code, offline: a cache folder laid out as the Hub
lays it out (``models--ORG--NAME/{blobs,refs,snapshots}``) holding a tiny model written by transformers."""

import numpy as np
import pytest
from tiny_hf import REVISION, lay_out_hub_cache, write_family

import jspec
from jspec.models.hub import hub_snapshot, parse_hub_id, resolve_model


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(cache folder, the torch reference): ``tiny-org/tiny-llama`` at REVISION, also tagged ``main``."""
    src = tmp_path_factory.mktemp("written")
    reference = write_family(src, "llama3")
    cache = tmp_path_factory.mktemp("hub")
    lay_out_hub_cache(cache, "tiny-org/tiny-llama", src)
    bin_only = tmp_path_factory.mktemp("bin_only")
    (bin_only / "config.json").write_text((src / "config.json").read_text())
    (bin_only / "pytorch_model.bin").write_bytes(b"not read")
    lay_out_hub_cache(cache, "tiny-org/bin-only", bin_only)
    return cache, reference


@pytest.fixture
def offline(hub, monkeypatch):
    cache, _ = hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_hub_id_grammar():
    assert parse_hub_id("meta-llama/Llama-3.1-8B-Instruct") == ("meta-llama/Llama-3.1-8B-Instruct", None)
    assert parse_hub_id("org/name@v1.0") == ("org/name", "v1.0")
    assert parse_hub_id("org/name@refs/pr/3") == ("org/name", "refs/pr/3")
    assert parse_hub_id("smollm2-135m") is None
    assert parse_hub_id("a/b/c") is None


def test_load_by_hub_id_offline_gives_the_written_model(hub, offline):
    torch = pytest.importorskip("torch")
    _, reference = hub
    model, tok = jspec.load_model("tiny-org/tiny-llama")
    ids = [2, 9, 17, 30, 9, 17, 30, 41]
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0].numpy()
    got = np.asarray(model(np.array([ids]), np.arange(len(ids))[None], model.init_cache(1, len(ids))).logits[0])
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    assert tok.vocab_size == 64
    # Revision pins: the commit itself, and the branch that names it.
    assert resolve_model(f"tiny-org/tiny-llama@{REVISION}") == offline / "models--tiny-org--tiny-llama" / (
        f"snapshots/{REVISION}"
    )
    assert resolve_model("tiny-org/tiny-llama@main") == resolve_model("tiny-org/tiny-llama")


def test_hf_home_is_honoured_when_hf_hub_cache_is_not(hub, monkeypatch, tmp_path):
    cache, _ = hub
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "hub").symlink_to(cache)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert (hub_snapshot("tiny-org/tiny-llama") / "config.json").exists()


def test_a_local_folder_wins_over_a_hub_id_of_the_same_spelling(hub, offline, tmp_path, monkeypatch):
    folder = tmp_path / "tiny-org" / "tiny-llama"
    folder.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("tiny-org/tiny-llama").resolve() == folder.resolve()


@pytest.mark.parametrize(
    "name, needle",
    [
        ("tiny-org/missing", r"tiny-org/missing: HF_HUB_OFFLINE is set and the Hub cache .* holds no copy"),
        ("tiny-org/tiny-llama@v9", r"tiny-org/tiny-llama@v9: HF_HUB_OFFLINE is set"),
        ("tiny-org/bin-only", r"tiny-org/bin-only holds no safetensors weights"),
        ("not-a-model", r"unknown model 'not-a-model'; known models: .*Hugging Face"),
    ],
)
def test_bad_ids_are_one_clear_line(offline, name, needle):
    with pytest.raises(ValueError, match=needle) as err:
        resolve_model(name)
    assert "\n" not in str(err.value)


def test_gated_and_missing_repositories_name_the_id_and_the_remedy(monkeypatch):
    """What huggingface_hub raises for a gated or unknown repository (after its own fall-back to the cache
    fails, which chains the Hub's answer) becomes one line naming the id and what to do."""
    import httpx2
    from huggingface_hub import errors

    response = httpx2.Response(401, request=httpx2.Request("GET", "https://example.invalid"))
    for raised, needle in [
        (errors.GatedRepoError("gated", response=response), r"org/gated is a gated repository: .*HF_TOKEN"),
        (errors.RepositoryNotFoundError("404", response=response), r"org/gated: no such model repository"),
    ]:

        def fake(*args, raised=raised, **kwargs):
            try:
                raise raised
            except Exception as cause:
                raise errors.LocalEntryNotFoundError("no cached snapshot") from cause

        monkeypatch.setattr("huggingface_hub.snapshot_download", fake)
        with pytest.raises(ValueError, match=needle):
            hub_snapshot("org/gated")
