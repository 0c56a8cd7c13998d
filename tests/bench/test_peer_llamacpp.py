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


def test_amx_cpus_build_without_ggmls_amx_matmul(tmp_path, monkeypatch):
    """ggml's AMX matmul dies with SIGILL in the pinned llama.cpp: on an AMX CPU the peer is built without it, and
    a cached build made with other flags (a cache moved between machines) is rebuilt rather than reused."""
    assert peer.build_flags({"avx2", "avx512f"}) == []
    amx = peer.build_flags({"avx512f", "amx_tile", "amx_int8", "amx_bf16"})
    assert {"-mno-amx-tile", "-mno-amx-int8"} <= set(amx)
    for bin_path in peer.binaries(tmp_path).values():
        bin_path.parent.mkdir(parents=True, exist_ok=True)
        bin_path.write_text("")
    stamp = tmp_path / "build" / "leverlab-build-flags.json"

    def no_build():
        raise peer.PeerError("would build")

    monkeypatch.setattr(peer, "_cmake", no_build)
    for cpu, built_with, reused in ((set(), None, True), (set(), [], True), ({"amx_tile"}, None, False),
                                    ({"amx_tile"}, amx, True), (set(), amx, False)):
        monkeypatch.setattr(peer.env, "cpu_flags", lambda cpu=cpu: cpu)
        stamp.unlink(missing_ok=True)
        if built_with is not None:
            stamp.write_text(json.dumps(built_with))
        if reused:
            assert peer.ensure_built(tmp_path) == peer.binaries(tmp_path)
        else:
            with pytest.raises(peer.PeerError, match="would build"):
                peer.ensure_built(tmp_path)


def _bench_peer(monkeypatch, *argv: str):
    """scripts/bench_peer.py imported, and its arguments parsed from argv: (the module, args)."""
    import importlib
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    bench_peer = importlib.import_module("bench_peer")
    monkeypatch.setattr(sys, "argv", ["bench_peer", *argv])
    return bench_peer, bench_peer.parse_args()


def test_peer_roofline_counts_the_kv_cache_a_step_reads(monkeypatch):
    """bench_peer's roofline: a decode step reads the weights once and every sequence's K and V at the decode
    span's mean context (16-bit cache, both engines), so long contexts do not read as a low share of the weights."""
    from leverlab.models.config import ModelConfig

    model = default_model_path()
    bench_peer, args = _bench_peer(monkeypatch, "--model", str(model), "--prompt-len", "1000", "--decode-len", "64",
                                   "--batch", "4", "--precisions", "int4")
    c = ModelConfig.from_folder(model)
    per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2
    assert args.kv_bytes_per_token == per_token
    assert bench_peer.step_bytes(10**8, 4, args) == 10**8 + 4 * 1032 * per_token
    best = {"int4": {"decode": {"leverlab": 50.0}, "decode16": {"leverlab": 120.0}, "prefill": {"leverlab": 900.0}}}
    shares = bench_peer.shares_both_ways(best, {"int4": {"leverlab": 10**8, "llamacpp": None}}, 40.0, args)
    one = shares["int4"]["decode"]["leverlab"]
    assert one["weights_only"] == pytest.approx(50.0 * 10**8 / 40e9)
    assert one["with_kv"] == pytest.approx(50.0 * (10**8 + 1032 * per_token) / 40e9)
    four = shares["int4"]["decode16"]["leverlab"]
    assert four["with_kv"] == pytest.approx(120.0 / 4 * (10**8 + 4 * 1032 * per_token) / 40e9)
    assert "prefill" not in shares["int4"]  # no roofline for prompt processing
    assert args.measurements == ["decode", "prefill", "decode16"]
    with pytest.raises(SystemExit):  # argparse's error: names the unknown one and the known ones
        _bench_peer(monkeypatch, "--model", str(model), "--measurements", "decode,prefil")


def test_peer_precision_ratios_best_and_round_by_round(monkeypatch):
    """The quantized single streams over bf16's: the ratio of the best rounds, and within each round (the same
    spell of the machine's bandwidth), per engine; a missing figure leaves its ratios empty, not zero."""
    bench_peer, args = _bench_peer(monkeypatch, "--model", str(default_model_path()), "--rounds", "2",
                                   "--precisions", "bf16,int4")
    rate = {(1, "bf16", "leverlab"): 25.0, (1, "int4", "leverlab"): 62.5, (2, "bf16", "leverlab"): 20.0,
            (2, "int4", "leverlab"): 70.0, (1, "bf16", "llamacpp"): 20.0, (1, "int4", "llamacpp"): 40.0,
            (2, "bf16", "llamacpp"): None, (2, "int4", "llamacpp"): 45.0}
    rounds = [{"round": r, "precision": p, "engine": e, "measurement": "decode", "tok_s": v}
              for (r, p, e), v in rate.items()]
    rounds.append({"round": 1, "precision": "bf16", "measurement": "bandwidth", "gb_s": 50.0})
    best: dict = {}
    for r in rounds:
        if r["measurement"] == "decode":
            bench_peer.keep_best(best, r["precision"], r["engine"], "decode", r["tok_s"])
    ratios = bench_peer.precision_ratios(rounds, best, args)
    assert list(ratios) == ["int4"]
    ours = ratios["int4"]["leverlab"]
    assert ours["best"] == pytest.approx(70.0 / 25.0)
    assert ours["rounds"] == [pytest.approx(2.5), pytest.approx(3.5)]
    theirs = ratios["int4"]["llamacpp"]
    assert theirs["best"] == pytest.approx(45.0 / 20.0) and theirs["rounds"] == [pytest.approx(2.0), None]


def test_peer_paired_ratios_generation_by_generation(monkeypatch):
    """Our precisions decoded once each per rep, alternately forwards and backwards: the median of the reps' ratios
    to the first precision and the best rep over the best rep; a precision that could not start is left out, and
    without the base there are no ratios."""
    bench_peer, args = _bench_peer(monkeypatch, "--model", str(default_model_path()), "--pair-reps", "3",
                                   "--precisions", "bf16,int8,int4")
    figures = {"bf16": iter([20.0, 40.0, 30.0]), "int4": iter([60.0, 90.0, 81.0])}
    order = []

    def decode(p):
        order.append(p)
        return next(figures[p]) if p in figures else None  # int8 failed to start

    paired = bench_peer.paired_precision_ratios(decode, args)
    assert order == ["bf16", "int8", "int4", "int4", "int8", "bf16", "bf16", "int8", "int4"]
    assert list(paired["ratios"]) == ["int4"] and paired["reps"] == 3
    int4 = paired["ratios"]["int4"]
    assert int4["pairs"] == [pytest.approx(3.0), pytest.approx(2.25), pytest.approx(2.7)]
    assert int4["median"] == pytest.approx(2.7) and int4["best"] == pytest.approx(90.0 / 40.0)
    assert bench_peer.paired_precision_ratios(lambda p: None, args) is None
    monkeypatch.setattr(args, "pair_reps", 0)
    assert bench_peer.paired_precision_ratios(decode, args) is None


def test_peer_block_shares_name_the_steal_of_their_block(monkeypatch, capsys):
    """The shares at the bandwidth beside each block: the best round's, with the host's CPU steal during that
    block (study/steal.py) and the threads' compute scaling before it, so a rate from a stolen spell, or from one
    where two threads had one core between them, reads as one."""
    bench_peer, args = _bench_peer(monkeypatch, "--model", str(default_model_path()), "--rounds", "2",
                                   "--precisions", "int4", "--measurements", "decode", "--prompt-len", "0",
                                   "--decode-len", "0")
    rounds = [{"round": 1, "precision": "int4", "measurement": "bandwidth", "gb_s": 20.0},
              {"round": 1, "precision": "int4", "engine": "leverlab", "measurement": "decode", "tok_s": 30.0},
              {"round": 1, "precision": "int4", "measurement": "steal", "share": 0.052},
              {"round": 1, "precision": "int4", "measurement": "thread_scaling", "x": 1.04},
              {"round": 2, "precision": "int4", "measurement": "bandwidth", "gb_s": 20.0},
              {"round": 2, "precision": "int4", "engine": "leverlab", "measurement": "decode", "tok_s": 40.0},
              {"round": 2, "precision": "int4", "engine": "llamacpp", "measurement": "decode", "tok_s": 20.0}]
    bench_peer.print_block_shares(rounds, {"int4": {"leverlab": 4 * 10**8, "llamacpp": 4 * 10**8}}, args)
    out = capsys.readouterr().out
    # round 2's 40 tok/s x 0.4 GB over 20 GB/s; round 2 has no steal figure, so none is shown for it
    assert "LeverLab 80%, llama.cpp 40%" in out
    rounds[-2]["tok_s"] = 10.0  # now round 1's block is the best: its steal and scaling go with it
    bench_peer.print_block_shares(rounds, {"int4": {"leverlab": 4 * 10**8, "llamacpp": 4 * 10**8}}, args)
    assert "LeverLab 60% (steal 5.2%, threads 1.04x), llama.cpp 40%" in capsys.readouterr().out
