"""``Settings``: every knob of ``python -m gateway serve`` in one typed object, and where each value comes from.

Sources, lowest to highest precedence (a later one wins, per option):

1. the defaults below;
2. a TOML file (``--config PATH``, or ``LLM_GATEWAY_CONFIG``; read with ``tomllib``) with the tables
   ``[http]``, ``[backend]``, ``[engine]``, ``[tenancy]``, ``[observability]``; keys are the option names
   with ``_`` (``max_body_bytes = 1048576``); ``[engine]`` holds ``python -m backend`` options
   (``device = "cuda"``, ``num_kv_blocks = 64``, ``no_prefix_caching = true``);
3. environment variables ``LLM_GATEWAY_<NAME>`` (``LLM_GATEWAY_PORT=8080``, ``LLM_GATEWAY_DEVICE=cuda``):
   lists comma-separated, booleans ``1``/``0``/``true``/``false``/``yes``/``no``, an empty value clears an
   optional one. Deprecated aliases, read when the new name is unset: ``GATEWAY_ADMIN_KEY``,
   ``GATEWAY_CORS_ORIGINS``, ``GATEWAY_METRICS_TENANT_LABEL``, ``GATEWAY_LOG_CONTENT``, ``GATEWAY_ACCESS_LOG``;
4. command-line flags (``--max-body-bytes``; list options repeat the flag; booleans have ``--no-...``).

Models: ``[[models]]`` tables (``gateway.sections.ModelSettings``; docs/gateway.md) or the repeatable flag
``--serve-model 'name=smol-f32,path=/m/smol.gguf,dtype=float32,replicas=1,alias=smol'`` (``KEY=VALUE``
pairs split at commas: every ``[[models]]`` key, ``alias``/``backend_url`` repeated for several, any
``python -m backend`` option by name, e.g. ``max_num_seqs=8``); the flags replace the file's list. Keys a
model of another kind reads (``urls`` for ``kind = "openai"``) are kept in its ``upstream`` table. With
models declared, the single-model options (``[backend] model``, ``tokenizer``, ``backend_url``,
``backends``, ``[http] served_model_name``) are an error; ``[engine]`` applies to every spawned backend
and a model's own engine options win (its KV size replaces both of ``[engine]``'s). Without any, those
options declare the one default model.

``python -m gateway serve --help`` lists every option (engine options are generated from the backend's own
parser, ``backend.__main__.add_engine_args``). An unknown flag, TOML key or table, or a value of the wrong
type or range from any source is an error at startup: ``SettingsError`` (the CLI prints it, exit 2).
"""

from __future__ import annotations

import argparse
import logging
import tomllib
from collections.abc import Mapping
from typing import Any

import msgspec
import msgspec.inspect as mi

from backend.__main__ import add_engine_args
from gateway.options import (
    TRUTHY,
    SettingsError,
    check_engine,
    check_models,
    convert,
    engine_actions,
    engine_argv,
    engine_token,
    model_table,
    parse_model_spec,
)
from gateway.sections import (
    SECTIONS,
    BackendSettings,
    HTTPSettings,
    ModelSettings,
    ObservabilitySettings,
    Section,
    Settings,
    TenancySettings,
)

ENV_PREFIX = "LLM_GATEWAY_"
DEPRECATED_ENV = {
    "admin_key": "GATEWAY_ADMIN_KEY",
    "cors_origins": "GATEWAY_CORS_ORIGINS",
    "metrics_tenant_label": "GATEWAY_METRICS_TENANT_LABEL",
    "log_content": "GATEWAY_LOG_CONTENT",
    "access_log": "GATEWAY_ACCESS_LOG",
}
SOURCES = (
    "Each option comes from, lowest to highest precedence: its default, the TOML file (--config PATH or "
    f"{ENV_PREFIX}CONFIG; tables [http], [backend], [engine], [tenancy], [observability], [[models]]), the "
    f"environment variable {ENV_PREFIX}<NAME>, the flag."
)
SERVE_MODEL_HELP = (
    "declare one served model (repeat for several; replaces the config file's [[models]]): KEY=VALUE pairs "
    "split at commas, the keys of a [[models]] table (name, path, kind, replicas, dtype, kv_cache_memory, "
    "num_kv_blocks, tokenizer, chat_template, context_length; alias, backend_url and url repeat; the keys of "
    "another kind, e.g. kind=openai,url=...) or any engine "
    "option by name, e.g. 'name=smol-f32,path=/m/smol.gguf,dtype=float32,replicas=1,alias=smol'"
)
__all__ = [
    "SECTIONS",
    "BackendSettings",
    "HTTPSettings",
    "ModelSettings",
    "ObservabilitySettings",
    "Section",
    "Settings",
    "SettingsError",
    "TenancySettings",
    "configure_logging",
    "engine_argv",
    "load_settings",
]


# ----------------------------------------------------------------------------- option tables


def _kind(annotation: object) -> str:
    """'bool', 'list', 'optional' or 'scalar' for a field annotation."""
    t = mi.type_info(annotation)
    t = t.type if isinstance(t, mi.Metadata) else t
    if isinstance(t, mi.BoolType):
        return "bool"
    if isinstance(t, mi.ListType):
        return "list"
    if isinstance(t, mi.UnionType) and any(isinstance(x, mi.NoneType) for x in t.types):
        return "optional"
    return "scalar"


def _fields(section: type[Section]) -> list[msgspec.structs.FieldInfo]:
    return list(msgspec.structs.fields(section))


def _field_value(section: type[Section], name: str, value: object, source: str) -> object:
    """``value`` (a flag's or an environment variable's text, or a TOML value) as field ``name`` of
    ``section``, checked with the section's own rules. Raises ``SettingsError`` naming ``source``."""
    checked = convert({name: value}, section, source, strict=not isinstance(value, str | list))
    return getattr(checked, name)


def _from_text(text: str, section: type[Section], field: msgspec.structs.FieldInfo, source: str) -> object:
    """An environment value for ``field``: comma-separated list, lax boolean, empty -> None when optional."""
    kind = _kind(field.type)
    if kind == "list":
        value: object = [part.strip() for part in text.split(",") if part.strip()]
    elif kind == "bool":
        value = TRUTHY.get(text.strip().lower(), text.strip())
    elif kind == "optional" and text == "":
        return None
    else:
        value = text
    return _field_value(section, field.name, value, source)


# ----------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every option of ``Settings`` to ``parser`` (the ``serve`` command), grouped by table. Flags
    given land in the namespace as ``"<table>.<name>"`` (engine options under their own names); absent
    ones are left out, so a lower source shows through."""
    parser.add_argument("--config", default=argparse.SUPPRESS, metavar="PATH", help="TOML settings file")
    parser.add_argument(
        "--serve-model",
        dest="models",
        action="append",
        default=argparse.SUPPRESS,
        metavar="SPEC",
        help=SERVE_MODEL_HELP,
    )
    for table, section in SECTIONS.items():
        group = parser.add_argument_group(
            f"[{table}] {(section.__doc__ or '').partition(': ')[2].rstrip('.')}"
        )
        defaults = section()
        for f in _fields(section):
            desc = mi.type_info(f.type).extra_json_schema["description"]
            default = getattr(defaults, f.name)
            shown = ", ".join(default) if isinstance(default, list) else default
            env = f"env {ENV_PREFIX}{f.name.upper()}"
            help_text = f"{desc} ({env})" if shown in (None, "") else f"{desc} (default {shown}; {env})"
            help_text = help_text.replace("%", "%%")
            flag = "--" + f.name.replace("_", "-")
            kind = _kind(f.type)
            common = {"dest": f"{table}.{f.name}", "default": argparse.SUPPRESS, "help": help_text}
            if kind == "bool":
                group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
            elif kind == "list":
                common["help"] = common["help"][:-1] + ", comma-separated; the flag repeats)"
                group.add_argument(flag, action="append", metavar=f.name.upper(), **common)
            else:
                group.add_argument(flag, metavar=f.name.upper(), **common)
    engine = parser.add_argument_group(
        "[engine] python -m backend's options, passed to each spawned backend (ignored with --backend-url)"
    )
    for action in add_engine_args(engine):
        action.default = argparse.SUPPRESS
        action.help = f"{action.help or ''} (env {ENV_PREFIX}{action.dest.upper()})".replace("%", "%%")


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """``python -m gateway`` and its one command's parser, ``serve``."""
    parser = argparse.ArgumentParser(
        prog="python -m gateway", description="OpenAI-compatible LLM gateway", allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="serve the HTTP API", description=SOURCES, allow_abbrev=False)
    add_arguments(serve)
    return parser, serve


def parse_argv(argv: list[str] | None) -> dict[str, Any]:
    """The flags of ``argv`` as a dict. An unknown flag exits 2 with ``serve``'s usage line (argparse
    would otherwise report it with the top-level usage, which lists no flag)."""
    parser, serve = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        serve.error(f"unrecognized arguments: {' '.join(unknown)}")
    return vars(ns)


# ----------------------------------------------------------------------------- loading


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise SettingsError(f"cannot read the config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: invalid TOML: {exc}") from None
    for table, values in data.items():
        if table == "models" and isinstance(values, list) and all(isinstance(v, dict) for v in values):
            continue
        if table not in (*SECTIONS, "engine") or not isinstance(values, dict):
            raise SettingsError(
                f"{path}: unknown table [{table}] (tables: {', '.join([*SECTIONS, 'engine'])}, [[models]])"
            )
    convert({k: v for k, v in data.items() if k not in ("engine", "models")}, Settings, path, strict=True)
    return data


def load_settings(argv: list[str] | None, environ: Mapping[str, str]) -> tuple[Settings, list[str]]:
    """Parse ``argv`` (``["serve", ...]``), read the TOML file and ``environ``; returns the settings and
    notices to log (deprecated names used, options ignored).

    Raises:
        SystemExit: (2, argparse) an unknown flag, a missing command, or a flag value of the wrong form.
        SettingsError: a bad TOML file, environment value or flag value (message names the source).
    """
    ns = parse_argv(argv)
    notices: list[str] = []
    merged: dict[str, dict[str, object]] = {table: {} for table in SECTIONS}
    engine: dict[str, str | bool] = {}
    models: list[ModelSettings] = []
    path = ns.get("config") or environ.get(ENV_PREFIX + "CONFIG")
    source = "models"
    if path:
        source = f"{path}: [[models]]"
        data = _read_toml(path)
        models = [model_table(t, f"{path}: [[models]]", strict=True) for t in data.get("models", [])]
        for table in SECTIONS:
            merged[table].update(data.get(table, {}))
        for name, value in data.get("engine", {}).items():
            if name not in engine_actions():
                raise SettingsError(f"{path}: unknown key {name!r} in [engine]")
            engine[name] = engine_token(name, value, f"{path}: [engine] {name}")
    for table, section in SECTIONS.items():
        for f in _fields(section):
            var = ENV_PREFIX + f.name.upper()
            old = DEPRECATED_ENV.get(f.name)
            if var not in environ and old is not None and old in environ:
                notices.append(f"environment variable {old} is deprecated: use {var}")
                var = old
            if var in environ:
                merged[table][f.name] = _from_text(environ[var], section, f, f"environment variable {var}")
    for name in engine_actions():
        var = ENV_PREFIX + name.upper()
        if var in environ:
            engine[name] = engine_token(name, environ[var], f"environment variable {var}")
    if "models" in ns:
        source = "argument --serve-model"
        models = [
            model_table(parse_model_spec(v, "argument --serve-model"), "argument --serve-model", strict=False)
            for v in ns.pop("models")
        ]
    for key, value in ns.items():
        table, dot, name = key.partition(".")
        if dot:
            flag = "argument --" + name.replace("_", "-")
            merged[table][name] = _field_value(SECTIONS[table], name, value, flag)
        elif key in engine_actions():
            engine[key] = value if isinstance(value, bool) else str(value)
    engine = {k: v for k, v in engine.items() if v is not False}
    check_engine(engine, "engine options")  # together: e.g. --kv-cache-memory with --num-kv-blocks
    settings = convert({**merged, "engine": engine}, Settings, "settings", strict=False)
    settings.models = models
    if models:
        check_models(settings, merged, notices, source)
    elif settings.backend.backend_url and settings.engine:
        notices.append(
            "engine options apply to spawned backends only; ignored with --backend-url: "
            + " ".join(engine_argv(settings.engine))
        )
        settings.engine = {}
    return settings, notices


def configure_logging(settings: Settings) -> None:
    """Root logging to stderr at ``observability.log_level``."""
    logging.basicConfig(
        level=settings.observability.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
