"""Levers through the server: prefix-cache counters and the admin reset, speculative decoding counters."""

import json

import httpx
from openai import OpenAI

from tests.checkpoints import make_eagle_head

PREFIX = list(range(20, 60))  # 40 tokens: two full 16-token blocks shared by every request


def test_prefix_cache_hits_counted_and_reset(start_server):
    srv = start_server("--api-key", "k3y")
    client = OpenAI(base_url=srv.url + "/v1", api_key="k3y")
    model = client.models.list().data[0].id
    for i in range(3):
        client.completions.create(model=model, prompt=PREFIX + [i], max_tokens=2, temperature=0)
    m = srv.metrics()
    assert m["leverlab_engine_prefix_cache_hits_total"] == 2 * 32
    assert m["leverlab_engine_prefix_cache_queries_total"] == 3 * 41
    # The reset endpoint is an admin route: under the API key.
    assert httpx.post(srv.url + "/reset_prefix_cache").status_code == 401
    r = httpx.post(srv.url + "/reset_prefix_cache", headers={"Authorization": "Bearer k3y"})
    assert r.status_code == 200 and r.json()["blocks_reset"] >= 2
    client.completions.create(model=model, prompt=PREFIX + [9], max_tokens=2, temperature=0)
    assert srv.metrics()["leverlab_engine_prefix_cache_hits_total"] == 2 * 32  # cold again: no new hits
    srv.stop()


def test_speculative_decoding_through_the_server(start_server, server):
    spec = start_server("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_min": 1}')
    prompt = [5, 6, 7, 8] * 5
    outs = []
    for srv in (server, spec):
        client = OpenAI(base_url=srv.url + "/v1", api_key="x")
        model = client.models.list().data[0].id
        outs.append(client.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0,
                                              extra_body={"ignore_eos": True}).choices[0].text)
    assert outs[0] == outs[1]
    m = spec.metrics()
    assert m["leverlab_engine_spec_draft_tokens_total"] > 0
    assert m["leverlab_engine_spec_accepted_tokens_total"] <= m["leverlab_engine_spec_draft_tokens_total"]
    spec.stop()


def test_eagle_through_the_server(start_server, server, checkpoint, tmp_path):
    head = make_eagle_head(checkpoint, tmp_path / "head")
    spec = start_server("--speculative-config",
                        json.dumps({"method": "eagle", "model": head, "num_speculative_tokens": 3}))
    prompts = [[5, 6, 7, 8] * 5, list(range(30, 50))]
    outs = []
    for srv in (server, spec):
        client = OpenAI(base_url=srv.url + "/v1", api_key="x")
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=prompts, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
        outs.append(sorted((c.index, c.text) for c in r.choices))
    assert outs[0] == outs[1]
    m = spec.wait_idle()
    assert m["leverlab_engine_spec_draft_tokens_total"] > 0 and m["leverlab_kv_blocks_used"] == 0
    spec.stop()


def test_adaptive_eagle3_head_through_the_server_under_arrivals(start_server, server, checkpoint, tmp_path):
    """A speculators-format EAGLE-3 head (reduced draft vocabulary) behind the gate, requests arriving while
    others decode: the same text as the plain server, the gate's counters on /metrics, no block left used."""
    import threading
    import time

    from tests.checkpoints import make_speculators_eagle3

    head = make_speculators_eagle3(checkpoint, tmp_path / "head", draft_vocab=80)
    spec = start_server("--speculative-config", json.dumps({"method": "eagle3", "model": head, "adaptive": True}))
    prompts = [[5, 6, 7, 8] * 5, list(range(30, 50)), [9, 10] * 6, [3] * 7, list(range(60, 75))]
    texts: dict[str, dict[int, str]] = {"plain": {}, "spec": {}}
    for name, srv in (("plain", server), ("spec", spec)):
        client = OpenAI(base_url=srv.url + "/v1", api_key="x")
        model = client.models.list().data[0].id

        def one(i, client=client, model=model, name=name):
            r = client.completions.create(model=model, prompt=prompts[i], max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True})
            texts[name][i] = r.choices[0].text

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
            time.sleep(0.05)  # staggered arrivals: later requests prefill while earlier ones decode
        for t in threads:
            t.join()
    assert texts["plain"] == texts["spec"]
    m = spec.wait_idle()
    assert m["leverlab_engine_spec_gate_spec_steps_total"] + m["leverlab_engine_spec_gate_plain_steps_total"] > 0
    assert m["leverlab_kv_blocks_used"] == 0
    spec.stop()
