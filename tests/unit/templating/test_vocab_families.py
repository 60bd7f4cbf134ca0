"""Tokenizers built from GGUF metadata give llama.cpp's own token ids, family by family.

Reference data: the ``vendor/llama.cpp/models`` folder of the llama-cpp-python 0.3.36 sdist (fixture
``llama_cpp_models_dir``, tests/plugins/llama_cpp_sdist.py): ``ggml-vocab-<family>.gguf`` with
``.gguf.inp`` (cases separated by ``"\\n__ggml_vocab_test__\\n"``) and ``.gguf.out`` (one line of
space-separated ids per case). llama.cpp's ``tests/test-tokenizer-0.cpp`` encodes each case with
``common_tokenize(ctx, text, add_special=false, parse_special=false)``: no BOS/EOS and control tokens read as
text, which is ``TextTokenizer.encode_plain``.

Every vocab file in the folder is in exactly one of three tables below: checked against the expected ids,
loaded without reference ids, or unsupported with the reason (and then it must fail to load with the one-line
``UnsupportedTokenizer`` naming the key and its value).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from templating import load_tokenizer
from templating.errors import TokenizerFileMissing, UnsupportedTokenizer
from templating.gguf_vocab import GGUFVocab, read_gguf_metadata
from templating.tokenizer import TextTokenizer

#: family -> what it is; each has .inp/.out files whose ids must come out exactly.
CHECKED = {
    "llama-bpe": "Llama 3 (byte-level BPE, llama3 regex, ignore_merges)",
    "qwen2": "Qwen2 / Qwen2.5",
    "qwen35": "Qwen3.5 (qwen2 regex with \\p{M})",
    "deepseek-llm": "DeepSeek LLM",
    "deepseek-coder": "DeepSeek Coder",
    "falcon": "Falcon",
    "starcoder": "StarCoder2",
    "refact": "Refact",
    "mpt": "MPT (GPT-NeoX vocabulary)",
    "command-r": "Command-R",
    "gpt-2": "GPT-2",
    "llama-spm": "Llama 2 / Mistral / TinyLlama (SentencePiece, byte fallback)",
    "phi-3": "Phi-3 (SentencePiece, byte fallback)",
    "gemma-4": "Gemma 4 (SentencePiece-style BPE with merges)",
}
#: family -> kind; no .inp/.out in the sdist, so only loading and a round trip are checked.
LOADED_ONLY = {
    "aquila": "gpt2 without tokenizer.ggml.pre (llama.cpp's 'default' regexes)",
    "gpt-neox": "gpt2 without tokenizer.ggml.pre (llama.cpp's 'default' regexes)",
    "baichuan": "llama (SentencePiece)",
}
#: family -> (key, value, reason it is left out).
UNSUPPORTED = {
    "bert-bge": ("tokenizer.ggml.model", "bert", "WordPiece: a BERT embedding model, not a chat model"),
    "nomic-bert-moe": ("tokenizer.ggml.model", "t5", "Unigram (T5): an embedding model, not a chat model"),
}

#: SentencePiece vocabularies whose pieces get a leading space (``add_space_prefix``, llama.cpp's default).
SPACE_PREFIXED = {"llama-spm", "phi-3"}

SEP = "\n__ggml_vocab_test__\n"


@functools.cache
def _load(models: Path, family: str) -> TextTokenizer:
    return load_tokenizer(models / f"ggml-vocab-{family}.gguf")


def read_cases(models: Path, family: str) -> list[tuple[str, list[int]]]:
    """(text, expected ids) pairs, read as ``test-tokenizer-0.cpp``'s ``read_tests`` does."""
    raw = (models / f"ggml-vocab-{family}.gguf.inp").read_text(encoding="utf-8")
    texts = raw.split(SEP)
    if texts and texts[-1] == "":  # the file ends with a separator
        texts.pop()
    lines = (models / f"ggml-vocab-{family}.gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(lines) >= len(texts), family
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


def test_tables_cover_the_folder(llama_cpp_models_dir):
    """Each vocab GGUF of the sdist is checked, loaded, or listed as unsupported; the checked ones have ids."""
    found = {
        p.name.removeprefix("ggml-vocab-").removesuffix(".gguf") for p in llama_cpp_models_dir.glob("*.gguf")
    }
    tables = [set(CHECKED), set(LOADED_ONLY), set(UNSUPPORTED)]
    assert found == set().union(*tables), found ^ set().union(*tables)
    assert sum(len(t) for t in tables) == len(found)
    for family in CHECKED:
        assert (llama_cpp_models_dir / f"ggml-vocab-{family}.gguf.out").exists(), family
    for family in LOADED_ONLY:
        assert not (llama_cpp_models_dir / f"ggml-vocab-{family}.gguf.out").exists(), family


@pytest.mark.parametrize("family", sorted(CHECKED))
def test_ids_match_llama_cpp(llama_cpp_models_dir, family):
    tok = _load(llama_cpp_models_dir, family)
    cases = read_cases(llama_cpp_models_dir, family)
    assert len(cases) >= 40
    wrong = [(text, ids, got) for text, ids in cases if (got := tok.encode_plain(text)) != ids]
    assert not wrong, f"{family}: {len(wrong)}/{len(cases)} cases differ, first: {wrong[0]!r}"


@pytest.mark.parametrize("family", sorted(CHECKED))
def test_reference_ids_detokenize_to_the_text(llama_cpp_models_dir, family):
    """The bytes table the streaming detokenizer reads gives back each case from llama.cpp's ids (SentencePiece
    vocabularies with the space they prepend), and ``decode`` gives the same text."""
    tok = _load(llama_cpp_models_dir, family)
    prefix = " " if family in SPACE_PREFIXED else ""
    for text, ids in read_cases(llama_cpp_models_dir, family):
        joined = b"".join(tok.id_to_bytes[i] for i in ids).decode("utf-8", "replace")
        assert joined == (prefix + text if text else ""), (family, text)
        assert tok.decode(ids, skip_special_tokens=False) == joined, (family, text)


@pytest.mark.parametrize("family", sorted(LOADED_ONLY))
def test_families_without_reference_ids_load_and_round_trip(llama_cpp_models_dir, family):
    tok = _load(llama_cpp_models_dir, family)
    text = "Hello world, 12345 apples!\n\tNew line. Привет 你好"
    ids = tok.encode_plain(text)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids).strip() == text


@pytest.mark.parametrize("family", sorted(UNSUPPORTED))
def test_unsupported_families_fail_with_one_line(llama_cpp_models_dir, family):
    key, value, _reason = UNSUPPORTED[family]
    with pytest.raises(UnsupportedTokenizer) as err:
        load_tokenizer(llama_cpp_models_dir / f"ggml-vocab-{family}.gguf")
    assert (err.value.key, err.value.value) == (key, value)
    message = str(err.value)
    assert "\n" not in message and f"{key} = {value!r}" in message and "gpt2" in message
    assert isinstance(err.value, ValueError)


def test_unsupported_pre_tokenizer_names_the_key(tmp_path):
    """A byte-level BPE GGUF whose ``tokenizer.ggml.pre`` is not a known type fails, naming it."""
    import gguf

    path = tmp_path / "v.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("no-such-pre")
    w.add_token_list(["a", "b", "ab"])
    w.add_token_merges(["a b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(UnsupportedTokenizer) as err:
        load_tokenizer(path)
    assert (err.value.key, err.value.value) == ("tokenizer.ggml.pre", "no-such-pre")
    assert "\n" not in str(err.value) and "qwen2" in str(err.value)


def test_startup_error_is_one_line(llama_cpp_models_dir):
    """What ``python -m gateway serve`` prints for such a model: one line naming the file, key and value."""
    from gateway.server import StartupError, _load_tokenizer

    path = str(llama_cpp_models_dir / "ggml-vocab-bert-bge.gguf")
    with pytest.raises(StartupError) as err:
        _load_tokenizer(path)
    assert str(err.value).splitlines() == [str(err.value)]
    assert path in str(err.value) and "tokenizer.ggml.model = 'bert'" in str(err.value)


# -- flags and special tokens as the metadata says ------------------------------------------------------


@pytest.mark.parametrize(
    "family, add_bos",
    [
        ("llama-bpe", True),  # llama.cpp's default for the llama3 pre type (no key in the file)
        ("llama-spm", True),  # tokenizer.ggml.add_bos_token
        ("gemma-4", True),
        ("command-r", True),
        ("qwen2", False),
        ("gpt-2", False),
    ],
)
def test_add_bos_as_llama_cpp(llama_cpp_models_dir, family, add_bos):
    tok = _load(llama_cpp_models_dir, family)
    assert tok.add_bos_token is add_bos and tok.add_eos_token is False
    prompt = tok.encode_prompt("Hello world")
    assert prompt == ([tok.bos_token_id] if add_bos else []) + tok.encode_plain("Hello world")


def test_special_tokens_parsed_only_in_trusted_text(llama_cpp_models_dir):
    llama3 = _load(llama_cpp_models_dir, "llama-bpe")
    assert (
        llama3.bos_token == "<|begin_of_text|>" and llama3.token_to_id("<|eot_id|>") in llama3.stop_token_ids
    )
    tok = _load(llama_cpp_models_dir, "deepseek-coder")
    bos = tok.bos_token
    assert bos == "<\uff5cbegin\u2581of\u2581sentence\uff5c>" and tok.eos_token_id in tok.stop_token_ids
    assert tok.encode_with_specials(bos + "def f():") == [tok.bos_token_id, *tok.encode_plain("def f():")]
    assert not set(tok.encode_plain(bos + "def f():")) & tok.special_ids


def test_sentencepiece_prefix_and_byte_fallback(llama_cpp_models_dir):
    tok = _load(llama_cpp_models_dir, "llama-spm")
    assert (tok.bos_token, tok.eos_token, tok.byte_level) == ("<s>", "</s>", False)
    assert tok.encode_plain("Hello") == [15043]  # "▁Hello": the space prefix
    assert tok.encode_with_specials("<s>Hello") == [1, 15043]  # prefix after a special token too
    ids = tok.encode_plain("\U0001f999")  # not in the vocabulary: its four UTF-8 bytes
    assert [tok.id_to_token(i) for i in ids[-4:]] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]


def test_phi3_turn_tokens_strip_the_whitespace_after_them(llama_cpp_models_dir):
    """llama.cpp gives Phi-3's special tokens RSTRIP (``<|end|>`` eats the newline after it); ``<|end|>`` ends
    a turn."""
    tok = _load(llama_cpp_models_dir, "phi-3")
    end, user = tok.token_to_id("<|end|>"), tok.token_to_id("<|user|>")
    assert tok.encode_with_specials("<|user|>\nHi<|end|>\n") == [user, *tok.encode_plain("Hi"), end]
    assert end in tok.stop_token_ids and tok.eos_token == "<|endoftext|>"
    assert {end, user} <= tok.rstrip_ids and tok.bos_token_id not in tok.rstrip_ids


def test_gguf_vocab_defaults():
    v = GGUFVocab.from_metadata(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": ["a", "", "ab"],
            "tokenizer.ggml.merges": ["a b"],
        }
    )
    assert v.pre == "default" and v.tokens[1] == "[EMPTY_1]" and v.merges == [("a", "b")]
    assert (v.add_bos, v.add_eos, v.bos_id) == (False, False, None)


def test_metadata_reader_reads_the_reference_files(llama_cpp_models_dir):
    meta = read_gguf_metadata(llama_cpp_models_dir / "ggml-vocab-qwen2.gguf")
    assert meta["tokenizer.ggml.pre"] == "qwen2" and len(meta["tokenizer.ggml.tokens"]) == 151936


# -- Hugging Face directories ---------------------------------------------------------------------------


def test_hf_directory_without_tokenizer_json_says_what_to_pass(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerFileMissing) as err:
        load_tokenizer(tmp_path)
    message = str(err.value)
    assert "\n" not in message and "tokenizer.json" in message and "GGUF" in message
    assert err.value.path == str(tmp_path / "tokenizer.json") and isinstance(err.value, FileNotFoundError)
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(TokenizerFileMissing, match="SentencePiece tokenizer.model"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerFileMissing, match="pass a GGUF file"):
        load_tokenizer(tmp_path / "nope.gguf")


def test_hf_directory_add_bos_from_config_or_post_processor(llama_cpp_models_dir, tmp_path):
    """``tokenizer_config.json``'s ``add_bos_token`` wins; without it, what ``tokenizer.json``'s
    post-processor adds (a ``TemplateProcessing`` that prepends BOS, as Llama 3's does)."""
    from tokenizers import Tokenizer, processors

    gguf_tok = _load(llama_cpp_models_dir, "gpt-2")
    inner = Tokenizer.from_str(gguf_tok.plain.to_str())
    inner.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 50256)]
    )
    inner.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = load_tokenizer(tmp_path)
    assert (hf.add_bos_token, hf.add_eos_token, hf.bos_token_id) == (True, False, 50256)
    assert hf.encode_prompt("Hi there") == [50256, *gguf_tok.encode_plain("Hi there")]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    assert load_tokenizer(tmp_path).add_bos_token is False


def test_hf_directory_keeps_the_strip_flags(llama_cpp_models_dir, tmp_path):
    """A ``tokenizer.json`` whose added tokens carry ``rstrip`` (Phi-3's) reports them and applies them."""
    phi3 = _load(llama_cpp_models_dir, "phi-3")
    phi3.plain.save(str(tmp_path / "tokenizer.json"))
    hf = load_tokenizer(tmp_path)
    assert hf.rstrip_ids == phi3.rstrip_ids and not hf.lstrip_ids
    assert (hf.add_bos_token, hf.bos_token_id) == (False, None)  # no config, no post-processor
    text = "<|user|>\nHi<|end|>\n<|assistant|>\n"
    assert hf.encode_with_specials(text) == phi3.encode_with_specials(text)
