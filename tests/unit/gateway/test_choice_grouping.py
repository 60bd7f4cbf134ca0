"""A choice's text, token count, logprobs and text offsets do not depend on how the backend grouped its
tokens into outputs (speculative decoding sends the accepted drafts and the next token in one output).

The real tokenizer, detokenizer, stop matcher, ``Choice`` and legacy-logprobs builder; no server."""

from __future__ import annotations

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.protocol import RequestOutput, TokenLogprob
from gateway.detokenizer import IncrementalDetokenizer
from gateway.generation.choice import Choice
from gateway.openai.logprobs import completion_logprobs, merge_completion_logprobs
from gateway.stops import StopMatcher
from templating import cached_tokenizer

TEXT = "The cat sat on the mat. STOP here, then more text that must never be seen. Fin."


@pytest.fixture(scope="module")
def tok(model_path):
    return cached_tokenizer(model_path)


class _Names:
    def __init__(self, tok) -> None:
        self.tok = tok

    def token_str(self, t: int) -> str:
        return self.tok.id_to_bytes[t].decode("utf-8", "replace")

    def token_bytes(self, t: int) -> list[int]:
        return list(self.tok.id_to_bytes[t])


def _run(tok, ids: list[int], groups: list[int]) -> dict:
    """Feed ``ids`` in outputs of ``groups`` tokens; what the run (``generation/run.py``) takes of them."""

    async def main() -> dict:
        ch = Choice(0, IncrementalDetokenizer.for_tokenizer(tok), StopMatcher(["STOP"]), None)
        names = _Names(tok)
        text, parts, tokens, pos = "", [], 0, 0
        for g in groups:
            chunk = ids[pos : pos + g]
            pos += g
            if not chunk or ch.finish is not None:
                break
            out = RequestOutput(
                request_id="r",
                new_token_ids=chunk,
                logprobs=[TokenLogprob(t, -0.01 * t, []) for t in chunk],
            )
            piece, _, _ = await ch.feed(out)
            lps = out.logprobs[: ch.consumed]
            parts.append(completion_logprobs(names, lps, 0, len(text), ch.offsets))
            tokens += ch.consumed
            text += piece
        merged = merge_completion_logprobs(parts, 0)
        return {
            "text": text,
            "finish": ch.finish,
            "completion_tokens": ch.completion_tokens,
            "tokens": tokens,
            "logprob_tokens": merged.tokens,
            "text_offset": merged.text_offset,
        }

    return trio.run(main)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=40))
def test_grouping_changes_nothing(tok, sizes):
    ids = tok.encode_plain(TEXT)
    one = _run(tok, ids, [1] * len(ids))
    assert one["finish"] == "stop" and one["text"].startswith("The cat sat on the mat.")
    assert "never" not in one["text"]
    groups = (sizes * (len(ids) // len(sizes) + 1))[: len(ids)]
    assert _run(tok, ids, groups) == one
