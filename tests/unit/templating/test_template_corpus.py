"""The 70 real chat templates shipped with llama.cpp (``models/templates/*.jinja`` in the llama-cpp-python
0.3.36 sdist) render exactly the text of ``transformers``' ``apply_chat_template(..., tokenize=False)``.

Each template x conversation is rendered by both with the same bos/eos/unk strings (a tiny tokenizer that
both load from the same files) and the same frozen clock for ``strftime_now``. Where transformers raises,
ours must raise a ``TemplateError`` with a client message, ``param`` and ``code`` (the gateway answers it
with a 400); such pairs are pinned in ``REJECTED`` with the reason, so a conversation that silently stopped
rendering anywhere fails the test.
"""

from __future__ import annotations

import copy
import datetime as dt
import json

import pytest

from templating import ChatTemplate, load_tokenizer
from templating.errors import TemplateError

transformers = pytest.importorskip("transformers")
from transformers import PreTrainedTokenizerFast  # noqa: E402
from transformers.utils import chat_template_utils as hf_utils  # noqa: E402

import templating.jinja_env as jinja_env  # noqa: E402

TEMPLATES = (
    "Apertus-8B-Instruct",
    "Apriel-1.6-15b-Thinker-fixed",
    "Bielik-11B-v3.0-Instruct",
    "ByteDance-Seed-OSS",
    "Cohere2MoE",
    "CohereForAI-c4ai-command-r-plus-tool_use",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
    "GLM-4.6",
    "GLM-4.7-Flash",
    "GigaChat3-10B-A1.8B",
    "GigaChat3.1-10B-A1.8B",
    "HuggingFaceTB-SmolLM3-3B",
    "Kimi-K2-Instruct",
    "Kimi-K2-Thinking",
    "Kimi-K3",
    "LFM2-8B-A1B",
    "LFM2.5-8B-A1B",
    "LFM2.5-Instruct",
    "MiMo-VL",
    "MiniMax-M1",
    "MiniMax-M2",
    "MiniMax-M3",
    "Mistral-Small-3.2-24B-Instruct-2506",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
    "NVIDIA-Nemotron-Nano-v2",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
    "Qwen-QwQ-32B",
    "Qwen-Qwen2.5-7B-Instruct",
    "Qwen-Qwen3-0.6B",
    "Qwen3-Coder",
    "Qwen3.5-4B",
    "Reka-Edge",
    "Spark2.5",
    "StepFun3.5-Flash",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "deepseek-ai-DeepSeek-V3.1",
    "deepseek-ai-DeepSeek-V3.2",
    "deepseek-ai-DeepSeek-V4-Flash-0731",
    "deepseek-ai-DeepSeek-V4",
    "fireworks-ai-llama-3-firefunction-v2",
    "google-gemma-2-2b-it",
    "google-gemma-4-31B-it-interleaved",
    "google-gemma-4-31B-it",
    "ibm-granite-granite-3.3-2B-Instruct",
    "ibm-granite-granite-4.0",
    "ibm-granite-granite-4.1",
    "inclusionai-ling-3.0-flash",
    "llama-cpp-deepseek-r1",
    "llama-cpp-rwkv-world",
    "meetkai-functionary-medium-v3.1",
    "meetkai-functionary-medium-v3.2",
    "meta-llama-Llama-3.1-8B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct",
    "meta-llama-Llama-3.3-70B-Instruct",
    "microsoft-Phi-3.5-mini-instruct",
    "mistralai-Ministral-3-14B-Reasoning-2512",
    "mistralai-Mistral-Nemo-Instruct-2407",
    "moonshotai-Kimi-K2",
    "muse-glimmer",
    "openai-gpt-oss-120b",
    "openbmb-MiniCPM5-1B",
    "poolside-Laguna-S-2.1",
    "poolside-Laguna-XS-2.1",
    "poolside-Laguna-XS.2",
    "tencent-Hy3",
    "unsloth-Apriel-1.5",
    "unsloth-mistral-Devstral-Small-2507",
    "upstage-Solar-Open-100B",
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city (°C & <b>wind</b>), e.g. Zürich.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "description": "Unit", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
# An id of 9 alphanumerics: the Mistral templates refuse any other.
_CALL = {"id": "call00001", "type": "function", "function": {"name": "get_weather"}}
_SYS = {"role": "system", "content": "You are a helpful assistant."}
_ASK = {"role": "user", "content": "Weather in Paris?"}
_RESULT = {
    "role": "tool",
    "tool_call_id": "call00001",
    "name": "get_weather",
    "content": '{"temperature": 22}',
}

#: name -> (messages, apply_chat_template keywords)
CONVERSATIONS: dict[str, tuple[list[dict], dict]] = {
    "system_user": ([_SYS, {"role": "user", "content": "What is the capital of France?"}], {}),
    "multi_turn": (
        [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
        {},
    ),
    # OpenAI's shape: null content; arguments as an object (HF's convention for templates)
    "tool_call": (
        [
            _SYS,
            _ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        **_CALL,
                        "function": {**_CALL["function"], "arguments": {"city": "Paris", "unit": "celsius"}},
                    }
                ],
            },
            _RESULT,
        ],
        {"tools": [WEATHER]},
    ),
    # text content and arguments as OpenAI's JSON string (transformers is given the object: ``hf_form``)
    "tool_call_text": (
        [
            _ASK,
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [
                    {**_CALL, "function": {**_CALL["function"], "arguments": json.dumps({"city": "Paris"})}}
                ],
            },
            _RESULT,
        ],
        {"tools": [WEATHER]},
    ),
    "tools": ([_SYS, _ASK], {"tools": [WEATHER]}),
    "unicode_jinja": (
        [
            {
                "role": "user",
                "content": "Ünïcödé 你好 🙂 — {{ x }} {% if %} {# c #} {{ raise_exception('no') }}",
            },
            {"role": "assistant", "content": "«{{ y }}» ✓ {%- raw %}"},
            {"role": "user", "content": "{% endif %}\\n\t\u200b"},
        ],
        {},
    ),
    "no_generation_prompt": (
        [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello!"}],
        {"add_generation_prompt": False},
    ),
}

#: (template, conversation) -> why transformers (and so this gateway) rejects it.
REJECTED = {
    **{
        (t, c): "tool-use-only template: iterates `tools`, which is None"
        for t in (
            "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
            "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
        )
        + ("CohereForAI-c4ai-command-r-plus-tool_use",)
        for c in ("system_user", "multi_turn", "unicode_jinja", "no_generation_prompt")
    },
    **{
        ("fireworks-ai-llama-3-firefunction-v2", c): "reads the variable `functions`, which callers must pass"
        for c in CONVERSATIONS
    },
    **{
        ("google-gemma-2-2b-it", c): "raise_exception: System role not supported"
        for c in ("system_user", "tool_call", "tools")
    },
    **{
        (t, "tool_call"): "reads the content of the assistant's tool-call message, which is null (dropped)"
        for t in (
            "Qwen-QwQ-32B",
            "Qwen-Qwen3-0.6B",
            "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
            "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
            "ibm-granite-granite-3.3-2B-Instruct",
            "microsoft-Phi-3.5-mini-instruct",
            "unsloth-mistral-Devstral-Small-2507",
            "LFM2-8B-A1B",
            "LFM2.5-Instruct",
        )
    },
    **{
        (t, c): "list.append on a template list: the sandbox forbids it"
        for t in ("Kimi-K2-Instruct", "Kimi-K2-Thinking")
        for c in ("tool_call", "tool_call_text")
    },
    **{
        ("llama-cpp-deepseek-r1", c): "tojson of a generator (a template bug)"
        for c in ("tool_call", "tool_call_text", "tools")
    },
    **{
        (
            "meetkai-functionary-medium-v3.2",
            c,
        ): "concatenates the arguments to a string: it needs them as text"
        for c in ("tool_call", "tool_call_text")
    },
    ("google-gemma-2-2b-it", "tool_call_text"): "raise_exception: roles must alternate user/assistant",
}


def hf_form(messages: list[dict]) -> list[dict]:
    """The messages as transformers expects them: tool-call arguments as objects, not JSON strings (its
    templates say "normalize JSON strings before apply_chat_template"); the gateway does this itself. The
    identity for every conversation but ``tool_call_text``."""
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls") or ():
            if isinstance(call["function"].get("arguments"), str):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


FROZEN = dt.datetime(2026, 3, 14, 9, 26, 53)


class _FrozenClock(dt.datetime):
    @classmethod
    def now(cls, tz=None):  # noqa: ARG003 - datetime's signature
        return FROZEN


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(transformers tokenizer, ours) read from one saved tiny tokenizer: bos <s>, eos </s>, unk <unk>."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    hf.save_pretrained(folder)
    ours = load_tokenizer(folder)
    assert (ours.bos_token, ours.eos_token) == ("<s>", "</s>")
    return hf, ours


@pytest.fixture(scope="module")
def sources(llama_cpp_models_dir):
    folder = llama_cpp_models_dir / "templates"
    found = sorted(p.stem for p in folder.glob("*.jinja"))
    assert found == sorted(TEMPLATES), "the sdist's template list changed: update TEMPLATES"
    return {name: (folder / f"{name}.jinja").read_text(encoding="utf-8") for name in TEMPLATES}


@pytest.fixture
def frozen_clock(monkeypatch):
    monkeypatch.setattr(hf_utils, "datetime", _FrozenClock)
    monkeypatch.setattr(jinja_env, "datetime", _FrozenClock)


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("template", TEMPLATES)
def test_renders_as_transformers(tokenizers, sources, frozen_clock, template, conversation):
    hf, ours = tokenizers
    src = sources[template]
    messages, kw = CONVERSATIONS[conversation]
    gen = kw.get("add_generation_prompt", True)
    tools = kw.get("tools")
    try:
        want = hf.apply_chat_template(
            hf_form(messages), tools=tools, chat_template=src, add_generation_prompt=gen, tokenize=False
        )
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises, ours must refuse too
        want = exc
    tmpl = ChatTemplate(ours, src)
    if isinstance(want, Exception):
        assert (template, conversation) in REJECTED, f"transformers rejects it: {want!r}"
        with pytest.raises(TemplateError) as ei:
            tmpl.render(copy.deepcopy(messages), tools=tools, add_generation_prompt=gen)
        e = ei.value
        assert e.param and e.code and e.message, e
        assert "Error" not in e.message and "Traceback" not in e.message, e.message
        return
    assert (template, conversation) not in REJECTED, "transformers renders it now: unpin it"
    got = tmpl.render(copy.deepcopy(messages), tools=tools, add_generation_prompt=gen)
    assert got.text == want


def test_frozen_clock_reaches_both_sides(tokenizers, sources, frozen_clock):
    """Llama 3.2 writes today's date through strftime_now: both sides print the frozen one."""
    hf, ours = tokenizers
    src = sources["meta-llama-Llama-3.2-3B-Instruct"]
    messages = CONVERSATIONS["system_user"][0]
    text = ChatTemplate(ours, src).render(messages).text
    assert "Today Date: 14 Mar 2026\n" in text
    assert text == hf.apply_chat_template(
        messages, chat_template=src, add_generation_prompt=True, tokenize=False
    )
