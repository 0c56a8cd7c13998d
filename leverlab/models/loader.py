"""Load a Hugging Face folder into our CausalLM: config.json + one or many *.safetensors (memory-mapped), or
PyTorch's pytorch_model*.bin where a folder has no safetensors (read with weights_only, memory-mapped too); or a
GGUF file, whose config and tensors gguf_file.py / gguf_loader.py read into the same names."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from leverlab.distributed.parallel_state import TPState, check_model, use_tp
from leverlab.errors import UnsupportedLever
from leverlab.kernels import huge_pages
from leverlab.layers import bf16_linear, prefetch_tune
from leverlab.layers.linear import Linear
from leverlab.layers.parallel import VocabParallelEmbedding
from leverlab.models import gguf_file, gguf_loader
from leverlab.models.config import ModelConfig
from leverlab.models.decoder import CausalLM
from leverlab.models.moe import SparseMoE
from leverlab.quant import autotune
from leverlab.quant.base import QuantMethod
from leverlab.quant.registry import get_quant_method, head_quant_method, quant_method_for_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def checkpoint_files(path: Path) -> list[Path]:
    """The weight files: safetensors (sharded by an index, or not) first, else PyTorch's pickled *.bin."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [path / n for n in names]
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors (nor pytorch_model*.bin) in {path}")
    return files


class _StateDictReader:
    """A loaded state dict behind safe_open's two calls (keys, get_tensor)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def keys(self):
        return list(self.state)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.state[name]


@contextmanager
def open_checkpoint(file: Path):
    """One weight file, read tensor by tensor: safetensors memory-mapped; a *.bin through torch.load with
    weights_only (no code from the pickle runs) and mmap (tensors are paged in as they are copied, not read
    whole first). A *.bin in the old, pre-zip format cannot be mapped: it is read into memory."""
    if file.suffix == ".safetensors":
        with safe_open(str(file), framework="pt", device="cpu") as f:
            yield f
        return
    try:
        state = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        state = torch.load(str(file), map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"{file} holds a {type(state).__name__}, not a state dict of tensors")
    try:
        yield _StateDictReader(state)
    finally:
        del state


def load_model(path: str | Path, dtype: str = "bfloat16", device: str | torch.device = "cpu",
               quantization: str | None = None, tp: TPState | None = None, lm_head: str = "auto",
               max_model_len: int | None = None) -> CausalLM:
    """`quantization`: a --quantization name (quantize at load time); a checkpoint that carries its own
    quantization_config (AWQ, GPTQ, `leverlab quantize` output) is read in its format whatever it is None.
    `lm_head`: --lm-head-quantization (registry.head_quant_method).
    `tp`: this rank's tensor-parallel state; the model holds its slice of every weight (None: all of them).
    `max_model_len`: the engine's, which the rotary tables cover and rope scaling is fixed for (None: the
    model's default)."""
    path = Path(path)
    cfg = ModelConfig.from_folder(path)
    tp_size = tp.size if tp is not None else 1
    check_model(cfg, tp_size)
    method = resolve_quant_method(path, quantization)
    head = head_quant_method(method, lm_head, device=device, hidden=cfg.hidden_size, dtype=dtype)
    with default_dtype(DTYPES[dtype]), torch.device(device), use_tp(tp):
        model = CausalLM(cfg, max_model_len)
    try:
        quantized = attach_quant_method(model, method, head)
    except ValueError as e:
        if tp_size == 1:
            raise
        name = method.name if method is not None else head.name
        raise UnsupportedLever(f"--tensor-parallel-size {tp_size} with {name}, on each rank's slice: {e}") from e
    load_weights(model, path, method, head)
    finish_quantization(quantized)
    if torch.device(device).type == "cpu":
        tile_bf16_layers(model)  # bf16 layers in AMX tile order where the CPU has it (before the move below)
        huge_pages.move_to_huge_pages(model)  # before anything times the weights or keeps pointers to them
        # The prefetch first: the rows' timing below measures the streaming kernels, whose speed depends on it,
        # so they are timed in the mode they will run in.
        # how the kernels prefetch their weights, here (off / nta / t0); whole decode steps check it at warm-up
        tuned = prefetch_tune.tune(model)
        model.prefetch_tuned = None if prefetch_tune.forced() else tuned
        autotune.tune(quantized)  # how many rows each layer streams before fbgemm's GEMM is faster
    model.quant_method = method
    return model.eval()


def tile_bf16_layers(model: CausalLM) -> int:
    """Every tileable bf16 Linear in AMX tile order where bf16_linear.tiles_available(); returns how many.
    The routed experts of a sparse MoE layer stay in place: not yet measured in tile order. A tied head's table is the
    embedding's too: the embedding then looks its rows up in the tiles (bf16_linear.embedding), one copy as before."""
    if not bf16_linear.tiles_available():
        return 0
    experts = {id(m) for moe in model.modules() if isinstance(moe, SparseMoE) for m in moe.experts.modules()}
    head, table = model.lm_head, model.model.embed_tokens
    tied = head.weight is table.weight
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and id(module) not in experts and bf16_linear.tileable(module):
            count += bf16_linear.to_tiles(module)
    if tied and head.kernel_state.tiles:
        table.weight = head.weight
    return count


def resolve_quant_method(path: Path, quantization: str | None):
    if gguf_file.is_gguf(path):
        return gguf_loader.quant_method(path, quantization)
    qcfg = json.loads((path / "config.json").read_text()).get("quantization_config")
    return quant_method_for_checkpoint(qcfg, quantization) if qcfg else get_quant_method(quantization)


def load_weights(model: CausalLM, path: Path, method: QuantMethod | None = None, head: QuantMethod | None = None) -> None:
    """`method`, `head`: the quantization methods attached (a GGUF file hands its projections over in their form)."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    named = gguf_loader.tensors(path, model.config, method, head) if gguf_file.is_gguf(path) else _checkpoint_tensors(path)
    for name, tensor in named:
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        _load_one(model, modules, params, name, tensor, loaded)
    missing = [n for n in params if n not in loaded and not (n == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} weights, e.g. {missing[:3]}")


def _checkpoint_tensors(path: Path):
    for file in checkpoint_files(path):
        # The file is mapped; each tensor is read once and copied into its (converted) parameter.
        with open_checkpoint(file) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


# Mixtral's names for an expert's projections (w1 gate, w3 up, w2 down) and its MoE block.
MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# Expert weights stacked into 3D tensors, as transformers 5 holds them in memory (and some checkpoints store them):
# gate_up_proj [E, 2 * I, H] (gate rows first), down_proj [E, H, I]. Published Qwen3-MoE and Mixtral checkpoints,
# and transformers' save_pretrained, write one tensor per expert instead (experts.{e}.gate_proj.weight); both load.
STACKED_EXPERTS = ("gate_up_proj", "down_proj")


def _our_name(name: str) -> str:
    """A checkpoint tensor's name in Hugging Face's Qwen/Llama vocabulary (Mixtral's renamed)."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    head, sep, tail = name.partition(".experts.")
    if sep:
        index, _, rest = tail.partition(".")
        proj, _, kind = rest.partition(".")
        name = f"{head}.experts.{index}.{MIXTRAL_NAMES.get(proj, proj)}.{kind}"
    return name


def _load_stacked(modules, experts_name: str, which: str, tensor: torch.Tensor, loaded: set[str]) -> None:
    """Split a stacked expert tensor into the experts' Linear layers: each expert's slice (a view) is loaded as its
    per-expert tensor would be."""
    experts = modules[experts_name]
    if tensor.dim() != 3 or tensor.shape[0] != len(experts):
        raise ValueError(f"stacked expert tensor {experts_name}.{which} has shape {tuple(tensor.shape)}; expected "
                         f"[{len(experts)}, out, in]")
    for e, expert in enumerate(experts):
        if which == "gate_up_proj":
            gate, up = tensor[e].chunk(2, dim=0)
            expert.gate_up_proj.load("weight", gate, "gate")
            expert.gate_up_proj.load("weight", up, "up")
        else:
            expert.down_proj.load("weight", tensor[e])
        loaded.add(f"{experts_name}.{e}.{which}.weight")


def _load_one(model, modules, params, name: str, tensor: torch.Tensor, loaded: set[str]) -> None:
    name = _our_name(name)
    module_name, _, kind = name.rpartition(".")
    if kind in STACKED_EXPERTS and module_name.endswith(".experts") and isinstance(modules.get(module_name), nn.ModuleList):
        _load_stacked(modules, module_name, kind, tensor, loaded)
        return
    parent, _, leaf = module_name.rpartition(".")
    if leaf in CausalLM.PACKED:
        target, shard = CausalLM.PACKED[leaf]
        module_name = f"{parent}.{target}"
    else:
        shard = None
    module = modules.get(module_name)
    if isinstance(module, Linear | VocabParallelEmbedding):  # these cut a tensor-parallel slice themselves
        module.load(kind, tensor, shard)
    elif name in params:
        if params[name].shape != tensor.shape:
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)} vs {tuple(params[name].shape)}")
        params[name].data.copy_(tensor)
    else:
        raise ValueError(f"checkpoint weight {name} has no place in {model.config.architecture}")
    loaded.add(f"{module_name}.{kind}")


def attach_quant_method(model: nn.Module, method: QuantMethod | None, head: QuantMethod | None = None) -> list[nn.Module]:
    """Give `method` to every decoder Linear and `head` to the output head (None: left in the model dtype),
    creating their weights; returns the layers that got one."""
    layers = []
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        m = method.for_layer(checkpoint_parts(name), module) if method is not None else None
        if name == "lm_head":
            m = head
        if m is not None:
            module.is_lm_head = name == "lm_head"
            module.use(m)
            m.create_weights(module)
            layers.append(module)
    if method is not None:
        method.attached()
    return layers


def checkpoint_parts(name: str) -> list[str]:
    """The checkpoint module names a layer of ours holds: q_proj, k_proj, v_proj for a packed qkv_proj."""
    parent, _, leaf = name.rpartition(".")
    parts = [f"{parent}.{part}" for part, (target, _) in CausalLM.PACKED.items() if target == leaf]
    return parts or [name]


def finish_quantization(layers: list[nn.Module]) -> None:
    """After every checkpoint tensor is in: convert each quantized layer to its kernel layout."""
    for layer in layers:
        layer.quant_method.process_weights_after_loading(layer)


def load_embedding_and_lm_head(path, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's full embedding table and output head [V, H] from its checkpoint (tied: one tensor)."""
    path = Path(path)
    found: dict[str, torch.Tensor] = {}
    wanted = ("model.embed_tokens.weight", "lm_head.weight")
    if gguf_file.is_gguf(path):
        for name, tensor in gguf_loader.tensors(path, ModelConfig.from_folder(path), None, only=wanted):
            found[name] = tensor.to(device=device, dtype=dtype)
    for file in [] if gguf_file.is_gguf(path) else checkpoint_files(path):
        with open_checkpoint(file) as f:
            for name in wanted:
                if name in f.keys():
                    found[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    embed = found["model.embed_tokens.weight"]
    return embed, found.get("lm_head.weight", embed)
