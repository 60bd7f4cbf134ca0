"""FilterPipeline (per tenant config) and OutputFilter (per choice of one request).

Where the gateway calls it (see docs/filters.md):

1. after auth / rate-limit admission, before templating and ``BackendClient.submit``::

       messages = await pipeline.check_prompt(tenant_id, messages)   # may raise ContentFiltered (400)

2. per choice, on the text produced after detokenizing and stop-string handling::

       of = pipeline.output_filter(tenant_id)
       safe = await of.feed(delta)        # send `safe` (may be ""), never the raw delta
       if of.cut: abort the backend request; finish_reason = "content_filter"
       ...at the end of generation (finish_reason "stop"/"length"): safe = await of.flush()

Matching time is bounded (``budget``, the ``http.filter_budget`` setting, seconds): the prompt stage of
one request, and each output step (one ``feed``/``flush``: every output hook over one window), may spend
at most ``budget`` seconds in the hooks' matching (``gateway.filters.matching.run_matching``); beyond it the
request fails with :func:`filter_timeout` (400, code ``content_filter_timeout``).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import Any

import httpx

from ..errors import ContentFiltered, InvalidRequest
from .base import Hook, OutputChunk, OutputCut, OutputScanner, PromptBlocked
from .config import HOOK_TYPES, FilterConfig, parse_config
from .matching import DEFAULT_BUDGET, MatchBudget, MatchTimeout, using_budget

log = logging.getLogger("gateway.filters")


def content_filter_result(hook: str, category: str) -> dict[str, Any]:
    """Azure-style ``content_filter_result(s)`` object naming the hook and category.

    Shape: ``{category: {"filtered": true, "detected": true, "hook": hook}}`` (Azure OpenAI keys
    its results by category, e.g. ``{"hate": {"filtered": true, "severity": "high"}}``).
    """
    return {category: {"filtered": True, "detected": True, "hook": hook}}


def filter_timeout(hook: str, budget: float, *, param: str | None) -> InvalidRequest:
    """The error of a request whose content-filter matching overran its budget: HTTP 400,
    ``invalid_request_error``, code ``content_filter_timeout``, naming the hook (never the text).

    A 400 like Azure OpenAI's ``content_filter`` errors (the request, under the tenant's filter
    config, cannot be checked); the client may retry with a shorter text.
    """
    return InvalidRequest(
        f"The content filter (hook '{hook}') did not finish checking the "
        f"{'prompt' if param else 'output'} within its {budget:g} s budget. "
        "Shorten the text, or simplify the tenant's filter patterns.",
        param=param,
        code="content_filter_timeout",
    )


class OutputFilter:
    """Filters one output stream (one choice). Create with :meth:`FilterPipeline.output_filter`.

    Feed it the text to send, in order; it returns the part that is now safe to send. It holds back
    at most ``window`` characters (fewer once the stream ends: :meth:`flush` releases the rest).

    Attributes:
        window: hold-back in characters (0 when no hook scans output: text passes straight through).
        cut: True once a hook cut the stream. After that ``feed``/``flush`` return ``""``; the caller
            must stop generation (abort the backend request) and finish with
            ``finish_reason: "content_filter"``. No text from the cut point on is ever returned.
        result: when cut, ``content_filter_result(hook, category)``; else None.
        sent: characters returned so far.
    """

    def __init__(
        self,
        scanners: list[tuple[str, OutputScanner]],
        window: int,
        tenant_id: str | None = None,
        *,
        budget: float = DEFAULT_BUDGET,
    ) -> None:
        self._scanners = scanners
        self.budget = budget
        self.window = window if scanners else 0
        self.tenant_id = tenant_id
        self.cut = False
        self.result: dict[str, Any] | None = None
        self.sent = 0
        self._pending = ""
        self._context = ""

    @property
    def held(self) -> int:
        """Characters fed but not yet returned (<= ``window`` between calls)."""
        return len(self._pending)

    async def feed(self, text: str) -> str:
        """Add generated ``text``; return the text now safe to send (possibly ``""``).

        Raises:
            gateway.errors.InvalidRequest: 400 ``content_filter_timeout``, the hooks' matching over
                this text took more than ``budget`` seconds (nothing unchecked has been returned).
            A hook's unexpected exception propagates (the caller should treat it as an internal
            error; nothing unchecked has been returned).
        """
        if self.cut:
            return ""
        self._pending += text
        if not self._scanners:
            return self._emit(self._pending)
        return await self._run(final=False)

    async def step(self, text: str, final: bool) -> str:
        """``feed(text)`` and, when ``final`` (the choice finished normally), ``flush()``; joined.

        One call per backend output is all a generation loop needs; afterwards check ``.cut``: if it
        is True, finish the choice with ``finish_reason = "content_filter"`` (overriding "stop" /
        "length") and stop generating for it.
        """
        out = await self.feed(text) if text else ""
        if final and not self.cut:
            out += await self.flush()
        return out

    async def flush(self) -> str:
        """The stream ended normally: check and return everything still held back."""
        if self.cut or not self._pending:
            return ""
        return await self._run(final=True)

    # ------------------------------------------------------------------ internals

    def _emit(self, out: str) -> str:
        self._pending = ""
        self.sent += len(out)
        return out

    async def _chain(
        self, pending: str, release: int, final: bool
    ) -> tuple[OutputChunk, tuple[int, str, str] | None]:
        chunk = OutputChunk(self._context, pending, release, final, self.sent, self.tenant_id)
        for name, sc in self._scanners:
            try:
                res = await sc.scan(chunk)
            except MatchTimeout:
                raise filter_timeout(name, self.budget, param=None) from None
            if isinstance(res, OutputCut):
                return chunk, (max(0, min(res.at, len(chunk.pending))), name, res.category)
            chunk = res
        return chunk, None

    async def _run(self, final: bool) -> str:
        with using_budget(MatchBudget(self.budget, key=self.tenant_id)):
            return await self._run_hooks(final)

    async def _run_hooks(self, final: bool) -> str:
        pending = self._pending
        release = len(pending) if final else max(0, len(pending) - self.window)
        chunk, cut = await self._chain(pending, release, final)
        if cut is None:
            p = chunk.pending
            r = len(p) if final else min(len(p), max(chunk.release, len(p) - self.window))
            out = p[:r]
            self._pending = p[r:]
            self.sent += len(out)
            self._context = (self._context + out)[-max(self.window, 32) :]
            return out
        # Cut: nothing from the cut point on is ever sent. The text before it is re-checked by
        # every hook as final text (a hook earlier in the list may have deferred a match in it).
        at, name, category = cut
        self.cut = True
        self.result = content_filter_result(name, category)
        prefix = chunk.pending[:at]
        for _ in range(len(self._scanners) + 1):
            if not prefix:
                break
            c2, cut2 = await self._chain(prefix, len(prefix), True)
            if cut2 is None:
                prefix = c2.pending
                break
            prefix = c2.pending[: cut2[0]]
        else:
            prefix = ""
        self._pending = ""
        self.sent += len(prefix)
        return prefix


class FilterPipeline:
    """The hooks of one tenant config, built once and shared by that tenant's requests.

    Attributes:
        config: the FilterConfig it was built from.
        hooks: Hook instances in run order.
        enabled: False when there are no hooks (``check_prompt`` returns its input; output
            filters pass text straight through with no hold-back).
        filters_output: True when at least one hook runs on the output stage.
    """

    def __init__(self, config: FilterConfig, hooks: list[Hook]) -> None:
        self.config = config
        self.hooks = hooks
        self._prompt_hooks = [h for h in hooks if "prompt" in h.stages]
        self._output_hooks = [h for h in hooks if "output" in h.stages]
        self.enabled = bool(hooks)
        self.filters_output = bool(self._output_hooks)

    async def check_prompt(
        self, tenant_id: str | None, messages: list[dict[str, Any]], *, budget: float = DEFAULT_BUDGET
    ) -> list[dict[str, Any]]:
        """Run the prompt-stage hooks in order; return the (maybe rewritten) messages.

        The input list is never mutated. Call it before templating/tokenizing and scheduling. The
        hooks' matching together may take ``budget`` seconds (texts over ``INLINE_CHARS`` characters
        are matched in a worker thread, so the event loop keeps serving other requests meanwhile).

        Raises:
            gateway.errors.ContentFiltered: 400, code ``content_filter``, param ``messages``,
                ``innererror.content_filter_result == {category: {"filtered": true, "detected":
                true, "hook": name}}``. The message never quotes the prompt.
            gateway.errors.InvalidRequest: 400, code ``content_filter_timeout``, param ``messages``:
                the matching took more than ``budget`` seconds (:func:`filter_timeout`).
        """
        with using_budget(MatchBudget(budget, key=tenant_id)):
            for h in self._prompt_hooks:
                messages = await self._check_one(h, tenant_id, messages, budget)
        return messages

    async def _check_one(
        self, h: Hook, tenant_id: str | None, messages: list[dict[str, Any]], budget: float
    ) -> list[dict[str, Any]]:
        try:
            new = await h.check_prompt(tenant_id, messages)
        except MatchTimeout:
            log.info("prompt filter over budget: tenant=%s hook=%s budget=%gs", tenant_id, h.name, budget)
            raise filter_timeout(h.name, budget, param="messages") from None
        except PromptBlocked as b:
            log.info("prompt blocked: tenant=%s hook=%s category=%s", tenant_id, h.name, b.category)
            raise ContentFiltered(
                f"The prompt was blocked by the content filter (hook '{h.name}', category '{b.category}'). "
                "Please modify your prompt and retry.",
                result=content_filter_result(h.name, b.category),
            ) from None
        return messages if new is None else new

    def output_filter(self, tenant_id: str | None = None, *, budget: float = DEFAULT_BUDGET) -> OutputFilter:
        """A fresh :class:`OutputFilter` for one output stream (one per choice when n > 1); each of its
        steps may spend ``budget`` seconds matching."""
        scanners = []
        for h in self._output_hooks:
            sc = h.output_scanner(tenant_id)
            if sc is not None:
                scanners.append((h.name, sc))
        return OutputFilter(scanners, self.config.output_window, tenant_id, budget=budget)


def build_pipeline(config: FilterConfig, *, http_client: httpx.AsyncClient | None = None) -> FilterPipeline:
    """Instantiate the hooks of ``config``.

    Args:
        http_client: optional shared ``httpx.AsyncClient`` for webhook hooks (connection reuse);
            without it each webhook call opens its own client.
    """
    hooks: list[Hook] = []
    for spec in config.hooks:
        cls = HOOK_TYPES[spec.type]
        kw: dict[str, Any] = dict(spec.params)
        if spec.type == "webhook" and http_client is not None:
            kw["client"] = http_client
        hooks.append(cls(spec.name, spec.stages, spec.roles, **kw))
    return FilterPipeline(config, hooks)


NO_FILTERS = FilterPipeline(FilterConfig(), [])

_CACHE: OrderedDict[str, FilterPipeline] = OrderedDict()
_CACHE_SIZE = 256


def pipeline_for(obj: Any) -> FilterPipeline:
    """The pipeline for a tenant's stored filter JSON (``None``/``{}`` -> no filtering), cached.

    Builds are cached by the normalized config (LRU, 256 entries), so calling this on every request
    is cheap and a changed config takes effect on the next request.

    Raises:
        ValueError: invalid config (should not happen for configs stored through ``parse_config``).
    """
    if obj is None or obj == {}:
        return NO_FILTERS
    if isinstance(obj, FilterConfig):
        cfg = obj
        key = cfg.cache_key()
    else:
        try:  # fast path: the stored JSON as given (no re-validation per request)
            key = "raw:" + json.dumps(obj, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError):
            key = None
        p = _CACHE.get(key) if key is not None else None
        if p is not None:
            _CACHE.move_to_end(key)
            return p
        cfg = parse_config(obj)
    p = build_pipeline(cfg) if cfg.enabled else NO_FILTERS
    if key is not None:
        _CACHE[key] = p
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return p
