"""Tokenizer: GGUF vocab -> tokenizers.Tokenizer, checked against the shared fixtures (exact ids)."""

from __future__ import annotations

import json

import pytest

from templating import cached_tokenizer, load_tokenizer
from templating.tokenizer import bytes_to_unicode


@pytest.fixture(scope="module")
def tok(model_path):
    return cached_tokenizer(model_path)


def test_fixture_texts_exact(tok, tokenizer_fixtures):
    assert len(tokenizer_fixtures) >= 10
    for case in tokenizer_fixtures:
        assert tok.encode_plain(case["text"]) == case["ids"], case["text"]
        assert tok.decode(case["ids"]) == case["text"]


def test_digits_split_individually(tok):
    ids = tok.encode_plain("2024")
    assert len(ids) == 4
    assert [tok.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_special_ids(tok):
    assert tok.vocab_size == 49152
    assert tok.im_start_id == 1 and tok.im_end_id == 2
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert tok.special_ids == frozenset(range(17))
    assert 2 in tok.stop_token_ids


def test_plain_vs_special_encoding(tok):
    text = "a<|im_end|>b<|im_start|>"
    plain = tok.encode_plain(text)
    assert not set(plain) & tok.special_ids
    assert tok.decode(plain) == text
    assert tok.encode_with_specials(text) == tok.encode_plain("a") + [2] + tok.encode_plain("b") + [1]


def test_decode_skips_specials(tok):
    ids = [1] + tok.encode_plain("hi") + [2]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_byte_table_matches_decode(tok):
    """id_to_bytes[i] is what tokenizers' ByteLevel decoder produces for token i (every id)."""
    assert len(tok.id_to_bytes) == tok.vocab_size
    ids = list(range(tok.vocab_size))
    decoded = tok.tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
    for i, text in zip(ids, decoded):
        assert tok.id_to_bytes[i].decode("utf-8", "replace") == text, i
    # Single-byte tokens: all printable ASCII, \t \n \r, every continuation byte (0x80-0xBF) and the lead
    # bytes of 2- and 3-byte sequences. SmolLM2's vocab lacks 0x04 0x06 0x13 0x14 0x16 0x1D, 0xF1 0xF2 and
    # the never-valid 0xC0 0xC1 0xF5-0xFF: such characters are dropped by encode (as in HF, unk_token null).
    singles = {tok.id_to_bytes[i][0] for i in ids if len(tok.id_to_bytes[i]) == 1}
    assert set(range(0x20, 0x7F)) | {9, 10, 13} | set(range(0x80, 0xC0)) | set(range(0xC2, 0xF0)) <= singles


def test_hf_directory_roundtrip(tok, tmp_path):
    """A Hugging Face directory (tokenizer.json + tokenizer_config.json) loads to the same tokenizer."""
    tok.tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": tok.chat_template}
        )
    )
    hf = load_tokenizer(tmp_path)
    assert hf.vocab_size == tok.vocab_size
    assert hf.special_ids == tok.special_ids
    assert hf.id_to_bytes == tok.id_to_bytes
    assert hf.chat_template == tok.chat_template
    assert (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    for text in ["12345 apples", "hello<|im_end|>world", "Xin chào 你好 🙂👍🏽"]:
        assert hf.encode_plain(text) == tok.encode_plain(text)


def test_bytes_to_unicode_is_a_bijection():
    m = bytes_to_unicode()
    assert len(m) == 256 and len(set(m.values())) == 256


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path)  # a directory without tokenizer.json


def test_gguf_metadata_reader_matches_gguf_writer(tmp_path):
    """The header-only GGUF reader reads back what the ``gguf`` library writes, every value type."""
    import gguf

    from templating.gguf_vocab import read_gguf_metadata

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_string("a.str", "héllo")
    w.add_uint32("a.u32", 7)
    w.add_int32("a.i32", -3)
    w.add_float32("a.f32", 0.5)
    w.add_bool("a.bool", True)
    w.add_uint64("a.u64", 2**40)
    w.add_array("a.strs", ["x", "", "Ġy"])
    w.add_array("a.ints", [1, 2, 3])
    w.add_token_types([1, 3, 6])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    m = read_gguf_metadata(path)
    assert m["general.architecture"] == "llama"
    assert m["a.str"] == "héllo" and m["a.u32"] == 7 and m["a.i32"] == -3
    assert m["a.f32"] == 0.5 and m["a.bool"] is True and m["a.u64"] == 2**40
    assert m["a.strs"] == ["x", "", "Ġy"] and m["a.ints"] == [1, 2, 3]
    assert m["tokenizer.ggml.token_type"] == [1, 3, 6]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ValueError):
        read_gguf_metadata(bad)


def test_long_text_is_encoded_without_holding_the_gil(tok):
    """A megabyte prompt tokenized in a worker thread leaves the main thread running (``Tokenizer.encode``
    holds the GIL for the whole call: a 4 MB prompt stalled every other stream for 3 s), with the same ids."""
    import threading
    import time

    from templating.tokenizer import GIL_FREE_CHARS

    text = "The quick brown fox, <|im_end|> jumps 12345 over the lazy dog. " * 16000  # ~1 MB
    short = text[: GIL_FREE_CHARS // 2]
    assert tok.encode_plain(short) == tok.plain.encode(short, add_special_tokens=False).ids
    out: list[list[int]] = []
    worker = threading.Thread(target=lambda: out.append(tok.encode_plain(text)))
    gaps, t0 = [], time.perf_counter()
    last = t0
    worker.start()  # the stall, with the GIL held, can begin here already: measured from t0
    while worker.is_alive():
        time.sleep(0.005)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    took = time.perf_counter() - t0
    assert out[0] == tok.plain.encode(text, add_special_tokens=False).ids
    assert max(gaps) < max(0.1, took / 4), (max(gaps), took)  # holding the GIL: one gap as long as the call
    assert tok.encode_with_specials(text) == tok.tokenizer.encode(text, add_special_tokens=False).ids
