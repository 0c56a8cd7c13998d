"""Flag mapping of each engine adapter, and what each says it cannot express."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

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


def test_a_precision_can_name_a_published_checkpoint_folder_for_every_engine(tmp_path, vllm_cpu):
    """--checkpoint int8=DIR (e.g. a RedHatAI W8A8 release): LeverLab serves that folder, as vLLM does, with the
    flag naming the precision (our compressed-tensors reader accepts int8 for a W8A8 folder); other precisions and
    the model lever keep their own folders. The in-process fidelity pass loads the same folder (Engine.weights)."""
    from leverlab.study.cli import _pairs

    folders = _pairs([f"int8={tmp_path}"], "--checkpoint")
    ours = get_engine("leverlab", checkpoints=folders)
    vllm_cpu.checkpoints.update(folders)
    cmd = ours.command("/m", Levers(quantization="int8"), 9)
    assert cmd[cmd.index("serve") + 1] == str(tmp_path) and _flag(cmd, "--quantization") == "int8"
    assert _flag(vllm_cpu.command("/m", Levers(quantization="int8"), 9), "--model") == str(tmp_path)
    assert ours.weights("/m", Levers(quantization="int8")) == str(tmp_path)
    assert ours.weights("/m", Levers(quantization="int4")) == "/m"
    assert ours.weights("/m", Levers(quantization="int8", model=str(tmp_path / "x"))) == str(tmp_path / "x")


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


@pytest.fixture
def vllm_cpu(monkeypatch, tmp_path):
    """The vLLM adapter as on a CPU machine with the peer venv installed (its python faked: no server starts)."""
    from leverlab.bench import peer_vllm

    monkeypatch.setattr(peer_vllm, "python", lambda root=None: tmp_path / "venv" / "bin" / "python")
    return get_engine("vllm")


def test_vllm_flags_and_gaps(vllm_cpu):
    e = vllm_cpu
    cmd = e.command("/m", Levers(quantization="fp8", kv_cache_dtype="int8", tensor_parallel_size=2), 9)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and _flag(cmd, "--model") == "/m"
    assert _flag(cmd, "--quantization") == "fp8" and _flag(cmd, "--kv-cache-dtype") == "fp8"
    assert _flag(cmd, "--tensor-parallel-size") == "2" and "--enable-prefix-caching" in cmd
    assert _flag(cmd, "--port") == "9" and _flag(cmd, "--host") == "127.0.0.1"
    # int8 / int4 are folders of ours that vLLM reads (prepare() writes them); other methods need a checkpoint
    assert e.unsupported(Levers(quantization="int4")) == {} and e.unsupported(Levers(quantization="int8")) == {}
    assert "pre-quantized checkpoint" in e.unsupported(Levers(quantization="gptq"))["precision"]
    assert "adaptive" in e.unsupported(Levers(speculative={**NGRAM, "adaptive": True}))["speculation"]
    e.checkpoints["int4"] = "/ckpt/awq"
    cmd = e.command("/m", Levers(quantization="int4"), 9)
    assert _flag(cmd, "--model") == "/ckpt/awq" and "--quantization" not in cmd


def test_vllm_prepare_writes_the_folders_it_reads(vllm_cpu, checkpoint_factory, tmp_path, monkeypatch):
    """int8 as a compressed-tensors W8A8 folder, int4 as an AWQ folder, written once into the cache."""
    from leverlab.study.plan import Plan, PlanBuilder

    monkeypatch.setenv("LEVERLAB_CACHE", str(tmp_path / "cache"))
    model = str(checkpoint_factory("qwen3", num_hidden_layers=2))
    b = PlanBuilder().step("int8", "precision", "int8").step("int4", "precision", "int4")
    made = vllm_cpu.prepare(model, Plan("p", b.steps), tmp_path / "w.json", say=lambda *_: None)
    assert len(made["checkpoints"]) == 2 and vllm_cpu.threads == 1
    w8a8 = Path(_flag(vllm_cpu.command(model, Levers(quantization="int8"), 9), "--model"))
    awq = Path(_flag(vllm_cpu.command(model, Levers(quantization="int4"), 9), "--model"))
    q8 = json.loads((w8a8 / "config.json").read_text())["quantization_config"]
    assert q8["quant_method"] == "compressed-tensors" and q8["format"] == "int-quantized"
    assert json.loads((awq / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    from safetensors import safe_open

    name = "model.layers.0.mlp.down_proj.weight"
    found = {}
    for file in w8a8.glob("*.safetensors"):  # the tiny checkpoint is sharded
        with safe_open(str(file), "pt") as f:
            found.update({k: f.get_tensor(k) for k in (name, name + "_scale") if k in f.keys()})
    w, s = found[name], found[name + "_scale"]
    assert w.dtype == torch.int8 and s.shape == (w.shape[0], 1) and s.dtype == torch.float32
    mtime = (w8a8 / "config.json").stat().st_mtime_ns
    vllm_cpu.prepare(model, Plan("p", b.steps), tmp_path / "w.json", say=lambda *_: None)
    assert (w8a8 / "config.json").stat().st_mtime_ns == mtime  # cached, not rewritten


def test_vllm_threads_bound_as_ours():
    from leverlab.bench.peer_vllm import server_env

    one = server_env(1, base={})
    assert one["VLLM_CPU_OMP_THREADS_BIND"] == "0" and one["VLLM_CPU_KVCACHE_SPACE"]
    assert server_env(None, base={}).get("VLLM_CPU_OMP_THREADS_BIND") is None  # vLLM's own default
    import os

    if (os.cpu_count() or 1) == 2:
        assert one["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"  # the other core for its front end
        two = server_env(1, ranks=2, base={})
        assert two["VLLM_CPU_OMP_THREADS_BIND"] == "0|1" and two["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_vllm_refusal_is_its_own_root_cause(tmp_path):
    """vLLM exits 1 for a refusal and for a kernel its CPU build lacks; the report shows its own exception."""
    from leverlab.study.engines.vllm import root_cause

    log = (
        "(APIServer pid=1) WARNING 12-06 [system_utils.py:255] failed ... `OSError: [Errno 24] Too many open files`\n"
        "(Worker pid=2) ERROR 12-06 [multiproc_executor.py:953] RuntimeError: _C::static_scaled_fp8_quant() "
        "expected at most 0 argument(s) but received 4 argument(s).\n"
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n"
    )
    assert root_cause(log) == (
        "vLLM: RuntimeError: _C::static_scaled_fp8_quant() expected at most 0 argument(s) but received 4 argument(s)."
    )
    log = (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for SpeculativeConfig\n"
        "  Value error, Speculative decoding is not supported on this platform [type=value_error, input_value={}]\n"
    )
    assert root_cause(log) == (
        "vLLM: ValidationError: 1 validation error for SpeculativeConfig: Value error, Speculative decoding is not "
        "supported on this platform"
    )
    assert root_cause("INFO all fine\nKilled\n") is None
    e = get_engine("vllm")
    (tmp_path / "log").write_text(log)
    assert e.refusal(1, tmp_path / "log").startswith("vLLM: ValidationError")


def test_vllm_speculative_config_has_vllms_keys_only(vllm_cpu):
    """vLLM's SpeculativeConfig: ngram needs prompt_lookup_max; keys it does not know are never passed."""
    e = vllm_cpu
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


def test_vllm_not_installed_says_how(monkeypatch):
    from leverlab.bench import peer_vllm

    monkeypatch.setattr(peer_vllm, "python", lambda root=None: None)
    monkeypatch.setattr("shutil.which", lambda name: None)
    why = get_engine("vllm").installed()
    assert why.startswith("not installed") and "python -m leverlab.bench.peer_vllm install" in why


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
    from leverlab.speculative.eagle_head import EagleConfig, EagleHead, init_head, save_head

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
