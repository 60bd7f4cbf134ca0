"""The served default mode end to end: ``python -m gateway serve`` with no ``--dtype`` runs
``default_dtype()`` on CPU (bfloat16 where the CPU multiplies bf16 natively, float32 elsewhere).

Every other gateway test pins ``--dtype float32`` (the exact mode). This one starts a private gateway with
no dtype flag and checks what a new user gets from ``make serve``: the model card says that dtype, greedy
text follows the float32 reference up to its first near tie (the bf16 tolerance of the reference
fixtures: ``tests/fixtures/README.md``), streaming equals the non-streaming answer, and nothing is left
running or holding KV blocks afterwards.
"""

from __future__ import annotations

import pytest
from plugins.gateway_server import NEAR_TIE_INT4, post_json, reference_prefix, stream_post

from backend.model_path import default_dtype
from templating import cached_tokenizer

CHAT = "/v1/chat/completions"
NEAR_TIE = 0.1  # reference top-2 logit gap under which bf16 rounding may pick the other token


@pytest.mark.timeout(900)
def test_default_mode_follows_the_reference(make_gateway, chat_fixtures, model_path):
    gw = make_gateway(dtype=None)
    models = gw.openai().models.list().data
    card = models[0].model_extra
    assert card["dtype"] == default_dtype()
    near_tie = NEAR_TIE_INT4 if card["dtype"] == "float32" and card["weights"] != "dense" else NEAR_TIE
    tok = cached_tokenizer(model_path)
    baseline = gw.wait_idle()["kv_blocks_used"]
    checked = 0
    for case in chat_fixtures:
        prefix = reference_prefix(case, near_tie)
        if len(prefix) < 8:
            continue  # a near tie within the first tokens leaves nothing worth comparing
        body = {
            "model": gw.model,
            "messages": case["messages"],
            "max_tokens": len(case["greedy_ids"]),
            "temperature": 0,
        }
        r = post_json(gw, CHAT, body)
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["message"]["content"]
        assert content.startswith(tok.decode(prefix)), (case["name"], content)
        assert r.json()["usage"]["prompt_tokens"] == len(case["prompt_ids"])
        checked += 1
    assert checked >= 3
    colors = {
        "model": gw.model,
        "messages": [{"role": "user", "content": "Name three colors."}],
        "max_tokens": 24,
        "temperature": 0,
    }
    s = stream_post(gw, CHAT, colors)
    n = post_json(gw, CHAT, colors)
    assert s.done and s.content() and s.content() == n.json()["choices"][0]["message"]["content"]
    st = gw.wait_idle(baseline_kv=baseline)
    assert st["running"] == 0 and st["waiting"] == 0 and st["kv_blocks_used"] <= baseline
