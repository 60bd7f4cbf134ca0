"""The real ``python -m backend`` process over a unix socket: handshake, bad input, reconnects, shutdown.

Bad requests (out-of-vocab logit_bias, bad params, over-long prompt, out-of-vocab
prompt ids, unknown message types, oversized frames) fail alone; the engine keeps
serving the others. A closed connection aborts its requests and frees their blocks.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from backend import protocol as P

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


class Client:
    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(120)
        self.sock.connect(path)
        self.dec = P.from_backend_decoder()
        self.pending: list = []

    def send(self, msg) -> None:
        self.sock.sendall(P.encode_frame(msg))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self):
        while not self.pending:
            data = self.sock.recv(1 << 16)
            if not data:
                raise EOFError
            self.pending.extend(self.dec.feed(data))
        return self.pending.pop(0)

    def hello(self) -> P.Ready:
        self.send(P.Hello())
        r = self.recv()
        assert isinstance(r, P.Ready), r
        return r

    def run_until_done(self, ids: set[str]) -> dict[str, list]:
        """Collect outputs and errors until every id in ``ids`` finished or failed."""
        got: dict[str, list] = {i: [] for i in ids}
        left = set(ids)
        while left:
            m = self.recv()
            if isinstance(m, P.StepOutputs):
                for o in m.outputs:
                    got.setdefault(o.request_id, []).append(o)
                    if o.finish_reason is not None:
                        left.discard(o.request_id)
            elif isinstance(m, P.RequestError):
                got.setdefault(m.request_id, []).append(m)
                left.discard(m.request_id)
        return got

    def stats(self) -> P.Stats:
        self.send(P.GetStats(nonce=5))
        while True:
            m = self.recv()
            if isinstance(m, P.Stats):
                return m

    def close(self) -> None:
        self.sock.close()


def spawn_backend(model_path: str, path: str, *options: str) -> subprocess.Popen:
    """Start ``python -m backend`` (float32) listening on the unix socket ``path``; return once it is ready.

    ``options``: more command-line options (KV blocks, batch sizes). Fails the test if the process exits
    before it prints ``backend ready`` on stderr.
    """
    cmd = [sys.executable, "-m", "backend", "--model", model_path, "--listen", f"unix:{path}"]
    proc = subprocess.Popen(
        [*cmd, "--dtype", "float32", *options], cwd=ROOT, stderr=subprocess.PIPE, text=True
    )
    while "backend ready" not in (line := proc.stderr.readline()):
        assert line, "backend exited before it was ready"
    return proc


@pytest.fixture(scope="module")
def backend(tmp_path_factory, model_path):
    path = str(tmp_path_factory.mktemp("be") / "backend.sock")
    options = ("--num-kv-blocks", "64", "--max-num-seqs", "8", "--max-num-batched-tokens", "256")
    proc = spawn_backend(model_path, path, *options)
    yield proc, path
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def submit(rid, ids=(1, 9690, 198, 2683, 359), **sp):
    sp.setdefault("max_tokens", 4)
    sp.setdefault("temperature", 0.0)
    return P.Submit(request_id=rid, prompt_ids=list(ids), sampling=P.SamplingParams(**sp), cache_salt="t")


def test_handshake_and_version(backend):
    proc, path = backend
    c = Client(path)
    c.send(P.Hello(version=99))
    m = c.recv()
    assert isinstance(m, P.Fatal) and "version" in m.message
    with pytest.raises((EOFError, ConnectionResetError)):
        c.recv()
    c = Client(path)
    r = c.hello()
    assert r.version == P.PROTOCOL_VERSION and r.kv_blocks_total == 64 and r.block_size == 16
    assert r.model_card.vocab_size == 49152
    c.close()


def test_bad_requests_fail_alone(backend):
    proc, path = backend
    c = Client(path)
    r = c.hello()
    ctx = r.model_card.context_length
    good = [submit("ok1"), submit("ok2", max_tokens=6)]
    bad = {
        "bias_oov": submit("bias_oov", logit_bias={999999: 5.0}),
        "bias_neg": submit("bias_neg", logit_bias={-1: 1.0}),
        "bias_big": submit("bias_big", logit_bias={50: 150.0}),
        "oov_prompt": submit("oov_prompt", ids=[1, 49152]),
        "neg_prompt": submit("neg_prompt", ids=[-3]),
        "too_long": submit("too_long", ids=[5] * 10, max_tokens=ctx),
        "kv_too_long": submit("kv_too_long", ids=[5] * 2000, max_tokens=10),  # > 64 blocks
        "empty": submit("empty", ids=[]),
        "bad_temp": submit("bad_temp", temperature=-1.0),
        "bad_top_p": submit("bad_top_p", top_p=0.0),
        "bad_n": submit("bad_n", n=0),
        "bad_min": submit("bad_min", min_tokens=10, max_tokens=2),
        "bad_lp": submit("bad_lp", top_logprobs=21),
        "bad_stop": submit("bad_stop", stop_token_ids=[10**6]),
        "nan": submit("nan", presence_penalty=float("nan")),
    }
    c.send(good[0])
    for m in bad.values():
        c.send(m)
    # unknown message type carrying a request_id, and a submit with ill-typed fields
    enc = msgspec.msgpack.Encoder()
    body = enc.encode({"type": "frobnicate", "request_id": "unknown_type"})
    c.send_raw(struct.pack(">I", len(body)) + body)
    body = enc.encode({"type": "submit", "request_id": "ill_typed", "prompt_ids": "abc"})
    c.send_raw(struct.pack(">I", len(body)) + body)
    c.send(good[1])
    got = c.run_until_done(set(bad) | {"ok1", "ok2", "unknown_type", "ill_typed"})
    for rid in list(bad) + ["unknown_type", "ill_typed"]:
        assert len(got[rid]) == 1 and isinstance(got[rid][0], P.RequestError), (rid, got[rid])
    assert got["bias_oov"][0].code == "invalid_parameter" and got["bias_oov"][0].param == "logit_bias"
    assert got["too_long"][0].code == "context_length_exceeded"
    assert got["oov_prompt"][0].code == "invalid_token_id"
    for rid in ("ok1", "ok2"):
        fin = got[rid][-1]
        assert isinstance(fin, P.RequestOutput) and fin.finish_reason in ("length", "stop")
    assert got["ok2"][-1].usage.prompt_tokens == 5
    st = c.stats()
    assert st.nonce == 5 and st.kv_blocks_used == 0 and st.running == 0
    c.close()


def test_connection_garbage_is_fatal_but_others_keep_going(backend):
    proc, path = backend
    a = Client(path)
    a.hello()
    a.send(submit("long_a", max_tokens=20, ignore_eos=True))
    # oversized frame on another connection -> Fatal + close for that connection only
    b = Client(path)
    b.hello()
    b.send_raw(struct.pack(">I", P.MAX_FRAME_BYTES + 1))
    m = b.recv()
    assert isinstance(m, P.Fatal)
    # garbage msgpack without request_id
    c = Client(path)
    c.hello()
    c.send_raw(struct.pack(">I", 3) + b"\xc1\xc1\xc1")
    assert isinstance(c.recv(), P.Fatal)
    # a message before Hello
    d = Client(path)
    d.send(P.GetStats())
    assert isinstance(d.recv(), P.Fatal)
    got = a.run_until_done({"long_a"})
    fin = got["long_a"][-1]
    assert fin.finish_reason == "length" and fin.usage.completion_tokens == 20
    assert sum(len(o.new_token_ids) for o in got["long_a"]) == 20
    a.close()


def test_abort_and_disconnect_free_blocks(backend):
    """An aborted request and a dropped connection release everything within a step or so."""
    proc, path = backend
    a = Client(path)
    a.hello()
    a.send(submit("gone1", max_tokens=500, ignore_eos=True))
    a.send(submit("gone2", max_tokens=500, ignore_eos=True, n=2, temperature=0.7))
    # wait until both produce tokens
    seen = set()
    while len(seen) < 2:
        m = a.recv()
        if isinstance(m, P.StepOutputs):
            seen |= {o.request_id for o in m.outputs}
    a.send(P.Abort(request_id="gone1"))
    while True:
        m = a.recv()
        if isinstance(m, P.StepOutputs) and any(
            o.request_id == "gone1" and o.finish_reason == "abort" for o in m.outputs
        ):
            break
    a.close()  # drops gone2
    c = Client(path)
    c.hello()
    deadline = time.time() + 60
    while True:
        st = c.stats()
        if st.running == 0 and st.kv_blocks_used == 0:
            break
        assert time.time() < deadline, st
        time.sleep(0.05)
    assert st.aborts >= 2
    # still serving
    got = c.run_until_done({"after"}) if c.send(submit("after")) is None else None
    assert got["after"][-1].finish_reason in ("length", "stop")
    c.close()


def test_shutdown_exits_zero(tmp_path, model_path):
    path = str(tmp_path / "b.sock")
    proc = spawn_backend(model_path, path, "--num-kv-blocks", "16")
    c = Client(path)
    c.hello()
    c.send(submit("s", max_tokens=200, ignore_eos=True))
    c.recv()
    c.send(P.Shutdown())
    msgs = []
    try:
        while True:
            msgs.append(c.recv())
    except (EOFError, ConnectionResetError):
        pass
    assert any(
        isinstance(m, P.StepOutputs) and any(o.finish_reason == "abort" for o in m.outputs) for m in msgs
    )
    assert proc.wait(timeout=30) == 0
    assert not os.path.exists(path)
