"""PyTorch pickle checkpoints (pytorch_model.bin, and sharded with pytorch_model.bin.index.json) give the same
float32 greedy tokens as the safetensors folder they were written from; the pickle is read with weights_only
(no code runs) and memory-mapped.

transformers 5 no longer writes *.bin (save_pretrained's safe_serialization=False is gone), so the files are
written here as transformers 4 wrote them: torch.save of the state dict, shards named
pytorch_model-0000i-of-0000n.bin with a weight_map index. Tied weights are saved once, as transformers did."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from leverlab import LLM, SamplingParams
from leverlab.models.loader import checkpoint_files

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["def add(a, b):", "The quick brown"]


def _as_bin(src: str, dst: Path, shards: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    dst.mkdir()
    if shards == 1:
        torch.save(state, dst / "pytorch_model.bin")
    else:
        names, weight_map = list(state), {}
        for i in range(shards):
            file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
            part = {k: state[k] for k in names[i::shards]}
            torch.save(part, dst / file)
            weight_map.update(dict.fromkeys(part, file))
        index = {"metadata": {"total_size": sum(v.numel() * 4 for v in state.values())}, "weight_map": weight_map}
        (dst / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    for f in Path(src).iterdir():
        if f.suffix == ".json" and "safetensors" not in f.name or f.name.startswith("tokenizer"):
            shutil.copy(f, dst / f.name)
    return dst


def _greedy(path) -> list[list[int]]:
    with LLM(str(path), dtype="float32", execution_mode="eager", num_kv_blocks=16) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])  # tied and untied output heads
def test_bin_checkpoint_matches_safetensors(checkpoint_factory, tmp_path, arch):
    src = checkpoint_factory(arch)
    one = _as_bin(src, tmp_path / "one", 1)
    sharded = _as_bin(src, tmp_path / "sharded", 3)
    assert [f.name for f in checkpoint_files(one)] == ["pytorch_model.bin"]
    assert (sharded / "pytorch_model.bin.index.json").is_file() and len(checkpoint_files(sharded)) > 1
    want = _greedy(src)
    assert _greedy(one) == want
    assert _greedy(sharded) == want
