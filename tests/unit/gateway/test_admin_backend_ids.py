"""``/admin/v1/backends/{id}/drain|undrain`` (gateway/admin/backends.py) for every backend name a model may
give: a served name with a slash (Hugging Face's ``org/model``, as vLLM serves them) names its backends
``org/model-backend-<i>``, and the routes take that id whole (``{backend_id:path}``)."""

from __future__ import annotations

from types import SimpleNamespace
from urllib.parse import quote

import pytest
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

from gateway.admin.backends import backend_routes
from gateway.backends.pool import BackendPool
from gateway.backends.supervisor import BackendSupervisor


async def _admit(request) -> None:
    return None


@pytest.mark.parametrize("name", ["smol", "meta-llama/Llama-3.1-8B-Instruct", "a b/c?d#é"])
def test_drain_and_undrain_take_a_backend_id_with_slashes(name):
    s = BackendSupervisor(url="tcp://127.0.0.1:1", name=f"{name}-backend-0")
    pool = BackendPool([s], wait_timeout=0.1)
    gw = SimpleNamespace(check_admin=_admit, catalog=[SimpleNamespace(name=name, pool=pool)])
    app = Starlette(routes=[Mount("/admin/v1", routes=backend_routes(gw))])  # type: ignore[arg-type]
    quoted = quote(s.name, safe="/")
    with TestClient(app, backend="trio") as client:
        r = client.post(f"/admin/v1/backends/{quoted}/drain")
        assert r.status_code == 200, r.text
        assert (r.json()["id"], r.json()["draining"]) == (s.name, True) and s.name in pool.drained
        r = client.post(f"/admin/v1/backends/{quoted}/undrain")
        assert r.status_code == 200 and r.json()["draining"] is False and not pool.drained
        r = client.post(f"/admin/v1/backends/{quoted}x/drain")
        assert r.status_code == 404 and r.json()["error"]["code"] == "backend_not_found"
