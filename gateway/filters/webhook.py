"""Built-in hook ``"webhook"``: ask an external moderation endpoint (HTTP POST, JSON) with httpx.

Config members (besides ``type``, ``name``, ``stages``, ``roles``)::

    "url": "https://moderation.internal/v1/check",   # http or https
    "timeout_s": 2.0,          # seconds for the whole call (connect + send + read), 0 < t <= 30
    "fail": "closed",          # on timeout / transport error / non-2xx / bad JSON:
                               #   "closed" -> block (category "moderation_unavailable"),
                               #   "open"   -> allow (and log a warning)
    "headers": {"authorization": "Bearer ..."},   # optional extra request headers
    "category": "moderation"   # category when the endpoint flags without naming one

Request body (``Content-Type: application/json``)::

    {"stage": "prompt", "tenant_id": "t1", "input": "<user: ...\\n...>", "messages": [...]}
    {"stage": "output", "tenant_id": "t1", "input": "<already-sent context + pending text>",
     "offset": 1234}

Accepted responses (HTTP 2xx)::

    {"flagged": true, "categories": {"violence": true, "hate": false}}
    {"results": [{"flagged": true, "categories": {...}}]}     # OpenAI moderation shape

The reported category is the first category whose value is true, else ``category``.

On the output stream the endpoint is called *per window*, not per token: when the filter is about
to release text the endpoint has not yet approved, it sends the whole pending text (up to
``window`` held-back characters beyond the release point), and that approval covers the next
releases, so there are about ``len(output) / window`` calls, each with at most ``2 * window + chunk``
characters. Security note: the URL is set by an admin (tenant filter config is admin-only); the
gateway will call whatever it names.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import httpx
import trio

from .base import Hook, OutputChunk, OutputCut, OutputScanner, PromptBlocked, iter_texts

log = logging.getLogger("gateway.filters.webhook")

UNAVAILABLE = "moderation_unavailable"


class WebhookError(Exception):
    """The moderation endpoint could not give a verdict (timeout, transport, status, JSON)."""


class WebhookHook(Hook):
    """Calls an external moderation endpoint (see module doc)."""

    type = "webhook"

    @classmethod
    def validate(cls, params: dict[str, Any]) -> dict[str, Any]:
        params = dict(params)
        url = params.pop("url", None)
        if not isinstance(url, str):
            raise ValueError("webhook: 'url' is required (string)")
        try:
            u = httpx.URL(url)
        except Exception as e:  # httpx.InvalidURL and friends
            raise ValueError(f"webhook: bad url: {e}") from None
        if u.scheme not in ("http", "https") or not u.host:
            raise ValueError("webhook: 'url' must be an absolute http(s) URL")
        t = params.pop("timeout_s", 2.0)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 < t <= 30:
            raise ValueError("webhook: 'timeout_s' must be a number in (0, 30]")
        fail = params.pop("fail", "closed")
        if fail not in ("open", "closed"):
            raise ValueError("webhook: 'fail' must be 'open' or 'closed'")
        headers = params.pop("headers", {})
        if not isinstance(headers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
        ):
            raise ValueError("webhook: 'headers' must be an object of strings")
        cat = params.pop("category", "moderation")
        if not isinstance(cat, str) or not cat or len(cat) > 64:
            raise ValueError("webhook: 'category' must be a non-empty string (<= 64 chars)")
        if params:
            raise ValueError(f"webhook: unknown members {sorted(params)}")
        return {"url": url, "timeout_s": float(t), "fail": fail, "headers": headers, "category": cat}

    def __init__(
        self,
        name,
        stages,
        roles,
        *,
        url,
        timeout_s,
        fail,
        headers,
        category,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(name, stages, roles)
        self.url = url
        self.timeout_s = timeout_s
        self.fail_open = fail == "open"
        self.headers = headers
        self.category = category
        self.client = client

    async def moderate(self, payload: dict[str, Any]) -> str | None:
        """POST ``payload``; return the flagged category, or None when allowed.

        Raises:
            WebhookError: timeout (``timeout_s`` for the whole call), transport error, non-2xx
                status, or a body that is not the accepted JSON shape.
        """
        try:
            with trio.fail_after(self.timeout_s):
                if self.client is not None:
                    r = await self.client.post(
                        self.url, json=payload, headers=self.headers, timeout=self.timeout_s
                    )
                else:
                    async with httpx.AsyncClient(timeout=self.timeout_s) as c:
                        r = await c.post(self.url, json=payload, headers=self.headers)
        except (trio.TooSlowError, httpx.TimeoutException) as e:
            raise WebhookError(f"timeout after {self.timeout_s}s") from e
        except httpx.HTTPError as e:
            raise WebhookError(f"transport error: {type(e).__name__}") from e
        if not 200 <= r.status_code < 300:
            raise WebhookError(f"status {r.status_code}")
        try:
            body = r.json()
            if isinstance(body, dict) and isinstance(body.get("results"), list) and body["results"]:
                body = body["results"][0]
            if not isinstance(body, dict) or not isinstance(body.get("flagged"), bool):
                raise ValueError("no boolean 'flagged'")
        except (ValueError, json.JSONDecodeError) as e:
            raise WebhookError(f"bad response: {e}") from e
        if not body["flagged"]:
            return None
        cats = body.get("categories")
        if isinstance(cats, dict):
            for k, v in cats.items():
                if v is True and isinstance(k, str) and k:
                    return k[:64]
        return self.category

    async def verdict(self, payload: dict[str, Any]) -> str | None:
        """Like :meth:`moderate`, with the fail-open / fail-closed policy applied to errors."""
        try:
            return await self.moderate(payload)
        except WebhookError as e:
            log.warning(
                "moderation webhook %s (hook %r): %s; failing %s",
                self.url,
                self.name,
                e,
                "open" if self.fail_open else "closed",
            )
            return None if self.fail_open else UNAVAILABLE

    async def check_prompt(self, tenant_id, messages):
        text = "\n".join(f"{role}: {t}" for role, t in iter_texts(messages, self.roles))
        cat = await self.verdict(
            {"stage": "prompt", "tenant_id": tenant_id, "input": text, "messages": messages}
        )
        if cat is not None:
            raise PromptBlocked(cat, "webhook verdict")
        return None

    def output_scanner(self, tenant_id=None):
        return _WebhookScanner(self, tenant_id)


class _WebhookScanner(OutputScanner):
    def __init__(self, hook: WebhookHook, tenant_id: str | None) -> None:
        self.hook = hook
        self.tenant_id = tenant_id
        self.approved_until = 0  # absolute output position up to which the endpoint said "allowed"

    async def scan(self, chunk: OutputChunk) -> OutputChunk | OutputCut:
        want = chunk.offset + (len(chunk.pending) if chunk.final else chunk.release)
        if want <= self.approved_until or not chunk.pending:
            return chunk
        cat = await self.hook.verdict(
            {
                "stage": "output",
                "tenant_id": self.tenant_id,
                "input": chunk.context + chunk.pending,
                "offset": chunk.offset - len(chunk.context),
            }
        )
        if cat is not None:
            return OutputCut(0, cat)
        self.approved_until = chunk.offset + len(chunk.pending)
        return chunk
