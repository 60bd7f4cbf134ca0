"""Option values checked where they are read: ``SettingsError``, the backend's engine options (parsed by
``python -m backend``'s own parser, ``backend.__main__.add_engine_args``) and the ``[[models]]`` tables
(``gateway.sections.ModelSettings``, from TOML or ``--serve-model``). ``gateway.settings`` loads and merges;
this module converts and checks one value or one table at a time.

Errors: ``SettingsError`` (a ``ValueError``) whose message names the source (file, environment variable or
flag), the model and the option.
"""

from __future__ import annotations

import argparse
import ipaddress
import urllib.parse
from collections.abc import Mapping
from typing import Any

import msgspec

from backend.__main__ import add_engine_args
from gateway.sections import ModelSettings, Settings

TRUTHY = {"yes": "true", "on": "true", "no": "false", "off": "false"}
SINGLE_MODEL_OPTIONS = (("backend", "model"), ("backend", "tokenizer"), ("backend", "backend_url"))
SINGLE_MODEL_OPTIONS += (("backend", "backends"), ("http", "served_model_name"))
KV_OPTIONS = ("kv_cache_memory", "num_kv_blocks")


class SettingsError(ValueError):
    """A setting that cannot be used: unknown name, wrong type or range, unreadable file. The message names
    the source (file, environment variable or flag) and the option."""


def engine_actions() -> dict[str, argparse.Action]:
    """The backend's engine options by name (``num_kv_blocks``), from ``backend.__main__.add_engine_args``."""
    return {a.dest: a for a in add_engine_args(argparse.ArgumentParser(add_help=False))}


def engine_argv(engine: Mapping[str, str | bool]) -> list[str]:
    """``python -m backend`` arguments for ``Settings.engine`` (``["--num-kv-blocks=64", "--no-prefix-caching"]``)."""
    actions = engine_actions()
    argv = []
    for name, value in engine.items():
        flag = actions[name].option_strings[-1]
        if value is True:
            argv.append(flag)
        elif value is not False:
            argv.append(f"{flag}={value}")
    return argv


def check_engine(engine: Mapping[str, str | bool], source: str) -> None:
    """Parse ``engine`` with the backend's own parser. Raises ``SettingsError`` naming ``source``."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--listen")
    add_engine_args(parser)
    try:
        parser.parse_args(engine_argv(engine))
    except argparse.ArgumentError as exc:
        raise SettingsError(f"{source}: {exc}") from None


def engine_token(name: str, value: object, source: str) -> str | bool:
    """One engine value from TOML or the environment as command-line text (True/False for a flag), checked
    by the backend's parser. Raises ``SettingsError`` naming ``source``."""
    action = engine_actions()[name]
    if action.nargs == 0:  # store_true
        if isinstance(value, str):
            value = convert(TRUTHY.get(value.strip().lower(), value), bool, source, strict=False)
        if not isinstance(value, bool):
            raise SettingsError(f"{source}: expected true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise SettingsError(f"{source}: expected a string or a number, got {value!r}")
    check_engine({name: str(value)}, source)
    return str(value)


def convert(value: object, annotation: Any, source: str, *, strict: bool) -> Any:
    try:
        return msgspec.convert(value, annotation, strict=strict)
    except (msgspec.ValidationError, ValueError) as exc:
        raise SettingsError(f"{source}: {exc}") from None


# ----------------------------------------------------------------------------- models

_MODEL_FIELDS = frozenset(f.name for f in msgspec.structs.fields(ModelSettings))
_MODEL_LISTS = {"alias": "aliases", "aliases": "aliases", "backend_url": "backend_url"}
_MODEL_LISTS |= {
    "url": "urls",
    "urls": "urls",
}  # an openai model's upstream URLs (gateway/upstream/config.py)


def parse_model_spec(text: str, source: str) -> dict[str, Any]:
    """One ``--serve-model`` value (``name=a,path=/m.gguf,dtype=float32,alias=b,alias=c``) as a
        ``[[models]]`` table: ``alias``, ``backend_url`` and ``url`` (``urls``) repeat into lists, engine options
        go to ``engine``, any other key is kept for ``model_table`` to place. Raises ``SettingsError`` naming ``source``
    (also for a key given twice that does not repeat, and for ``engine=`` / ``upstream=``: tables in TOML)."""
    table: dict[str, Any] = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key:
            raise SettingsError(
                f"{source}: expected KEY=VALUE pairs separated by commas, got {part.strip()!r}"
            )
        value = value.strip()
        if key in ("engine", "upstream"):  # tables in TOML; here each of their options goes by its own name
            raise SettingsError(f"{source}: give the {key} options by name (max_num_seqs=8), not {key}=")
        if key in _MODEL_LISTS:
            table.setdefault(_MODEL_LISTS[key], []).append(value)
            continue
        into = (
            table.setdefault("engine", {}) if key not in _MODEL_FIELDS and key in engine_actions() else table
        )
        if key in into:
            raise SettingsError(f"{source}: {key!r} given twice (only alias, backend_url and url repeat)")
        into[key] = value
    return table


def model_table(table: dict[str, Any], source: str, *, strict: bool) -> ModelSettings:
    """A ``[[models]]`` table (from TOML, or ``parse_model_spec``) as ``ModelSettings``: keys that are not
    ``ModelSettings`` fields go to ``upstream`` for a model of another kind (a native model: an error).
    Raises ``SettingsError`` naming ``source`` and the model."""
    where = f"{source}: model {table.get('name', '?')!r}"
    known = {k: v for k, v in table.items() if k in _MODEL_FIELDS}
    rest = {k: v for k, v in table.items() if k not in _MODEL_FIELDS}
    if rest and table.get("kind", "native") == "native":
        raise SettingsError(
            f"{where}: unknown key {next(iter(rest))!r} (a native model's keys: {', '.join(sorted(_MODEL_FIELDS - {'upstream'}))})"
        )
    known["upstream"] = {**known.get("upstream", {}), **rest}
    model = convert(known, ModelSettings, where, strict=strict)
    for name, value in model.engine.items():
        if name not in engine_actions():
            raise SettingsError(f"{where}: unknown engine option {name!r}")
        model.engine[name] = engine_token(name, value, f"{where}: engine {name}")
    return model


def model_engine(engine: Mapping[str, str | bool], model: ModelSettings) -> dict[str, str | bool]:
    """The ``python -m backend`` options of ``model``'s spawned backends: ``engine`` (``[engine]``), then
    the model's ``dtype``, ``kv_cache_memory``, ``num_kv_blocks`` and ``engine`` entries (a KV size of the
    model's replaces both of ``engine``'s)."""
    own: dict[str, str | bool] = {k: v for k, v in model.engine.items() if v is not False}
    for name in ("dtype", *KV_OPTIONS):
        value = getattr(model, name)
        if value is not None:
            own[name] = str(value)
    base = dict(engine)
    if any(k in own for k in KV_OPTIONS):
        base = {k: v for k, v in base.items() if k not in KV_OPTIONS}
    return base | own


_LOCAL_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def _addresses(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address] | None:
    """The addresses a host of a URL or a listener names without asking DNS (an IP literal, or a name of
    this machine's loopback); None for any other name."""
    host = host.strip("[]").lower()
    if host in _LOCAL_NAMES:
        return {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    try:
        return {ipaddress.ip_address(host)}
    except ValueError:
        return None


def own_listener(url: str, host: str, port: int) -> bool:
    """Whether ``url`` reaches this gateway's own listener ``host:port`` (``http.host``, ``http.port``): the
    same port and the same address, a loopback name for a loopback listener, or any local address (loopback
    or unspecified) for a listener on every address (``0.0.0.0``, ``::``). Names other than localhost are not
    resolved (no DNS at start): a loop through one is refused at run time (``gateway.middleware.hops``)."""
    try:
        u = urllib.parse.urlsplit(url)
        url_port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        return False
    if port == 0 or url_port != port or not u.hostname:
        return False
    target, listener = _addresses(u.hostname), _addresses(host)
    if target is None:
        return listener is None and u.hostname.lower() == host.lower()
    if listener is None:
        return False
    if any(a.is_unspecified for a in listener):
        return any(a.is_loopback or a.is_unspecified for a in target)
    return bool(target & listener)


def check_models(
    settings: Settings, merged: dict[str, dict[str, object]], notices: list[str], source: str = "models"
) -> None:
    """The declared models against the rest: single-model options set too, names used twice, engine options
    that do not go together (checked by the backend's parser), engine options of a model with
    ``backend_url`` (ignored: a notice), a model of kind ``openai`` whose ``urls`` lead to this gateway's
    own listener (``own_listener``: it would call itself). Raises ``SettingsError`` (``source``: where the
    models were declared, e.g. ``/etc/gw.toml: [[models]]``)."""
    given = [f"[{t}] {n}" for t, n in SINGLE_MODEL_OPTIONS if n in merged[t]]
    if given:
        raise SettingsError(
            f"{', '.join(given)}: an option of the one default model; with [[models]] (or --serve-model) "
            "give each model's path, tokenizer, backend_url, replicas and aliases in its own table"
        )
    seen: dict[str, str] = {}
    for m in settings.models:
        for n in dict.fromkeys([m.name, *m.aliases]):
            if n in seen:
                if seen[n] == m.name:
                    raise SettingsError(f"model name {n!r} is declared by two models")
                raise SettingsError(f"model name {n!r} is used by both {seen[n]!r} and {m.name!r}")
            seen[n] = m.name
        if m.kind != "native":
            urls = m.upstream.get("urls")
            for url in urls if isinstance(urls, list) else []:
                if isinstance(url, str) and own_listener(url, settings.http.host, settings.http.port):
                    raise SettingsError(
                        f"{source}: model {m.name!r}: urls holds {url[:200]!r}, this gateway's own listener "
                        f"({settings.http.host}:{settings.http.port}): the model would call itself"
                    )
            continue
        check_engine(model_engine(settings.engine, m), f"model {m.name!r}: engine options")
        if m.backend_url and model_engine({}, m):
            notices.append(
                f"model {m.name!r}: engine options apply to spawned backends only; ignored with backend_url"
            )
