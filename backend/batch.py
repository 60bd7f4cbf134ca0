"""What the engine asks the model runner to compute in one step (plain Python, no torch).

The engine (scheduler) builds one ``SeqChunk`` per scheduled sequence and passes the list to
``backend.model_runner.ModelRunner.execute``. Decode chunks (exactly one new token) come first,
then prefill chunks (one or more prompt tokens), as in vLLM's mixed batches.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SeqChunk:
    """The new tokens of one sequence for this step.

    Attributes:
        token_ids: the tokens to compute now (>= 1), in order; ids in ``[0, vocab_size)``.
        start_pos: position of ``token_ids[0]`` == number of this sequence's tokens already in the
            KV cache (tokens). The chunk covers positions ``[start_pos, start_pos + len(token_ids))``.
        block_table: physical KV block ids covering positions ``[0, start_pos + len(token_ids))``;
            position ``p`` lives in block ``block_table[p // block_size]`` at offset ``p % block_size``.
            Needs at least ``ceil((start_pos + len(token_ids)) / block_size)`` entries.
        need_logits: return the logits of the last new token (the next-token distribution).
            False for non-final prefill chunks.
        prompt_len: the sequence's prompt length (tokens). Positions at or past it hold generated tokens,
            whose rows the model may compute in another weight format than prompt rows (see
            ``backend.model_runner.ModelRunner``, ``generated_int4``): a row's arithmetic then depends on
            its token's role only, never on what else is in the step. None: every position is a prompt
            token.
        num_logits: with ``need_logits``, how many of the chunk's last rows return logits (a speculative
            verify chunk: its last committed token and each draft token, ``1 + drafts``); default 1.
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    need_logits: bool = True
    prompt_len: int | None = None
    num_logits: int = 1

    @property
    def num_tokens(self) -> int:
        """New tokens in this chunk."""
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        """Context length after this step (tokens): ``start_pos + len(token_ids)``."""
        return self.start_pos + len(self.token_ids)
