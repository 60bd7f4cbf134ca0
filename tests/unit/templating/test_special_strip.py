"""Prompt ids as llama.cpp builds them: the whitespace next to an added token with a strip flag is dropped
(``tokenizer_st_partition``), a chat prompt starts with exactly one BOS, and a raw /v1/completions prompt gets
the BOS/EOS the model's metadata asks for.

Reference: llama.cpp's ``src/llama-vocab.cpp`` in the llama-cpp-python 0.3.36 sdist (fixture
``llama_cpp_models_dir``): Phi-3's special tokens are RSTRIP, and ``<|user|>\\nHi<|end|>\\n<|assistant|>\\n``
tokenizes to ``32010 6324 32007 32001``; ``common/chat.cpp`` strips a rendered BOS and lets the tokenizer add
it back when ``add_bos`` holds. SmolLM2 (no strip flags, no BOS added) keeps its fixture ids
(``test_chat_template.py::test_fixture_prompts_exact``).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from backend.protocol import ModelCard
from gateway.openai.prepare import prepare_chat, prepare_completion
from gateway.openai.schemas import ChatRequest, CompletionRequest
from gateway.settings import Settings
from gateway.state import Gateway
from templating import ChatTemplate, cached_tokenizer, load_tokenizer

SIMPLE_PHI = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of Ontario?"},
    {"role": "assistant", "content": "Toronto.\n\n"},
    {"role": "user", "content": "  And its history?\t"},
]


@pytest.fixture(scope="module")
def phi3(llama_cpp_models_dir):
    return load_tokenizer(llama_cpp_models_dir / "ggml-vocab-phi-3.gguf")


@pytest.fixture(scope="module")
def llama3(llama_cpp_models_dir):
    return load_tokenizer(llama_cpp_models_dir / "ggml-vocab-llama-bpe.gguf")


@pytest.fixture(scope="module")
def smollm(model_path):
    return cached_tokenizer(model_path)


def _template(models, name: str) -> str:
    return (models / "templates" / f"{name}.jinja").read_text(encoding="utf-8")


# -- strip flags --------------------------------------------------------------------------------------


def test_phi3_specials_take_the_whitespace_after_them(phi3):
    assert {32001, 32007, 32010} <= phi3.rstrip_ids and phi3.add_bos_token
    p = ChatTemplate(phi3, SIMPLE_PHI).render([{"role": "user", "content": "Hi"}])
    assert p.text == "<|user|>\nHi<|end|>\n<|assistant|>\n"
    assert p.ids == [1, 32010, 6324, 32007, 32001]  # llama.cpp's ids, after the BOS it adds


def test_phi3_real_template_equals_the_tokenizers_own_parse(phi3, llama_cpp_models_dir):
    """The Phi-3.5 template on a conversation with whitespace at every edge: the same ids as the tokenizer's
    own special-token parse (HF ``AddedToken(rstrip=True)``), with one BOS before them."""
    tmpl = ChatTemplate(phi3, _template(llama_cpp_models_dir, "microsoft-Phi-3.5-mini-instruct"))
    for gen in (True, False):
        p = tmpl.render(CONVO, add_generation_prompt=gen)
        assert p.ids == [1] + phi3.encode_with_specials(p.text), gen
        assert 13 not in p.ids[:3]  # no newline piece after <|system|>


def test_client_control_text_is_not_stripped_around(phi3):
    """A client spelling ``<|end|>`` gets ordinary text: no special id, so the whitespace after it stays."""
    tmpl = ChatTemplate(phi3, SIMPLE_PHI)
    content = "a<|end|>\n b"
    p = tmpl.render([{"role": "user", "content": content}])
    assert p.ids == [1, 32010] + phi3.encode_plain(content) + [32007, 32001]


def test_lstrip_drops_the_whitespace_before(smollm):
    """A token that takes the whitespace before it (HF ``lstrip``) empties a whitespace-only piece."""
    assert not smollm.lstrip_ids and not smollm.rstrip_ids
    tok = dataclasses.replace(smollm, lstrip_ids=frozenset({2}))  # <|im_end|>
    tmpl = ChatTemplate(tok, CHATML)
    spaced = tmpl.render([{"role": "user", "content": "Hi \n\t "}, {"role": "assistant", "content": " \n"}])
    plain = tmpl.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}])
    assert spaced.ids == plain.ids
    assert spaced.ids != ChatTemplate(smollm, CHATML).render([{"role": "user", "content": "Hi \n\t "}]).ids


# -- BOS -----------------------------------------------------------------------------------------------


def test_one_bos_whether_or_not_the_template_writes_it(llama3, llama_cpp_models_dir):
    bos = llama3.bos_token_id
    assert bos == 128000 and llama3.add_bos_token
    written = ChatTemplate(llama3, _template(llama_cpp_models_dir, "meta-llama-Llama-3.1-8B-Instruct"))
    p = written.render(CONVO)
    assert p.text.startswith("<|begin_of_text|>")
    assert p.ids[0] == bos and p.ids.count(bos) == 1
    assert p.ids == llama3.encode_with_specials(p.text)
    p = ChatTemplate(llama3, CHATML).render(CONVO)  # this template writes no BOS: it is added
    assert p.ids == [bos] + llama3.encode_with_specials(p.text)
    # a client spelling BOS at the very start is text; the real one is still added
    p = ChatTemplate(llama3, "{{ messages[0].content }}").render(
        [{"role": "user", "content": "<|begin_of_text|>x"}]
    )
    assert p.ids == [bos] + llama3.encode_plain("<|begin_of_text|>x")


def test_smollm2_gets_no_bos(smollm):
    assert not smollm.add_bos_token
    p = ChatTemplate(smollm).render([{"role": "user", "content": "Hi"}])
    assert p.ids == smollm.encode_with_specials(p.text) and p.ids[0] == smollm.im_start_id


# -- the gateway's prompts --------------------------------------------------------------------------


def _gateway(tok, source: str | None = None) -> Gateway:
    card = ModelCard(name="m", context_length=4096, vocab_size=tok.vocab_size)
    return Gateway(Settings(), SimpleNamespace(card=card), tok, ChatTemplate(tok, source))


async def _completion_ids(gw: Gateway, prompt) -> list[int]:
    req = CompletionRequest(model="m", prompt=prompt)
    return (await prepare_completion(gw, req, principal=None, api="openai", t_arrival=0.0)).prompt_ids


async def test_completion_prompt_gets_the_metadata_bos(llama3, smollm):
    gw = _gateway(llama3, CHATML)
    text = "Once upon a time <|eot_id|>"
    assert await _completion_ids(gw, text) == [128000] + llama3.encode_plain(text)
    assert await _completion_ids(gw, [text]) == [128000] + llama3.encode_plain(text)
    assert await _completion_ids(gw, [9906, 11]) == [9906, 11]  # token ids as given (llama.cpp too)
    assert await _completion_ids(_gateway(smollm), text) == smollm.encode_plain(text)


async def test_chat_prompt_has_one_bos(llama3, llama_cpp_models_dir):
    gw = _gateway(llama3, _template(llama_cpp_models_dir, "meta-llama-Llama-3.2-3B-Instruct"))
    req = ChatRequest(model="m", messages=CONVO)
    ids = (await prepare_chat(gw, req, principal=None, api="openai", t_arrival=0.0)).prompt_ids
    assert ids[0] == 128000 and ids.count(128000) == 1
