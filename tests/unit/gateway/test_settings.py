"""``gateway.settings``: one ``Settings`` filled from defaults < TOML (``--config``) < ``LLM_GATEWAY_*`` environment
< flags; ``--help`` lists every option, the backend's engine options included; unknown or badly typed settings
stop the start with a message (exit 2), from any source."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.server import main
from gateway.settings import (
    ENV_PREFIX,
    SECTIONS,
    Settings,
    SettingsError,
    add_arguments,
    engine_actions,
    engine_argv,
    load_settings,
)

ROOT = Path(__file__).resolve().parents[3]


def _gateway(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m gateway *argv`` as a user runs it (it must end before starting anything)."""
    return subprocess.run(
        [sys.executable, "-m", "gateway", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    return str(path)


def test_defaults():
    s, notices = load_settings(["serve"], {})
    assert s == Settings() and notices == []
    assert s.http.port == 8000 and s.http.max_body_bytes == 4 * 1024 * 1024 and s.http.cors_origins == ["*"]
    assert s.backend.backends == 1 and s.engine == {} and s.observability.access_log == "-"


def test_precedence_flags_over_env_over_toml_over_defaults(tmp_path):
    path = _toml(
        tmp_path,
        "[http]\nport = 9000\nmax_body_bytes = 100\nsse_heartbeat = 2.5\n"
        "[engine]\nnum_kv_blocks = 64\ndevice = 'cuda'\n",
    )
    env = {
        ENV_PREFIX + "PORT": "9100",
        ENV_PREFIX + "MAX_BODY_BYTES": "200",
        ENV_PREFIX + "NUM_KV_BLOCKS": "32",
    }
    s, _ = load_settings(["serve", "--config", path, "--port", "9200", "--num-kv-blocks", "16"], env)
    assert s.http.port == 9200  # flag > env > TOML
    assert s.http.max_body_bytes == 200  # env > TOML
    assert s.http.sse_heartbeat == 2.5  # TOML > default
    assert s.http.drain_timeout == 30.0  # default
    assert s.engine == {"num_kv_blocks": "16", "device": "cuda"}
    assert engine_argv(s.engine) == ["--num-kv-blocks=16", "--device=cuda"]
    # the file can come from the environment too
    s, _ = load_settings(["serve"], {ENV_PREFIX + "CONFIG": path})
    assert s.http.port == 9000 and s.engine["num_kv_blocks"] == "64"


def test_env_forms_and_deprecated_names():
    env = {
        ENV_PREFIX + "SERVED_MODEL_NAME": "a, b,",
        ENV_PREFIX + "LOG_CONTENT": "yes",
        ENV_PREFIX + "REDIS_URL": "",
        ENV_PREFIX + "NO_PREFIX_CACHING": "1",
        "GATEWAY_ADMIN_KEY": "old-admin",
        "GATEWAY_METRICS_TENANT_LABEL": "1",
    }
    s, notices = load_settings(["serve"], env)
    assert s.http.served_model_name == ["a", "b"] and s.observability.log_content is True
    assert s.tenancy.redis_url is None and s.engine == {"no_prefix_caching": True}
    assert s.tenancy.admin_key == "old-admin" and s.observability.metrics_tenant_label is True
    assert any("GATEWAY_ADMIN_KEY" in n and ENV_PREFIX + "ADMIN_KEY" in n for n in notices)
    # the new name wins over the old one; a flag wins over both (the old GATEWAY_ACCESS_LOG beat the flag)
    env = {"GATEWAY_ADMIN_KEY": "old", ENV_PREFIX + "ADMIN_KEY": "new", "GATEWAY_ACCESS_LOG": "off"}
    s, _ = load_settings(["serve", "--access-log", "/tmp/access.log", "--no-log-content"], env)
    assert s.tenancy.admin_key == "new" and s.observability.access_log == "/tmp/access.log"


def test_repeated_flags_and_booleans():
    argv = [
        "serve",
        "--served-model-name",
        "x",
        "--served-model-name",
        "y",
        "--log-content",
        "--log-level",
        "debug",
    ]
    s, _ = load_settings(argv, {ENV_PREFIX + "SERVED_MODEL_NAME": "ignored"})
    assert s.http.served_model_name == ["x", "y"] and s.observability.log_content is True
    assert s.observability.log_level == "DEBUG"
    s, _ = load_settings(["serve", "--no-log-content"], {ENV_PREFIX + "LOG_CONTENT": "1"})
    assert s.observability.log_content is False


def test_engine_options_are_ignored_with_backend_urls():
    s, notices = load_settings(["serve", "--backend-url", "unix:/tmp/b.sock", "--dtype", "float32"], {})
    assert s.backend.backend_url == ["unix:/tmp/b.sock"] and s.engine == {}
    assert any("--dtype=float32" in n for n in notices)


def test_help_lists_every_option_and_the_backends():
    parser = argparse.ArgumentParser(prog="serve")
    add_arguments(parser)
    text = parser.format_help()
    for section in SECTIONS.values():
        for name in section.__struct_fields__:
            assert "--" + name.replace("_", "-") in text, name
    for action in engine_actions().values():
        assert action.option_strings[-1] in text
    assert "--num-kv-blocks" in text and "--attention-backend" in text and ENV_PREFIX + "PORT" in text
    out = _gateway("serve", "--help")
    assert out.returncode == 0 and "--kv-cache-memory" in out.stdout and "--config" in out.stdout


def test_unknown_flag_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        load_settings(["serve", "--no-such-flag", "1"], {})
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --no-such-flag" in err
    assert "usage: python -m gateway serve [-h]" in err  # serve's usage, which lists the flags
    out = _gateway("serve", "--frobnicate")
    assert out.returncode == 2 and "unrecognized arguments: --frobnicate" in out.stderr
    with pytest.raises(SystemExit):  # no abbreviations: a misspelt option is never taken for another one
        load_settings(["serve", "--num-kv-block", "7"], {})


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[http]\nport = 'eighty'\n", "Expected `int`, got `str` - at `$.http.port`"),
        ("[http]\nport = 70000\n", "Expected `int` <= 65535 - at `$.http.port`"),
        ("[http]\nprot = 8000\n", "unknown field `prot`"),
        ("[htp]\nport = 8000\n", "unknown table [htp]"),
        ("[engine]\ndtype = 'fp8'\n", "invalid choice: 'fp8'"),
        ("[engine]\nnum_kv_blocks = 'many'\n", "invalid int value: 'many'"),
        ("[engine]\nno_prefix_caching = 'sometimes'\n", "no_prefix_caching"),
        ("[engine]\nwarp_drive = 1\n", "unknown key 'warp_drive' in [engine]"),
        ("[http\nport = 1\n", "invalid TOML"),
        ("[observability]\nlog_level = 'loud'\n", "log_level must be DEBUG"),
        ("[backend]\nbackend_url = ['http://x:1']\n", "backend url must be unix:PATH or tcp://HOST:PORT"),
        ("[tenancy]\nredis_url = 'http://h:1'\n", "the scheme must be redis://, rediss://"),
        ("[tenancy]\nredis_url = 'redis://:pw@h:port'\n", "the port and the db must be numbers"),
        ("[tenancy]\nredis_url = 'redis://h?ssl_verify=0'\n", "unknown query parameter(s) ssl_verify"),
    ],
)
def test_bad_toml_value_is_a_clear_error(tmp_path, toml, message):
    path = _toml(tmp_path, toml)
    with pytest.raises(SettingsError) as exc:
        load_settings(["serve", "--config", path], {})
    assert message in str(exc.value) and path in str(exc.value)


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["serve"], {ENV_PREFIX + "PORT": "abc"}, "environment variable LLM_GATEWAY_PORT: Expected `int`"),
        (["serve"], {ENV_PREFIX + "LOG_CONTENT": "maybe"}, "LLM_GATEWAY_LOG_CONTENT: Expected `bool`"),
        (
            ["serve"],
            {ENV_PREFIX + "BLOCK_SIZE": "x"},
            "LLM_GATEWAY_BLOCK_SIZE: argument --block-size: invalid int",
        ),
        (["serve", "--port", "x"], {}, "argument --port: Expected `int`, got `str`"),
        (["serve", "--backends", "0"], {}, "argument --backends: Expected `int` >= 1"),
        (["serve", "--num-kv-blocks", "8"], {ENV_PREFIX + "KV_CACHE_MEMORY": "1GiB"}, "not allowed with"),
        (["serve", "--config", "/nonexistent/gateway.toml"], {}, "cannot read the config file"),
    ],
)
def test_bad_env_or_flag_value_is_a_clear_error(argv, env, message):
    with pytest.raises(SettingsError) as exc:
        load_settings(argv, env)
    assert message in str(exc.value)


def test_main_exits_2_with_the_message(capsys, monkeypatch):
    monkeypatch.setenv(ENV_PREFIX + "MAX_BODY_BYTES", "lots")
    assert main(["serve"]) == 2
    assert "LLM_GATEWAY_MAX_BODY_BYTES" in capsys.readouterr().err


def test_flat_names_are_unique():
    """Environment variables and flags are flat: no two tables (nor the engine) share an option name."""
    names = [n for s in SECTIONS.values() for n in s.__struct_fields__] + list(engine_actions())
    assert len(names) == len(set(names))
