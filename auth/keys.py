"""API keys: generation, hashing, constant-time comparison.

A key looks like ``sk-gw-<43 url-safe base64 chars>`` (256 bits from :mod:`secrets`, a CSPRNG). It is shown
once, at creation; the database stores only its SHA-256 hex digest plus a short visible *prefix*
(``sk-gw-AbCd``...) so that operators can recognise a key in listings and in the usage ledger. Lookups go by
digest and the stored digest is compared with :func:`hmac.compare_digest` (constant time). A high-entropy
key does not need a slow KDF: brute-forcing 256 bits is impossible, so SHA-256 is the usual choice
(as GitHub/Stripe-style tokens do).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_PREFIX = "sk-gw-"
VISIBLE_CHARS = 10  # characters of the key shown in listings (prefix included): "sk-gw-AbCd"


def generate_key() -> tuple[str, str, str]:
    """Return ``(key, visible_prefix, sha256_hex)``; ``key`` must be shown once and never stored/logged."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    return key, key[:VISIBLE_CHARS], hash_key(key)


def hash_key(key: str) -> str:
    """SHA-256 hex digest of a key (what the database stores)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def digest_equal(a: str, b: str) -> bool:
    """Constant-time comparison of two digests / secrets."""
    return hmac.compare_digest(a.encode(), b.encode())


def new_id(kind: str) -> str:
    """Public, non-secret identifiers: ``tn_<16 hex>`` for tenants, ``key_<16 hex>`` for keys."""
    return f"{kind}_{secrets.token_hex(8)}"


def redact(text: str) -> str:
    """Replace anything that looks like one of our keys by its visible prefix + ``...`` (for safe logging)."""
    import re

    return re.sub(
        r"sk-gw-[A-Za-z0-9_\-]{4}[A-Za-z0-9_\-]*", lambda m: m.group(0)[:VISIBLE_CHARS] + "...", text
    )
