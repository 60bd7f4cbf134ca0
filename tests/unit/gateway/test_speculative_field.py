"""The ``speculative`` request field (default true; false opts a request out of the engine's speculative
decoding) from each API to ``SamplingParams``, and the speculative counts the gateway reports: per response
(``timings.draft_tokens`` / ``accepted_tokens``) and summed over backends (``/admin/v1/stats``). No model."""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest

from backend.protocol import SamplingParams, Submit, Timings
from gateway.errors import InvalidRequest
from gateway.generation.request import GenerationRequest
from gateway.generation.run import _Run
from gateway.ollama.translate import parse_options, to_chat_request
from gateway.openai.prepare import sampling_params
from gateway.openai.schemas import decode_chat, decode_completion
from gateway.probes import _add_positions
from gateway.upstream.call import passed_fields

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def _body(base: dict, **kw: object) -> bytes:
    return msgspec.json.encode({**base, **kw})


@pytest.mark.parametrize("decode, base", [(decode_chat, CHAT), (decode_completion, COMPLETION)])
def test_speculative_reaches_the_sampling_params(decode, base):
    assert decode(_body(base)).speculative is True  # the default: speculative decoding on
    for value in (True, False):
        req = decode(_body(base, speculative=value))
        sp = sampling_params(req, 8, logprobs=False, top_logprobs=0)
        assert sp.speculative is value
        # on the wire: omitted at its default, sent when false, read back the same by the backend
        wire = msgspec.msgpack.encode(Submit(request_id="r", prompt_ids=[1], sampling=sp))
        assert (b"speculative" in wire) is (not value)
        assert msgspec.msgpack.decode(wire, type=Submit).sampling.speculative is value


@pytest.mark.parametrize("decode, base", [(decode_chat, CHAT), (decode_completion, COMPLETION)])
@pytest.mark.parametrize("bad", ["false", 0, 1, None, [], {}])
def test_non_boolean_speculative_is_a_400_naming_it(decode, base, bad):
    with pytest.raises(InvalidRequest) as e:
        decode(_body(base, speculative=bad))
    err = e.value
    assert err.status == 400 and err.param == "speculative" and err.code == "invalid_type"
    assert err.body()["error"]["param"] == "speculative"


def test_ollama_options_speculative():
    assert parse_options({"speculative": False}).speculative is False
    assert parse_options({}).speculative is None
    for kind, body in (("chat", {"messages": []}), ("generate", {"prompt": "x"})):
        base = {"model": "m", **body}
        assert to_chat_request(base, kind).speculative is True
        assert to_chat_request({**base, "options": {"speculative": False}}, kind).speculative is False
        assert to_chat_request({**base, "options": {"speculative": True}}, kind).speculative is True
    for bad in ("no", 0, [False]):
        with pytest.raises(InvalidRequest) as e:
            parse_options({"speculative": bad})
        assert e.value.param == "options.speculative" and e.value.code == "invalid_type"


def test_speculative_is_not_sent_to_an_upstream():
    req = decode_chat(_body(CHAT, speculative=False, ignore_eos=True))
    fields = passed_fields(req)
    assert "speculative" not in fields and fields["ignore_eos"] is True  # the vLLM extras still pass


def _run_with(*timings: Timings | None) -> _Run:
    """A run's state as far as ``_Run.timings`` reads it: the request and each choice's backend timings."""
    run = _Run.__new__(_Run)
    run.req = GenerationRequest(
        request_id="r",
        api="openai",
        model="m",
        prompt_ids=[1, 2],
        sampling=SamplingParams(n=len(timings)),
        t_arrival=time.perf_counter(),
    )
    run.choices = [SimpleNamespace(tokens=3, timings=t) for t in timings]  # type: ignore[list-item]
    run.t_first = run.t_submit = None
    run.handle = None
    return run


def test_response_timings_carry_draft_and_accepted_tokens():
    a = Timings(queue=0.001, prefill=0.002, decode=0.003, ttft=0.003, draft_tokens=10, accepted_tokens=6)
    b = Timings(draft_tokens=4, accepted_tokens=4)
    run = _run_with(a, b)
    whole = run.timings()
    assert whole["draft_tokens"] == 14 and whole["accepted_tokens"] == 10  # summed over the choices
    one = run.timings(run.choices[0])  # type: ignore[arg-type]
    assert one["draft_tokens"] == 10 and one["accepted_tokens"] == 6
    off = _run_with(Timings(queue=0.001)).timings()  # speculative: false, or nothing drafted
    assert off["draft_tokens"] == 0 and off["accepted_tokens"] == 0
    # no backend timings yet (a choice the gateway ended): absent, like the backend's phases
    assert "draft_tokens" not in _run_with(None).timings()


def test_admin_stats_sums_accepted_per_position():
    assert _add_positions([], [3, 1]) == [3, 1]
    assert _add_positions([3, 1], [2, 2, 5]) == [5, 3, 5]
    assert _add_positions([1], []) == [1]
