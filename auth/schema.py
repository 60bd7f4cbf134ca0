"""The database schema: the ordered list of migrations (append a new SQL string to migrate; never edit one
that shipped). ``schema_version`` holds one row per migration applied."""

from __future__ import annotations

MIGRATIONS: list[str] = [
    # 1: initial schema
    """
    CREATE TABLE tenants (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        disabled INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL,
        deleted_at REAL,
        limits TEXT NOT NULL DEFAULT '{}',
        filters TEXT NOT NULL DEFAULT '{}'
    );
    CREATE TABLE api_keys (
        id TEXT PRIMARY KEY,
        tenant_id TEXT NOT NULL REFERENCES tenants(id),
        name TEXT,
        prefix TEXT NOT NULL,
        hash TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL,
        expires_at REAL,
        revoked_at REAL,
        limits TEXT
    );
    CREATE INDEX api_keys_tenant ON api_keys(tenant_id);
    CREATE TABLE usage (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        ts REAL NOT NULL,
        day TEXT NOT NULL,
        tenant_id TEXT NOT NULL,
        key_id TEXT,
        key_prefix TEXT,
        request_id TEXT,
        model TEXT,
        prompt_tokens INTEGER NOT NULL DEFAULT 0,
        cached_tokens INTEGER NOT NULL DEFAULT 0,
        completion_tokens INTEGER NOT NULL DEFAULT 0,
        total_tokens INTEGER NOT NULL DEFAULT 0,
        status INTEGER,
        finish_reason TEXT,
        timings TEXT
    );
    CREATE INDEX usage_tenant_ts ON usage(tenant_id, ts);
    CREATE INDEX usage_tenant_day ON usage(tenant_id, day);
    CREATE INDEX usage_key_day ON usage(key_id, day);
    """,
]
