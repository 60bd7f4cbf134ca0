"""A GGUF file's tokenizer metadata, and the Hugging Face ``tokenizers`` pipeline each vocabulary kind needs.

Sources followed:

* the GGUF spec (ggml ``docs/gguf.md``) for the header (:func:`read_gguf_metadata`);
* llama.cpp ``src/llama-vocab.cpp`` (the copy vendored in the llama-cpp-python 0.3.36 sdist) for what the
  keys mean: the pre-tokenizer regexes of each ``tokenizer.ggml.pre`` (``llm_tokenizer_bpe``), which pre
  types set ``ignore_merges`` and add BOS by default, the SentencePiece defaults (``add_space_prefix``,
  add BOS), token attributes, and that user-defined tokens are matched in the text before anything else
  even when special tokens are not parsed (``tokenizer_st_partition``);
* llama.cpp ``src/unicode.cpp`` (``unicode_regex_split``): each regex splits every piece the previous one
  left, keeping both the matches and the text between them -- ``tokenizers``' ``Split(behavior="isolated")``
  in a ``Sequence``;
* transformers' ``SentencePieceExtractor`` (``convert_slow_tokenizer.py``) for the merges of a SentencePiece
  BPE vocabulary, which GGUF stores as scores only.

Pipelines, by ``tokenizer.ggml.model``::

    "gpt2"    byte-level BPE   Split(regex) per regex of the pre type -> ByteLevel(use_regex=False);
                               BPE(merges, ignore_merges per pre type); ByteLevel decoder.
                               "smollm" keeps HF's own SmolLM2 pipeline: Digits(individual) -> ByteLevel.
    "llama"   SentencePiece    Prepend("▁") when add_space_prefix (default true) -> Replace(" ", "▁");
                               BPE(merges from scores, byte_fallback <0xNN>, unk); llama.cpp
                               ``llm_tokenizer_spm`` merges the highest-scoring pair first: the same order.
    "gemma4"  SentencePiece-   Replace(" ", "▁") -> Split("[^\\n]+|[\\n]+"); BPE(merges, byte_fallback).
              style BPE

Token types: CONTROL and UNKNOWN become special added tokens (parsed only in trusted text), USER_DEFINED
non-special added tokens (always matched), as llama.cpp does. Every pipeline is checked against llama.cpp's
expected ids for the vocab GGUFs in the sdist (``tests/unit/templating/test_vocab_families.py``).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from templating.errors import TokenizerError, UnsupportedTokenizer

__all__ = ["GGUFVocab", "PreTokenizer", "PRE_TOKENIZERS", "MODELS", "build_tokenizer", "read_gguf_metadata"]

# GGUF token types (gguf.TokenType / llama.cpp llama_token_type).
TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = 1, 2, 3, 4, 5, 6

SPACE = "\u2581"  # "▁", SentencePiece's visible space

# ------------------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, as written in llama-vocab.cpp (Oniguruma, which tokenizers uses, reads them as is)
# ------------------------------------------------------------------------------------------------------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# DeepSeek LLM's letter class: Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee... (no \p{..} in it).
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
    "\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b"
    "\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before byte-level BPE, for one ``tokenizer.ggml.pre`` type.

    Attributes:
        regexes: applied in order, each to every piece the previous left (matches and gaps both kept).
        ignore_merges: a piece that is itself a vocabulary entry is one token, unmerged (llama.cpp
            ``ignore_merges``; ``tokenizers`` ``BPE(ignore_merges=True)``).
        add_bos: llama.cpp's default for ``tokenizer.ggml.add_bos_token`` (the key wins when present).
    """

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_GPT2_PRE = PreTokenizer((_GPT2,))
_STARCODER_PRE = PreTokenizer((r"\p{N}", _GPT2))
_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = PreTokenizer((_QWEN2,))

#: ``tokenizer.ggml.pre`` value -> pipeline. The first name of each group is checked against llama.cpp's
#: reference ids; the others are the names llama.cpp maps to the same regexes and flags.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(
        ("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        _LLAMA3_PRE,
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "solar-open", "kormo"), _QWEN2_PRE
    ),
    "qwen35": PreTokenizer((_QWEN35,)),
    "deepseek-llm": PreTokenizer(
        (
            "[\r\n]",
            "\\s?[" + _DEEPSEEK_LETTERS + "]+",
            "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
            r"\s+\z",  # llama.cpp's "\s+$": std::regex "$" is the end of the piece, Oniguruma's "\z"
            _CJK,
            r"\p{N}+",
        )
    ),
    "deepseek-coder": PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"), _STARCODER_PRE
    ),
    **dict.fromkeys(
        (
            "gpt-2",
            "gpt2",
            "mpt",
            "phi-2",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
            "gigachat",
            "a.x-4.0",
            "mellum",
        ),
        _GPT2_PRE,
    ),
    # llama.cpp's fallback when the key is absent (it warns that quality degrades); no reference ids.
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
}
_SMOLLM = "smollm"  # built as HF's SmolLM2 tokenizer.json does (same splits as the starcoder regexes)

#: ``tokenizer.ggml.model`` values that are built.
MODELS = ("gpt2", "llama", "gemma4")
_CHECKED_PRE = (
    "llama-bpe",
    "qwen2",
    "qwen35",
    "deepseek-llm",
    "deepseek-coder",
    "falcon",
    "starcoder",
    "refact",
    "command-r",
    "smollm",
    "gpt-2",
    "mpt",
)


# ------------------------------------------------------------------------------------------------------
# GGUF metadata
# ------------------------------------------------------------------------------------------------------

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


def read_gguf_metadata(path: Path) -> dict[str, object]:
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
                if et == 8:  # string arrays (vocabularies, merges): the hot loop, kept inline
                    out: list[str] = []
                    append, size = out.append, len(buf)
                    for _ in range(n):
                        if pos + 8 > size:
                            need(pos + 8)
                            size = len(buf)
                        end = pos + 8 + int.from_bytes(buf[pos : pos + 8], "little")
                        if end > size:
                            need(end)
                            size = len(buf)
                        append(buf[pos + 8 : end].decode("utf-8", errors="replace"))
                        pos = end
                    return out
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


def _merge_pair(merge: str) -> tuple[str, str]:
    """``"left right"`` -> ``("left", "right")``; llama.cpp cuts at the first space after the first character
    (a left part may itself be a space)."""
    cut = merge.find(" ", 1)
    return (merge[:cut], merge[cut + 1 :]) if cut > 0 else (merge, "")


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer keys of a GGUF file, with llama.cpp's defaults filled in (``llama_vocab::impl::load``).

    Attributes:
        model: ``tokenizer.ggml.model`` (one of :data:`MODELS`).
        pre: ``tokenizer.ggml.pre`` ("default" when absent; "gemma4" for that model); unused for "llama".
        tokens: token strings by id (an empty one is named ``[EMPTY_<id>]``, as llama.cpp does).
        token_types: GGUF token type per id (NORMAL 1 when the key is absent).
        scores: SentencePiece scores per id (float; 0.0 when absent).
        merges: BPE merges as (left, right) pairs, highest priority first ("gpt2", "gemma4").
        bos_id / eos_id / unk_id / pad_id / eot_id / eom_id: ids or None.
        add_bos / add_eos: whether a raw prompt starts with BOS / ends with EOS.
        add_space_prefix: SentencePiece prepends a space to each text piece ("llama" only).
        rstrip_ids: ids whose added token eats the whitespace after it (llama.cpp's Phi-3 rule).
        chat_template: ``tokenizer.chat_template`` or None.
    """

    model: str
    pre: str
    tokens: list[str]
    token_types: list[int]
    scores: list[float]
    merges: list[tuple[str, str]]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    eot_id: int | None
    eom_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    rstrip_ids: frozenset[int]
    chat_template: str | None

    @functools.cached_property
    def bpe_merges(self) -> list[tuple[str, str]]:
        """The merges the BPE model runs: the file's, or for "llama" those derived from the scores (computed
        once per vocabulary)."""
        return _sentencepiece_merges(self.tokens, self.scores) if self.model == "llama" else self.merges

    @property
    def byte_level(self) -> bool:
        """Tokens are GPT-2 byte-mapped strings ("gpt2"), not UTF-8 with ``▁`` and ``<0xNN>``."""
        return self.model == "gpt2"

    @classmethod
    def from_metadata(cls, meta: dict[str, object]) -> GGUFVocab:
        """Read the tokenizer keys.

        Raises:
            UnsupportedTokenizer: ``tokenizer.ggml.model`` or ``tokenizer.ggml.pre`` is a kind not built here.
            TokenizerError: the vocabulary or merges are missing.
        """
        model = meta.get("tokenizer.ggml.model")
        if model not in MODELS:
            raise UnsupportedTokenizer("tokenizer.ggml.model", model, MODELS)
        pre = str(meta.get("tokenizer.ggml.pre") or "default")
        if model == "gemma4":
            pre = "gemma4"
        elif model == "gpt2" and pre != _SMOLLM and pre not in PRE_TOKENIZERS:
            raise UnsupportedTokenizer("tokenizer.ggml.pre", pre, _CHECKED_PRE)
        raw_tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(raw_tokens, list) or not raw_tokens:
            raise TokenizerError("GGUF file has no tokenizer.ggml.tokens (no vocabulary)")
        tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(raw_tokens)]
        n = len(tokens)
        types = list(meta.get("tokenizer.ggml.token_type") or [TT_NORMAL] * n)
        scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * n)
        merges: list[tuple[str, str]] = []
        if model != "llama":
            raw_merges = meta.get("tokenizer.ggml.merges")
            if not raw_merges:
                raise TokenizerError(
                    f"GGUF file has no tokenizer.ggml.merges (needed by tokenizer model {model!r})"
                )
            merges = [_merge_pair(m) for m in raw_merges]

        def tid(key: str) -> int | None:
            v = meta.get(f"tokenizer.ggml.{key}_token_id")
            return int(v) if v is not None and 0 <= int(v) < n else None

        # llama.cpp's defaults: BOS for SentencePiece and Gemma 4, per pre type for byte-level BPE; no EOS.
        add_bos = model != "gpt2" or (pre != _SMOLLM and PRE_TOKENIZERS[pre].add_bos)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        if model == "gemma4":
            add_bos = True  # llama.cpp overrides it for Gemma 4
        space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", model == "llama"))

        rstrip: frozenset[int] = frozenset()
        name = str(meta.get("general.name") or "").lower()
        if "phi-3" in name or "phi3" in name:  # llama.cpp: every special token of Phi-3 strips on its right
            keep = {"<unk>", "<s>", "<|endoftext|>"}
            rstrip = frozenset(
                i
                for i, (t, ty) in enumerate(zip(tokens, types))
                if (ty in (TT_CONTROL, TT_USER_DEFINED, TT_UNKNOWN) or t == "</s>") and t not in keep
            )
        template = meta.get("tokenizer.chat_template")
        return cls(
            model=str(model),
            pre=pre,
            tokens=tokens,
            token_types=types,
            scores=scores,
            merges=merges,
            bos_id=tid("bos"),
            eos_id=tid("eos"),
            unk_id=tid("unknown"),
            pad_id=tid("padding"),
            eot_id=tid("eot"),
            eom_id=tid("eom"),
            add_bos=add_bos,
            add_eos=add_eos,
            add_space_prefix=space_prefix,
            rstrip_ids=rstrip,
            chat_template=template if isinstance(template, str) else None,
        )


# ------------------------------------------------------------------------------------------------------
# Pipelines
# ------------------------------------------------------------------------------------------------------


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece vocabulary: every split of every piece into two pieces, the pieces of
    higher score first, a piece's own splits in (left id, right id) order (transformers'
    ``SentencePieceExtractor.extract`` with scores). BPE on these merges picks, at each step, the pair whose
    concatenation scores highest: llama.cpp's ``llm_tokenizer_spm``."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, int]] = []
    for piece, i in vocab.items():
        for k in range(1, len(piece)):
            left, right = vocab.get(piece[:k]), vocab.get(piece[k:])
            if left is not None and right is not None:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    return [(tokens[a], tokens[b]) for _, _, a, b in ranked]


def _sentencepiece_decoder() -> decoders.Decoder:
    """``▁`` -> space, ``<0xNN>`` pieces -> their bytes (HF's Llama 2 decoder, without its leading-space strip:
    the text is what the ids stand for, as llama.cpp's ``token_to_piece``)."""
    return decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])


def _bpe_pipeline(v: GGUFVocab) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(v.tokens)}
    unk = v.tokens[v.unk_id] if v.unk_id is not None else None
    if v.model == "llama":
        tok = Tokenizer(
            models.BPE(vocab=vocab, merges=v.bpe_merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
        )
        steps = [normalizers.Prepend(SPACE)] if v.add_space_prefix else []
        tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
        tok.decoder = _sentencepiece_decoder()
        return tok
    if v.model == "gemma4":
        tok = Tokenizer(models.BPE(vocab=vocab, merges=v.merges, unk_token=unk, byte_fallback=True))
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
        tok.decoder = _sentencepiece_decoder()
        return tok
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=False, trim_offsets=True, use_regex=v.pre == _SMOLLM
    )
    if v.pre == _SMOLLM:  # HuggingFaceTB/SmolLM2-*/tokenizer.json
        tok = Tokenizer(models.BPE(vocab=vocab, merges=v.merges, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        pre = PRE_TOKENIZERS[v.pre]
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=v.merges,
                fuse_unk=False,
                byte_fallback=False,
                ignore_merges=pre.ignore_merges,
            )
        )
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    tok.normalizer = None
    tok.decoder = decoders.ByteLevel()
    return tok


def build_tokenizer(v: GGUFVocab) -> tuple[Tokenizer, dict[int, str]]:
    """The ``tokenizers.Tokenizer`` for a GGUF vocabulary, and its special tokens (id -> string).

    CONTROL and UNKNOWN tokens are special added tokens, USER_DEFINED ones non-special added tokens (both
    keep their ids; ``normalized=False``: matched in the raw text).

    Raises:
        TokenizerError: ``tokenizers`` rejects the vocabulary (e.g. a merge of tokens it does not hold).
    """
    try:
        tok = _bpe_pipeline(v)
    except Exception as exc:  # tokenizers raises plain Exception for a bad vocabulary or merges
        raise TokenizerError(f"the GGUF vocabulary cannot be built: {' '.join(str(exc).split())}") from None
    special: dict[int, str] = {}
    added: list[AddedToken] = []
    for i, (t, ty) in enumerate(zip(v.tokens, v.token_types)):
        if ty in (TT_CONTROL, TT_UNKNOWN, TT_USER_DEFINED):
            is_special = ty != TT_USER_DEFINED
            if is_special:
                special[i] = t
            added.append(
                AddedToken(t, special=is_special, normalized=False, lstrip=False, rstrip=i in v.rstrip_ids)
            )
    if added:
        tok.add_tokens(added)  # ids already exist in the vocab: add_tokens reuses them
    return tok, special
