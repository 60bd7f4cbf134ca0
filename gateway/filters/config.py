"""Per-tenant filter config: JSON in, validated :class:`FilterConfig` out.

Schema (every member optional; unknown members are errors, so typos do not silently disable a
filter)::

    {
      "output_window": 64,          # int, 0..4096: most characters of output held back (default 64)
      "hooks": [                    # run in this order, at each stage they are enabled for
        {"type": "blocklist", "name": "words", "stages": ["prompt", "output"],
         "roles": ["user"], "keywords": [...], "patterns": [...], "case_sensitive": false,
         "category": "blocklist"},
        {"type": "pii", "kinds": ["email", "phone", "card"], "action": "redact"},
        {"type": "webhook", "url": "http://127.0.0.1:9000/moderate", "timeout_s": 2, "fail": "open"}
      ]
    }

Common hook members: ``type`` (required; a registered hook type), ``name`` (unique, default the
type, then ``type-2``...), ``stages`` (default: every stage the type supports), ``roles`` (message
roles checked on the prompt side; default all).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .base import ALL_ROLES, STAGES, Hook

DEFAULT_WINDOW = 64
MAX_WINDOW = 4096
MAX_HOOKS = 16
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

#: Registered hook types: config ``"type"`` -> Hook subclass. Extend with :func:`register_hook_type`.
HOOK_TYPES: dict[str, type[Hook]] = {}


def register_hook_type(cls: type[Hook]) -> type[Hook]:
    """Register a :class:`Hook` subclass under ``cls.type`` (usable as a class decorator).

    Raises:
        ValueError: empty or already-registered type name.
    """
    if not cls.type or (cls.type in HOOK_TYPES and HOOK_TYPES[cls.type] is not cls):
        raise ValueError(f"hook type {cls.type!r} is empty or already registered")
    HOOK_TYPES[cls.type] = cls
    return cls


@dataclass(frozen=True)
class HookSpec:
    """One validated hook entry. ``params`` are the type-specific members, normalized."""

    type: str
    name: str
    stages: tuple[str, ...]
    roles: tuple[str, ...]
    params: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "name": self.name,
            "stages": list(self.stages),
            "roles": list(self.roles),
            **self.params,
        }


@dataclass(frozen=True)
class FilterConfig:
    """A tenant's validated filter config. ``FilterConfig()`` is "no filtering".

    Attributes:
        output_window: most characters of generated text held back before sending (0..4096).
        hooks: the hooks in run order.
    """

    output_window: int = DEFAULT_WINDOW
    hooks: tuple[HookSpec, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The normalized JSON form (defaults filled in); ``parse_config(c.to_json()) == c``."""
        return {"output_window": self.output_window, "hooks": [h.to_json() for h in self.hooks]}

    def cache_key(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @property
    def enabled(self) -> bool:
        return bool(self.hooks)


def _str_tuple(v: Any, what: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    if not isinstance(v, list) or not v or not all(isinstance(s, str) for s in v):
        raise ValueError(f"{what} must be a non-empty list of strings")
    bad = [s for s in v if s not in allowed]
    if bad:
        raise ValueError(f"{what}: unknown {bad}; allowed {list(allowed)}")
    return tuple(dict.fromkeys(v))


def parse_config(obj: Any) -> FilterConfig:
    """Validate a tenant's filter config (parsed JSON; a JSON string is also accepted).

    ``None`` and ``{}`` mean no filtering.

    Returns:
        FilterConfig (immutable, hashable by :meth:`FilterConfig.cache_key`).
    Raises:
        ValueError: with a message naming the offending member, on any invalid input.
    """
    if isinstance(obj, (str, bytes)):
        try:
            obj = json.loads(obj)
        except json.JSONDecodeError as e:
            raise ValueError(f"filters: not JSON: {e}") from None
    if obj is None:
        return FilterConfig()
    if not isinstance(obj, dict):
        raise ValueError("filters: config must be a JSON object")
    obj = dict(obj)
    window = obj.pop("output_window", DEFAULT_WINDOW)
    if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window <= MAX_WINDOW:
        raise ValueError(f"filters: 'output_window' must be an integer in [0, {MAX_WINDOW}]")
    hooks = obj.pop("hooks", [])
    obj.pop("version", None)
    if obj:
        raise ValueError(f"filters: unknown members {sorted(obj)}")
    if not isinstance(hooks, list):
        raise ValueError("filters: 'hooks' must be a list")
    if len(hooks) > MAX_HOOKS:
        raise ValueError(f"filters: at most {MAX_HOOKS} hooks")
    specs: list[HookSpec] = []
    names: set[str] = set()
    for i, h in enumerate(hooks):
        where = f"filters: hooks[{i}]"
        if not isinstance(h, dict):
            raise ValueError(f"{where} must be an object")
        h = dict(h)
        typ = h.pop("type", None)
        cls = HOOK_TYPES.get(typ) if isinstance(typ, str) else None
        if cls is None:
            raise ValueError(f"{where}: 'type' must be one of {sorted(HOOK_TYPES)}")
        name = h.pop("name", None)
        if name is None:
            name, k = typ, 2
            while name in names:
                name, k = f"{typ}-{k}", k + 1
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"{where}: 'name' must match [A-Za-z0-9_.-]{{1,64}}")
        if name in names:
            raise ValueError(f"{where}: duplicate hook name {name!r}")
        names.add(name)
        stages = _str_tuple(
            h.pop("stages", list(cls.supported_stages)), f"{where}.stages", cls.supported_stages
        )
        roles = _str_tuple(h.pop("roles", list(ALL_ROLES)), f"{where}.roles", ALL_ROLES)
        try:
            params = cls.validate(h)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        specs.append(HookSpec(typ, name, stages, roles, params))
    return FilterConfig(output_window=window, hooks=tuple(specs))


assert set(STAGES) == {"prompt", "output"}
