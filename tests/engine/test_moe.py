"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) against transformers on tiny random checkpoints, and
through every engine path: batching, chunked prefill, prefix-cache hits and speculation change no token (float32,
greedy); int8 and int4 quantize the experts; a tie in the router resolves as transformers resolves it. Tensor parallelism:
test_moe_tensor_parallel.py."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from leverlab import LLM, SamplingParams
from leverlab.layers.attention import AttentionMetadata, forward_context
from leverlab.layers.linear import Linear
from leverlab.models.config import ModelConfig
from leverlab.models.loader import checkpoint_files, load_model
from leverlab.models.moe import Router, SparseMoE
from tests.checkpoints import MOE_ARCHS, make_eagle_head
from tests.engine.helpers import hf_greedy
from tests.quant.formats import write_float
from tests.quant.test_engine import fake_quant_weights

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [7], [100, 3, 250, 17, 9, 31, 2, 8], list(range(5, 75))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def hf_model(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def our_logits(model, ids: list[int]) -> torch.Tensor:
    """One prefill of `ids` through our model's forward (module path), float32 logits [T, V]."""
    cfg = model.config
    t = len(ids)
    dtype = model.model.embed_tokens.weight.dtype
    caches = [torch.zeros(2, 8, 16, cfg.num_kv_heads, cfg.head_dim, dtype=dtype) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(torch.arange(t), torch.tensor([list(range(8))]), torch.tensor([t]), torch.tensor([0, t]))
    with torch.no_grad(), forward_context(meta, caches):
        return model.compute_logits(model(torch.tensor(ids), torch.arange(t)))


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_all_free(llm):
    eng = llm.engine
    eng.check_invariants()
    assert eng.blocks.num_free == eng.blocks.num_blocks, "KV blocks leaked"


@pytest.fixture(scope="module")
def alone(checkpoint_factory):
    """Per architecture: greedy tokens of each prompt generated on its own (max_num_seqs=1)."""
    made = {}

    def get(arch):
        if arch not in made:
            llm = LLM(checkpoint_factory(arch), dtype="float32", max_num_seqs=1)
            made[arch] = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
        return made[arch]

    return get


def test_config_reads_the_moe_facts(checkpoint_factory):
    from transformers import AutoConfig

    for arch in MOE_ARCHS:
        path = checkpoint_factory(arch)
        cfg, hf = ModelConfig.from_folder(path), AutoConfig.from_pretrained(path)
        model = hf_model(path)
        # Which layers route: exactly those where transformers builds an expert block.
        assert cfg.sparse_layers == tuple(hasattr(layer.mlp, "experts") for layer in model.model.layers)
        assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
        assert cfg.norm_topk_prob == bool(getattr(hf, "norm_topk_prob", True))
        # Every weight is counted once (the q/k norms and attention biases aside, as for dense models).
        omitted = sum(p.numel() for n, p in model.named_parameters()
                      if n.endswith(("q_norm.weight", "k_norm.weight", "proj.bias")))
        assert cfg.num_params() == sum(p.numel() for p in model.parameters()) - omitted
        # Active: a token reads top-k of the experts, so fewer bytes than the whole model.
        assert cfg.weight_bytes(4) == cfg.num_params(active=True) * 4 < cfg.num_params() * 4
    qwen2 = ModelConfig.from_folder(checkpoint_factory("qwen2-moe"))
    assert qwen2.sparse_layers == (True, False, True) and qwen2.shared_expert_intermediate_size == 64


def test_decoder_sparse_step_and_mlp_only_layers(checkpoint_factory):
    path = checkpoint_factory("qwen2-moe", num_hidden_layers=4, decoder_sparse_step=2)  # mlp_only_layers [1]
    cfg, model = ModelConfig.from_folder(path), hf_model(path)
    assert cfg.sparse_layers == (False, False, False, True)
    assert cfg.sparse_layers == tuple(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    ours = load_model(path, "float32")
    assert torch.allclose(our_logits(ours, PROMPTS[1]), model(torch.tensor([PROMPTS[1]])).logits[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_logits_match_transformers(checkpoint_factory, arch):
    path = checkpoint_factory(arch)
    ours, ref = load_model(path, "float32"), hf_model(path)
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPTS[4]])).logits[0]
    logits = our_logits(ours, PROMPTS[4])
    assert torch.allclose(logits, expected, atol=1e-4, rtol=0), (logits - expected).abs().max()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_tokens_match_transformers(checkpoint_factory, arch):
    path = checkpoint_factory(arch)
    llm = LLM(path, dtype="float32")
    assert llm.engine.runner.fused is not None  # decode steps run in the fused C++ step (test_moe_fused.py)
    ref = hf_model(path)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        expected = hf_greedy(ref, prompt, 32)
        assert out.outputs[0].token_ids == expected
    assert_all_free(llm)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_batched_and_chunked_equal_alone(checkpoint_factory, alone, arch):
    path = checkpoint_factory(arch)
    batched = LLM(path, dtype="float32")
    assert tokens(batched.generate(PROMPTS, GREEDY)) == alone(arch)
    assert_all_free(batched)
    # A 16-token budget splits the long prompts into chunks mixed with the other sequences' decodes.
    chunked = LLM(path, dtype="float32", max_num_batched_tokens=16)
    assert tokens(chunked.generate(PROMPTS, GREEDY)) == alone(arch)
    assert_all_free(chunked)


def test_prefix_cache_hits_change_no_token(checkpoint_factory):
    path = checkpoint_factory("qwen3-moe")
    shared = list(range(20, 60))
    prompts = [shared + [i, i + 1] for i in range(4)] + [shared]
    cold = LLM(path, dtype="float32", enable_prefix_caching=False, block_size=8)
    expected = tokens(cold.generate(prompts, GREEDY))
    warm = LLM(path, dtype="float32", enable_prefix_caching=True, block_size=8)
    warm.generate(prompts[:1], GREEDY)
    again = warm.generate(prompts, GREEDY)  # every prompt now hits the shared prefix
    assert tokens(again) == expected
    assert all(o.metrics.num_cached_prompt_tokens >= 32 for o in again)
    assert_all_free(warm)


@pytest.mark.parametrize("arch,method", [("qwen3-moe", "ngram"), ("mixtral", "ngram"), ("qwen2-moe", "draft_model"),
                                         ("qwen3-moe", "eagle")])
def test_speculation_changes_no_token(checkpoint_factory, tmp_path, arch, method):
    """Verification batches route their tokens like any other step: drafts checked by the MoE target give the
    plain decode's tokens."""
    path = checkpoint_factory(arch)
    prompts = [[5, 6, 7, 8] * 6, list(range(30, 60)), [9, 10] * 9 + [11], [3] * 5]
    plain = tokens(LLM(path, dtype="float32").generate(prompts, GREEDY))
    if method == "ngram":
        sc = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    elif method == "eagle":  # a random head over the MoE target's aux layers: drafts mostly rejected
        sc = {"method": "eagle", "model": make_eagle_head(path, tmp_path / "eagle"), "num_speculative_tokens": 3}
    else:  # the target as its own draft: every draft is accepted, so verification spans whole drafts
        sc = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    spec = LLM(path, dtype="float32", speculative_config=sc)
    assert tokens(spec.generate(prompts, GREEDY)) == plain
    c = spec.engine.counter_snapshot()
    assert c["spec_draft_tokens"] > 0
    if method != "eagle":  # a random EAGLE head's drafts are all rejected here: it exercises rollback instead
        assert c["spec_accepted_tokens"] > 0, "the test should exercise acceptance"
    assert_all_free(spec)


@pytest.mark.parametrize("method,arch", [("int8", "qwen3-moe"), ("int4-g32", "qwen2-moe")])
def test_quantized_experts_generate_like_their_dequantized_model(checkpoint_factory, tmp_path, method, arch):
    """Every expert (and the shared expert) is quantized by the dense layers' method, one Linear each; the
    router stays float. Greedy tokens equal those of a float model holding the dequantized weights."""
    path = checkpoint_factory(arch)
    llm = LLM(path, dtype="float32", quantization=method)
    model = llm.engine.runner.model
    moe = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE))
    assert all(e.gate_up_proj.quant_method is not None and e.down_proj.quant_method is not None for e in moe.experts)
    assert not isinstance(moe.gate, Linear) and moe.gate.weight.dtype == torch.float32
    got = tokens(llm.generate(PROMPTS, GREEDY))
    ref = LLM(str(write_float(path, tmp_path / "fake", fake_quant_weights(llm))), dtype="float32")
    assert got == tokens(ref.generate(PROMPTS, GREEDY))
    assert_all_free(llm)


def test_mixtral_int4_and_bf16_int8_generate(checkpoint_factory):
    path = checkpoint_factory("mixtral")
    for kw in ({"dtype": "float32", "quantization": "int4"}, {"dtype": "bfloat16", "quantization": "int8"},
               {"dtype": "bfloat16", "quantization": "int4", "kv_cache_dtype": "int8"}):
        out = LLM(path, **kw).generate(PROMPTS[:2], GREEDY)
        assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in out)


@pytest.mark.parametrize("arch,method,load_time", [("qwen2-moe", "int8", "int8"), ("mixtral", "int4", "int4")])
def test_quantize_cli_quantizes_every_expert(checkpoint_factory, tmp_path, arch, method, load_time):
    """`leverlab quantize` writes each expert's projections quantized (Mixtral's w1/w2/w3 too); the folder loads
    without re-quantizing and generates what quantizing at load time generates."""
    from leverlab.models.quantize import quantize_folder

    src = checkpoint_factory(arch)
    dst = quantize_folder(src, tmp_path / method, method)
    with safe_open(str(checkpoint_files(dst)[0]), framework="pt") as f:
        names = list(f.keys())
    assert not [n for n in names if ".experts." in n and n.endswith(".weight")], "an expert stayed float"
    pre = LLM(str(dst), dtype="float32")
    assert tokens(pre.generate(PROMPTS, GREEDY)) == tokens(
        LLM(src, dtype="float32", quantization=load_time).generate(PROMPTS, GREEDY))


def test_bfloat16_close_to_transformers(checkpoint_factory):
    """bf16 rounds differently here and in transformers, and a router whose two best experts are nearly tied can
    pick differently: the routes must agree on nearly every (token, layer), and the logits be close at every
    position before the first token routed differently (a later layer's attention carries a different route on)."""
    path = checkpoint_factory("qwen3-moe")
    ref, ours = hf_model(path, torch.bfloat16), load_model(path, "bfloat16")
    routes = {"ours": [], "ref": []}
    for name, model, pick in (("ours", ours, 1), ("ref", ref, 2)):
        for layer in model.model.layers:
            layer.mlp.gate.register_forward_hook(lambda m, i, o, name=name, pick=pick: routes[name].append(o[pick]))
    ids = PROMPTS[4]
    got = torch.log_softmax(our_logits(ours, ids), -1)
    with torch.no_grad():
        expected = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)
    differ = torch.stack([(a.sort(-1).values != b.sort(-1).values).any(-1)
                          for a, b in zip(routes["ours"], routes["ref"])])  # [layers, T]
    assert differ.float().mean() < 0.05, differ
    first = int(differ.any(0).nonzero().min()) if differ.any() else len(ids)
    assert first >= len(ids) // 4, differ
    assert (got[:first] - expected[:first]).abs().max() < 0.1


def test_each_hit_expert_runs_once_per_step_over_all_its_tokens(checkpoint_factory):
    """Grouped by expert: in one forward of 16 tokens (a decode batch of 16 sequences looks the same to the MoE
    block), every expert any token chose is called once, on exactly the tokens that chose it, in their order."""
    model = load_model(checkpoint_factory("qwen3-moe"), "float32")
    moe = model.model.layers[0].mlp
    calls = []
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda m, i, o, e=e: calls.append((e, i[0].clone())))
    x = torch.randn(16, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, chosen = moe.gate(x)
        moe(x)
    hit = sorted(set(chosen.flatten().tolist()))
    assert [e for e, _ in calls] == hit  # once each, in expert order
    for e, rows in calls:
        assert torch.equal(rows, x[(chosen == e).any(-1)])


def _stack_experts(src, dst):
    """A copy of `src` whose experts are stored as transformers 5 holds them in memory: per layer one
    gate_up_proj [E, 2I, H] and one down_proj [E, H, I]."""
    import shutil

    dst.mkdir()
    tensors = {}
    for f in checkpoint_files(src):
        with safe_open(str(f), framework="pt") as fh:
            tensors.update({k: fh.get_tensor(k) for k in fh.keys()})
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    out = {}
    for name, t in tensors.items():
        if ".experts." not in name:
            out[name] = t
        elif name.endswith(".experts.0.gate_proj.weight"):
            base = name[: -len("0.gate_proj.weight")]
            out[base + "gate_up_proj"] = torch.stack(
                [torch.cat([tensors[f"{base}{e}.gate_proj.weight"], tensors[f"{base}{e}.up_proj.weight"]])
                 for e in range(experts)])
            out[base + "down_proj"] = torch.stack([tensors[f"{base}{e}.down_proj.weight"] for e in range(experts)])
    save_file(out, str(dst / "model.safetensors"))
    return dst


def test_stacked_expert_tensors_load_like_per_expert_ones(checkpoint_factory, tmp_path):
    from pathlib import Path

    path = Path(checkpoint_factory("qwen3-moe"))
    stacked = _stack_experts(path, tmp_path / "stacked")
    a, b = load_model(path, "float32"), load_model(stacked, "float32")
    assert torch.equal(our_logits(a, PROMPTS[1]), our_logits(b, PROMPTS[1]))
    with torch.no_grad():  # transformers reads the stacked form as well
        assert torch.allclose(our_logits(b, PROMPTS[1]), hf_model(stacked)(torch.tensor([PROMPTS[1]])).logits[0],
                              atol=1e-4, rtol=0)


def _tied_router(h: int, e: int, g: torch.Generator) -> torch.Tensor:
    """Router rows 1, 4 and 6 equal, every other row their negation: each token's top two come out of a three-way
    (or five-way) tie, so which experts run is decided by how torch.topk breaks ties."""
    v = torch.randn(h, generator=g)
    w = -v.repeat(e, 1)
    w[[1, 4, 6]] = v
    return w


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral"])
def test_router_tie_resolves_as_transformers(arch):
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    g = torch.Generator().manual_seed(0)
    if arch == "mixtral":
        ref = MixtralTopKRouter(MixtralConfig(hidden_size=64, num_local_experts=8, num_experts_per_tok=2))
        ours = Router(64, 8, 2, renormalize=True, float32_weights=True)
    else:
        ref = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=64, num_experts=8, num_experts_per_tok=2,
                                                norm_topk_prob=True))
        ours = Router(64, 8, 2, renormalize=True, float32_weights=False)
    w = _tied_router(64, 8, g)
    with torch.no_grad():
        ref.weight.copy_(w)
        ours.weight.copy_(w)
        x = torch.randn(33, 64, generator=g)
        _, ref_weights, ref_experts = ref(x)
        weights, experts = ours(x)
    logits = torch.nn.functional.linear(x, w)
    assert torch.equal(logits[:, 1], logits[:, 4]) and torch.equal(logits[:, 1], logits[:, 6]), "no tie to test"
    assert torch.equal(experts, ref_experts) and torch.equal(weights, ref_weights)
    assert weights.dtype == ref_weights.dtype


def test_forced_tie_in_a_model_matches_transformers(checkpoint_factory, tmp_path):
    """A whole model whose routers all tie: the experts picked (and so the logits and tokens) are transformers'."""
    from pathlib import Path

    src = Path(checkpoint_factory("qwen3-moe"))
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for f in checkpoint_files(src):
        with safe_open(str(f), framework="pt") as fh:
            tensors.update({k: fh.get_tensor(k) for k in fh.keys() if k.endswith("mlp.gate.weight")})
    tied = {k: _tied_router(t.shape[1], t.shape[0], g) for k, t in tensors.items()}
    path = write_float(src, tmp_path / "tied", tied)
    ours, ref = load_model(path, "float32"), hf_model(path)
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPTS[4]])).logits[0]
    assert torch.allclose(our_logits(ours, PROMPTS[4]), expected, atol=1e-4, rtol=0)
    out = LLM(str(path), dtype="float32").generate(PROMPTS[:2], GREEDY)
    for prompt, o in zip(PROMPTS[:2], out):
        assert o.outputs[0].token_ids == hf_greedy(ref, prompt, 24)


@pytest.mark.slow
def test_compiled_equals_eager(checkpoint_factory, tmp_path, monkeypatch):
    """The compiled path runs the expert loop eagerly (moe.expert_outputs), the rest in the graph."""
    monkeypatch.setenv("LEVERLAB_CACHE", str(tmp_path))
    path = checkpoint_factory("qwen3-moe")
    eager = tokens(LLM(path, dtype="float32").generate(PROMPTS[:3], GREEDY))
    assert tokens(LLM(path, dtype="float32", execution_mode="compiled").generate(PROMPTS[:3], GREEDY)) == eager


def test_quantize_cli_refuses_stacked_experts(checkpoint_factory, tmp_path):
    from pathlib import Path

    from leverlab.models.quantize import quantize_folder

    stacked = _stack_experts(Path(checkpoint_factory("qwen3-moe")), tmp_path / "stacked")
    with pytest.raises(ValueError, match="stacked tensor"):
        quantize_folder(stacked, tmp_path / "q", "int8")
    assert not (tmp_path / "q").exists()
