"""The configuration files of docs/deployment.md load as the gateway loads them (every key known, every
value in range), and the upstream model's table is a valid ``UpstreamConfig``."""

from __future__ import annotations

from pathlib import Path

import msgspec

from gateway.settings import load_settings
from gateway.upstream.config import UpstreamConfig

DEPLOY = Path(__file__).resolve().parents[3] / "docs" / "deploy"


SECRET = "/etc/llm-gateway/backend.secret"


def _load(path: Path):
    settings, notices = load_settings(["serve", "--config", str(path)], {})
    assert notices == []
    return settings


def test_backend_hosts_config_declares_two_remote_models(tmp_path: Path) -> None:
    secret = tmp_path / "backend.secret"  # the file is read at load: the page's path, moved here
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    text = (DEPLOY / "backend-hosts.toml").read_text()
    assert SECRET in text
    (tmp_path / "gw.toml").write_text(text.replace(SECRET, str(secret)))
    s = _load(tmp_path / "gw.toml")
    assert s.backend.routing == "prefix"
    assert s.backend.backend_secret_file == str(secret)
    names = [(m.name, m.kind, len(m.backend_url)) for m in s.models]
    assert names == [("smollm2", "native", 2), ("smollm2-exact", "native", 1)]


def test_upstream_config_is_a_valid_openai_model() -> None:
    s = _load(DEPLOY / "in-front-of-vllm.toml")
    (model,) = s.models
    assert model.kind == "openai"
    up = msgspec.convert(model.upstream, UpstreamConfig)
    assert up.urls == ["http://127.0.0.1:8081/v1", "http://127.0.0.1:8082/v1"]
    assert up.send == "messages" and up.api_key_env == "UPSTREAM_API_KEY"
