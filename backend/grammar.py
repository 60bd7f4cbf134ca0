"""Grammar-constrained decoding: compiled grammars, per-choice matchers, batched token masks.

A ``protocol.Grammar`` (JSON Schema, Lark or regex text) is compiled once per distinct ``Grammar.key``
into an llguidance ``LLMatcher`` over the model's vocabulary; each constrained choice gets its own copy
(``deep_copy``: the parser state of that choice). Per engine step:

1. ``MaskJob.start`` computes the masks of every constrained row on a worker thread (llguidance releases
   the GIL; ``LLExecutor`` spreads the rows over its threads): beside the forward pass when the model
   runs on an accelerator, so the masks are ready when the logits are; right after it on a CPU, whose
   cores the forward pass already keeps busy (measured: overlapping there only slows both);
2. ``MaskJob.result`` gives ``Masks``: which tokens batch row ``rows[j]`` allows; ``apply_masks`` sets
   every other logit of those rows to ``-inf`` (a C++ kernel over the bitmask when built). Rows without a grammar are
   not touched, and a step without constrained rows does no work at all;
3. each sampled token is fed to its choice's matcher (``advance``): a token the grammar refuses is a
   ``GrammarError`` for that request alone; a grammar that can take no more tokens ends the choice
   ("stop").

Compiling runs on a worker thread too (``GrammarCompiler.submit`` returns a ``Future``; one already
compiled is copied at once): the engine queues a constrained request only when its grammar is ready, so a
slow compile never stalls the step loop. The vocabulary (llguidance ``LLTokenizer``, ~0.2 s to build) is loaded on first use from the
model's own tokenizer (``templating.load_tokenizer``), never from the gateway.

Limits: ``MAX_GRAMMAR_BYTES`` of grammar text; chains of references (``$ref`` of every kind, Lark rules)
at most ``backend.grammar_depth.MAX_GRAMMAR_DEPTH`` deep (llguidance's compiler recurses along them with
no bound of its own: a deeper one crashed the process), checked in ``to_llguidance`` before llguidance
sees the text, and compiles run on a thread with ``COMPILE_STACK_BYTES`` of stack; llguidance's
``LLParserLimits`` bound the lexer and parser work per compile and per mask (a grammar over them errors
instead of hanging).

Shapes: masks are int32 bitmasks ``[R, ceil(V / 32)]`` (bit ``t % 32`` of word ``t // 32`` set = token
``t`` allowed), unpacked to ``[R, V] bool``. Token ids are ints in ``[0, V)``.

Errors::

    GrammarError                 the grammar does not compile, or the output left it
    GrammarUnavailable           llguidance is not installed, or the model's vocabulary cannot be loaded

Source followed: llguidance (https://github.com/guidance-ai/llguidance: ``LLMatcher``, ``LLExecutor``,
``fill_next_token_bitmask_par``); vLLM v1 structured output (masks computed per step beside the forward
pass, applied in the sampler).
"""

from __future__ import annotations

import json
import os
import random
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from backend.grammar_depth import COMPILE_STACK_BYTES, depth_problem, pointer
from backend.protocol import Grammar, grammar_key

if TYPE_CHECKING:
    import torch

MAX_GRAMMAR_BYTES = 1024 * 1024  # bytes of Grammar.source the backend compiles at most
CACHE_SIZE = 128  # compiled grammars kept (LRU by Grammar.key)

try:  # optional at import time: a backend without it does not announce FEATURE_GRAMMAR
    import llguidance as llg
except ImportError:  # pragma: no cover - llguidance is a dependency
    llg = None


class GrammarError(Exception):
    """The grammar does not compile, or the generated tokens left it (``message`` says where)."""


class GrammarUnavailable(GrammarError):
    """No grammar engine here: llguidance missing, or the model's vocabulary could not be loaded."""


def available() -> bool:
    """True when llguidance can be imported (the backend then announces ``FEATURE_GRAMMAR``)."""
    return llg is not None


def parser_limits() -> object:
    """llguidance's work limits for one grammar (defaults: lexer fuel 1M at compile, 200k per mask)."""
    assert llg is not None
    return llg.LLParserLimits(max_grammar_size=500_000, step_lexer_fuel=200_000)


def to_llguidance(grammar: Grammar) -> str:
    """The llguidance grammar text (its JSON top-level form) of ``grammar``: the one way grammars reach
    llguidance here, so its guards hold for every caller (``backend.grammar_depth``: the chains llguidance
    recurses along are at most ``MAX_GRAMMAR_DEPTH`` deep).

    Raises:
        GrammarError: too large, too deep, or a JSON Schema that is not a JSON object.
        GrammarUnavailable: no llguidance.
    """
    if llg is None:
        raise GrammarUnavailable("structured output needs the llguidance package")
    if len(grammar.source.encode()) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"the grammar is larger than {MAX_GRAMMAR_BYTES} bytes")
    problem = depth_problem(grammar.kind, grammar.source)
    if problem is not None:
        raise GrammarError(problem)
    try:
        if grammar.kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(grammar.source)
        if grammar.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(grammar.source)
        return llg.LLMatcher.grammar_from_lark(grammar.source)
    except (ValueError, TypeError) as exc:
        raise GrammarError(str(exc)) from None


WALK_STEPS = 16  # tokens each of check_grammar's walks goes into the output
WALKS = 3  # one preferring the longest allowed token, two random


def check_grammar(grammar: Grammar, tokenizer: object | None = None, walk: int = WALK_STEPS) -> None:
    """Compile ``grammar``; with a tokenizer, also walk ``walk`` tokens into outputs it allows.

    ``tokenizer``: an ``llguidance.LLTokenizer``. With one, the masks of the first ``walk`` steps are
    computed along ``WALKS`` outputs the grammar allows: one taking the longest allowed token (bytes) at
    each step, two taking seeded random ones; none takes EOS or a whitespace-only token while another is
    allowed. Most problems that compiling alone does not show surface there (a ``$ref`` cycle, an object
    whose many optional properties overflow a parser row, a rule with no base case). A problem deeper in
    the output than the walks go still ends that request during generation.

    Raises:
        GrammarError: the message says what is wrong.
        GrammarUnavailable: no llguidance.
    """
    text = to_llguidance(grammar)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, tokenizer, limits=parser_limits())
    if is_error:
        raise GrammarError(_short(messages[0]) if messages else "invalid grammar")
    if tokenizer is None:
        return
    first = llg.LLMatcher(tokenizer, text, log_level=0, limits=parser_limits())
    for n in range(WALKS):
        m = first.deep_copy() if n < WALKS - 1 else first
        error = _walk(m, tokenizer, walk, None if n == 0 else random.Random(n))
        if error is not None:
            raise GrammarError(error)


_TOKEN_INFO: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _token_info(tokenizer: object) -> tuple[np.ndarray, np.ndarray]:
    """Per token id: its length in bytes, and whether it is whitespace only (cached per tokenizer)."""
    info = _TOKEN_INFO.get(id(tokenizer))
    if info is None:
        n = tokenizer.vocab_size  # type: ignore[attr-defined]
        pieces = [tokenizer.decode_bytes([t]) for t in range(n)]  # type: ignore[attr-defined]
        info = (
            np.array([len(b) for b in pieces], dtype=np.int32),
            np.array([not b.strip() for b in pieces], dtype=np.bool_),
        )
        _TOKEN_INFO[id(tokenizer)] = info
    return info


def _walk(m: object, tokenizer: object, steps: int, rng: random.Random | None) -> str | None:
    """One walk of ``check_grammar``: the matcher's error, or None. ``rng`` None: longest token first."""
    eos = np.array(sorted(tokenizer.eos_tokens), dtype=np.int64)  # type: ignore[attr-defined]
    n_vocab = tokenizer.vocab_size  # type: ignore[attr-defined]
    lengths, blank = _token_info(tokenizer)
    for step in range(steps + 1):
        raw = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)  # type: ignore[attr-defined]
        if m.is_error():  # type: ignore[attr-defined]
            return _short(m.get_error())  # type: ignore[attr-defined]
        ids = np.flatnonzero(np.unpackbits(raw, bitorder="little")[:n_vocab])
        if step == 0 and ids.size == 0:
            return "the grammar accepts no output at all"
        if m.is_stopped() or ids.size == 0:  # type: ignore[attr-defined]
            return None
        ids = ids[~np.isin(ids, eos)]
        if ids.size == 0:
            return None  # only EOS may follow: the output can end here
        words = ids[~blank[ids]]
        if words.size:
            ids = words
        pick = int(ids[np.argmax(lengths[ids])]) if rng is None else int(ids[rng.randrange(ids.size)])
        if not m.consume_token(pick):  # type: ignore[attr-defined]
            return _short(m.get_error())  # type: ignore[attr-defined]
    return None


def _short(message: str) -> str:
    """llguidance's error text without its parser-state dump (and its bare internal names explained)."""
    text = message.split("\n<state>", 1)[0].strip() or "grammar error"
    if text == "NoExtensionBias":
        return "no token can continue the output here (e.g. a '$ref' that only refers to itself)"
    return text


# ----------------------------------------------------------------------------- JSON Schema refs


_ANNOTATIONS = frozenset(
    {"$ref", "title", "description", "$comment", "default", "examples", "$id", "$schema"}
)
_WRAPPERS = ("allOf", "anyOf", "oneOf")


def _only_ref(node: Any) -> str | None:
    """The ``$ref`` of a node that says nothing else (its content is all the referenced node's): a bare
    ``{"$ref": ...}`` (annotations and ``$defs`` aside), or an ``allOf``/``anyOf``/``oneOf`` of one such
    node and nothing else, at any depth of such wrapping."""
    for _ in range(64):
        if not isinstance(node, dict):
            return None
        keys = set(node) - _ANNOTATIONS - {"$defs", "definitions"}
        ref = node.get("$ref")
        if isinstance(ref, str) and not keys:
            return ref
        if ref is None and len(keys) == 1:
            (k,) = keys
            if k in _WRAPPERS and isinstance(node[k], list) and len(node[k]) == 1:
                node = node[k][0]
                continue
        return None
    return None


MAX_REF_CHAIN = 256  # refs in a row that describe nothing; llguidance's compiler recurses along them


def ref_cycle(schema: Any, max_nodes: int = 200_000) -> list[str] | None:
    """A chain of ``$ref`` that comes back to where it started without describing anything, or one longer
    than ``MAX_REF_CHAIN`` (its first links, then "..."); None when there is neither.

    O(nodes + refs x pointer depth): every node is visited once (iteratively, never recursing), and
    every ref's chain is followed once (the links left from a ref already seen are remembered).
    """
    if not isinstance(schema, dict):
        return None
    left: dict[str, int] = {}  # ref -> links from it to a node that describes something
    stack: list[Any] = [schema]
    seen = 0
    while stack and seen < max_nodes:
        node = stack.pop()
        seen += 1
        if isinstance(node, dict):
            ref = _only_ref(node)
            if ref is not None and ref not in left:
                chain: list[str] = []
                on_chain: set[str] = set()
                cur: str | None = ref
                while cur is not None and cur not in left:
                    if cur in on_chain:
                        return chain[chain.index(cur) :] + [cur]
                    chain.append(cur)
                    on_chain.add(cur)
                    cur = _only_ref(pointer(schema, cur))
                tail = left[cur] if cur is not None else 0
                for k, link in enumerate(chain):
                    left[link] = tail + len(chain) - k
                if left[ref] > MAX_REF_CHAIN:
                    return chain[:3] + ["..."]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None


_STACK_LOCK = threading.Lock()


def big_stack_executor(name: str) -> ThreadPoolExecutor:
    """A one-thread executor whose thread has ``COMPILE_STACK_BYTES`` of stack (reserved address space;
    pages are committed as they are used), whatever ``ulimit -s`` the process got: llguidance's compiler
    recurses (``backend.grammar_depth``). ``threading.stack_size`` is process-wide, so it is set only
    while that one thread starts."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    with _STACK_LOCK:
        old = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            pool.submit(int).result()  # max_workers=1: this thread is the executor's only one
        finally:
            threading.stack_size(old)
    return pool


class GrammarCompiler:
    """Compiles grammars against one vocabulary on a worker thread; caches the results by ``Grammar.key``.

    Args:
        tokenizer_json: the model's ``tokenizer.json`` text, or a callable returning it (called once, on
            the first compile, on the worker thread).
        vocab_size: logits width V (ids >= the tokenizer's size are never allowed).
        eos_token_ids: ids that end a choice; a complete grammar allows them.
        cache_size: compiled grammars kept.
    """

    def __init__(
        self,
        tokenizer_json: str | Callable[[], str],
        vocab_size: int,
        eos_token_ids: list[int],
        cache_size: int = CACHE_SIZE,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: object | None = None
        self._lock = threading.Lock()  # guards _cache and _tokenizer (worker threads only)
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._cache_size = cache_size
        self._pool = big_stack_executor("grammar-compile")
        self.compiled = 0  # compiles done (cache misses)

    def tokenizer(self) -> object:
        """The llguidance ``LLTokenizer`` (built on first use). Raises ``GrammarUnavailable``."""
        if llg is None:
            raise GrammarUnavailable("structured output needs the llguidance package")
        with self._lock:
            if self._tokenizer is None:
                src = self._tokenizer_json
                try:
                    text = src() if callable(src) else src
                    self._tokenizer = llg.LLTokenizer(
                        text, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                    )
                except Exception as exc:  # noqa: BLE001 - any loader failure means no grammar here
                    raise GrammarUnavailable(f"cannot load the model's vocabulary: {exc}") from None
            return self._tokenizer

    def compile(self, grammar: Grammar, key: str | None = None) -> object:
        """A fresh matcher for ``grammar`` (a copy of the cached compiled one). ``key``: its
        ``grammar_key`` when the caller has it. Raises ``GrammarError``."""
        tok = self.tokenizer()
        key = key or grammar_key(grammar.kind, grammar.source)  # computed here: a sender's key is not trusted
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached.deep_copy()  # type: ignore[attr-defined]
        if grammar.kind == "json_schema":  # guard the compiler's recursion, whoever sent the grammar
            try:
                chain = ref_cycle(json.loads(grammar.source))
            except (ValueError, RecursionError):
                chain = None  # the compiler reports bad JSON itself
            if chain:
                raise GrammarError(f"'$ref' chain {' -> '.join(chain)} describes no value")
        matcher = llg.LLMatcher(tok, to_llguidance(grammar), log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise GrammarError(_short(matcher.get_error()))
        with self._lock:
            self.compiled += 1
            self._cache[key] = matcher
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher.deep_copy()

    def submit(self, grammar: Grammar) -> Future:
        """``compile`` on the worker thread; the future's result is a matcher, or it raises. A grammar
        already compiled is copied at once: the future is done on return."""
        key = grammar_key(grammar.kind, grammar.source)
        with self._lock:
            cached = self._cache.get(key)
        if cached is None or self._tokenizer is None:
            return self._pool.submit(self.compile, grammar, key)
        done: Future = Future()
        done.set_result(self.compile(grammar, key))
        return done

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def advance(matcher: object, token_id: int) -> None:
    """Feed one sampled token to a choice's matcher.

    Raises:
        GrammarError: the grammar refuses the token (the matcher's error message).
    """
    if not matcher.consume_token(token_id):  # type: ignore[attr-defined]
        raise GrammarError(_short(matcher.get_error()))  # type: ignore[attr-defined]


def error_message(matcher: object) -> str:
    """The matcher's error, without llguidance's parser-state dump."""
    return _short(matcher.get_error())  # type: ignore[attr-defined]


def finished(matcher: object) -> bool:
    """The grammar can take no more tokens: the choice's output is complete."""
    return bool(matcher.is_stopped())  # type: ignore[attr-defined]


class Masks(NamedTuple):
    """One step's grammar masks: batch row ``rows[j]`` may take the tokens ``allowed[j]`` marks
    (``[R, V] bool``, unpacked from ``bitmask [R, W] int32``); ``some[j]``: it allows at least one token."""

    rows: list[int]
    allowed: torch.Tensor
    some: list[bool]
    bitmask: np.ndarray | None = None


def apply_masks(logits: torch.Tensor, masks: Masks) -> None:
    """Set every logit that row ``masks.rows[j]``'s grammar does not allow to ``-inf``, in place.

    ``logits``: ``[B, V] float32`` CPU. Uses the C++ kernel (``backend.cpu_kernels``) when it is built and
    the bitmask is at hand (skips all-allowed words, no unpacking), else one ``masked_fill_`` per row.
    """
    import torch

    from backend import cpu_kernels

    mod = cpu_kernels.load() if masks.bitmask is not None else None
    with torch.inference_mode():  # the model's logits are inference tensors
        if mod is not None and logits.dtype == torch.float32 and logits.stride(1) == 1:
            rows = torch.tensor(masks.rows, dtype=torch.int64)
            mod.apply_token_bitmask(logits, torch.from_numpy(masks.bitmask), rows)
            return
        forbidden = ~masks.allowed
        for j, r in enumerate(masks.rows):  # row views: no gather/scatter copy of the rows
            logits[r].masked_fill_(forbidden[j], float("-inf"))


class MaskJob:
    """The token masks of one step's constrained rows, computed on a worker thread.

    Args:
        vocab_size: logits width V.
        threads: llguidance ``LLExecutor`` threads used for the rows of one step (default: the CPUs, at
            most 8).
    """

    def __init__(self, vocab_size: int, threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        threads = threads or min(8, os.cpu_count() or 1)
        self._executor = llg.LLExecutor(num_threads=threads) if llg is not None else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self.mask_time_s: list[float] = []  # per step with constrained rows (bench); bounded below

    def start(self, rows: list[int], matchers: list[object]) -> Future | None:
        """Begin the masks of batch rows ``rows`` (matcher ``matchers[i]`` for row ``rows[i]``).
        Returns None when there is nothing to mask."""
        if not rows:
            return None
        return self._pool.submit(self._fill, list(rows), list(matchers))

    def _fill(self, rows: list[int], matchers: list[object]) -> tuple[list[int], np.ndarray, float]:
        import time

        t0 = time.perf_counter()
        bitmask = np.full((len(rows), self.words), -1, dtype=np.int32)
        assert self._executor is not None
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bitmask.ctypes.data, self.words * 4, len(rows)
        )
        return rows, bitmask, time.perf_counter() - t0

    def result(self, job: Future | None) -> Masks | None:
        """The ``Masks`` of a started job, or None."""
        if job is None:
            return None
        rows, bitmask, dt = job.result()
        if len(self.mask_time_s) < 100_000:
            self.mask_time_s.append(dt)
        import torch

        # little-endian words: byte-wise unpacking with bitorder="little" keeps token order (10x torch shifts)
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
        some = (bitmask != 0).any(axis=1).tolist()
        return Masks(rows, torch.from_numpy(bits.view(np.bool_)), some, bitmask)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = [
    "GrammarCompiler",
    "GrammarError",
    "GrammarUnavailable",
    "MaskJob",
    "Masks",
    "apply_masks",
    "big_stack_executor",
    "advance",
    "available",
    "check_grammar",
    "ref_cycle",
    "error_message",
    "finished",
    "to_llguidance",
]
