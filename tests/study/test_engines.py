"""Flag mapping of each engine adapter, and what each says it cannot express."""

from __future__ import annotations

import json

from leverlab.study.engines import get_engine
from leverlab.study.engines.base import refusal_message
from leverlab.study.plan import Levers

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_leverlab_flags():
    e = get_engine("leverlab", execution_mode="eager")
    lv = Levers(
        quantization="int8", kv_cache_dtype="int8", speculative=NGRAM, prefix_caching=False, max_num_seqs=8
    )
    cmd = e.command("/m", lv, 1234)
    assert cmd[cmd.index("serve") + 1] == "/m" and _flag(cmd, "--port") == "1234"
    assert _flag(cmd, "--quantization") == "int8" and _flag(cmd, "--kv-cache-dtype") == "int8"
    assert json.loads(_flag(cmd, "--speculative-config")) == NGRAM
    assert "--no-enable-prefix-caching" in cmd and _flag(cmd, "--max-num-seqs") == "8"
    assert _flag(cmd, "--execution-mode") == "eager" and _flag(cmd, "--dtype") == "bfloat16"


def test_leverlab_refusals_come_from_the_engine_config_then_the_draft_folder():
    e = get_engine("leverlab")
    assert e.unsupported(Levers(tensor_parallel_size=2)) == {}
    assert e.precheck("m", Levers(tensor_parallel_size=2)) is None  # built (issue 9): a TP step runs
    assert "tensor_parallel_size must be a positive integer" in e.precheck("m", Levers(tensor_parallel_size=0))
    assert e.precheck("m", Levers(speculative=NGRAM)) is None
    msg = e.precheck("m", Levers(speculative={"method": "draft_model", "model": "models/no-such-draft"}))
    assert "does not exist" in msg
    assert not e.runnable("m", Levers(tensor_parallel_size=0)) and e.runnable("m", Levers(tensor_parallel_size=2))


def test_refusal_message_is_the_engines_line():
    log = "$ leverlab serve ...\nsome info\nleverlab serve: speculative method 'eagle' is not built yet (issue 7)\n"
    assert refusal_message(log) == "speculative method 'eagle' is not built yet (issue 7)"


def test_vllm_flags_and_gaps():
    e = get_engine("vllm")
    cmd = e.command(
        "Qwen/Qwen3-8B", Levers(quantization="int8", kv_cache_dtype="fp8", tensor_parallel_size=4), 9
    )
    assert cmd[1:3] == ["serve", "Qwen/Qwen3-8B"]
    assert _flag(cmd, "--quantization") == "fp8" and _flag(cmd, "--kv-cache-dtype") == "fp8"
    assert _flag(cmd, "--tensor-parallel-size") == "4" and "--enable-prefix-caching" in cmd
    assert "pre-quantized checkpoint" in e.unsupported(Levers(quantization="int4"))["precision"]
    assert "adaptive" in e.unsupported(Levers(speculative={**NGRAM, "adaptive": True}))["speculation"]
    e2 = get_engine("vllm", checkpoints={"int4": "Qwen/Qwen3-8B-AWQ"})
    cmd = e2.command("Qwen/Qwen3-8B", Levers(quantization="int4"), 9)
    assert cmd[2] == "Qwen/Qwen3-8B-AWQ" and "--quantization" not in cmd


def test_vllm_speculative_config_has_vllms_keys_only():
    """vLLM's SpeculativeConfig: ngram needs prompt_lookup_max; keys it does not know are never passed."""
    e = get_engine("vllm")
    spec = json.loads(_flag(e.command("m", Levers(speculative=NGRAM), 9), "--speculative-config"))
    assert spec == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    own = {**NGRAM, "prompt_lookup_max": 3, "draft_tensor_parallel_size": 1, "adaptive": False}
    spec = json.loads(_flag(e.command("m", Levers(speculative=own), 9), "--speculative-config"))
    assert spec["prompt_lookup_max"] == 3 and "adaptive" not in spec and spec["draft_tensor_parallel_size"] == 1
    draft = {"method": "draft_model", "model": "org/small", "num_speculative_tokens": 5}
    assert json.loads(_flag(e.command("m", Levers(speculative=draft), 9), "--speculative-config")) == draft
    assert "disable_by_batch_size" in e.unsupported(Levers(speculative={**NGRAM, "disable_by_batch_size": 8}))[
        "speculation"
    ]
    cmd = e.command("m", Levers(), 9)
    assert "--data-parallel-size" not in cmd and "--quantization" not in cmd and "--kv-cache-dtype" not in cmd
    assert "--no-enable-prefix-caching" in e.command("m", Levers(prefix_caching=False), 9)


def test_llamacpp_server_flags(monkeypatch):
    """Flags as this llama-server (llama-cpp-python 0.3.36's llama.cpp) names them: --draft-max is gone there."""
    e = get_engine("llamacpp", gguf={"bfloat16": "m-bf16.gguf", "int8": "m-q8.gguf"}, draft_gguf="d.gguf", threads=1)
    e.binary, e.module = "/usr/bin/llama-server", False
    e.max_slots, e.slot_ctx = 16, 1000
    lv = Levers(quantization="int8", kv_cache_dtype="int8", max_num_seqs=4)
    cmd = e.command("ignored", lv, 7)
    assert _flag(cmd, "-m") == "m-q8.gguf" and _flag(cmd, "-ctk") == "q8_0" and _flag(cmd, "-np") == "4"
    assert _flag(cmd, "-c") == "4000" and _flag(cmd, "-t") == "1" and "--metrics" in cmd
    # slots: no more than the plan's top concurrency (64 sequences, 16 clients: 16 slots of 1000 tokens)
    assert _flag(e.command("ignored", Levers(), 7), "-np") == "16"
    cmd = e.command("ignored", Levers(speculative={"method": "draft_model", "num_speculative_tokens": 5}), 7)
    assert _flag(cmd, "-md") == "d.gguf" and _flag(cmd, "--spec-draft-n-max") == "5" and "--draft-max" not in cmd
    cmd = e.command("ignored", Levers(speculative=NGRAM), 7)
    assert _flag(cmd, "--spec-type") == "ngram-simple" and _flag(cmd, "--spec-ngram-simple-size-m") == "4"
    assert _flag(cmd, "--spec-ngram-simple-size-n") == "2"  # our shortest lookup (prompt_lookup_min)
    assert e.unsupported(Levers(speculative=NGRAM)) == {}
    assert "no EAGLE" in e.unsupported(Levers(speculative={"method": "eagle"}))["speculation"]
    assert "adaptive" in e.unsupported(Levers(speculative={**NGRAM, "adaptive": True}))["speculation"]
    assert "no GGUF file for int4" in e.unsupported(Levers(quantization="int4"))["precision"]
    assert "no llama.cpp file type for fp8" in e.unsupported(Levers(quantization="fp8"))["precision"]
    assert "tensor_parallel" in e.unsupported(Levers(tensor_parallel_size=2))
    assert e.extra_body(Levers(prefix_caching=False)) == {"cache_prompt": False}


def test_llamacpp_python_module_flags():
    e = get_engine("llamacpp", gguf={"bfloat16": "m.gguf"})
    e.binary, e.module = None, True
    cmd = e.command("ignored", Levers(speculative=NGRAM), 7)
    assert cmd[1:3] == ["-m", "llama_cpp.server"]
    assert (
        _flag(cmd, "--draft_model") == "prompt-lookup-decoding"
        and _flag(cmd, "--draft_model_num_pred_tokens") == "4"
    )
    assert e.unsupported(Levers(speculative=NGRAM)) == {}


def test_llamacpp_not_installed_is_reported_with_the_install_step():
    e = get_engine("llamacpp")
    e.binary, e.module = None, False
    assert e.installed().startswith("not installed") and "peer_llamacpp build" in e.installed()


def test_llamacpp_a_file_that_could_not_be_made_fails_the_configuration(tmp_path):
    """A conversion failure is the study's own failure (status failed, with the reason), not a refusal."""
    from leverlab.study.engines.base import StartFailed

    e = get_engine("llamacpp")
    e.binary, e.module = "/usr/bin/llama-server", False
    e.errors["int8"] = "GGUF conversion failed: boom"
    assert e.unsupported(Levers(quantization="int8")) == {}
    try:
        e.start("m", Levers(quantization="int8"), tmp_path / "server.log")
    except StartFailed as err:
        assert err.kind == "failed" and "boom" in err.reason
    else:
        raise AssertionError("start() should have failed")


def test_vllm_gets_our_eagle_head_as_its_speculators_export(checkpoint_factory, tmp_path):
    from leverlab.models.config import ModelConfig
    from leverlab.spec.eagle_head import EagleConfig, EagleHead, init_head, save_head

    target = checkpoint_factory("qwen3", num_hidden_layers=4)
    tcfg = ModelConfig.from_folder(target)
    e = get_engine("vllm")
    for aux, ok in (((0, 1, 2), True), ((1, 2, 3), False)):  # 3: the top layer's output, which vLLM cannot take
        head = tmp_path / f"head{aux[-1]}"
        save_head(init_head(EagleHead(EagleConfig.for_target(tcfg, aux))), head, dtype="float32")
        lv = Levers(speculative={"method": "eagle", "model": str(head), "num_speculative_tokens": 3})
        gaps = e.unsupported(lv)
        if not ok:
            assert "top layer" in gaps["speculation"]
            continue
        assert not gaps
        spec = json.loads(_flag(e.command(target, lv, 9), "--speculative-config"))
        assert spec["method"] == "eagle3" and spec["model"] == str(head / "speculators")
        cfg = json.loads((head / "speculators" / "config.json").read_text())
        assert cfg["speculators_model_type"] == "eagle3" and cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
