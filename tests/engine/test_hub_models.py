"""Models by Hugging Face Hub id, from a cache folder in the Hub's own layout (blobs, snapshots of symlinks,
refs), offline: LLM("Org/name"), a revision (a ref, a commit hash), the tokenizer by id, and the errors when
the id is in no cache. Nothing is downloaded: HF_HUB_OFFLINE is set and the cache is built here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from leverlab import LLM, SamplingParams
from leverlab.config import EngineConfig
from leverlab.errors import ModelNotFound
from tests.checkpoints import add_to_hub_cache, make_checkpoint

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
KW = dict(dtype="float32", execution_mode="eager", num_kv_blocks=16)
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A Hub cache holding tiny/qwen3 at main (seed 0) and at ref v2 (seed 1, another commit)."""
    root = tmp_path_factory.mktemp("hub")
    main = make_checkpoint(root / "src-main", "qwen3", seed=0)
    other = make_checkpoint(root / "src-v2", "qwen3", seed=1)
    cache = root / "cache"
    main_snap = add_to_hub_cache(cache, "tiny/qwen3", main)
    v2_snap = add_to_hub_cache(cache, "tiny/qwen3", other, ref="v2")
    return {"cache": cache, "main": main, "other": other, "main_snap": main_snap, "v2_snap": v2_snap}


@pytest.fixture
def offline(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub["cache"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def _greedy(model: str, **kw) -> list[int]:
    with LLM(model, **KW, **kw) as llm:
        return llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids


def test_llm_by_hub_id_matches_the_folder(offline):
    by_id = _greedy("tiny/qwen3")
    assert by_id == _greedy(str(offline["main"]))
    cfg = EngineConfig(model="tiny/qwen3").resolve_models()
    assert Path(cfg.model) == offline["main_snap"] and cfg.model_id == "tiny/qwen3"
    assert (Path(cfg.model) / "config.json").is_symlink()  # really the Hub layout, read through its links


def test_revision_by_ref_and_by_commit(offline):
    want = _greedy(str(offline["other"]))
    assert want != _greedy(str(offline["main"]))  # the two snapshots differ, so the revision is what picks
    assert _greedy("tiny/qwen3", revision="v2") == want
    assert _greedy("tiny/qwen3", revision=offline["v2_snap"].name) == want  # a commit hash, no ref needed
    # the tokenizer by id and revision too (vLLM's tokenizer / tokenizer_revision)
    cfg = EngineConfig(model=str(offline["main"]), tokenizer="tiny/qwen3", tokenizer_revision="v2").resolve_models()
    assert Path(cfg.tokenizer) == offline["v2_snap"]
    # a draft model by id (with vLLM's "revision" key), resolved with the target before anything loads it
    spec = {"method": "draft_model", "model": "tiny/qwen3", "revision": "v2", "num_speculative_tokens": 2}
    cfg = EngineConfig(model="tiny/qwen3", speculative_config=spec).resolve_models()
    assert Path(cfg.speculative_config["model"]) == offline["v2_snap"] and Path(cfg.model) == offline["main_snap"]


def test_missing_id_says_which_id_revision_and_cache(offline):
    with pytest.raises(ModelNotFound) as e:
        LLM("tiny/absent", revision="v9")
    msg = str(e.value)
    assert "'tiny/absent'" in msg and "'v9'" in msg and str(offline["cache"]) in msg and "HF_HUB_OFFLINE" in msg
    assert str(offline["cache"] / "models--tiny--absent") in msg
    with pytest.raises(ModelNotFound, match="revision 'nope'"):
        LLM("tiny/qwen3", revision="nope")  # the repo is cached, that revision is not
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM("./no/such/folder")  # a path, never looked up on the Hub: the loader says what is missing


@pytest.mark.parametrize("command", [["serve", "tiny/absent"], ["generate", "--model", "tiny/absent", "hi"],
                                     ["study", "tiny/absent"]])
def test_cli_missing_id_is_a_clear_error(hub, tmp_path, command):
    env = {"PATH": "/usr/bin:/bin", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "leverlab.cli", *command, "--revision", "v3"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    assert "'tiny/absent'" in r.stderr and "'v3'" in r.stderr and str(tmp_path / "hf" / "hub") in r.stderr


def test_cli_generate_by_hub_id(hub, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_CACHE": str(hub["cache"]), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "leverlab.cli", "generate", "--model", "tiny/qwen3", "--revision", "v2",
                        "--dtype", "float32", "--max-tokens", "8", "--ignore-eos", PROMPT], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    with LLM(str(hub["other"]), **KW) as llm:
        want = llm.generate(PROMPT, GREEDY)[0].outputs[0].text
    assert PROMPT + want in r.stdout
