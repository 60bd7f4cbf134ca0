"""Prefix-aware routing keeps each system prompt's KV blocks on one replica; least-loaded spreads them.

The model: a tiny random-weight llama (``plugins.tiny_models``: hidden 64, 2 layers, 4 heads of 16) carrying
the default model's (SmolLM2-135M's) GGUF tokenizer and chat template, written once per run into a
temporary folder (the ``tiny_smollm2`` fixture, ``plugins.tiny_smollm2``). Prefix-cache hits and prefix-aware routes depend only on the prompt's token ids and its
KV block hashes, not on the weights, so the hit rates are the real model's (the rendered prompts are checked
to equal the default model's ids) at a fraction of the prefill time. The real model's TTFT under both
policies is measured by ``bench/routing.py`` and recorded in docs/perf.md.

Two real backend processes (``python -m backend``, spawned by the gateway's own ``BackendSupervisor``s in
one ``BackendPool``), each KV pool capped (``--num-kv-blocks``) to about half of 8 distinct ~600-token
system prompts, and one uncapped replica. The same 8 x 16 chat prompts (the bench's ``workload``, rendered
with the model's chat template; ``max_tokens`` 1) are sent in shuffled order, 4 in flight, through
``BackendPool.pick(prompt_ids, salt)``: with prefix-aware routing, with least-loaded routing (the policy
switched on the same pool; a fresh tenant salt, so the first run's cached blocks serve nothing), and to the
uncapped replica. The prefix-cache hit rate is the backends' own count: hit tokens / prompt tokens
(``Stats.prefix_cache_hits``, ``Stats.prompt_tokens``).

Asserted: prefix-aware >= 85% of the uncapped rate and >= 20 points above least-loaded. The three rates are
printed (``-s``). The admin test (list, drain, undrain) runs a private gateway with 2 backends of the same
tiny model.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import httpx
import openai
import pytest
import trio
from plugins.gateway_server import GatewayProc

from backend.protocol import SamplingParams, Stats, Submit
from gateway.backends.pool import BackendPool
from gateway.backends.routing import Router, RoutingConfig
from gateway.backends.supervisor import BackendSupervisor, SpawnSpec
from templating import ChatTemplate, cached_tokenizer


def _bench_module():
    """bench/routing.py, loaded by its path (bench/ is scripts, not an installed package)."""
    path = Path(__file__).resolve().parents[2] / "bench" / "routing.py"
    spec = importlib.util.spec_from_file_location("bench_routing", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


workload = _bench_module().workload
CAP_BLOCKS = 176  # per capped replica: ~4.8 of the 8 prompts (37 blocks of 16 a request, 36 of them shared)
IN_FLIGHT = 4


def pool_of(model: str, n: int, *extra: str, name: str) -> BackendPool:
    spec = SpawnSpec(model=model, extra_args=["--threads=1", *extra], startup_timeout=300)
    return BackendPool([BackendSupervisor(spawn=spec, name=f"{name}-{i}") for i in range(n)])


async def totals(pool: BackendPool) -> Stats:
    """The pool's backends' counters summed (hits and prompt tokens)."""
    out = Stats()
    for s in pool.supervisors:
        assert s.client is not None
        st = await s.client.get_stats()
        out.prefix_cache_hits += st.prefix_cache_hits
        out.prompt_tokens += st.prompt_tokens
    return out


async def hit_rate(pool: BackendPool, prompts: list[list[int]], salt: str) -> float:
    """Send every prompt (``max_tokens`` 1, ``IN_FLIGHT`` at once) through ``pool.pick``; the hit tokens /
    prompt tokens of these requests, from the backends' counters."""
    before = await totals(pool)
    send, recv = trio.open_memory_channel[tuple[int, list[int]]](len(prompts))
    for item in enumerate(prompts):
        send.send_nowait(item)
    send.close()

    async def sender() -> None:
        async for i, ids in recv:
            client = await pool.pick(ids, salt)
            submit = Submit(
                request_id=f"{salt}-{i}",
                prompt_ids=ids,
                sampling=SamplingParams(max_tokens=1),
                cache_salt=salt,
            )
            with client.open_request(submit) as handle:
                while (out := await handle.next()) is not None and out.finish_reason is None:
                    pass

    async with trio.open_nursery() as nursery:
        for _ in range(IN_FLIGHT):
            nursery.start_soon(sender)
    after = await totals(pool)
    return (after.prefix_cache_hits - before.prefix_cache_hits) / (after.prompt_tokens - before.prompt_tokens)


def rendered(model: str) -> list[list[int]]:
    """The workload's 8 x 16 chat prompts as token ids, rendered with ``model``'s tokenizer and template."""
    template = ChatTemplate(cached_tokenizer(model))
    return [
        template.render([{"role": "system", "content": s}, {"role": "user", "content": q}]).ids
        for _, s, q in workload(prompts=8, questions=16, seed=0)
    ]


async def test_prefix_routing_beats_least_loaded_and_nears_one_uncapped_replica(tiny_smollm2, model_path):
    prompts = rendered(tiny_smollm2)
    assert prompts == rendered(model_path)  # the default model's tokens, hence its KV blocks
    assert 550 <= sum(map(len, prompts)) / len(prompts) <= 700  # ~600-token system prompts
    capped = pool_of(tiny_smollm2, 2, f"--num-kv-blocks={CAP_BLOCKS}", name="capped")
    uncapped = pool_of(tiny_smollm2, 1, name="uncapped")
    t0 = time.monotonic()
    async with trio.open_nursery() as nursery:
        await nursery.start(capped.run)
        await nursery.start(uncapped.run)
        t1 = time.monotonic()
        rates: dict[str, float] = {}

        async def run_capped() -> None:
            rates["prefix"] = await hit_rate(capped, prompts, "tn_prefix")
            capped.router = Router(RoutingConfig(policy="least-loaded"))
            rates["least-loaded"] = await hit_rate(capped, prompts, "tn_least")

        async def run_uncapped() -> None:
            rates["uncapped"] = await hit_rate(uncapped, prompts, "tn_uncapped")

        async with trio.open_nursery() as runs:
            runs.start_soon(run_capped)
            runs.start_soon(run_uncapped)
        print(
            f"\nprefix-cache hit rate: prefix-aware {rates['prefix']:.3f}, least-loaded "
            f"{rates['least-loaded']:.3f}, one uncapped replica {rates['uncapped']:.3f} "
            f"(start {t1 - t0:.1f} s, runs {time.monotonic() - t1:.1f} s)"
        )
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as stops:
                stops.start_soon(capped.stop)
                stops.start_soon(uncapped.stop)
        nursery.cancel_scope.cancel()
    assert rates["prefix"] >= 0.85 * rates["uncapped"], rates
    assert rates["prefix"] >= rates["least-loaded"] + 0.20, rates


def finished(gp: GatewayProc) -> dict[str, int]:
    """Requests each backend finished (GET /admin/v1/stats)."""
    return {b["name"]: b["stats"]["requests_finished"] for b in gp.stats()["backends"]}


def test_admin_backends_list_drain_undrain(make_gateway, tiny_smollm2):
    gp = make_gateway("--backends", "2", "--threads", "1", "--model", tiny_smollm2)
    assert gp.model == "tiny-smollm2"  # the file's stem
    url, A = gp.base_url + "/admin/v1/backends", gp.admin_headers()
    assert httpx.get(url, timeout=30).status_code == 401
    assert httpx.get(url, headers=gp.headers(), timeout=30).status_code == 403  # a tenant key
    listing = httpx.get(url, headers=A, timeout=30).json()
    assert [b["id"] for b in listing["data"]] == ["backend-0", "backend-1"]
    for b in listing["data"]:
        assert (b["state"], b["spawned"], b["url"], b["draining"], b["model"]) == (
            "ready",
            True,
            None,
            False,
            gp.model,
        )
        assert b["stats"]["kv_blocks_free"] + b["stats"]["kv_blocks_used"] == b["stats"]["kv_blocks_total"]
    client = gp.openai()
    system = workload(prompts=1, questions=1, prompt_words=200)[0][1]  # > 8 blocks: one route key

    def ask(question: str) -> None:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        client.chat.completions.create(model=gp.model, messages=messages, max_tokens=1)  # type: ignore[arg-type]

    before = finished(gp)
    for q in ("one?", "two?", "three?"):
        ask(q)
    delta = {k: v - before[k] for k, v in finished(gp).items()}
    assert sorted(delta.values()) == [0, 3], delta  # one system prompt: one backend
    home = max(delta, key=delta.__getitem__)
    other = next(k for k in delta if k != home)
    listing = httpx.get(url, headers=A, timeout=30).json()
    hit = next(b for b in listing["data"] if b["id"] == home)
    assert hit["stats"]["prefix_cache_hit_rate"] > 0
    (routing,) = listing["routing"]
    assert (routing["model"], routing["policy"], routing["prefix_blocks"]) == (gp.model, "prefix", 8)
    assert routing["routed_prefix"] >= 3

    r = httpx.post(f"{url}/{home}/drain?wait=10", headers=A, timeout=30)
    assert r.status_code == 200, r.text
    assert (r.json()["state"], r.json()["draining"], r.json()["drained"]) == ("draining", True, True)
    before = finished(gp)
    ask("four?")
    assert finished(gp)[other] == before[other] + 1  # the drained one gets nothing new
    assert httpx.post(f"{url}/{other}/drain", headers=A, timeout=30).status_code == 200
    with pytest.raises(openai.APIStatusError) as e:
        ask("five?")
    assert e.value.status_code == 503
    assert httpx.get(gp.base_url + "/readyz", timeout=30).status_code == 503
    for name in (home, other):
        r = httpx.post(f"{url}/{name}/undrain", headers=A, timeout=30)
        assert (r.status_code, r.json()["state"], r.json()["draining"]) == (200, "ready", False)
    ask("six?")
    assert httpx.get(gp.base_url + "/readyz", timeout=30).status_code == 200

    r = httpx.post(f"{url}/backend-9/drain", headers=A, timeout=30)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "backend_not_found" and r.json()["error"]["param"] == "backend_id"
    r = httpx.post(f"{url}/{home}/drain?wait=soon", headers=A, timeout=30)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "wait")
    assert httpx.get(f"{url}/{home}", headers=A, timeout=30).status_code in (404, 405)
