"""Request bodies of the Ollama API (/api/chat, /api/generate) against a real gateway: the /v1 size limit
(``max_body_bytes``, 4 MiB by default) whether the size is announced or the body is sent chunked, and client
errors (400, never a 500) for invalid or too deeply nested JSON. Errors have Ollama's shape
``{"error": message, "type", "code"}``."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

LIMIT = 4 * 1024 * 1024  # the gateway's default max_body_bytes
PATHS = ["/api/chat", "/api/generate"]


def _body(gp, path: str, text: str) -> bytes:
    if path == "/api/chat":
        return json.dumps({"model": gp.model, "messages": [{"role": "user", "content": text}]}).encode()
    return json.dumps({"model": gp.model, "prompt": text}).encode()


def _post(gp, path: str, content, **headers) -> httpx.Response:
    hdrs = {"Content-Type": "application/json", **gp.headers(), **headers}
    return httpx.post(gp.base_url + path, content=content, headers=hdrs, timeout=60)


def _ollama_error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()
    assert isinstance(err["error"], str) and err["error"], err
    assert err["type"] == "invalid_request_error" and err["code"] == code, err
    return err


@pytest.mark.parametrize("path", PATHS)
def test_oversize_body_with_content_length_is_413(gateway, path):
    big = _body(gateway, path, "x" * (LIMIT + 1024))
    err = _ollama_error(_post(gateway, path, big), 413, "request_too_large")
    assert str(LIMIT) in err["error"]


@pytest.mark.parametrize("path", PATHS)
def test_oversize_chunked_body_is_413(gateway, path):
    big = _body(gateway, path, "x" * (LIMIT + 1024))
    sent = []

    def chunks():
        for i in range(0, len(big), 65536):
            sent.append(i)
            yield big[i : i + 65536]

    r = _post(gateway, path, chunks())  # a generator: Transfer-Encoding chunked, no Content-Length
    _ollama_error(r, 413, "request_too_large")
    assert sent  # the body really went out in chunks


def test_oversize_body_through_the_official_client(gateway):
    c = ollama.Client(host=gateway.base_url, headers=gateway.headers(), timeout=60)
    with pytest.raises(ollama.ResponseError) as ei:
        c.generate(model=gateway.model, prompt="x" * (LIMIT + 1024))
    assert ei.value.status_code == 413
    with pytest.raises(ollama.ResponseError) as ei:
        c.chat(model=gateway.model, messages=[{"role": "user", "content": "x" * (LIMIT + 1024)}])
    assert ei.value.status_code == 413


@pytest.mark.parametrize("path", PATHS)
def test_body_at_the_limit_is_read(gateway, path):
    # an empty prompt / message list only "loads" the model: answered without generating
    head = json.dumps({"model": gateway.model, "prompt": "", "messages": [], "stream": False}).encode()
    body = head[:-1] + b" " * (LIMIT - len(head)) + b"}"
    assert len(body) == LIMIT
    r = _post(gateway, path, body)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["done"] is True and r.json()["done_reason"] == "load"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000,
        b"[" * 100_000 + b"]" * 100_000,
        b'{"model": "m", "options": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_001,
    ],
    ids=["open-arrays", "closed-arrays", "nested-objects"],
)
def test_deeply_nested_json_is_400(gateway, path, raw):
    _ollama_error(_post(gateway, path, raw), 400, "invalid_json")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("raw", [b"{not json", b'{"model": "m",', b"", b"\xff\xfe{}"], ids=repr)
def test_invalid_json_is_400(gateway, path, raw):
    _ollama_error(_post(gateway, path, raw), 400, "invalid_json")


@pytest.mark.parametrize("path", PATHS)
def test_a_body_that_is_not_an_object_is_400(gateway, path):
    r = _post(gateway, path, b"[1, 2]")
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "invalid_request_error"


def test_413_to_a_client_that_closes_is_not_a_server_error(gateway):
    """A client announcing an oversized body, reading the 413 and closing at once races hypercorn's close
    of the connection with the end of the response: that is a disconnect, never an unhandled error in the
    log (nor a ``server_error`` access-log line)."""
    import socket

    key = gateway.headers()["Authorization"]
    head = (
        "POST /api/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: {key}\r\nContent-Length: 99999999\r\n\r\n{{}}"
    ).encode()
    start = gateway.log_path.stat().st_size
    for _ in range(30):
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as s:
            s.sendall(head)
            assert s.recv(65536).startswith(b"HTTP/1.1 413")
    with open(gateway.log_path, "rb") as f:
        f.seek(start)
        log = f.read().decode(errors="replace")
    assert "unhandled error" not in log and "BusyResourceError" not in log, gateway.log_tail()
    assert httpx.get(gateway.base_url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    "method, path, headers, status",
    [
        ("POST", "/api/chat", {}, 401),
        ("POST", "/api/chat", {"Authorization": "Bearer sk-wrong"}, 401),
        ("GET", "/api/tags", {}, 401),
        ("GET", "/api/chat", None, 405),
        ("GET", "/api/nonexistent", None, 404),
    ],
)
def test_ollama_routes_answer_errors_in_ollama_shape(gateway, method, path, headers, status):
    """Errors raised before an Ollama handler runs (auth, unknown route, wrong method) are in Ollama's
    shape too: ``{"error": "<message>"}``, which Ollama clients read as a string."""
    hdrs = gateway.headers() if headers is None else headers
    r = httpx.request(method, gateway.base_url + path, headers=hdrs, timeout=30)
    assert r.status_code == status, r.text
    assert isinstance(r.json()["error"], str) and r.json()["error"], r.text
    with pytest.raises(ollama.ResponseError) as ei:
        ollama.Client(host=gateway.base_url, headers={"Authorization": "Bearer sk-wrong"}).list()
    assert ei.value.status_code == 401 and "API key" in ei.value.error


@pytest.mark.parametrize(
    "content, status",
    [
        (b"{}", 400),
        (b'{"model": 5}', 400),
        (b"[1]", 400),
        (b"{nope", 400),
        (b'{"model": "no-such-model"}', 404),
    ],
)
def test_show_needs_a_model_name(gateway, content, status):
    r = _post(gateway, "/api/show", content)
    assert r.status_code == status, r.text
    assert isinstance(r.json()["error"], str)
