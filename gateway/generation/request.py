"""``GenerationRequest``: one API request parsed once, whichever API it came through.

The OpenAI chat and completion handlers and the Ollama chat and generate handlers each turn their body into
this one struct (validated, templated, tokenized, limits resolved), then hand it to a run
(``gateway.generation.run``) and a renderer for their API. Nothing after parsing looks at the raw body.

Fields:
    request_id: the public id (``chatcmpl-…``, ``cmpl-…``) and the backend request id.
    api: which API the request came through (``"openai"`` or ``"ollama"``): a metrics/log label only.
    model: the model name the client asked for (a served name or an alias).
    served: the model it resolved to (``gateway.catalog.ServedModel``): its backends, tokenizer and grammar
        checker serve the run; None only in tests that render without running.
    prompt_ids: prompt token ids (list[int], after the chat template).
    sampling: backend sampling parameters: ``n``, ``max_tokens`` (resolved against the context), penalties,
        seed, ``logprobs``/``top_logprobs``, ``speculative`` (the client's ``speculative``, default true)...
    stops: stop strings (normalized, non-empty); include_stop: keep the matched stop string in the text;
    skip_special_tokens: leave special tokens (``<|im_end|>``) out of the text (vLLM's default).
    stream: the client asked for a stream; include_usage: OpenAI ``stream_options.include_usage``.
    principal: the authenticated tenant key, or None without tenancy.
    prompt_log: the prompt as the client sent it (messages or text), for the access log with
        ``--log-content`` only.
    t_arrival: ``time.perf_counter()`` at arrival (TTFT and total durations start here).
    grammar: the constraint the backend enforces on every choice (checked already), or None.
    grammar_param: the request parameter the grammar came from (named by errors about it).
    grammar_checks: every grammar of the request, checked by the run after admission and before the
        backend (``gateway.structured.checker``).
    tools: the request's tool plan (``gateway.tools.spec.ToolPlan``), or None.
    tool_parser: makes one choice's tool-call parser; None: the output is plain content.
    inspect: the client asked for an inspection record (the gateway extension ``"inspect": true``): the
        backend records each choice's timeline and the run's record is kept for the tenant to read back
        (``gateway.inspector``).
    upstream: the run of a model served elsewhere (kind ``openai``, ``gateway.upstream.entry``), None for a
        native model: ``run_generation`` hands it the sink.
    counted: the request's rpm charge (its ``x-ratelimit-*-requests`` headers), made before its prompt was
        rendered (``Gateway.count_request``); admission then reserves tokens and the slot only. None: no
        tenancy, or not counted yet (admission counts it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec

from auth.principal import Principal
from backend.protocol import Grammar, SamplingParams
from gateway.catalog import ServedModel
from gateway.generation.events import EventSink
from gateway.structured.checker import GrammarCheck
from gateway.tools.parser import ToolParser
from gateway.tools.spec import ToolPlan
from ratelimit.reservation import RequestCount


class GenerationRequest(msgspec.Struct, kw_only=True):
    request_id: str
    api: Literal["openai", "ollama"]
    model: str
    served: ServedModel | None = None
    prompt_ids: list[int]
    sampling: SamplingParams
    stops: list[str] = []
    include_stop: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    include_usage: bool = False
    principal: Principal | None = None
    prompt_log: Any = None
    t_arrival: float = 0.0
    grammar: Grammar | None = None
    grammar_param: str | None = None
    grammar_checks: list[GrammarCheck] = []
    tools: ToolPlan | None = None
    tool_parser: Callable[[], ToolParser] | None = None
    inspect: bool = False
    upstream: Callable[[EventSink], Awaitable[None]] | None = None
    counted: RequestCount | None = None

    @property
    def served_name(self) -> str:
        """The served name of the model (an alias resolved): the name limits, billing and metrics key on."""
        return self.served.name if self.served is not None else self.model

    @property
    def tenant_id(self) -> str:
        """The tenant's id, "" without tenancy (also the prefix-cache salt: tenants never share KV)."""
        return self.principal.tenant_id if self.principal is not None else ""
