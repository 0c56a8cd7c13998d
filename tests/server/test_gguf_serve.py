"""`leverlab serve model.gguf`: a real server process on a GGUF file written by llama.cpp's converter, queried with
the official `openai` client, answers with the greedy tokens of the HF folder the file came from (F32: lossless),
and chats through the chat template the file carries."""

from __future__ import annotations

import openai

from leverlab import LLM, SamplingParams
from tests.gguf_files import convert

PROMPT = "def add(a, b):"


def test_serve_a_gguf_file(start_server, checkpoint, tmp_path_factory):
    path = convert(checkpoint, tmp_path_factory.mktemp("gguf") / "tiny-qwen3-f32.gguf", "f32")
    server = start_server(ckpt=path)  # --dtype float32 (the helper's default)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    name = client.models.list().data[0].id
    assert name == path.name
    r = client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    llm = LLM(checkpoint, dtype="float32")
    try:
        ref = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    finally:
        llm.engine.close()
    assert r.choices[0].text == ref.text
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop")
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
    assert chat.usage.prompt_tokens == len(ids)  # the same ChatML prompt as the folder's template gives
