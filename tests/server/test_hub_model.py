"""`leverlab serve ORG/NAME`: a real server process given a Hugging Face Hub id, found in a Hub-layout cache
under HF_HOME with HF_HUB_OFFLINE set, answers the official `openai` client under that id, with the tokens the
same checkpoint gives as a folder."""

from __future__ import annotations

import openai
import pytest

from tests.checkpoints import add_to_hub_cache, make_checkpoint


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory, checkpoint):
    home = tmp_path_factory.mktemp("hf-home")
    add_to_hub_cache(home / "hub", "tiny-org/tiny-qwen3", checkpoint)
    other = make_checkpoint(tmp_path_factory.mktemp("v2") / "m", "qwen3", seed=3)
    add_to_hub_cache(home / "hub", "tiny-org/tiny-qwen3", other, ref="v2")
    return home, other


def _complete(url: str, model: str) -> tuple[list[str], str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    names = [m.id for m in client.models.list().data]
    r = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    return names, r.choices[0].text


def test_serve_by_hub_id(start_server, hub_home, server, checkpoint):
    home, other = hub_home
    env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    by_id = start_server(env=env, ckpt="tiny-org/tiny-qwen3")
    names, text = _complete(by_id.url, "tiny-org/tiny-qwen3")
    assert names == ["tiny-org/tiny-qwen3"]  # vLLM's default served name: the id as given
    assert text == _complete(server.url, checkpoint.name)[1]  # the same checkpoint, served from its folder
    v2 = start_server("--revision", "v2", env=env, ckpt="tiny-org/tiny-qwen3")
    from_folder = start_server(ckpt=other)
    assert _complete(v2.url, "tiny-org/tiny-qwen3")[1] == _complete(from_folder.url, "m")[1] != text
    for s in (by_id, v2, from_folder):
        s.stop()
