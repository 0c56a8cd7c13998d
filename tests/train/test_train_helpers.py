import numpy as np
import pytest
import torch

from leverlab.train.chat_data import explain_request, iter_functions, write_request
from leverlab.train.corpus import SourceFile
from leverlab.train.evaluate import tokenizes_as_python
from leverlab.train.trainer import TrainSettings, ce_loss, lr_at, train

SRC = '''
class K:
    def area(self, w, h=2):
        """Return the area of a w by h box.

        More text.
        """
        z = w * h
        return z
'''


def test_chat_examples_from_functions():
    (fi,) = iter_functions(SourceFile("m.py", SRC))
    assert fi.name == "area" and fi.signature == "def area(self, w, h=2):"
    assert fi.summary == "Return the area of a w by h box."
    assert "Return the area" not in explain_request(fi) and "z = w * h" in explain_request(fi)
    assert write_request(fi).startswith(
        "Write a function named area with signature `def area(self, w, h=2):`"
    )


def test_tokenizes_as_python():
    assert tokenizes_as_python("def f(x):\n    return x + 1\n    y = 'ab")  # cut back to the last full line
    assert not tokenizes_as_python("def f(x):\n    s = '''never closed\n    return s\n")
    assert not tokenizes_as_python("def f(x):\n        a = 1\n    b = 2\n")  # inconsistent dedent


def test_lr_schedule_warms_up_then_decays_with_time():
    s = TrainSettings(time_budget_min=10, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(s, 0, 0) == pytest.approx(1e-4)
    assert lr_at(s, 100, 0) == pytest.approx(1e-3)
    assert lr_at(s, 100, 600) == pytest.approx(1e-4)
    assert lr_at(s, 100, 300) == pytest.approx(0.55e-3)


def test_lr_schedule_follows_the_steps_under_a_step_budget():
    s = TrainSettings(time_budget_min=10, max_steps=200, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(s, 100, 600) == pytest.approx(0.55e-3)  # half the steps, whatever the clock says
    assert lr_at(s, 200, 0) == pytest.approx(1e-4)


def _tiny_lm():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(cfg)


def test_a_step_budget_trains_exactly_that_many_steps_the_same_way(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 64, size=5000).astype(np.uint16)
    s = TrainSettings(time_budget_min=1e-6, max_steps=7, batch_size=2, seq_len=16, val_windows=2, threads=1)
    runs = []
    for name in ("a", "b"):
        torch.manual_seed(0)
        model = _tiny_lm()
        state = train(model, ce_loss, tokens, tokens, tmp_path / name, s)
        assert state["step"] == 7 and state["tokens"] == 7 * 2 * 16  # the tiny time budget does not apply
        runs.append(model.state_dict())
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_training_checkpoints_and_resumes(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 64, size=5000).astype(np.uint16)
    s = TrainSettings(time_budget_min=0.01, batch_size=2, seq_len=16, val_windows=2, log_every=1, threads=1)
    torch.manual_seed(0)
    first = train(_tiny_lm(), ce_loss, tokens, tokens, tmp_path, s)
    assert (tmp_path / "ckpt.pt").exists() and first["step"] > 0
    s.time_budget_min = 0.02
    second = train(_tiny_lm(), ce_loss, tokens, tokens, tmp_path, s)  # resumes from ckpt.pt
    assert second["step"] > first["step"] and second["tokens"] == second["step"] * 2 * 16
    log = (tmp_path / "log.jsonl").read_text()
    assert log.count('"event": "start"') == 2 and '"event": "val"' in log
