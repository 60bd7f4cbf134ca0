"""The backend link over TCP and TLS: the shared-secret handshake both ways, refusals, a replica killed mid-stream.

Two real backend processes listen on loopback: ``plain`` on ``tcp://`` and ``tls`` on
``tls://`` (a self-signed certificate for 127.0.0.1), both with the same secret file and a 1 s handshake
limit. They serve ``tiny_smollm2`` (``plugins.tiny_smollm2``: the default model's tokenizer and chat
template on tiny random weights): nothing here reads the generated text, only its structure. Checked:

* a ``tcp://`` listener without a secret does not start: one stderr line, exit 2, before any model load;
* raw sockets without the proof, with a wrong proof, with garbage, an oversized handshake frame, an old
  protocol version, or silent: each is closed (``Fatal``, then EOF; the silent one within the 1 s limit)
  and logged, and the ``Submit`` sent right behind the failing frame is never read: the engine's
  ``prompt_tokens`` and ``requests_finished`` do not move;
* the gateway's side of the handshake (fake backends, no model): a TCP backend that proves nothing or proves
  the wrong thing is refused with ``AuthenticationFailed``; a spawned TCP backend gets its secret in its
  environment, not its command line; an external backend that dies is reconnected with capped exponential
  backoff, is ``unavailable`` (503 ``model_unavailable``) after ``max_failures``, and serves again;
* a real gateway with both backends (``--backend-url tcp://...`` and ``tls://...``, the secret, the CA file)
  serves through each with the openai client; kill -9 of one replica mid-stream ends its streams with an
  error event within ``ERROR_BOUND_S`` and the next request is served by the other;
* the wrong secret stops a first start at once with one clear line (no retry, no hang).
* a ``tcp://`` URL to a TLS listener and a ``tls://`` URL to a plain one: an error naming the scheme to use.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from plugins.gateway_server import ROOT, chat_body, free_port, start_gateway
from plugins.redis_server import self_signed

from backend import protocol as P

pytestmark = pytest.mark.slow

ERROR_BOUND_S = 5.0  # seconds from kill -9 to the error event of a stream it served
REFUSED_BOUND_S = 10.0  # seconds a first start with the wrong secret may take to fail
HANDSHAKE_S = 1.0  # --handshake-timeout of the test backends
#: tokens a stream of the kill test asks for (``ignore_eos``): near the tiny model's context, which decodes
#: fast, so that every stream is still running when its replica is killed
STREAM_TOKENS = 1900
KV_BLOCKS = 1024  # per backend: 8 such streams (the tiny model's blocks are a few KiB each)


# ----------------------------------------------------------------------------- backends


class Backend:
    """One ``python -m backend`` on loopback; stderr goes to ``log``."""

    def __init__(self, folder: Path, name: str, model: str, secret_file: Path, tls=None) -> None:
        self.port = free_port()
        self.log = folder / f"{name}.log"
        self.tls = tls
        scheme = "tls" if tls else "tcp"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "backend", "--model", model]
        self.args += ["--listen", f"tcp://127.0.0.1:{self.port}"]
        self.args += ["--secret-file", str(secret_file), "--handshake-timeout", str(HANDSHAKE_S)]
        self.args += ["--num-kv-blocks", str(KV_BLOCKS), "--max-num-seqs", "8", "--threads", "1"]
        if tls:
            self.args += ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]
        env = {k: v for k, v in os.environ.items() if k != P.SECRET_ENV}
        self.proc = subprocess.Popen(self.args, cwd=ROOT, stderr=open(self.log, "wb"), env=env)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while "backend ready" not in self.log.read_text():
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "backend not ready"
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()  # a no-op once it exited
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def link(tmp_path_factory, tiny_smollm2):
    """``(secret bytes, secret file, TLS files, plain backend, TLS backend)``, both started at once."""
    folder = tmp_path_factory.mktemp("link")
    secret = os.urandom(32).hex().encode()
    secret_file = folder / "secret"
    secret_file.write_bytes(secret + b"\n")
    tls = self_signed(folder)
    plain = Backend(folder, "plain", tiny_smollm2, secret_file)
    tls_backend = Backend(folder, "tls", tiny_smollm2, secret_file, tls)
    try:
        plain.wait_ready()
        tls_backend.wait_ready()
        yield secret, secret_file, tls, plain, tls_backend
    finally:
        plain.stop()
        tls_backend.stop()


class Raw:
    """A blocking socket to a backend that speaks frames (optionally under TLS)."""

    def __init__(self, backend: Backend, timeout: float = 10) -> None:
        sock = socket.create_connection(("127.0.0.1", backend.port), timeout=timeout)
        if backend.tls:
            ctx = ssl.create_default_context(cafile=str(backend.tls.cert))
            sock = ctx.wrap_socket(sock, server_hostname="127.0.0.1")
        self.sock = sock
        self.dec = P.from_backend_decoder()
        self.pending: list = []

    def send(self, *msgs) -> None:
        self.sock.sendall(b"".join(m if isinstance(m, bytes) else P.encode_frame(m) for m in msgs))

    def recv(self):
        """The next message, or None at EOF."""
        while not self.pending:
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                return None
            self.pending.extend(self.dec.feed(data))
        return self.pending.pop(0)

    def authenticate(self, secret: bytes) -> P.Ready:
        nonce = P.new_nonce()
        self.send(P.Hello(nonce=nonce))
        challenge = self.recv()
        assert isinstance(challenge, P.Challenge), challenge
        self.send(P.Proof(proof=P.proof_of("gateway", secret, nonce, challenge.nonce)))
        ready = self.recv()
        assert isinstance(ready, P.Ready), ready
        assert P.proof_matches(ready.proof, "backend", secret, nonce, challenge.nonce)
        return ready

    def stats(self) -> P.Stats:
        self.send(P.GetStats(nonce=7))
        while not isinstance(m := self.recv(), P.Stats):
            assert m is not None
        return m

    def close(self) -> None:
        self.sock.close()


def submit(rid: str) -> P.Submit:
    return P.Submit(request_id=rid, prompt_ids=[1, 9690, 198], sampling=P.SamplingParams(max_tokens=1))


def test_tcp_listener_without_a_secret_does_not_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != P.SECRET_ENV}
    cmd = [sys.executable, "-m", "backend", "--listen", f"tcp://127.0.0.1:{free_port()}"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "needs the link's shared secret" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run(cmd, cwd=ROOT, env={**env, P.SECRET_ENV: "short"}, capture_output=True, text=True)
    assert out.returncode == 2 and "at least 16" in out.stderr and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.timeout(300)  # the backends' start (fixture) counts
@pytest.mark.parametrize("which", ["plain", "tls"])
def test_unauthenticated_connections_are_refused_before_any_submit(link, which):
    secret, _, _, plain, tls_backend = link
    backend = plain if which == "plain" else tls_backend
    observer = Raw(backend)
    observer.authenticate(secret)
    before = observer.stats()
    good_nonce = P.new_nonce()
    attempts = {
        "no proof": [P.Hello(nonce=good_nonce), submit("no-proof")],
        "wrong proof": [P.Hello(nonce=good_nonce), P.Proof(proof=b"\0" * 32), submit("wrong-proof")],
        "garbage": [struct.pack(">I", 3) + b"\xc1\xc1\xc1", submit("garbage")],
        "huge frame": [struct.pack(">I", P.MAX_FRAME_BYTES)],
        "old version": [P.Hello(version=1), submit("old-version")],
        "submit first": [submit("submit-first")],
    }
    for name, frames in attempts.items():
        r = Raw(backend)
        r.send(*frames)
        msgs = []
        while (m := r.recv()) is not None:
            msgs.append(m)
        kinds = [type(m).__name__ for m in msgs]
        assert kinds in (["Fatal"], ["Challenge", "Fatal"]), (name, kinds)
        r.close()
    # the right nonce with the proof of another secret
    r = Raw(backend)
    r.send(P.Hello(nonce=good_nonce))
    challenge = r.recv()
    r.send(
        P.Proof(proof=P.proof_of("gateway", b"another secret of 32 bytes......", good_nonce, challenge.nonce))
    )
    r.send(submit("other-secret"))
    assert isinstance(r.recv(), P.Fatal) and r.recv() is None
    # silent: closed by the handshake limit
    r = Raw(backend)
    t0 = time.monotonic()
    assert r.recv() is None or r.recv() is None
    assert time.monotonic() - t0 < HANDSHAKE_S + 2.0
    after = observer.stats()
    assert (after.prompt_tokens, after.requests_finished) == (before.prompt_tokens, before.requests_finished)
    assert after.running == after.waiting == 0
    observer.close()
    log = backend.log.read_text()
    assert "wrong proof of the secret" in log and "no proof of the secret" in log and "timed out" in log


# ----------------------------------------------------------------------------- the gateway's side, fake backends


async def _fake_backend(behaviour: str, task_status) -> None:
    """A TCP listener answering one handshake as ``behaviour`` says: ``no-proof`` (Ready at once),
    ``wrong-proof`` (Challenge, then Ready with a proof of another secret)."""
    import trio

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    stream = await listeners[0].accept()
    dec = P.to_backend_decoder()
    hello = dec.feed(await stream.receive_some(65536))[0]
    card = P.ModelCard(name="fake")
    ready = dict(
        version=P.PROTOCOL_VERSION, model_card=card, kv_blocks_total=1, block_size=16, max_num_seqs=1
    )
    if behaviour == "no-proof":
        await stream.send_all(P.encode_frame(P.Ready(**ready, max_num_batched_tokens=16)))
    else:
        nonce = P.new_nonce()
        await stream.send_all(P.encode_frame(P.Challenge(nonce=nonce)))
        await stream.receive_some(65536)
        proof = P.proof_of("backend", b"x" * 32, hello.nonce, nonce)
        await stream.send_all(P.encode_frame(P.Ready(**ready, max_num_batched_tokens=16, proof=proof)))
    await trio.sleep(5)


@pytest.mark.parametrize("behaviour", ["no-proof", "wrong-proof"])
async def test_gateway_refuses_a_backend_that_does_not_prove_the_secret(behaviour):
    import trio

    from gateway.backends.address import LinkCredentials
    from gateway.backends.client import BackendClient

    async with trio.open_nursery() as nursery:
        port = await nursery.start(_fake_backend, behaviour)
        with pytest.raises(P.AuthenticationFailed, match="did not prove|wrong proof"):
            await BackendClient.connect(
                f"tcp://127.0.0.1:{port}", timeout=5, credentials=LinkCredentials(secret=b"s" * 32)
            )
        nursery.cancel_scope.cancel()


async def _scheme_listener(tls: ssl.SSLContext | None, task_status) -> None:
    """One connection to a listener as a backend of the other scheme answers it: with ``tls`` a TLS
    listener whose handshake fails on the plain Hello; without, a plain one that answers a TLS ClientHello
    with a ``Fatal`` frame (what ``python -m backend`` does), both then closing."""
    import trio

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    raw = await listeners[0].accept()
    if tls is not None:
        stream = trio.SSLStream(raw, tls, server_side=True)
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.do_handshake()
    else:
        await raw.receive_some(65536)
        await raw.send_all(P.encode_frame(P.Fatal(message="expected Hello first")))
    await trio.aclose_forcefully(raw)


@pytest.mark.parametrize("listener", ["tls", "plain"])
async def test_a_url_of_the_wrong_scheme_is_named_in_the_error(tmp_path, listener):
    """A ``tcp://`` URL to a TLS backend and a ``tls://`` URL to a plain one fail with a ``ProtocolError``
    that names the scheme to use (a bare ``connection reset`` before)."""
    import trio

    from gateway.backends.address import LinkCredentials
    from gateway.backends.client import BackendClient

    ctx = None
    if listener == "tls":
        files = self_signed(tmp_path)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(files.cert, files.key)
    scheme, want = ("tcp", "a tls:// URL") if listener == "tls" else ("tls", "a tcp:// URL")
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_scheme_listener, ctx)
        with pytest.raises(P.ProtocolError, match=want):
            await BackendClient.connect(
                f"{scheme}://127.0.0.1:{port}", timeout=5, credentials=LinkCredentials(secret=b"s" * 32)
            )


FAKE_TCP_BACKEND = """
import os, socket, sys
sys.path.insert(0, {root!r})
from backend import protocol as P

secret = os.environ[P.SECRET_ENV].encode()
assert P.SECRET_ENV not in " ".join(sys.argv) and os.environ[P.SECRET_ENV] not in " ".join(sys.argv)
host, port = sys.argv[sys.argv.index("--listen") + 1][len("tcp://"):].rsplit(":", 1)
s = socket.create_server((host, int(port)))
conn, _ = s.accept()
dec = P.to_backend_decoder()
msgs = []
def recv():
    while not msgs:
        msgs.extend(dec.feed(conn.recv(65536)))
    return msgs.pop(0)
hello = recv()
nonce = P.new_nonce()
conn.sendall(P.encode_frame(P.Challenge(nonce=nonce)))
assert P.proof_matches(recv().proof, "gateway", secret, hello.nonce, nonce)
conn.sendall(P.encode_frame(P.Ready(version=P.PROTOCOL_VERSION, model_card=P.ModelCard(name="fake"),
    kv_blocks_total=1, block_size=16, max_num_seqs=1, max_num_batched_tokens=16,
    proof=P.proof_of("backend", secret, hello.nonce, nonce))))
while True:
    data = conn.recv(65536)
    if not data or any(isinstance(m, P.Shutdown) for m in dec.feed(data)):
        sys.exit(0)
"""


@pytest.mark.timeout(60)
async def test_spawned_tcp_backend_gets_its_secret_in_the_environment(tmp_path):
    import trio

    from gateway.backends import supervisor as S

    exe = tmp_path / "fake-python"
    exe.write_text(f"#!{sys.executable}\n" + FAKE_TCP_BACKEND.format(root=str(ROOT)))
    exe.chmod(0o755)
    sup = S.BackendSupervisor(spawn=S.SpawnSpec(model="m", python=str(exe), host="127.0.0.1"))
    async with trio.open_nursery() as nursery:
        with trio.fail_after(20):
            await nursery.start(sup.run)
        assert sup.state == "ready" and sup.url.startswith("tcp://127.0.0.1:"), sup.info()
        with trio.fail_after(20):
            await sup.stop(grace=1)


async def _flaky_backend(secret: bytes, accepting, after: str, task_status) -> None:
    """A backend (no model) on a fixed port that completes the handshake while ``accepting`` holds a True;
    otherwise it closes every connection at once (``after="close"``) or refuses the proof (``"refuse"``).
    It hangs up the first accepted link after 0.2 s."""
    import trio

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    served = 0
    while True:
        stream = await listeners[0].accept()
        if not accepting[0] and after == "close":
            await stream.aclose()
            continue
        dec = P.to_backend_decoder()
        hello = dec.feed(await stream.receive_some(65536))[0]
        nonce = P.new_nonce()
        await stream.send_all(P.encode_frame(P.Challenge(nonce=nonce)))
        dec.feed(await stream.receive_some(65536))
        if not accepting[0]:
            await stream.send_all(
                P.encode_frame(P.Fatal(message="wrong or missing proof of the shared secret"))
            )
            await stream.aclose()
            continue
        ready = P.Ready(
            version=P.PROTOCOL_VERSION,
            model_card=P.ModelCard(name="fake"),
            kv_blocks_total=1,
            block_size=16,
            max_num_seqs=1,
            max_num_batched_tokens=16,
            proof=P.proof_of("backend", secret, hello.nonce, nonce),
        )
        await stream.send_all(P.encode_frame(ready))
        served += 1
        if served == 1:
            await trio.sleep(0.2)
            accepting[0] = False
            await stream.aclose()


@pytest.mark.timeout(60)
async def test_external_backend_is_reconnected_with_backoff_then_unavailable_then_back(monkeypatch):
    import trio

    from gateway.backends import supervisor as S
    from gateway.backends.address import LinkCredentials

    monkeypatch.setattr(S, "BACKOFF_MIN_S", 0.1)
    monkeypatch.setattr(S, "BACKOFF_MAX_S", 0.4)
    secret = os.urandom(16).hex().encode()
    accepting = [True]
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_flaky_backend, secret, accepting, "close")
        sup = S.BackendSupervisor(
            url=f"tcp://127.0.0.1:{port}", max_failures=4, credentials=LinkCredentials(secret=secret)
        )
        with trio.fail_after(10):
            await nursery.start(sup.run)
        states, t0 = [], trio.current_time()
        with trio.fail_after(10):
            while sup.state != "unavailable":  # noqa: ASYNC110 - polling the actor from outside
                if sup.state not in states:
                    states.append(sup.state)
                await trio.sleep(0.01)
        # failures at about 0, 0.1, 0.3, 0.7 s after the link ended: unavailable after the 4th
        assert 0.5 < trio.current_time() - t0 < 3.0 and states[-1] == "restarting", states
        with pytest.raises(S.ModelUnavailable) as err:
            await sup.wait_client(5)
        assert err.value.code == "model_unavailable" and int(err.value.headers["retry-after"]) >= 1
        accepting[0] = True  # the backend is back: the next attempt (every BACKOFF_MAX_S) serves again
        with trio.fail_after(5):
            while (client := sup.client) is None:  # noqa: ASYNC110 - polling the actor from outside
                await trio.sleep(0.01)
        assert client.alive and sup.state == "ready" and sup.restarts >= 4, sup.info()
        with trio.fail_after(10):
            await sup.stop()
        nursery.cancel_scope.cancel()


async def test_a_refused_proof_after_a_good_start_is_unavailable_at_once():
    """The backend came back with another secret: no backoff ladder (waiting would not fix it)."""
    import trio

    from gateway.backends import supervisor as S
    from gateway.backends.address import LinkCredentials

    secret = os.urandom(16).hex().encode()
    accepting = [True]
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_flaky_backend, secret, accepting, "refuse")
        sup = S.BackendSupervisor(url=f"tcp://127.0.0.1:{port}", credentials=LinkCredentials(secret=secret))
        with trio.fail_after(10):
            await nursery.start(sup.run)
        with trio.fail_after(5):
            while sup.state != "unavailable":  # noqa: ASYNC110 - polling the actor from outside
                await trio.sleep(0.01)
        assert sup.failures == 2 and sup.last_error.startswith("authentication failed: "), sup.info()
        with trio.fail_after(10):
            await sup.stop()
        nursery.cancel_scope.cancel()


# ----------------------------------------------------------------------------- a real gateway on both links


class Stream(threading.Thread):
    """One streamed completion; records its events and when an error event came."""

    def __init__(self, gw, prompt: str) -> None:
        super().__init__(daemon=True)
        self.gw = gw
        self.body = {
            "model": gw.model,
            "prompt": prompt,
            "max_tokens": STREAM_TOKENS,
            "stream": True,
            "ignore_eos": True,
        }
        self.events: list[dict] = []
        self.done = False
        self.error_at: float | None = None
        self.leave = False  # set: the client stops reading (the gateway aborts the request)

    def run(self) -> None:
        with httpx.stream(
            "POST",
            self.gw.base_url + "/v1/completions",
            json=self.body,
            headers=self.gw.headers(),
            timeout=120,
        ) as r:
            for line in r.iter_lines():
                if self.leave:
                    break
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error_at = time.monotonic()
                    self.events.append(event)


@pytest.mark.timeout(240)
def test_gateway_serves_through_tcp_and_tls_and_survives_a_replica_killed_mid_stream(link):
    secret, secret_file, tls, plain, tls_backend = link
    gw = start_gateway(
        *("--backend-url", plain.url, "--backend-url", tls_backend.url),
        *("--backend-secret-file", str(secret_file), "--backend-tls-ca-file", str(tls.cert)),
        *("--backend-wait", "5"),
        dtype=None,
    )
    try:
        backends = {b["url"]: b for b in gw.stats()["backends"]}
        assert {backends[plain.url]["state"], backends[tls_backend.url]["state"]} == {"ready"}, backends
        r = gw.openai().chat.completions.create(
            model=gw.model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
        )
        assert r.choices[0].message.content and r.usage.completion_tokens >= 1

        # streams until each replica has one in flight (whatever the routing policy); each stream's replica
        # is the one whose in_flight grew when it started
        streams: dict[Stream, str] = {}
        deadline = time.monotonic() + 60
        in_flight = {b["url"]: b["in_flight"] for b in gw.stats()["backends"]}
        while not (in_flight[plain.url] and in_flight[tls_backend.url]):
            assert time.monotonic() < deadline and len(streams) < 12, in_flight
            s = Stream(gw, f"{len(streams)} {len(streams) * 7} Once upon a time, a dragon learned to cook.")
            s.start()
            while not s.events and s.is_alive():
                time.sleep(0.02)
            now = {b["url"]: b["in_flight"] for b in gw.stats()["backends"]}
            (streams[s],) = [u for u in now if now[u] > in_flight[u]]
            in_flight = now
        t_kill = time.monotonic()
        plain.proc.send_signal(signal.SIGKILL)
        plain.proc.wait(10)
        for s, url in streams.items():
            if url == plain.url:
                s.join(ERROR_BOUND_S + 1)
                assert s.done and s.error_at is not None, s.events[-2:]
                assert s.events[-1]["error"]["code"] == "backend_unavailable", s.events[-1]
                assert s.error_at - t_kill < ERROR_BOUND_S, s.error_at - t_kill
        survivors = [s for s, url in streams.items() if url == tls_backend.url]
        assert all(s.is_alive() and s.error_at is None for s in survivors), "the TLS replica's streams go on"
        r = httpx.post(
            gw.base_url + "/v1/chat/completions",
            json=chat_body(gw, "Say hi.", max_tokens=4),
            headers=gw.headers(),
            timeout=30,
        )
        assert r.status_code == 200, r.text
        states = {b["url"]: b["state"] for b in gw.stats()["backends"]}
        assert states[tls_backend.url] == "ready" and states[plain.url] != "ready", states
        for s in survivors:
            s.leave = True
            s.join(10)
    finally:
        gw.stop()


@pytest.mark.timeout(300)  # the backends' start (fixture) counts
async def test_wrong_secret_stops_the_first_start_at_once_with_one_line(link):
    """The supervisor of ``python -m gateway serve`` (its ``BackendStartError`` is the CLI's one line and exit 1,
    tests/fault/test_model_cannot_load.py): no retry, no hang."""
    import trio

    from gateway.backends import supervisor as S
    from gateway.backends.address import link_credentials

    _, _, tls, _, tls_backend = link
    wrong = link_credentials(None, str(tls.cert), {P.SECRET_ENV: os.urandom(32).hex()})
    sup = S.BackendSupervisor(url=tls_backend.url, credentials=wrong)
    t0 = trio.current_time()
    with trio.fail_after(REFUSED_BOUND_S), pytest.raises(S.BackendStartError) as err:
        await sup.run()
    assert trio.current_time() - t0 < 2.0 and sup.restarts == 0
    (line,) = str(err.value).splitlines()
    assert line == (
        f"authentication failed: backend {tls_backend.url} refused the handshake: "
        "wrong or missing proof of the shared secret"
    )
    assert "wrong proof of the secret" in tls_backend.log.read_text()


def test_backend_urls_and_link_credentials(tmp_path):
    """No model: the URL forms and the start-up errors of the gateway's link settings."""
    from gateway.backends.address import is_network_url, link_credentials, parse_backend_url

    assert parse_backend_url("tls://10.0.0.7:7000") == ("tls", ("10.0.0.7", 7000))
    assert parse_backend_url("tcp+tls://[::1]:7000") == ("tls", ("::1", 7000))
    assert parse_backend_url("tcp://h:1") == ("tcp", ("h", 1)) and parse_backend_url("unix:/s") == (
        "unix",
        "/s",
    )
    assert is_network_url("tls://h:1") and is_network_url("tcp://h:1") and not is_network_url("unix:/s")
    with pytest.raises(ValueError, match="lacks a port"):
        parse_backend_url("tls://h")
    assert link_credentials(None, None, {}).secret is None
    assert link_credentials(None, None, {P.SECRET_ENV: "s" * 16}).secret == b"s" * 16
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    with pytest.raises(ValueError, match=f"cannot load the backend CA file {bad}"):
        link_credentials(None, str(bad), {})
