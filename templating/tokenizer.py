"""The model's tokenizer: text <-> token ids, built on Hugging Face ``tokenizers``.

Two sources are supported:

* a GGUF file: the vocabulary, merges or scores, token types, special ids and add-BOS/EOS flags of its
  metadata, turned into the pipeline llama.cpp uses for that kind (``templating/gguf_vocab.py``: byte-level
  BPE with each ``tokenizer.ggml.pre`` type's regexes, SentencePiece ``llama`` vocabularies with byte
  fallback, Gemma 4). ``"smollm"`` keeps the pipeline of HF's ``HuggingFaceTB/SmolLM2-*/tokenizer.json``
  (checked against ``tests/fixtures/smollm2_tokenizer.json``; transformers 5.23 and llama.cpp agree); the
  others are checked against llama.cpp's expected ids (``tests/unit/templating/test_vocab_families.py``).
* a Hugging Face model directory: ``tokenizer.json`` as is, with ``tokenizer_config.json`` (bos/eos/unk/pad
  strings, ``add_bos_token``/``add_eos_token``, ``chat_template``) and ``chat_template.jinja`` when present.

Token ids are Python ``int``; all ids lie in ``[0, vocab_size)``.

Errors (``templating/errors.py``): ``TokenizerFileMissing`` (also ``FileNotFoundError``) for a missing path or
a directory without ``tokenizer.json``; ``UnsupportedTokenizer`` (also ``ValueError``) naming the GGUF key and
value of a kind not built; ``TokenizerError`` for a vocabulary ``tokenizers`` rejects. Each ``str()`` is one
line.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer

from templating.errors import TokenizerFileMissing
from templating.gguf_vocab import GGUFVocab, build_tokenizer, read_gguf_metadata

__all__ = ["TextTokenizer", "load_tokenizer", "cached_tokenizer", "bytes_to_unicode"]

# Token strings that end a turn when they are special tokens (llama.cpp ``llama_vocab`` end-of-generation list).
_END_OF_TURN = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<EOT>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
)


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE (openai/gpt-2 encoder.py)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@lru_cache(maxsize=1)
def _to_latin1() -> dict[int, str]:
    """``str.translate`` table: each byte-map character -> the character of its byte (< 256); every other
    character below 256 -> U+FFFF, so that ``encode("latin-1")`` fails on it as on any character >= 256."""
    table = {c: "\uffff" for c in range(256)}
    table.update({ord(c): chr(b) for b, c in bytes_to_unicode().items()})
    return table


def _byte_level_token_bytes(token: str) -> bytes:
    """Bytes of one token string under the ByteLevel decoder.

    Same rule as ``tokenizers`` (``decoders/byte_level.rs``): if every character is in the byte map the
    token is those bytes, otherwise (e.g. an added token such as ``"a b"``) its raw UTF-8.
    """
    try:
        return token.translate(_to_latin1()).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode("utf-8")


def _sentencepiece_token_bytes(token: str) -> bytes:
    """Best effort for Metaspace/ByteFallback decoders (Llama-2 style): ``<0xNN>`` -> byte, ``▁`` -> space."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    return token.replace("\u2581", " ").encode("utf-8")


GIL_FREE_CHARS = 4096  # texts longer than this are encoded with the GIL released


def _encode(tok: Tokenizer, text: str) -> list[int]:
    """``tok.encode(text)`` ids (no special tokens added). A long text goes through ``encode_batch``, the same
    ids, which releases the GIL while it runs: ``Tokenizer.encode`` holds it, so a multi-megabyte prompt
    tokenized in a worker thread would still stall the event loop for seconds."""
    if len(text) <= GIL_FREE_CHARS:
        return tok.encode(text, add_special_tokens=False).ids
    return tok.encode_batch([text], add_special_tokens=False)[0].ids


@dataclass
class TextTokenizer:
    """A loaded tokenizer plus what templating and detokenizing need.

    Attributes:
        tokenizer: the ``tokenizers.Tokenizer`` that parses special added tokens in text (trusted text only).
        plain: a second one with ``encode_special_tokens=True``: special-token strings in text are ordinary
            text (user-defined added tokens are still matched, as llama.cpp does). Built from the source
            again rather than copied: a copy through ``to_str`` costs two to three times a build.
        vocab_size: number of ids, added tokens included (49,152 for SmolLM2).
        bos_token_id / eos_token_id / unk_token_id / pad_token_id: ids or None.
        bos_token / eos_token: their strings ("" when unknown), passed to chat templates.
        special_ids: ids of special (control) tokens; skipped by ``decode(skip_special_tokens=True)``.
        special_tokens: id -> string for the special tokens.
        id_to_bytes: ``id_to_bytes[i]`` is the UTF-8 byte string token ``i`` stands for (specials: their text).
        chat_template: the model's Jinja chat template source, or None.
        byte_level: tokens are GPT-2 byte-mapped strings (else SentencePiece ``▁`` / ``<0xNN>`` pieces).
        add_bos_token / add_eos_token: a raw prompt starts with BOS / ends with EOS (:meth:`encode_prompt`;
            GGUF ``tokenizer.ggml.add_bos_token`` with llama.cpp's per-kind default, HF
            ``tokenizer_config.json`` or the ``tokenizer.json`` post-processor).
        end_ids: further ids that end a turn (GGUF ``eot``/``eom`` token ids).
        lstrip_ids / rstrip_ids: added tokens that take the whitespace before / after them when they are
            matched in text (HF ``AddedToken.lstrip``/``rstrip``; llama.cpp gives Phi-3's specials RSTRIP).
            ``encode_with_specials`` applies them; a caller that splits at special tokens itself must too.
        max_token_bytes: the most UTF-8 bytes one ordinary (non-special) token stands for: a text of ``b``
            bytes is at least ``ceil(b / max_token_bytes)`` tokens (``encode_plain``), which bounds a prompt's
            token count from its length before it is tokenized.
        stop_token_ids: ids that end generation: eos, ``end_ids``, and the special tokens among
            ``<|im_end|>``, ``<|endoftext|>``, ``<|eot_id|>``, ``<|end|>``, ``<end_of_turn>``... (llama.cpp's
            end-of-generation names).
    """

    tokenizer: Tokenizer
    plain: Tokenizer
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    bos_token: str
    eos_token: str
    special_tokens: dict[int, str]
    id_to_bytes: list[bytes]
    chat_template: str | None
    byte_level: bool = True
    add_bos_token: bool = False
    add_eos_token: bool = False
    end_ids: frozenset[int] = frozenset()
    lstrip_ids: frozenset[int] = frozenset()
    rstrip_ids: frozenset[int] = frozenset()
    special_ids: frozenset[int] = field(init=False)
    stop_token_ids: frozenset[int] = field(init=False)
    max_token_bytes: int = field(init=False)

    def __repr__(self) -> str:
        return f"TextTokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_id}, specials={len(self.special_ids)})"

    def __post_init__(self) -> None:
        self.special_ids = frozenset(self.special_tokens)
        specials = self.special_ids
        self.max_token_bytes = max(
            (len(b) for i, b in enumerate(self.id_to_bytes) if i not in specials), default=1
        )
        stops = {i for i in (self.eos_token_id,) if i is not None} | set(self.end_ids)
        for name in _END_OF_TURN:
            i = self.token_to_id(name)
            if i is not None and i in self.special_ids:
                stops.add(i)
        self.stop_token_ids = frozenset(stops)

    # -- lookups ---------------------------------------------------------------------------------
    def token_to_id(self, token: str) -> int | None:
        """Id of an exact token string (special or not), or None."""
        return self.plain.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Raw vocabulary string of an id (byte-level form, e.g. ``"Ġhello"``), or None."""
        return self.plain.id_to_token(token_id)

    @property
    def im_start_id(self) -> int | None:
        """Id of ``<|im_start|>`` (ChatML), or None."""
        return self.token_to_id("<|im_start|>")

    @property
    def im_end_id(self) -> int | None:
        """Id of ``<|im_end|>`` (ChatML), or None."""
        return self.token_to_id("<|im_end|>")

    # -- encode / decode -------------------------------------------------------------------------
    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` with NO special-token parsing and no BOS/EOS added.

        A user typing ``"<|im_end|>"`` gets the ordinary tokens ``<``, ``|``, ``im``, ``_``, ``end``...
        (HF ``encode_special_tokens=True``; matches ``smollm2_tokenizer.json``).
        """
        if not text:
            return []
        return _encode(self.plain, text)

    def encode_with_specials(self, text: str) -> list[int]:
        """Token ids of trusted text (e.g. a rendered template) in which special-token strings ARE parsed.

        Never call this on client text: use ``encode_plain`` or ``ChatTemplate.render``.
        """
        if not text:
            return []
        return _encode(self.tokenizer, text)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a raw prompt as the model was trained to see one: BOS first when ``add_bos_token``,
        ``encode_plain(text)``, EOS last when ``add_eos_token`` (llama.cpp ``common_tokenize`` with
        ``add_special=true, parse_special=false``). A chat prompt: use ``ChatTemplate.render``, which adds BOS
        only when the template does not write one."""
        ids = self.encode_plain(text)
        if self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        if self.add_eos_token and self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD (one per maximal invalid subpart).

        Raises:
            OverflowError/TypeError: an id that is negative or not an int (from ``tokenizers``).
        """
        return self.plain.decode(list(ids), skip_special_tokens=skip_special_tokens)


# ---------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------


def load_tokenizer(path: str | os.PathLike[str]) -> TextTokenizer:
    """Load from a GGUF file or a Hugging Face model directory (one holding ``tokenizer.json``).

    Raises:
        TokenizerFileMissing: no such file, or a directory without ``tokenizer.json`` (also
            ``FileNotFoundError``; the message says what to pass).
        UnsupportedTokenizer: a GGUF tokenizer kind that is not built (also ``ValueError``; names the key
            and its value).
        TokenizerError: a GGUF vocabulary ``tokenizers`` rejects, or one without tokens/merges.
        ValueError: a file that is not GGUF.
    """
    p = Path(path)
    if p.is_dir():
        return _from_hf_dir(p)
    if not p.exists():
        raise TokenizerFileMissing(str(p), _WHAT_TO_PASS)
    return _from_gguf(p)


_WHAT_TO_PASS = "pass a GGUF file, or a Hugging Face model directory that holds tokenizer.json"


def _finish(
    tok: Tokenizer,
    plain: Tokenizer,
    special: dict[int, str],
    *,
    bos,
    eos,
    unk,
    pad,
    chat_template,
    byte_level: bool,
    add_bos: bool,
    add_eos: bool,
    end_ids: frozenset[int] = frozenset(),
    lstrip_ids: frozenset[int] = frozenset(),
    rstrip_ids: frozenset[int] = frozenset(),
) -> TextTokenizer:
    plain.encode_special_tokens = True
    n = tok.get_vocab_size(with_added_tokens=True)
    conv = _byte_level_token_bytes if byte_level else _sentencepiece_token_bytes
    strings: list[str | None] = [None] * n
    for s, i in tok.get_vocab(with_added_tokens=True).items():  # one call, not n id_to_token calls
        if 0 <= i < n:
            strings[i] = s
    table = [conv(s) if s is not None else b"" for s in strings]
    for i in special:  # a special token stands for its own text
        s = strings[i] if 0 <= i < n else None
        if s is not None:
            table[i] = _byte_level_token_bytes(s) if byte_level else s.encode("utf-8")
    return TextTokenizer(
        tokenizer=tok,
        plain=plain,
        vocab_size=n,
        bos_token_id=bos,
        eos_token_id=eos,
        unk_token_id=unk,
        pad_token_id=pad,
        bos_token=(tok.id_to_token(bos) or "") if bos is not None else "",
        eos_token=(tok.id_to_token(eos) or "") if eos is not None else "",
        special_tokens=special,
        id_to_bytes=table,
        chat_template=chat_template,
        byte_level=byte_level,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        end_ids=end_ids,
        lstrip_ids=lstrip_ids,
        rstrip_ids=rstrip_ids,
    )


def _from_gguf(path: Path) -> TextTokenizer:
    vocab = GGUFVocab.from_metadata(read_gguf_metadata(path))
    tok, special = build_tokenizer(vocab)
    return _finish(
        tok,
        build_tokenizer(vocab)[0],
        special,
        bos=vocab.bos_id,
        eos=vocab.eos_id,
        unk=vocab.unk_id,
        pad=vocab.pad_id,
        chat_template=vocab.chat_template,
        byte_level=vocab.byte_level,
        add_bos=vocab.add_bos,
        add_eos=vocab.add_eos,
        end_ids=frozenset(i for i in (vocab.eot_id, vocab.eom_id) if i is not None),
        rstrip_ids=vocab.rstrip_ids,
    )


def _token_str(v) -> str | None:
    if v is None:
        return None
    if isinstance(v, dict):
        return v.get("content")
    return str(v)


def _from_hf_dir(d: Path) -> TextTokenizer:
    tj = d / "tokenizer.json"
    if not tj.exists():
        if (d / "tokenizer.model").exists():
            hint = (
                "the directory has only a SentencePiece tokenizer.model, which is not read; pass the model's GGUF "
                "file, or add the tokenizer.json its repository publishes"
            )
        else:
            hint = _WHAT_TO_PASS
        raise TokenizerFileMissing(str(tj), hint)
    tok, plain = Tokenizer.from_file(str(tj)), Tokenizer.from_file(str(tj))
    cfg: dict = {}
    if (d / "tokenizer_config.json").exists():
        cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    raw = json.loads(tj.read_text(encoding="utf-8"))
    added = raw.get("added_tokens", [])
    special = {int(a["id"]): a["content"] for a in added if a.get("special")}

    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if (d / "chat_template.jinja").exists():
        template = (d / "chat_template.jinja").read_text(encoding="utf-8")

    def _id(name: str) -> int | None:
        s = _token_str(cfg.get(name))
        return tok.token_to_id(s) if s else None

    dec = raw.get("decoder") or {}
    byte_level = dec.get("type") == "ByteLevel"
    bos, eos = _id("bos_token"), _id("eos_token")
    # add_bos_token / add_eos_token: the config's flags, else what tokenizer.json's post-processor adds.
    probe = tok.encode("a", add_special_tokens=True).ids
    bare = tok.encode("a", add_special_tokens=False).ids
    add_bos = cfg.get("add_bos_token", bos is not None and probe[:1] == [bos] and bare[:1] != [bos])
    add_eos = cfg.get("add_eos_token", eos is not None and probe[-1:] == [eos] and bare[-1:] != [eos])
    return _finish(
        tok,
        plain,
        special,
        bos=bos,
        eos=eos,
        unk=_id("unk_token"),
        pad=_id("pad_token"),
        chat_template=template,
        byte_level=byte_level,
        add_bos=bool(add_bos),
        add_eos=bool(add_eos),
        lstrip_ids=frozenset(int(a["id"]) for a in added if a.get("lstrip")),
        rstrip_ids=frozenset(int(a["id"]) for a in added if a.get("rstrip")),
    )


@lru_cache(maxsize=4)
def cached_tokenizer(path: str) -> TextTokenizer:
    """``load_tokenizer`` memoized per path (the tokenizer is immutable; share it between requests)."""
    return load_tokenizer(path)
