"""Long-context rope scaling (layers/rotary.py) against transformers, float32, past the original context.

Tiny random checkpoints with an original context of 64 positions run prompts of 150-200 tokens: the logits of the
plain torch forward, the engine's default path (the fused C++ step where the kernels are built) and greedy
generation match transformers' eager model. dynamic and longrope are fixed for the engine's max_model_len (the
module docstring of layers/rotary.py says why); they are compared where transformers computes the same thing.
"""

import json

import pytest
import torch

from leverlab import LLM, SamplingParams
from leverlab.kernels import cpu_kernels
from leverlab.layers.attention import AttentionMetadata, forward_context
from leverlab.models.config import ModelConfig
from leverlab.models.loader import load_model
from tests.checkpoints import make_checkpoint, make_eagle_head
from tests.engine.helpers import hf_greedy

ORIGINAL = 64
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
# head_dim 16 (hidden 64 / 4 heads) for llama, 32 for qwen3: longrope needs head_dim / 2 factors.
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL,
            "short_factor": [1.0 + 0.05 * i for i in range(8)], "long_factor": [1.0 + 0.7 * i for i in range(8)]}
CASES = {
    # name: (arch, rope scaling, max_position_embeddings, other config fields)
    "yarn-qwen3": ("qwen3", YARN, ORIGINAL, {}),
    "yarn-llama": ("llama", {**YARN, "beta_fast": 16, "beta_slow": 2, "mscale": 1.2, "mscale_all_dim": 0.8,
                             "truncate": False}, 96, {}),
    "linear-qwen2": ("qwen2", {"rope_type": "linear", "factor": 4.0}, ORIGINAL, {}),
    "dynamic-qwen3": ("qwen3", {"rope_type": "dynamic", "factor": 4.0}, ORIGINAL, {}),
    # longrope through transformers' Llama, which takes it in rope_parameters; max_position_embeddings is the
    # extended length (Phi-3's layout), the original 64.
    "longrope-llama": ("llama", LONGROPE, 256, {}),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            arch, rope, max_pos, extra = CASES[name]
            made[name] = str(make_checkpoint(tmp_path_factory.mktemp(name), arch, rope_scaling=rope,
                                             max_position_embeddings=max_pos, **extra))
        return made[name]

    return get


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def prompt(n, seed=0):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def module_logits(path, ids, max_model_len):
    """Logits [T, V] of the plain torch forward (no fused step) over `ids`, one prefill."""
    model = load_model(path, "float32", max_model_len=max_model_len)
    cfg, t, bs = model.config, len(ids), 16
    blocks = -(-t // bs)
    caches = [torch.zeros(2, blocks, bs, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(torch.arange(t), torch.arange(blocks)[None], torch.tensor([t]), torch.tensor([0, t]))
    with torch.no_grad(), forward_context(meta, caches):
        return model.compute_logits(model(torch.tensor(ids), torch.arange(t)))


def engine_prompt_logprobs(llm, ids):
    """Our engine's log-probabilities of ids[1:] (its default path: prefill chunks, fused where built)."""
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    return torch.tensor([lp[tok].logprob for lp, tok in zip(out.prompt_logprobs[1:], ids[1:])])


def their_logprobs(logits, ids):
    lp = torch.log_softmax(logits.float(), -1)
    return torch.tensor([lp[i, tok].item() for i, tok in enumerate(ids[1:])])


def engine(path, **kw):
    llm = LLM(path, dtype="float32", **kw)
    if cpu_kernels.kernels() is not None:
        assert llm.engine.runner.fused is not None  # the default path is the fused C++ step here
    return llm


def close(a, b):
    assert torch.allclose(a, b, atol=1e-4, rtol=0), (a - b).abs().max()


@pytest.mark.parametrize("name", ["yarn-qwen3", "yarn-llama", "linear-qwen2", "longrope-llama"])
def test_static_schemes_match_transformers_past_the_original_context(ckpt, name):
    """yarn and linear do not depend on the length; longrope with max_model_len past the original length takes the
    long factors, as transformers does for any sequence that long."""
    path = ckpt(name)
    ref = hf_model(path)
    ids = prompt(200)
    expected = hf_logits(ref, ids)
    long = 256 if name == "longrope-llama" else None  # longrope's long factors need max_model_len past 64
    close(module_logits(path, ids, long), expected)
    llm = engine(path)
    assert llm.engine.max_model_len == ModelConfig.from_folder(path).default_max_len
    if name == "longrope-llama":  # longrope stays within its original length unless asked for more, as vLLM
        assert llm.engine.max_model_len == ORIGINAL
        llm = engine(path, max_model_len=256)
    close(engine_prompt_logprobs(llm, ids), their_logprobs(expected, ids))
    # Decode steps past the original context: greedy tokens as transformers' generate.
    p = prompt(150, seed=1)
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    want = hf_greedy(ref, p, 30)
    assert out.outputs[0].token_ids == want
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_yarn_scales_cos_and_sin_and_reaches_original_times_factor(ckpt):
    path = ckpt("yarn-qwen3")
    cfg = ModelConfig.from_folder(path)
    assert cfg.rope_scaling["rope_type"] == "yarn"
    assert (cfg.max_context, cfg.default_max_len) == (ORIGINAL * 4, ORIGINAL * 4)  # past max_position_embeddings
    model = load_model(path, "float32")
    rotary = model.model.layers[0].self_attn.rotary
    assert rotary.cos.shape[0] == 256
    # the attention factor 0.1 ln(4) + 1 multiplies the tables: at position 0 cos is that factor
    assert torch.allclose(rotary.cos[0], torch.full((cfg.head_dim,), 1 + 0.1 * torch.log(torch.tensor(4.0)).item()))
    with pytest.raises(ValueError, match="exceeds the model's context of 256 tokens"):
        LLM(path, dtype="float32", max_model_len=257)


def test_dynamic_is_fixed_for_max_model_len(ckpt):
    """transformers recomputes dynamic NTK for each forward's length; we fix it for max_model_len. A whole
    forward of max_model_len tokens matches, and so does any run while max_model_len stays within the original."""
    path = ckpt("dynamic-qwen3")
    ref = hf_model(path)
    assert ModelConfig.from_folder(path).default_max_len == 4 * ORIGINAL
    ids = prompt(180)
    expected = hf_logits(ref, ids)  # transformers' base for 180 positions
    close(module_logits(path, ids, 180), expected)
    # The engine with max_model_len 180 sees a prompt of 179 (one token must fit after it); causal attention
    # makes its logits those of transformers' forward over all 180.
    llm = engine(path, max_model_len=180)
    close(engine_prompt_logprobs(llm, ids[:-1]), their_logprobs(expected[:-1], ids[:-1]))
    assert not torch.allclose(module_logits(path, ids, 4 * ORIGINAL), expected, atol=1e-3, rtol=0)  # another base
    # Within the original context: plain RoPE, transformers' greedy tokens.
    short = engine(path, max_model_len=ORIGINAL)
    p = prompt(30, seed=2)
    out = short.generate([p], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    want = hf_greedy(ref, p, 30)
    assert out.outputs[0].token_ids == want


def test_longrope_short_factors_when_max_model_len_stays_within_the_original(ckpt):
    path = ckpt("longrope-llama")
    ref = hf_model(path)
    llm = engine(path)  # default max_model_len: the original 64
    ids = prompt(ORIGINAL)
    close(engine_prompt_logprobs(llm, ids[:-1]), their_logprobs(hf_logits(ref, ids[:-1]), ids[:-1]))
    p = prompt(30, seed=3)
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=34, ignore_eos=True))[0]
    want = hf_greedy(ref, p, 34)
    assert out.outputs[0].token_ids == want
    # A short prompt under a long max_model_len takes the long factors (vLLM's rule), where transformers would
    # take the short ones: the logits differ.
    short_logits = hf_logits(ref, ids[:-1])
    assert not torch.allclose(module_logits(path, ids[:-1], 256), short_logits, atol=1e-3, rtol=0)


def test_eagle_head_shares_the_scaled_tables_past_its_max_positions(ckpt, tmp_path):
    """An EAGLE head for a YaRN target rotates with the same scaled tables, over the engine's whole context (the
    head's config says max_position_embeddings 64); speculation stays lossless past it."""
    path = ckpt("yarn-qwen3")
    p = prompt(150, seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base = LLM(path, dtype="float32").generate([p], greedy)[0].outputs[0].token_ids
    head = make_eagle_head(path, tmp_path / "head")
    llm = LLM(path, dtype="float32",
              speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": 3})
    assert llm.generate([p], greedy)[0].outputs[0].token_ids == base
    assert llm.engine.counter_snapshot()["spec_draft_tokens"] > 0
    target_rotary = llm.engine.runner.model.model.layers[0].self_attn.rotary
    assert torch.equal(llm.engine.proposer.head.rotary.cos, target_rotary.cos)


def write_config(tmp_path, rope):
    path = make_checkpoint(tmp_path / "ck", "qwen3", shards=False)
    raw = json.loads((path / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw["rope_scaling"] = rope
    (path / "config.json").write_text(json.dumps(raw))
    return path


def test_unsupported_rope_scaling_is_refused_naming_it(tmp_path):
    path = write_config(tmp_path, {"rope_type": "mrope", "factor": 2.0})
    with pytest.raises(ValueError, match=r"'mrope' is not supported \(supported: default, linear, dynamic, yarn, "
                                         r"longrope, llama3\)"):
        ModelConfig.from_folder(path)
    write_config(tmp_path, {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "alpha": 1})
    with pytest.raises(ValueError, match=r"field\(s\) \['alpha'\] not supported"):
        ModelConfig.from_folder(path)
    write_config(tmp_path, {"rope_type": "linear"})
    with pytest.raises(ValueError, match=r"'linear' needs \['factor'\]"):
        ModelConfig.from_folder(path)
    write_config(tmp_path, {**LONGROPE})  # 8 factors; this Qwen3's head_dim 32 needs 16
    with pytest.raises(ValueError, match="short_factor has 8 values, the head needs 16"):
        ModelConfig.from_folder(path)
    write_config(tmp_path, {"type": "yarn", "factor": 2.0})  # the old key; original defaults to max positions
    cfg = ModelConfig.from_folder(path)
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512}
    assert cfg.max_context == 1024


@pytest.mark.parametrize("name,max_len", [("yarn-qwen3", None), ("dynamic-qwen3", 180)])
def test_tensor_parallel_ranks_build_the_same_tables(ckpt, name, max_len):
    """At TP=2 the other rank builds its own model (worker/tp_worker.py): its tables must be the same scaled ones,
    for the same max_model_len (dynamic's base depends on it)."""
    path = ckpt(name)
    ids = prompt(179)
    expected = hf_logits(hf_model(path), ids + [5])[:-1]  # transformers over 180 positions
    llm = LLM(path, dtype="float32", execution_mode="eager", tensor_parallel_size=2, max_model_len=max_len)
    try:
        close(engine_prompt_logprobs(llm, ids), their_logprobs(expected, ids))
    finally:
        llm.engine.close()


def test_yarn_bfloat16_close_to_transformers(ckpt):
    """bf16 casts the scaled float32 tables per call, as transformers does (the fused step's bf16 rope too)."""
    from transformers import AutoModelForCausalLM

    path = ckpt("yarn-qwen3")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    ids = prompt(200, seed=5)
    ours = engine_prompt_logprobs(LLM(path, dtype="bfloat16"), ids)
    theirs = their_logprobs(hf_logits(ref, ids), ids)
    assert (ours - theirs).abs().max() < 0.1
