"""The loader moves a CPU model's weights into one huge-page arena (kernels/huge_pages.py): every weight the kernels
read (parameters, buffers, the streaming layouts int4's `q4` and int8's `q8`) lands there, tied weights stay one
tensor, the outputs do not change by a bit, and LEVERLAB_NO_HUGE_PAGES=1 leaves the weights where they are."""

import pytest
import torch

from leverlab.kernels import huge_pages
from leverlab.layers.attention import AttentionMetadata, forward_context
from leverlab.models.loader import load_model


def _logits(model, ids):
    cfg, t = model.config, ids.numel()
    caches = [torch.zeros(2, 4, 16, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(torch.arange(t), torch.tensor([[0, 1, 2]]), torch.tensor([t]), torch.tensor([0, t]))
    with torch.inference_mode(), forward_context(meta, caches):
        return model.compute_logits(model(ids, torch.arange(t)))


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_weights_move_into_one_arena_and_outputs_stay(checkpoint_factory, monkeypatch, quantization):
    if huge_pages.thp_mode() in ("never", "none"):
        pytest.skip("no transparent huge pages here: nothing moves")
    path = checkpoint_factory("qwen3")
    # Both loads stream the same rows: chosen by timing at load (quant/autotune.py), the 6-row prefill below could
    # take the streaming kernel in one and the int8 GEMM (AMX's, fast at a few rows) in the other, another product.
    monkeypatch.setenv("LEVERLAB_STREAM_ROWS", "16")
    monkeypatch.setenv("LEVERLAB_NO_HUGE_PAGES", "1")
    before = load_model(path, "bfloat16", quantization=quantization)
    assert huge_pages.move_to_huge_pages(before) == 0  # the switch: nothing moves
    monkeypatch.delenv("LEVERLAB_NO_HUGE_PAGES")
    model = load_model(path, "bfloat16", quantization=quantization)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for t in {huge_pages._key(t): t for t in map(huge_pages._get, huge_pages._slots(model))}.values())
    kinds = {kind for _, kind, _, _ in huge_pages._slots(model)}
    if quantization is not None:
        assert "attr" in kinds  # the streaming layout (q4 / q8) was found and moved
    # one arena: the distinct tensors are laid end to end, none overlapping, within a span the size of their sum
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    total = sum(e - s for s, e in spans)
    assert spans[-1][1] - spans[0][0] < total + 64 * len(spans)
    if model.config.tie_word_embeddings and quantization is None:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([1, 5, 9, 2, 7, 3])
    assert torch.equal(_logits(before, ids), _logits(model, ids))


def test_huge_page_buffer_and_the_bandwidth_it_reads(monkeypatch):
    """The roofline's bandwidth is read in huge-page memory too, where the weights are (a 4 KB-page read alone sat
    below what the kernels reached)."""
    from leverlab.study.bandwidth import measure_bandwidth

    if huge_pages.thp_mode() not in ("never", "none"):
        b = huge_pages.huge_page_buffer(3 << 20)
        assert b.dtype == torch.uint8 and b.numel() == 3 << 20 and b.data_ptr() % huge_pages.HUGE == 0
        b.fill_(7)
        assert int(b[-1]) == 7
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    assert huge_pages.huge_page_buffer(1 << 20) is None
    assert measure_bandwidth(1, gib=1 / 64, reps=1) > 0  # 4 KB pages only, then
