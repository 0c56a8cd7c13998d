"""EAGLE-3 heads as others write them: a `speculators`-format head (and the original EAGLE-3 release layout)
with its own lm_head over a reduced draft vocabulary loads and runs losslessly (float32 greedy, identical to
plain decoding), its drafts are target ids of that vocabulary; our own head exported to the speculators
format and loaded back drafts exactly as before; KV blocks (target and head) all free afterwards."""

import json

import pytest
import torch

from leverlab import LLM, SamplingParams
from leverlab.errors import UnsupportedLever
from leverlab.speculative.eagle3_format import export_speculators, load_head, read_foreign_config
from tests.checkpoints import make_eagle_head, make_speculators_eagle3
from tests.engine.helpers import assert_all_free

PROMPTS = [[5, 6, 7, 8] * 6, list(range(30, 60)), [9, 10] * 9 + [11], [3] * 5]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def target(checkpoint_factory):
    return checkpoint_factory("qwen3", num_hidden_layers=4)


@pytest.fixture(scope="module")
def plain(target):
    return tokens(LLM(target, dtype="float32").generate(PROMPTS, GREEDY))


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def record_drafts(llm) -> list[list[int]]:
    """Every draft the proposer hands out, in order."""
    seen: list[list[int]] = []
    prop = llm.engine.proposer
    inner = prop.propose

    def propose(seqs, ks):
        drafts = inner(seqs, ks)
        seen.extend(list(d.tokens) for d in drafts)
        return drafts

    prop.propose = propose
    return seen



@pytest.mark.parametrize("layout", ["speculators-llama", "speculators-qwen3", "original"])
def test_reduced_vocabulary_eagle3_head_is_lossless(target, plain, tmp_path, layout):
    head = make_speculators_eagle3(target, tmp_path / "head", draft_vocab=96, original=layout == "original",
                                   layer_type="qwen3" if layout.endswith("qwen3") else "llama",
                                   norm_before_residual=None if layout == "speculators-qwen3" else True)
    llm = LLM(target, dtype="float32", speculative_config={"method": "eagle3", "model": head,
                                                           "num_speculative_tokens": 3})
    p = llm.engine.proposer
    assert p.head.config.draft_vocab_size == 96 and p.head.lm_head.weight.shape[0] == 96
    assert p.head.config.aux_layer_ids == (0, 1, 2)  # vLLM ids 1, 2, 3: the stream entering those layers
    assert llm.engine.runner.model.aux_layers == (0, 1, 2)
    assert p.head.config.norm_before_residual  # written true, or missing (vLLM reads missing as true)
    assert p.head.q_norm is not None if layout.endswith("qwen3") else p.head.q_norm is None
    drafts = record_drafts(llm)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain
    # Every draft token is a TARGET id that the draft vocabulary maps to (d2t applied exactly).
    raw = torch.load(f"{head}/pytorch_model.bin") if layout == "original" else None
    if raw is None:
        from safetensors.torch import load_file

        raw = load_file(f"{head}/model.safetensors")
    allowed = set((torch.arange(96) + raw["d2t"]).tolist())
    drafted = [t for d in drafts for t in d]
    assert drafted and set(drafted) <= allowed
    assert_all_free(llm)


def test_draft_logits_map_back_to_target_ids(target, tmp_path):
    head_dir = make_speculators_eagle3(target, tmp_path / "head", draft_vocab=40)
    llm = LLM(target, dtype="float32", speculative_config={"method": "eagle3", "model": head_dir})
    p = llm.engine.proposer
    h = torch.randn(3, p.head.config.hidden_size)
    full = p._logits(h)  # [3, V]
    small = p.head.lm_head(h).float()  # [3, Vd]
    targets = p.head.draft_to_target
    assert full.shape[1] == p.head.config.vocab_size
    assert torch.equal(full[:, targets], small)
    mask = torch.ones(full.shape[1], dtype=torch.bool)
    mask[targets] = False
    assert torch.isinf(full[:, mask]).all()
    assert torch.equal(full.argmax(-1), targets[small.argmax(-1)])


def test_our_head_exported_to_speculators_drafts_identically(target, plain, tmp_path):
    ours = make_eagle_head(target, tmp_path / "ours")
    head = load_head(ours, torch.float32)
    out = export_speculators(head, tmp_path / "spec", target, num_speculative_tokens=3)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in head.config.aux_layer_ids]
    assert cfg["norm_before_residual"] is False and cfg["transformer_layer_config"]["model_type"] == "qwen3"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    from safetensors.torch import load_file

    names = set(load_file(str(out / "model.safetensors")))
    assert {"fc.weight", "layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight",
            "layers.0.self_attn.q_proj.weight", "layers.0.mlp.gate_proj.weight", "norm.weight",
            "lm_head.weight"} <= names
    runs = []
    for method, path in (("eagle", ours), ("eagle3", str(out))):
        llm = LLM(target, dtype="float32", speculative_config={"method": method, "model": path,
                                                               "num_speculative_tokens": 3})
        drafts = record_drafts(llm)
        assert tokens(llm.generate(PROMPTS, GREEDY)) == plain
        runs.append(drafts)
        assert_all_free(llm)
    assert runs[0] == runs[1] and any(runs[0])


def test_foreign_config_checks(target, tmp_path):
    cfg = read_foreign_config(make_speculators_eagle3(target, tmp_path / "a", layer_ids=None, original=True),
                              target_num_layers=32)
    assert cfg.aux_layer_ids == (0, 1, 2)  # from eagle_config
    bare = tmp_path / "b"
    make_speculators_eagle3(target, bare)
    raw = json.loads((bare / "config.json").read_text())
    del raw["eagle_aux_hidden_state_layer_ids"]
    (bare / "config.json").write_text(json.dumps(raw))
    assert read_foreign_config(bare, target_num_layers=32).aux_layer_ids == (1, 15, 28)  # EAGLE-3's (2, 16, 29)
    raw["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    (bare / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedLever, match="embedding output"):
        LLM(target, dtype="float32", speculative_config={"method": "eagle3", "model": str(bare)})
    raw["eagle_aux_hidden_state_layer_ids"] = [1, 2, 9]
    (bare / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedLever, match="reads target layers"):
        LLM(target, dtype="float32", speculative_config={"method": "eagle3", "model": str(bare)})
    raw["speculators_model_type"] = "mlp"
    (bare / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedLever, match="only \"eagle3\""):
        LLM(target, dtype="float32", speculative_config={"method": "eagle3", "model": str(bare)})


def test_draft_tensor_parallel_size_other_than_one_is_refused(target):
    from leverlab.config import EngineConfig

    for method in ("ngram", "eagle3", "draft_model"):
        with pytest.raises(UnsupportedLever, match="draft_tensor_parallel_size 2 is not supported"):
            EngineConfig(model=target, speculative_config={"method": method, "model": target,
                                                           "draft_tensor_parallel_size": 2})
    EngineConfig(model=target, speculative_config={"method": "ngram", "draft_tensor_parallel_size": 1})


def test_reduced_vocabulary_head_adaptive_and_sampled(target, plain, tmp_path):
    """Adaptive (the gate) stays token-identical; sampling with a draft distribution that lives on the draft
    vocabulary only (zero elsewhere) runs through the rejection rule, reproducibly for a seed (with fixed K:
    the gate's choices depend on timing, and a speculating step draws differently from a plain one)."""
    head = make_speculators_eagle3(target, tmp_path / "head", draft_vocab=64)
    llm = LLM(target, dtype="float32", speculative_config={"method": "eagle3", "model": head, "adaptive": True})
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain
    assert llm.engine.counter_snapshot()["spec_gate_spec_steps"] > 0
    assert_all_free(llm)
    # Without the prefix cache: a cached prompt gives the head less context, so other drafts, other draws.
    llm = LLM(target, dtype="float32", enable_prefix_caching=False,
              speculative_config={"method": "eagle3", "model": head})
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    a, b = (tokens(llm.generate(PROMPTS, sampled)) for _ in range(2))
    assert a == b and llm.engine.counter_snapshot()["spec_draft_tokens"] > 0
    assert_all_free(llm)


def test_train_eagle_export_only_writes_the_speculators_folder(target, tmp_path, capsys):
    from leverlab.cli import main

    head = make_eagle_head(target, tmp_path / "head")
    assert main(["train-eagle", "--model", target, "--out", head, "--export-only", "--k", "2"]) == 0
    cfg = json.loads((tmp_path / "head" / "speculators" / "config.json").read_text())
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    loaded = load_head(tmp_path / "head" / "speculators", torch.float32, target_num_layers=4)
    assert loaded.config.source_format == "speculators" and loaded.lm_head is not None
    # A 4-layer target's default aux layers (1, 2) reach no higher than vLLM can capture: nothing to note.
    assert "vLLM cannot run" not in capsys.readouterr().out


@pytest.mark.parametrize("switches", [{"norm_before_fc": True, "norm_output": True}, {"fc_norm": True}])
def test_feature_norm_switches_load_and_stay_lossless(target, plain, tmp_path, switches):
    head = make_speculators_eagle3(target, tmp_path / "head", switches=switches)
    llm = LLM(target, dtype="float32", speculative_config={"method": "eagle3", "model": head})
    h = llm.engine.proposer.head
    assert (h.input_norm is not None) == bool(switches.get("norm_before_fc"))
    assert (h.fc_norm is not None) == bool(switches.get("fc_norm"))
    assert h.config.norm_output == bool(switches.get("norm_output"))
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain
    assert llm.engine.counter_snapshot()["spec_draft_tokens"] > 0
    assert_all_free(llm)
