"""Several models served by one gateway (the model catalog, gateway/catalog.py), through the official ``openai``
client, the Ollama API and the admin stats.

One gateway for the module, declared by a TOML ``[[models]]`` config: one GGUF file in bfloat16 as
``smol-bf16`` (alias ``smol``) and the same file in float32 as ``smol-f32`` (alias ``smol-exact``, a KV pool of
``F32_BLOCKS`` blocks, a ``context_length`` of ``F32_CONTEXT``), each with its own backend process. The file is
``tiny_smollm2`` (``plugins.tiny_smollm2``): random tiny weights with the default model's tokenizer and chat
template, so prompt-token counts are the default model's; the generated tokens are random, so only the
structure of the answers is checked. Checked:

* each request lands on its model's backend: the per-backend engine counters of ``/admin/v1/stats`` (each
  backend names its model) move only for the backend of the model asked for, by its name or an alias,
  through /v1/chat/completions, /v1/completions and Ollama's /api/chat;
* per-model engine settings reach the backends (dtype, KV pool size), the declared context length is the
  one served (``/v1/models``; a request over it is a 400), and each model renders with its own chat template
  (``smol-f32``'s ``chat_template`` file has no default system turn: a shorter prompt);
* ``/v1/models`` and ``/api/tags`` list both models and their aliases; ``/v1/models/{id}`` answers an alias;
* an unknown model is a 404 ``model_not_found`` (``openai.NotFoundError``), and so is a model the tenant
  may not use (a tenant whose ``models`` lists only ``smol-f32``), which its listings leave out; a request
  by alias counts against the served model's limit, and metrics label it with the served name;
* the ``--serve-model`` flag's syntax and the settings errors of model declarations (no gateway).
"""

from __future__ import annotations

import os
import time

import httpx
import openai
import pytest
from plugins.gateway_server import GatewayProc, start_gateway
from plugins.tiny_smollm2 import TINY_CONTEXT

from auth.principal import Principal
from backend.protocol import ModelCard
from gateway.catalog import ModelCatalog, ServedModel
from gateway.errors import NotFound
from gateway.options import model_engine
from gateway.settings import SettingsError, load_settings
from ratelimit.core import Limits

BF16_BLOCKS = 96
F32_BLOCKS = 48
BLOCK_SIZE = 16  # tokens per KV block (the backend's default)
F32_CONTEXT = 512
CONFIG = f"""
[[models]]
name = "smol-bf16"
aliases = ["smol"]
path = "{{path}}"
dtype = "bfloat16"
num_kv_blocks = {BF16_BLOCKS}

[[models]]
name = "smol-f32"
aliases = ["smol-exact"]
path = "{{path}}"
dtype = "float32"
num_kv_blocks = {F32_BLOCKS}
context_length = {F32_CONTEXT}
chat_template = "{{template}}"
"""
#: smol-f32's own chat template: ChatML without SmolLM2's default system prompt (a shorter prompt)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NAMES = {"smol-bf16": "smol-bf16", "smol": "smol-bf16", "smol-f32": "smol-f32", "smol-exact": "smol-f32"}


@pytest.fixture(scope="module")
def two_models(tmp_path_factory, tiny_smollm2) -> GatewayProc:
    folder = tmp_path_factory.mktemp("models")
    (folder / "chatml.jinja").write_text(TEMPLATE)
    path = folder / "gateway.toml"
    path.write_text(
        CONFIG.replace("{template}", str(folder / "chatml.jinja")).replace("{path}", tiny_smollm2)
    )
    gp = start_gateway("--config", str(path), dtype=None)
    try:
        yield gp
    finally:
        gp.stop()


def _finished(gp: GatewayProc) -> dict[str, int]:
    """Requests each model's backend finished (``/admin/v1/stats``), by model."""
    out: dict[str, int] = {}
    for b in gp.stats()["backends"]:
        out[b["model"]] = out.get(b["model"], 0) + b["stats"]["requests_finished"]
    return out


def _settled(gp: GatewayProc, want: dict[str, int]) -> dict[str, int]:
    """The counters once they reach ``want`` (a backend reports a finish a moment after the response)."""
    deadline = time.monotonic() + 10
    seen = _finished(gp)
    while seen != want and time.monotonic() < deadline:
        time.sleep(0.05)
        seen = _finished(gp)
    return seen


def test_each_request_lands_on_its_models_backend(two_models):
    gp = two_models
    client = gp.openai(timeout=60)
    counts = _finished(gp)
    assert set(counts) == {"smol-bf16", "smol-f32"}
    prompt_tokens = {}
    for asked in ("smol-bf16", "smol-exact"):  # a served name, an alias of the other model
        r = client.chat.completions.create(
            model=asked, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, temperature=0
        )
        assert r.model == asked and r.usage.completion_tokens == 1
        prompt_tokens[NAMES[asked]] = r.usage.prompt_tokens
        counts[NAMES[asked]] += 1
        assert _settled(gp, counts) == counts, asked  # only the served model's backend moved
    # each model's own chat template: "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n" for smol-f32,
    # SmolLM2's (with its default system turn) for smol-bf16
    assert prompt_tokens["smol-f32"] < 12 < prompt_tokens["smol-bf16"]
    r = client.completions.create(model="smol-f32", prompt="The sky is", max_tokens=1, temperature=0)
    counts["smol-f32"] += 1
    assert r.choices[0].text and _settled(gp, counts) == counts
    body = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "stream": False}
    body["options"] = {"num_predict": 1}
    resp = httpx.post(gp.base_url + "/api/chat", json=body, headers=gp.headers(), timeout=60)
    assert resp.status_code == 200, resp.text
    counts["smol-bf16"] += 1
    assert _settled(gp, counts) == counts


def test_engine_settings_and_context_length_per_model(two_models):
    gp = two_models
    backends = {b["model"]: b["stats"] for b in gp.stats()["backends"]}
    assert backends["smol-f32"]["kv_blocks_total"] == F32_BLOCKS
    assert backends["smol-bf16"]["kv_blocks_total"] == BF16_BLOCKS
    client = gp.openai(timeout=60)
    listed = {m.id: m.model_dump() for m in client.models.list().data}
    assert listed["smol-f32"]["dtype"] == "float32" and listed["smol-bf16"]["dtype"] == "bfloat16"
    assert listed["smol-exact"]["context_length"] == F32_CONTEXT
    # smol-bf16 declares none: the file's own, capped by what its KV pool holds for one sequence
    assert listed["smol"]["context_length"] == min(TINY_CONTEXT, BF16_BLOCKS * BLOCK_SIZE)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="smol-f32", messages=[{"role": "user", "content": "Hi"}], max_tokens=F32_CONTEXT
        )
    assert exc.value.code == "invalid_value" and exc.value.param == "max_tokens"


def test_listings_name_every_model_and_alias(two_models):
    gp = two_models
    client = gp.openai(timeout=30)
    listed = {m.id: m.model_dump() for m in client.models.list().data}
    assert set(listed) == set(NAMES)
    assert {name: m["root"] for name, m in listed.items()} == NAMES
    alias = client.models.retrieve("smol-exact")
    assert alias.id == "smol-exact" and alias.model_dump() == listed["smol-exact"]
    tags = httpx.get(gp.base_url + "/api/tags", headers=gp.headers(), timeout=30).json()
    assert [m["name"] for m in tags["models"]] == list(NAMES)
    show = httpx.post(
        gp.base_url + "/api/show", json={"model": "smol-exact"}, headers=gp.headers(), timeout=30
    )
    assert show.status_code == 200 and show.json()["model_info"]["llama.context_length"] == F32_CONTEXT


def test_unknown_model_is_404_model_not_found(two_models):
    client = two_models.openai(timeout=30)
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="smol-f16", messages=[{"role": "user", "content": "Hi"}])
    assert exc.value.code == "model_not_found" and exc.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("smol-f16")
    resp = httpx.post(
        two_models.base_url + "/api/show",
        json={"model": "smol-f16"},
        headers=two_models.headers(),
        timeout=30,
    )
    assert resp.status_code == 404 and resp.json()["code"] == "model_not_found"


def test_a_tenant_sees_and_uses_only_its_models(two_models):
    gp = two_models
    admin = gp.admin_headers()
    r = httpx.post(
        gp.base_url + "/admin/v1/tenants",
        json={
            "name": "f32-only-" + os.urandom(4).hex(),
            "models": ["smol-f32"],
            "model_limits": {"smol-f32": {"rpm": 1}},
        },
        headers=admin,
        timeout=30,
    )
    assert r.status_code == 201, r.text
    r = httpx.post(
        gp.base_url + f"/admin/v1/tenants/{r.json()['id']}/keys", json={}, headers=admin, timeout=30
    )
    assert r.status_code == 201, r.text
    client = openai.OpenAI(base_url=gp.base_url + "/v1", api_key=r.json()["key"], max_retries=0, timeout=60)
    assert {m.id for m in client.models.list().data} == {"smol-f32", "smol-exact"}
    for name in ("smol-bf16", "smol"):
        with pytest.raises(openai.NotFoundError) as exc:
            client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
            )
        assert exc.value.code == "model_not_found"
        assert exc.value.message.endswith("Available: smol-f32, smol-exact.")  # only the tenant's
    r = client.chat.completions.create(
        model="smol-exact", messages=[{"role": "user", "content": "Hi"}], max_tokens=1
    )
    assert r.usage.completion_tokens == 1
    # the alias counted against the served model's limit (1 request a minute): no way around it by name
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(
            model="smol-f32", messages=[{"role": "user", "content": "Hi"}], max_tokens=1
        )
    metrics = httpx.get(gp.base_url + "/metrics", timeout=30).text  # labels: served names, not aliases
    assert 'model_name="smol-f32"' in metrics and 'model_name="smol-exact"' not in metrics
    tags = httpx.get(
        gp.base_url + "/api/tags", headers={"Authorization": f"Bearer {client.api_key}"}, timeout=30
    )
    assert [m["name"] for m in tags.json()["models"]] == ["smol-f32", "smol-exact"]


# ----------------------------------------------------------------------------- the catalog (no gateway)


class _Pool:
    """What the catalog reads of a ``BackendPool``: the card, readiness, the drain flag."""

    def __init__(self, name: str | None) -> None:
        self.card = ModelCard(name=name, context_length=2048) if name else None
        self.draining = False

    def is_ready(self) -> bool:
        return self.card is not None and not self.draining


def _principal(*models: str) -> Principal:
    return Principal("tn_1", "t", "key_1", "sk-gw-x", Limits(), models=models)


def test_catalog_resolves_names_aliases_and_the_tenants_models():
    default = ServedModel(None, pool=_Pool(None), aliases=["smol"])  # type: ignore[arg-type]
    other = ServedModel("b", pool=_Pool("B.gguf"), aliases=["b1"], context_length=512)  # type: ignore[arg-type]
    catalog = ModelCatalog([default, other])
    assert default.names == ("smol",) and not catalog.is_ready()  # no card yet: named by its aliases only
    default.pool.card = ModelCard(name="SmolLM2", context_length=8192)  # type: ignore[union-attr]
    assert default.names == ("SmolLM2", "smol") and catalog.is_ready()
    assert [n for _, n in catalog.listing(None)] == ["SmolLM2", "smol", "b", "b1"]
    assert catalog.resolve("b1", None) is other and other.context_length == 512
    assert catalog.resolve("b1", _principal("b")) is other  # allowed by its served name: every alias too
    with pytest.raises(NotFound) as exc:
        catalog.resolve("smol", _principal("b1"))
    assert exc.value.code == "model_not_found" and exc.value.message.endswith("Available: b, b1.")
    with pytest.raises(NotFound):
        catalog.resolve("SMOL", None)  # names are exact
    catalog.draining = True
    assert not catalog.is_ready() and all(p.draining for p in catalog.pools)
    with pytest.raises(ValueError, match="'b1' is used by both"):
        ModelCatalog([other, ServedModel("c", pool=_Pool("C"), aliases=["b1"])])  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- declarations (no gateway)


def test_serve_model_flag_declares_models():
    settings, _ = load_settings(
        [
            "serve",
            "--dtype=float32",
            "--num-kv-blocks=64",
            "--serve-model",
            "name=a,alias=a1,alias=a2,replicas=2,max_num_seqs=8,kv_cache_memory=64MiB",
            "--serve-model",
            "name=b,path=/m/b.gguf,context_length=256,backend_url=unix:/tmp/b.sock",
            "--serve-model",
            "name=c,kind=openai,url=http://10.0.0.5:8000/v1,url=http://10.0.0.6:8000/v1,send=prompt",
        ],
        {},
    )
    a, b, c = settings.models
    assert (a.name, a.aliases, a.replicas, a.path) == ("a", ["a1", "a2"], 2, None)
    # [engine] for every spawned backend; the model's own KV size replaces [engine]'s
    assert model_engine(settings.engine, a) == {
        "dtype": "float32",
        "max_num_seqs": "8",
        "kv_cache_memory": "64MiB",
    }
    assert (b.path, b.context_length, b.backend_url) == ("/m/b.gguf", 256, ["unix:/tmp/b.sock"])
    # another kind's own keys are kept for it (gateway/upstream/), url repeated into its list
    assert c.upstream == {"urls": ["http://10.0.0.5:8000/v1", "http://10.0.0.6:8000/v1"], "send": "prompt"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--serve-model", "a"], "expected KEY=VALUE"),
        (["--serve-model", "name=a,colour=red"], "unknown key 'colour'"),
        (["--serve-model", "name=a", "--served-model-name", "x"], "[http] served_model_name"),
        (["--serve-model", "name=a", "--serve-model", "name=b,alias=a"], "'a' is used by both"),
        (["--serve-model", "name=a,dtype=f8"], "model 'a': engine options"),
        (["--serve-model", "name=a,kind=mystery"], "kind must be native or openai"),
        (["--serve-model", "name=a,replicas=0"], "replicas"),
        (["--serve-model", "name=a,backend_url=unix:/tmp/b.sock,replicas=3"], "each URL is one replica"),
        (["--serve-model", "name=a", "--serve-model", "name=a"], "'a' is declared by two models"),
        (["--serve-model", "name=a,name=b"], "'name' given twice"),
        (["--serve-model", "name=a,max_num_seqs=4,max_num_seqs=8"], "'max_num_seqs' given twice"),
        (["--serve-model", "name=a,engine=x,max_num_seqs=8"], "give the engine options by name"),
        (["--serve-model", "name=a,upstream=x"], "give the upstream options by name"),
        (["--serve-model", "name=a,alias="], "model name '': 1-256 characters"),
        (["--serve-model", "name=" + "m" * 257], "1-256 characters"),
        (
            ["--serve-model", "name=u,kind=openai,url=http://h/v1,replicas=2"],
            "replicas: a native model's keys",
        ),
        (
            ["--serve-model", "name=u,kind=openai,url=http://h/v1,dtype=float32"],
            "dtype: a native model's keys",
        ),
        (["--serve-model", "name=u,kind=openai,url=http://h/v1,max_num_seqs=4"], "engine: a native model's"),
        (["--serve-model", "name=u,kind=openai,url=http://h/v1,chat_template=/t.jinja"], "chat_template: a"),
        (["--serve-model", "name=u,kind=openai,url=http://h/v1,backend_url=tcp://h:1"], "backend_url: a"),
        (["--serve-model", "name=a,colour=red"], "name, num_kv_blocks, path, replicas, tokenizer)"),
    ],
)
def test_bad_model_declarations_are_one_clear_error(argv, message):
    with pytest.raises(SettingsError) as exc:
        load_settings(["serve", *argv], {})
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_a_native_model_refuses_another_kinds_keys(tmp_path):
    cfg = tmp_path / "m.toml"
    cfg.write_text('[[models]]\nname = "a"\nupstream = { urls = ["http://h/v1"] }\n')
    with pytest.raises(SettingsError, match="upstream: the keys of another kind"):
        load_settings(["serve", "--config", str(cfg)], {})


@pytest.mark.parametrize("names", ['name = "a"\naliases = [" pad"]', 'name = "x\\ny"', 'name = "a "'])
def test_model_names_are_the_tenants_model_names(tmp_path, names):
    """A served name or alias that a tenant's ``models`` could not hold (gateway/admin/schemas.py: 1-256
    characters, no line break, no leading or trailing white space) stops the start with one line."""
    cfg = tmp_path / "m.toml"
    cfg.write_text(f"[[models]]\n{names}\n")
    with pytest.raises(SettingsError) as exc:
        load_settings(["serve", "--config", str(cfg)], {})
    assert "1-256 characters" in str(exc.value) and "\n" not in str(exc.value)
