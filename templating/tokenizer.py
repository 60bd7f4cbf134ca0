"""The model's tokenizer: text <-> token ids, built on Hugging Face ``tokenizers``.

Two sources are supported:

* a GGUF file (``tokenizer.ggml.model == "gpt2"``: byte-level BPE; metadata read by a header-only parser
  that follows the GGUF spec, ~10x faster than ``gguf.GGUFReader``), from its vocabulary
  (``tokenizer.ggml.tokens``/``merges``/``token_type``) and the pre-tokenizer named by
  ``tokenizer.ggml.pre``. For ``"smollm"`` (SmolLM/SmolLM2, StarCoder2 lineage) the pipeline is the one in
  HF's ``HuggingFaceTB/SmolLM2-*/tokenizer.json``: no normalizer; pre-tokenizer
  ``Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)]``;
  BPE model without byte fallback; ``ByteLevel`` decoder. Tokens of type CONTROL (3) become special added
  tokens, USER_DEFINED (4) non-special added tokens (llama.cpp ``llama-vocab.cpp`` semantics).
* a Hugging Face model directory (``tokenizer.json`` + optional ``tokenizer_config.json`` /
  ``chat_template.jinja``), loaded as is.

Checked against ``tests/fixtures/smollm2_tokenizer.json`` (transformers 5.23 and llama.cpp agree).

Token ids are Python ``int``; all ids lie in ``[0, vocab_size)``.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

__all__ = ["TextTokenizer", "load_tokenizer", "cached_tokenizer", "bytes_to_unicode"]

# GGUF token types (gguf.TokenType / llama.cpp llama_token_type).
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes of llama.cpp's ``llama_vocab`` pre types that are byte-level BPE, keyed by
# ``tokenizer.ggml.pre``. Only "smollm" is verified by fixtures; the GPT-2 one is the HF ByteLevel default.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


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
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def _byte_level_token_bytes(token: str) -> bytes:
    """Bytes of one token string under the ByteLevel decoder.

    Same rule as ``tokenizers`` (``decoders/byte_level.rs``): if every character is in the byte map the
    token is those bytes, otherwise (e.g. an added token such as ``"a b"``) its raw UTF-8.
    """
    table = _unicode_to_bytes()
    try:
        return bytes(table[c] for c in token)
    except KeyError:
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
        tokenizer: the full ``tokenizers.Tokenizer`` (special added tokens are parsed in text).
        plain: a copy with ``encode_special_tokens=True``: special-token strings in text are ordinary text.
        vocab_size: number of ids, added tokens included (49,152 for SmolLM2).
        bos_token_id / eos_token_id / unk_token_id / pad_token_id: ids or None.
        bos_token / eos_token: their strings ("" when unknown), passed to chat templates.
        special_ids: ids of special (control) tokens; skipped by ``decode(skip_special_tokens=True)``.
        special_tokens: id -> string for the special tokens.
        id_to_bytes: ``id_to_bytes[i]`` is the UTF-8 byte string token ``i`` stands for (specials: their text).
        chat_template: the model's Jinja chat template source, or None.
        stop_token_ids: ids that end generation (eos plus ``<|im_end|>``/``<|endoftext|>`` when present).
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
    special_ids: frozenset[int] = field(init=False)
    stop_token_ids: frozenset[int] = field(init=False)

    def __repr__(self) -> str:
        return f"TextTokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_id}, specials={len(self.special_ids)})"

    def __post_init__(self) -> None:
        self.special_ids = frozenset(self.special_tokens)
        stops = {i for i in (self.eos_token_id,) if i is not None}
        for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"):
            i = self.token_to_id(name)
            if i is not None and i in self.special_ids:
                stops.add(i)
        self.stop_token_ids = frozenset(stops)

    # -- lookups ---------------------------------------------------------------------------------
    def token_to_id(self, token: str) -> int | None:
        """Id of an exact token string (special or not), or None."""
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Raw vocabulary string of an id (byte-level form, e.g. ``"Ġhello"``), or None."""
        return self.tokenizer.id_to_token(token_id)

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

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD (one per maximal invalid subpart).

        Raises:
            OverflowError/TypeError: an id that is negative or not an int (from ``tokenizers``).
        """
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


# ---------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------


def load_tokenizer(path: str | os.PathLike[str]) -> TextTokenizer:
    """Load from a GGUF file or a Hugging Face model directory (one holding ``tokenizer.json``).

    Raises:
        FileNotFoundError: no such file, or a directory without ``tokenizer.json``.
        ValueError: an unsupported GGUF tokenizer model/pre-tokenizer.
    """
    p = Path(path)
    if p.is_dir():
        return _from_hf_dir(p)
    if not p.exists():
        raise FileNotFoundError(str(p))
    return _from_gguf(p)


def _finish(
    tok: Tokenizer, special: dict[int, str], *, bos, eos, unk, pad, chat_template, byte_level: bool
) -> TextTokenizer:
    plain = Tokenizer.from_str(tok.to_str())
    plain.encode_special_tokens = True
    n = tok.get_vocab_size(with_added_tokens=True)
    conv = _byte_level_token_bytes if byte_level else _sentencepiece_token_bytes
    table: list[bytes] = []
    for i in range(n):
        s = tok.id_to_token(i)
        if s is None:
            table.append(b"")
        elif i in special:
            table.append(_byte_level_token_bytes(s) if byte_level else s.encode("utf-8"))
        else:
            table.append(conv(s))
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
    )


_GGUF_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}


def _read_gguf_metadata(path: Path) -> dict[str, object]:
    """All key/value metadata of a little-endian GGUF v2/v3 file (tensor data is not read).

    Follows the GGUF spec (ggml ``docs/gguf.md``). ``gguf.GGUFReader`` gives the same values but builds a
    numpy view per string (seconds for a 49k vocabulary); this reads only the header.

    Raises:
        ValueError: not a GGUF file, big-endian, or an unknown value type.
    """
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version, _n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version} (or big-endian)")
        # Metadata is at the start of the file; read generously and grow if needed.
        buf = bytearray(head)
        chunk = 8 << 20

        def need(end: int) -> None:
            while len(buf) < end:
                more = f.read(max(chunk, end - len(buf)))
                if not more:
                    raise ValueError(f"{path}: truncated GGUF metadata")
                buf.extend(more)

        pos = 24

        def read_str() -> str:
            nonlocal pos
            need(pos + 8)
            (n,) = struct.unpack_from("<Q", buf, pos)
            need(pos + 8 + n)
            out = bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace")
            pos += 8 + n
            return out

        def read_val(t: int):
            nonlocal pos
            if t == 8:
                return read_str()
            if t == 9:
                need(pos + 12)
                et, n = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                if et == 8:
                    return [read_str() for _ in range(n)]
                if et in _GGUF_SCALARS:
                    fmt = _GGUF_SCALARS[et]
                    size = struct.calcsize(fmt)
                    need(pos + size * n)
                    vals = list(struct.unpack_from("<" + fmt[1] * n, buf, pos))
                    pos += size * n
                    return vals
                return [read_val(et) for _ in range(n)]
            fmt = _GGUF_SCALARS.get(t)
            if fmt is None:
                raise ValueError(f"{path}: unknown GGUF value type {t}")
            size = struct.calcsize(fmt)
            need(pos + size)
            (v,) = struct.unpack_from(fmt, buf, pos)
            pos += size
            return v

        meta: dict[str, object] = {}
        for _ in range(n_kv):
            key = read_str()
            need(pos + 4)
            (t,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            meta[key] = read_val(t)
        return meta


def _from_gguf(path: Path) -> TextTokenizer:
    meta = _read_gguf_metadata(path)
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {model!r} (only byte-level BPE 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre") or "default"
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    merges_raw: list[str] = meta.get("tokenizer.ggml.merges") or []
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [_TT_NORMAL] * len(tokens)

    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = None
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("default", "gpt2", "gpt-2"):
        tok.pre_tokenizer = byte_level
    else:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: 'smollm', 'gpt2')")
    tok.decoder = decoders.ByteLevel()

    special: dict[int, str] = {}
    added: list[AddedToken] = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == _TT_CONTROL:
            special[i] = t
            added.append(
                AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)
            )
        elif ty == _TT_USER_DEFINED:
            added.append(
                AddedToken(t, special=False, normalized=False, lstrip=False, rstrip=False, single_word=False)
            )
    if added:
        tok.add_tokens(added)  # ids already exist in the vocab: add_tokens reuses them

    def _id(key: str) -> int | None:
        v = meta.get(key)
        return int(v) if v is not None else None

    return _finish(
        tok,
        special,
        bos=_id("tokenizer.ggml.bos_token_id"),
        eos=_id("tokenizer.ggml.eos_token_id"),
        unk=_id("tokenizer.ggml.unknown_token_id"),
        pad=_id("tokenizer.ggml.padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        byte_level=True,
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
        raise FileNotFoundError(f"{tj} not found")
    tok = Tokenizer.from_file(str(tj))
    cfg: dict = {}
    if (d / "tokenizer_config.json").exists():
        cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    raw = json.loads(tj.read_text(encoding="utf-8"))
    special = {int(a["id"]): a["content"] for a in raw.get("added_tokens", []) if a.get("special")}

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
    return _finish(
        tok,
        special,
        bos=_id("bos_token"),
        eos=_id("eos_token"),
        unk=_id("unk_token"),
        pad=_id("pad_token"),
        chat_template=template,
        byte_level=byte_level,
    )


@lru_cache(maxsize=4)
def cached_tokenizer(path: str) -> TextTokenizer:
    """``load_tokenizer`` memoized per path (the tokenizer is immutable; share it between requests)."""
    return load_tokenizer(path)
