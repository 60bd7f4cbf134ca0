"""A generated tiny ``qwen2`` model served end to end: random weights (``plugins.tiny_models``), the real
qwen2 vocabulary (``ggml-vocab-qwen2.gguf`` of the llama-cpp-python sdist) and Qwen2.5's chat template,
written as one GGUF in a temporary folder and served by a real gateway (``--model <path>``) with its
backend, through the official ``openai`` client.

Random weights write gibberish, so the tests check structure, not text:

* ``/v1/models`` lists the model (architecture ``qwen2``, the vocabulary's 151936 tokens);
* a chat completion, non-stream and stream (``include_usage``): ``prompt_tokens`` is the qwen2 tokenizer's
  count of the prompt the template renders (rendered here with jinja2 as transformers does), and
  ``completion_tokens`` is ``max_tokens`` (``ignore_eos``), finish ``"length"``; the stream's text and usage
  equal the non-stream answer's (greedy);
* a forced tool call through Qwen2.5's template (the Hermes format; this older qwen2 vocabulary has no
  ``<tool_call>`` token, so the grammar spells it in ordinary tokens), non-stream and stream: finish ``"tool_calls"`` and arguments that are the only object
  the schema allows, the streamed pieces assembled as the SDK does giving the same call.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.sandbox
import pytest
from plugins.gateway_server import start_gateway

TEMPLATE = "Qwen-Qwen2.5-7B-Instruct.jinja"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Grüß dich! What is 2 + 2? {{ not jinja }} 東京"},
]
MAX_TOKENS = 7


@pytest.fixture(scope="module")
def qwen2_tokenizer(llama_cpp_models_dir: Path):
    """The project's qwen2 tokenizer of the vocabulary file; skips, naming the missing piece, while the
    writer, the architecture or the tokenizer is not there."""
    from templating.tokenizer import load_tokenizer

    try:
        import plugins.tiny_models  # noqa: F401
    except ImportError:
        pytest.skip("missing: tests/plugins/tiny_models.py (the tiny GGUF writer)")
    from backend.loaders import gguf as loader

    if "qwen2" not in getattr(loader, "SUPPORTED_ARCHS", ()):
        pytest.skip("missing: the qwen2 architecture in backend/loaders/gguf.py")
    try:
        return load_tokenizer(llama_cpp_models_dir / "ggml-vocab-qwen2.gguf")
    except ValueError as exc:
        pytest.skip(f"missing: the qwen2 tokenizer in templating/tokenizer.py ({exc})")


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory, llama_cpp_models_dir: Path, qwen2_tokenizer) -> Path:
    """The GGUF file: tiny random qwen2 weights, the qwen2 vocabulary, Qwen2.5's template."""
    from plugins.tiny_models import write_tiny_gguf

    template = (llama_cpp_models_dir / "templates" / TEMPLATE).read_text()
    path = tmp_path_factory.mktemp("tiny-qwen2") / "tiny-qwen2.gguf"
    vocab = llama_cpp_models_dir / "ggml-vocab-qwen2.gguf"
    return write_tiny_gguf(path, "qwen2", vocab=vocab, chat_template=template)


@pytest.fixture(scope="module")
def served(tiny_qwen2: Path):
    gp = start_gateway("--model", str(tiny_qwen2))
    try:
        yield gp
    finally:
        gp.stop()


def expected_prompt_tokens(tok, llama_cpp_models_dir: Path) -> int:
    """The template rendered as transformers renders it (sandboxed jinja2, trim/lstrip blocks,
    ``add_generation_prompt``), tokenized by the qwen2 tokenizer with its special tokens parsed."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    src = (llama_cpp_models_dir / "templates" / TEMPLATE).read_text()
    text = env.from_string(src).render(messages=MESSAGES, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "Be brief." in text
    return len(tok.encode_with_specials(text))


def test_models_lists_it(served):
    models = served.openai().models.list().data
    assert [m.id for m in models] == ["tiny-qwen2"]
    extra = models[0].model_extra or {}
    assert extra.get("architecture") == "qwen2" and extra.get("vocab_size") == 151936


def test_chat_completion_stream_and_usage(served, qwen2_tokenizer, llama_cpp_models_dir):
    client = served.openai()
    ask = dict(model=served.model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    ask["extra_body"] = {"ignore_eos": True}
    full = client.chat.completions.create(**ask)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    prompt = expected_prompt_tokens(qwen2_tokenizer, llama_cpp_models_dir)
    assert full.usage is not None
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (prompt, MAX_TOKENS)
    assert full.usage.total_tokens == prompt + MAX_TOKENS

    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"] and text == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (prompt, MAX_TOKENS)
    assert all(c.usage is None for c in chunks[:-1])


def test_forced_tool_call(served):
    unit = {
        "type": "function",
        "function": {
            "name": "set_unit",
            "parameters": {
                "type": "object",
                "properties": {"unit": {"enum": ["celsius"]}},
                "required": ["unit"],
                "additionalProperties": False,
            },
        },
    }
    ask = dict(
        model=served.model,
        messages=MESSAGES[1:],
        tools=[unit],
        tool_choice={"type": "function", "function": {"name": "set_unit"}},
        max_tokens=64,
    )
    client = served.openai()
    full = client.chat.completions.create(**ask)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls or []
    assert call.function.name == "set_unit" and json.loads(call.function.arguments) == {"unit": "celsius"}
    assert call.id.startswith("call_")

    calls: dict[int, list[str]] = {}  # index -> [id, name, arguments], assembled as the SDK does
    finish = []
    for chunk in client.chat.completions.create(**ask, stream=True):
        for c in chunk.choices:
            finish += [c.finish_reason] if c.finish_reason else []
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                got = calls.setdefault(d.index, ["", "", ""])
                got[0] += d.id or ""
                got[1] += (d.function and d.function.name) or ""
                got[2] += (d.function and d.function.arguments) or ""
    assert finish == ["tool_calls"] and list(calls) == [0]
    assert calls[0][0].startswith("call_") and calls[0][1:] == ["set_unit", call.function.arguments]
