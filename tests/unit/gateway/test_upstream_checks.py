"""The start-up and answer checks that bound upstream models (kind ``openai``): an upstream URL that is the
gateway's own listener is a settings error naming the file and the model; usage counts no upstream could
report are implausible; the ``Via`` hop header names this gateway and keeps the hops before it."""

from __future__ import annotations

import pytest

from gateway.middleware import hops
from gateway.options import SettingsError, own_listener
from gateway.settings import load_settings
from gateway.upstream.usage import MAX_TOKEN_COUNT, implausible


def _models(tmp_path, url: str) -> str:
    path = tmp_path / "gw.toml"
    path.write_text(f'[[models]]\nname = "big"\nkind = "openai"\nurls = ["http://127.0.0.1:9/v1", "{url}"]\n')
    return str(path)


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("http://127.0.0.1:8123/v1", "127.0.0.1"),
        ("http://localhost:8123/v1", "127.0.0.1"),
        ("http://[::1]:8123/v1", "localhost"),
        ("http://127.0.0.1:8123", "0.0.0.0"),
        ("https://gw.internal:8123/v1", "gw.internal"),
    ],
)
def test_an_upstream_url_that_is_the_gateways_own_listener_is_a_start_up_error(tmp_path, url, host):
    path = _models(tmp_path, url)
    with pytest.raises(SettingsError) as e:
        load_settings(["serve", "--config", path, "--host", host, "--port", "8123"], {})
    assert str(e.value).startswith(f"{path}: [[models]]: model 'big': urls holds {url!r}")
    with pytest.raises(SettingsError, match="argument --serve-model: model 'big'"):
        spec = f"name=big,kind=openai,urls={url}"
        load_settings(["serve", "--serve-model", spec, "--host", host, "--port", "8123"], {})


@pytest.mark.parametrize(
    ("url", "host", "port"),
    [
        ("http://127.0.0.1:8124/v1", "127.0.0.1", 8123),  # another port
        ("http://127.0.0.2:8123/v1", "127.0.0.1", 8123),  # another loopback address: not this socket
        ("http://other.host:8123/v1", "127.0.0.1", 8123),  # a name not resolved at start (Via catches it)
        ("http://127.0.0.1:8123/v1", "127.0.0.1", 0),  # a port chosen by the system
        ("http://127.0.0.1/v1", "127.0.0.1", 8123),  # port 80
    ],
)
def test_other_urls_are_not_the_listener(url, host, port):
    assert not own_listener(url, host, port)


def test_usage_no_upstream_could_report_is_implausible():
    ok = {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29}
    assert implausible(ok, context_length=8192) is None
    assert implausible({"prompt_tokens": 20, "completion_tokens": "x"}, context_length=8192) is None
    why = implausible(ok | {"completion_tokens": 2**64}, context_length=8192)
    assert why == "completion_tokens = 18446744073709551616 (over 524288)"
    assert "negative" in implausible(ok | {"prompt_tokens": -1}, context_length=8192)
    huge_context = 2**40  # the absolute bound holds whatever the configured context
    assert f"over {MAX_TOKEN_COUNT}" in implausible(ok | {"total_tokens": 2**31}, context_length=huge_context)
    cached = ok | {"prompt_tokens_details": {"cached_tokens": 10**9}}
    assert "cached_tokens" in implausible(cached, context_length=8192)
    assert implausible(ok | {"completion_tokens": 600_000}, context_length=8192, n=2) is None  # n choices


def test_the_via_header_names_this_gateway_after_the_hops_before_it():
    own = f"1.1 {hops.INSTANCE}"
    assert hops.outgoing_via() == own
    assert hops.passed_here(own) and hops.passed_here(f"1.1 proxy, {own} (llm-gateway)")
    assert not hops.passed_here("1.1 llm-gateway-000000000000, HTTP/1.1 nginx")
    assert not hops.passed_here(f"1.1 x{hops.INSTANCE}")
    token = hops._incoming.set("1.0 front, 1.1 lb")
    try:
        assert hops.outgoing_via() == f"1.0 front, 1.1 lb, {own}"
        hops._incoming.set("1.1 a, " * 2000)
        kept = hops.outgoing_via()
        assert len(kept) <= 4200 and kept.endswith(own) and not kept.startswith(",")
    finally:
        hops._incoming.reset(token)
