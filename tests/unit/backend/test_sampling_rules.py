"""One set of sampling rules: the gateway's request checks and the engine's frame checks accept and refuse
the same values, naming the same parameter (backend/sampling_rules.py)."""

from __future__ import annotations

import pytest

from backend.protocol import SamplingParams
from backend.sampling_rules import check_sampling
from gateway.errors import InvalidRequest
from gateway.openai.schemas import ChatRequest
from gateway.openai.validation import validate_chat

VOCAB = 1000

BAD = [
    ("n", 0),
    ("n", 17),
    ("temperature", 2.5),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("min_p", 1.5),
    ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", 2.5),
    ("max_tokens", 0),
    ("min_tokens", -1),
    ("stop_token_ids", [VOCAB]),
    ("top_logprobs", 21),
]
GOOD = [
    ("temperature", 0.0),
    ("temperature", 2.0),
    ("top_p", 1.0),
    ("top_k", -1),
    ("repetition_penalty", 2.0),
    ("presence_penalty", -2.0),
    ("n", 16),
    ("top_logprobs", 20),
]


def _request(field: str, value: object) -> ChatRequest:
    req = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}], logprobs=True)
    setattr(req, field, value)
    return req


@pytest.mark.parametrize("field,value", BAD)
def test_gateway_and_engine_refuse_the_same_values(field, value):
    with pytest.raises(InvalidRequest) as exc:
        validate_chat(_request(field, value), vocab_size=VOCAB)
    assert (exc.value.param, exc.value.code) == (field, "invalid_value")
    v = check_sampling(SamplingParams(**{field: value}), VOCAB)
    assert v is not None and v.param == field
    assert v.message == exc.value.message


@pytest.mark.parametrize("field,value", GOOD)
def test_gateway_and_engine_accept_the_same_values(field, value):
    validate_chat(_request(field, value), vocab_size=VOCAB)
    assert check_sampling(SamplingParams(**{field: value}), VOCAB) is None


def test_logit_bias_rules():
    for bias, ok in (({5: 100.0}, True), ({5: 100.5}, False), ({VOCAB: 1.0}, False), ({-1: 1.0}, False)):
        assert (check_sampling(SamplingParams(logit_bias=bias), VOCAB) is None) is ok, bias
        req = _request("logit_bias", {str(k): v for k, v in bias.items()})
        if ok:
            validate_chat(req, vocab_size=VOCAB)
        else:
            with pytest.raises(InvalidRequest) as exc:
                validate_chat(req, vocab_size=VOCAB)
            assert exc.value.param == "logit_bias"
    with pytest.raises(InvalidRequest):
        validate_chat(_request("logit_bias", {"x": 1.0}), vocab_size=VOCAB)
