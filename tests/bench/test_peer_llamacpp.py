"""scripts/bench_peer.py's llama.cpp helper: the parts that need neither the build nor the network."""

from __future__ import annotations

import json
import os

import pytest

from leverlab.bench import peer_llamacpp as peer
from leverlab.config import default_model_path


def _tokenizer(tmp_path, pre):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"pre_tokenizer": pre}))
    return tmp_path


def test_pre_tokenizer_read_from_tokenizer_json(tmp_path):
    # The bundled tokenizer is a bare ByteLevel pre-tokenizer: GPT-2's regex, llama.cpp's "gpt-2".
    assert peer.pre_tokenizer_of(default_model_path()) == "gpt-2"
    split = {"type": "Split", "pattern": {"Regex": peer.QWEN2_SPLIT}, "behavior": "Isolated"}
    qwen2 = {"type": "Sequence", "pretokenizers": [split, {"type": "ByteLevel", "use_regex": False}]}
    assert peer.pre_tokenizer_of(_tokenizer(tmp_path, qwen2)) == "qwen2"
    with pytest.raises(peer.PeerError, match="--pre-tokenizer"):
        peer.pre_tokenizer_of(_tokenizer(tmp_path, {"type": "Whitespace"}))


def test_model_key_follows_the_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    w = tmp_path / "model.safetensors"
    w.write_bytes(b"x")
    key = peer.model_key(tmp_path)
    assert key == peer.model_key(tmp_path) and key.startswith(tmp_path.name)
    os.utime(w, ns=(1, 1))
    assert peer.model_key(tmp_path) != key


def test_missing_cmake_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(peer.shutil, "which", lambda *a, **k: None)
    with pytest.raises(peer.PeerError, match="pip install cmake"):
        peer._cmake()
