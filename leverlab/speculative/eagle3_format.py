"""EAGLE head folders in every format we read: ours (eagle_head.py), and EAGLE-3 heads as the rest of the world
writes them; `load_head` and `head_config` read any of them, `aux_layers_for` tells the engine which target
layers a configured head reads.

EAGLE-3 heads as the rest of the world writes them: the `speculators` format (what vLLM loads, e.g.
RedHatAI's published speculators) and the original EAGLE-3 release; read into our EagleHead, and our heads
exported to the `speculators` format so the same head runs in vLLM.

`speculators` folder (config.json + model.safetensors):
  config   speculators_model_type "eagle3", architectures ["Eagle3Speculator"], transformer_layer_config (a
           Llama or Qwen3 decoder-layer config: hidden size, heads, rope, vocab_size = the target's
           vocabulary), draft_vocab_size, eagle_aux_hidden_state_layer_ids, target_hidden_size,
           norm_before_residual (vLLM reads a missing key as true), norm_before_fc, fc_norm, norm_output,
           speculators_config {algorithm, proposal_methods [{proposal_type, speculative_tokens}],
           default_proposal_method, verifier {name_or_path, architectures}}
  tensors  fc.weight [H, A*F]; layers.0.{input_layernorm (on the embedding), hidden_norm (on the feature),
           self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm (qwen3), post_attention_layernorm,
           mlp.{gate,up,down}_proj}.weight; norm.weight; lm_head.weight [Vd, H]; d2t [Vd] int64 offsets
           (target id = draft id + d2t[draft id]); t2d [V] bool (which target ids the draft can say);
           optionally embed_tokens.weight, input_norm.weight, fc_norm.{i}.weight.
Original EAGLE-3 release: a flat Llama config (architectures like "LlamaForCausalLMEagle3", draft_vocab_size,
  maybe eagle_config {eagle_aux_hidden_state_layer_ids}); the layer's tensors under "midlayer." instead of
  "layers.0."; often pytorch_model.bin.

Aux layer ids in both formats count the residual stream ENTERING layer i (vLLM captures it before running
layer i), so their id i is our "output of layer i - 1"; id 0 (the embedding output) has no equivalent here,
and a head reading our top layer's output cannot be expressed for vLLM. Without ids, EAGLE-3's default
(2, L/2, L-3) applies.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from leverlab.config import default_model_path
from leverlab.errors import UnsupportedLever
from leverlab.models.config import ModelConfig, read_rope
from leverlab.models.loader import load_embedding_and_lm_head
from leverlab.speculative.eagle_head import ARCHITECTURE, EagleConfig, EagleHead, build_head
from leverlab.speculative_config import EAGLE_METHODS, SpeculativeConfig

LAYER = "layers.0."
# Our parameter name -> theirs (after the layer prefix is normalized to "layers.0.").
RENAME = {
    "embed_norm.weight": LAYER + "input_layernorm.weight",
    "feature_norm.weight": LAYER + "hidden_norm.weight",
    "q_norm.weight": LAYER + "self_attn.q_norm.weight",
    "k_norm.weight": LAYER + "self_attn.k_norm.weight",
    "o_proj.weight": LAYER + "self_attn.o_proj.weight",
    "o_proj.bias": LAYER + "self_attn.o_proj.bias",
    "post_attention_layernorm.weight": LAYER + "post_attention_layernorm.weight",
    "mlp.down_proj.weight": LAYER + "mlp.down_proj.weight",
}
SAME = ("fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "input_norm.weight")
# Packed in our module, one tensor each in theirs (rows in this order).
PACKED = {"qkv_proj": [LAYER + f"self_attn.{x}_proj" for x in "qkv"],
          "mlp.gate_up_proj": [LAYER + "mlp.gate_proj", LAYER + "mlp.up_proj"]}


def detect_format(path: str | Path) -> str:
    """leverlab | speculators | eagle3, from config.json; a clear error for anything else."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise UnsupportedLever(f"EAGLE head folder {path} has no config.json (train one: leverlab train-eagle)")
    raw = json.loads(f.read_text())
    archs = raw.get("architectures") or []
    if ARCHITECTURE in archs:
        return "leverlab"
    kind = raw.get("speculators_model_type")
    if kind is not None:
        if kind != "eagle3":
            raise UnsupportedLever(f"{path}: speculators model type {kind!r} is not supported (only \"eagle3\")")
        return "speculators"
    if any("eagle3" in a.lower() for a in archs):
        return "eagle3"
    raise UnsupportedLever(f"{path} is not an EAGLE head (architectures {archs}); for a separate draft model "
                           "use method \"draft_model\"")


# ---- reading -------------------------------------------------------------------------------------------------
def read_foreign_config(path: str | Path, target_num_layers: int | None) -> EagleConfig:
    fmt = detect_format(path)
    raw = json.loads((Path(path) / "config.json").read_text())
    if fmt == "speculators":
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise UnsupportedLever(f"{path}: speculators config has no transformer_layer_config object")
        top = raw
        # vLLM's reading of the speculators format: a missing norm_before_residual means true.
        norm_before_residual = bool(raw.get("norm_before_residual", True))
    else:
        layer, top = raw, {**raw, **(raw.get("eagle_config") or {})}
        norm_before_residual = bool(raw.get("norm_before_residual", False))
    if layer.get("num_hidden_layers", 1) != 1:
        raise UnsupportedLever(f"{path}: EAGLE-3 heads with {layer['num_hidden_layers']} layers are not supported "
                               "(one decoder layer)")
    if layer.get("hidden_act", "silu") != "silu":
        raise UnsupportedLever(f"{path}: hidden_act {layer['hidden_act']!r} is not supported (silu)")
    if top.get("use_aux_hidden_state") is False:
        raise UnsupportedLever(f"{path}: heads without aux hidden states (EAGLE-1/2 style) are not supported")
    h, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
    try:
        theta, scaling = read_rope(layer, int(layer.get("head_dim") or h // heads),
                                   int(layer.get("max_position_embeddings", 4096)))
    except ValueError as e:
        raise UnsupportedLever(f"{path}: {e}") from None
    vocab = int(layer["vocab_size"])
    ids = top.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        if target_num_layers is None:
            raise UnsupportedLever(f"{path} names no eagle_aux_hidden_state_layer_ids; the default needs the target")
        ids = [2, target_num_layers // 2, target_num_layers - 3]  # EAGLE-3's and vLLM's default
    if any(int(i) < 1 for i in ids):
        raise UnsupportedLever(f"{path}: aux layer id 0 (the embedding output) is not supported; ids {list(ids)}")
    if len(set(ids)) != len(ids):
        # vLLM captures each layer once, in layer order: repeated ids would not fill fc's input either.
        raise UnsupportedLever(f"{path}: repeated aux layer ids {list(ids)}")
    ids = sorted(int(i) for i in ids)  # features come in layer order, whatever order the config lists
    model_type = layer.get("model_type", "llama")
    if model_type not in ("llama", "qwen3"):
        raise UnsupportedLever(f"{path}: layer model_type {model_type!r} is not supported (llama, qwen3)")
    target_hidden = top.get("target_hidden_size")
    draft_vocab = top.get("draft_vocab_size") or vocab
    return EagleConfig(
        target_architecture=None, target_num_layers=None, vocab_size=vocab,
        aux_layer_ids=tuple(int(i) - 1 for i in ids),  # theirs: entering layer i; ours: output of layer i - 1
        hidden_size=h, num_heads=heads, num_kv_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or h // heads), intermediate_size=int(layer["intermediate_size"]),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(layer.get("max_position_embeddings", 4096)), qk_norm=model_type == "qwen3",
        dtype=str(top.get("torch_dtype") or top.get("dtype") or layer.get("torch_dtype") or "bfloat16"),
        target_hidden_size=int(target_hidden) if target_hidden and int(target_hidden) != h else None,
        draft_vocab_size=int(draft_vocab), attention_bias=bool(layer.get("attention_bias", False)),
        norm_before_residual=norm_before_residual, norm_before_fc=bool(top.get("norm_before_fc", False)),
        fc_norm=bool(top.get("fc_norm", False)), norm_output=bool(top.get("norm_output", False)),
        source_format=fmt)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if files:
        out: dict[str, torch.Tensor] = {}
        for name in files:
            out.update(load_file(str(path / name)))
        return out
    bins = sorted(path.glob("*.bin"))
    if not bins:
        raise UnsupportedLever(f"{path}: no *.safetensors or *.bin weights")
    out = {}
    for b in bins:
        out.update(torch.load(b, map_location="cpu", weights_only=True))
    return out


def read_foreign(path: str | Path, target_num_layers: int | None) -> tuple[EagleConfig, dict[str, torch.Tensor]]:
    """(config, state dict in our parameter names) of a speculators / original EAGLE-3 head folder."""
    path = Path(path)
    cfg = read_foreign_config(path, target_num_layers)
    theirs = {}
    for name, t in _tensors(path).items():
        name = name.removeprefix("model.").replace("midlayer.", LAYER)
        theirs[name] = t
    cfg.qk_norm = LAYER + "self_attn.q_norm.weight" in theirs  # the tensors decide, whatever model_type says
    cfg.own_embedding = "embed_tokens.weight" in theirs
    if LAYER + "self_attn.q_proj.bias" in theirs:
        cfg.attention_bias = True
    ours: dict[str, torch.Tensor] = {}
    for mine, their in RENAME.items():
        if their in theirs:
            ours[mine] = theirs.pop(their)
    for name in SAME:
        if name in theirs:
            ours[name] = theirs.pop(name)
    for name in list(theirs):
        if name.startswith("fc_norm."):
            ours[name] = theirs.pop(name)
    for mine, parts in PACKED.items():
        for kind in ("weight", "bias"):
            got = [theirs.pop(f"{p}.{kind}", None) for p in parts]
            if all(g is not None for g in got):
                ours[f"{mine}.{kind}"] = torch.cat(got, dim=0)
    vd = cfg.draft_vocab_size
    d2t, t2d = theirs.pop("d2t", None), theirs.pop("t2d", None)
    if "lm_head.weight" not in ours:
        raise UnsupportedLever(f"{path}: no lm_head.weight (an EAGLE-3 head brings its own output head)")
    if ours["lm_head.weight"].shape[0] != vd:
        raise UnsupportedLever(f"{path}: lm_head has {ours['lm_head.weight'].shape[0]} rows, draft_vocab_size {vd}")
    ours["draft_to_target"] = _draft_map(path, d2t, t2d, vd, cfg.vocab_size)
    theirs.pop("verifier_lm_head.weight", None)
    theirs.pop("verifier_norm.weight", None)
    if theirs:
        raise UnsupportedLever(f"{path}: tensors not understood: {sorted(theirs)[:5]}")
    return cfg, ours


def _draft_map(path, d2t: torch.Tensor | None, t2d: torch.Tensor | None, vd: int, vocab: int) -> torch.Tensor:
    """[Vd] target id of each draft id; checked to be distinct, in range, and to agree with t2d."""
    if d2t is None:
        if vd != vocab:
            raise UnsupportedLever(f"{path}: a reduced draft vocabulary ({vd} of {vocab}) needs d2t")
        return torch.arange(vd, dtype=torch.int64)
    if tuple(d2t.shape) != (vd,):
        raise UnsupportedLever(f"{path}: d2t has shape {tuple(d2t.shape)}, expected ({vd},)")
    targets = torch.arange(vd, dtype=torch.int64) + d2t.to(torch.int64)
    if targets.min() < 0 or targets.max() >= vocab or targets.unique().numel() != vd:
        raise UnsupportedLever(f"{path}: d2t maps draft ids outside [0, {vocab}) or two onto one target id")
    if t2d is not None:
        t2d = t2d.to(torch.bool)
        if t2d.numel() != vocab or int(t2d.sum()) != vd or not bool(t2d[targets].all()):
            raise UnsupportedLever(f"{path}: t2d disagrees with d2t")
    return targets


# ---- writing (export) ----------------------------------------------------------------------------------------
def vllm_problems(cfg: EagleConfig, target_num_layers: int) -> list[str]:
    """Why vLLM could not run this head as exported (empty: it can)."""
    out = []
    if any(i + 1 >= target_num_layers for i in cfg.aux_layer_ids):
        out.append(f"aux layer {max(cfg.aux_layer_ids)} is the target's top layer output, which vLLM cannot "
                   f"capture (it takes the stream entering layers 0..{target_num_layers - 1}); retrain with "
                   f"--aux-layers below {target_num_layers - 1}")
    if len(cfg.aux_layer_ids) != 3 and not cfg.qk_norm:
        out.append(f"vLLM's Llama EAGLE-3 head expects 3 aux layers; this one has {len(cfg.aux_layer_ids)}")
    return out


def export_speculators(head: EagleHead, out: str | Path, target_path: str | Path,
                       num_speculative_tokens: int = 3, dtype: str | None = None) -> Path:
    """Write `head` as a `speculators` eagle3 folder. A head that shares the target's lm_head gets a copy of
    it (full vocabulary: no d2t/t2d, as speculators writes them only for a reduced one)."""
    from safetensors.torch import save_file

    cfg = head.config
    out, target_path = Path(out), Path(target_path)
    target = ModelConfig.from_folder(target_path)
    cfg.check_target(target, str(out))
    dtype = dtype or cfg.dtype
    tdt = getattr(torch, dtype)
    mine = {k: v.detach().to("cpu") for k, v in head.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for name, t in mine.items():
        if name in RENAME:
            state[RENAME[name]] = t
        elif name in SAME or name.startswith("fc_norm."):
            state[name] = t
        elif name.rsplit(".", 1)[0] in PACKED:
            base, kind = name.rsplit(".", 1)
            parts = PACKED[base]
            sizes = ([cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2 if base == "qkv_proj"
                     else [cfg.intermediate_size] * 2)
            for p, chunk in zip(parts, t.split(sizes, dim=0)):
                state[f"{p}.{kind}"] = chunk
        elif name == "draft_to_target":
            vd = t.numel()
            state["d2t"] = t - torch.arange(vd, dtype=torch.int64)
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[t] = True
            state["t2d"] = t2d
        else:
            raise ValueError(f"export: no speculators name for {name}")
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = load_embedding_and_lm_head(target_path, torch.float32, "cpu")[1]
    state = {k: (v.to(tdt) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    raw_target = json.loads((target_path / "config.json").read_text())
    layer = {
        "model_type": "qwen3" if cfg.qk_norm else "llama", "architectures": [],
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias, "mlp_bias": False, "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size, "torch_dtype": dtype,
    }
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size,
        "target_hidden_size": cfg.feature_size,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.aux_layer_ids],  # theirs count one more
        # Written out, never left to defaults: vLLM reads a missing norm_before_residual as true.
        "norm_before_residual": cfg.norm_before_residual, "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(target_path), "architectures": raw_target.get("architectures", [])},
        },
        "torch_dtype": dtype,
        "exported_by": "leverlab (speculative/eagle3_format.py)",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def speculators_export_of(head_dir: str | Path, target_path: str | Path) -> Path:
    """The `speculators` folder to hand vLLM for a head folder: the folder itself when it already is one (or
    an original EAGLE-3 release, which vLLM reads too), else our head exported once to head_dir/speculators
    (rewritten when the head is newer)."""
    head_dir = Path(head_dir)
    if detect_format(head_dir) != "leverlab":
        return head_dir
    out = head_dir / "speculators"
    src = head_dir / "model.safetensors"
    done = out / "config.json"
    if not done.is_file() or done.stat().st_mtime < src.stat().st_mtime:
        head = load_head(head_dir, torch.float32)
        export_speculators(head, out, target_path, dtype=head.config.dtype)
    return out


def load_head(path: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu",
              target_num_layers: int | None = None, max_len: int | None = None) -> EagleHead:
    """Any supported head folder: ours, `speculators` (eagle3) or the original EAGLE-3 release.
    target_num_layers: for heads that do not name their aux layers (EAGLE-3's default depends on it).
    max_len: the engine's max_model_len, which the head's rotary tables must cover (None: the head's own)."""
    if detect_format(path) != "leverlab":
        cfg, state = read_foreign(path, target_num_layers)
    else:
        cfg, state = EagleConfig.from_folder(path), load_file(str(Path(path) / "model.safetensors"))
    return build_head(cfg, state, dtype, path, max_len).to(device=device).eval()


def head_config(path: str | Path, target_num_layers: int | None = None) -> EagleConfig:
    if detect_format(path) != "leverlab":
        return read_foreign_config(path, target_num_layers)
    return EagleConfig.from_folder(path)


def aux_layers_for(engine_config) -> tuple[int, ...]:
    """Target layers whose outputs the model must return next to its hidden states: the EAGLE head's aux
    layers when eagle speculation is configured, else none (the plain forward returns hidden only)."""
    raw = engine_config.speculative_config
    if not raw:
        return ()
    spec = SpeculativeConfig.from_dict(raw)
    if spec.method not in EAGLE_METHODS:
        return ()
    target = ModelConfig.from_folder(engine_config.model or default_model_path())
    return head_config(spec.model, target.num_layers).aux_layer_ids
