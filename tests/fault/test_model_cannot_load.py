"""A model that cannot load, and a backend that keeps dying: the gateway fails fast, backs off, and stops at any
moment.

* ``python -m gateway serve --model BAD`` for a path that does not exist, a file that is not GGUF and a
  vocab-only GGUF (tokenizer metadata, no tensor; written here with ``gguf.GGUFWriter`` from the default
  model's metadata, as llama.cpp's ``ggml-vocab-*.gguf`` files are): exits non-zero within 30 s, its last
  stderr line ``python -m gateway serve: error: cannot load model BAD: <reason>``, the reason said once, no
  restart. ``python -m backend`` alone: exit status 3 and the one line.
* SIGTERM while the backend is still loading (the backend is SIGSTOPped, a load that never ends): the gateway
  exits 0 within ``PROMPT_EXIT_S`` and no process it started is left.
* A backend that dies at once every time it is restarted after a good start (each new backend child is
  SIGKILLed as soon as it appears): the restarts are spaced 0.5, 1, 2 s (exponential, never a tight
  loop); after ``MAX_FAILURES`` = 4 failures in a row (``--max-failures 4``; the default is 5, fewer keeps the
  test short) the model is unavailable: a request gets 503
  ``model_unavailable`` with ``retry-after`` at once, ``/readyz`` is 503, no new attempt for
  ``UNAVAILABLE_RETRY_S`` = 30 s; SIGTERM during that backoff exits 0 within ``PROMPT_EXIT_S``.
* A restart that cannot load the model (the file was removed after a good start): unavailable at once; the
  reason names the file in the supervisor's ``last_error`` (the log, ``/admin/v1/stats``), not in the 503.
  And ``stop()`` (what SIGTERM runs) while a restarted backend is still loading: the process is SIGTERMed
  at once, not after the 10 s ``Shutdown`` grace. These two drive ``BackendSupervisor`` against a fake
  backend process (``fake_backend``: the handshake without torch), so they take about a second.

Bounds: 30 s from the issue (exit of a gateway whose model cannot load); ``PROMPT_EXIT_S`` = 5 s, the normal
drain bound of the issue, for a SIGTERM with nothing in flight.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from plugins.gateway_server import ROOT, chat_body, free_port, post_json

pytestmark = pytest.mark.slow

EXIT_BOUND_S = 30.0
PROMPT_EXIT_S = 5.0
MAX_FAILURES = 4  # --max-failures (backend.max_failures; the default is 5)
BACKOFFS_S = (0.5, 1.0, 2.0)  # the waits before restarts #1..#3


def write_vocab_only_gguf(src: str, dst: Path) -> None:
    """A GGUF with ``src``'s metadata (architecture, hyperparameters, tokenizer) and no tensor."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), "llama")
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            if f.types[1] == gguf.GGUFValueType.STRING:
                writer.add_array(key, [bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data])
            else:
                writer.add_array(key, [f.parts[i].tolist()[0] for i in f.data])
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_string(key, bytes(f.parts[f.data[0]]).decode())
        else:
            writer.add_key_value(key, f.parts[f.data[0]].tolist()[0], vtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gateway_cmd(tmp: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gateway",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "--db",
        str(tmp / f"t-{os.urandom(4).hex()}.sqlite"),
        *args,
    ]


def spawn(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def backend_children(pid: int) -> list[psutil.Process]:
    """The gateway's direct children that run ``python -m backend`` (exec done: a child still between fork
    and exec runs the gateway's image)."""
    out = []
    try:
        kids = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []
    for p in kids:
        try:
            if "backend" in p.cmdline()[1:3]:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def kill_tree(proc: subprocess.Popen, extra: list[psutil.Process] = ()) -> None:
    """Cleanup after a failed assertion: SIGKILL the process and everything it started."""
    for p in [*descendants(proc.pid), *extra]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


@pytest.mark.timeout(120)
def test_gateway_exits_at_once_when_its_model_cannot_load(tmp_path, model_path):
    missing = tmp_path / "missing.gguf"
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("these are notes, not a model\n")
    vocab_only = tmp_path / "vocab-only.gguf"
    write_vocab_only_gguf(model_path, vocab_only)
    cases = {
        missing: "no such file or directory",
        not_gguf: "not a GGUF file",
        vocab_only: "tensor 'token_embd.weight' missing",
    }
    t0 = time.monotonic()
    procs = {m: spawn(gateway_cmd(tmp_path, "--model", str(m))) for m in cases}  # side by side: one wait
    backend_alone = spawn([sys.executable, "-m", "backend", "--model", str(vocab_only), "--listen", "unix:x"])
    try:
        results = {}
        for m, p in procs.items():
            try:
                out, err = p.communicate(timeout=max(1.0, EXIT_BOUND_S - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                pytest.fail(f"gateway with --model {m} still running after {EXIT_BOUND_S}s")
            results[m] = (p.returncode, time.monotonic() - t0, err)
        b_out, b_err = backend_alone.communicate(timeout=EXIT_BOUND_S)
    finally:
        for p in [*procs.values(), backend_alone]:
            kill_tree(p)
    for m, (rc, took, err) in results.items():
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 1, (m, rc, err[-2000:])
        assert took < EXIT_BOUND_S, (m, took)
        assert lines[-1].startswith(f"python -m gateway serve: error: cannot load model {m}: "), err[-2000:]
        assert cases[m] in lines[-1], lines[-1]
        assert sum("cannot load model" in ln for ln in lines) == 1, err[-2000:]  # said once, one line
        assert "Traceback" not in err and "restarting" not in err, err[-2000:]
    assert backend_alone.returncode == 3, b_err
    assert b_err.strip().splitlines() == [
        f"error: cannot load model {vocab_only}: no tensors in the file (a vocab-only GGUF?): "
        "tensor 'token_embd.weight' missing"
    ]


@pytest.mark.timeout(60)
def test_sigterm_while_the_backend_is_still_loading(tmp_path):
    proc = spawn(gateway_cmd(tmp_path))
    stopped: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 30
        while not (kids := backend_children(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.01)
        backend = kids[0]
        backend.suspend()  # SIGSTOP: a load that does not end
        stopped.append(backend)
        time.sleep(0.3)
        assert proc.poll() is None
        tree = [backend, *descendants(backend.pid)]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(PROMPT_EXIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"gateway still running {PROMPT_EXIT_S}s after SIGTERM during startup")
        took = time.monotonic() - t0
        assert rc == 0, proc.stderr.read()[-2000:]
        assert took < PROMPT_EXIT_S
        time.sleep(0.2)
        assert not alive(tree), alive(tree)
    finally:
        kill_tree(proc, stopped)


class Reaper:
    """SIGKILLs every backend process the gateway starts, as soon as it appears; records when each appeared."""

    def __init__(self, gateway_pid: int) -> None:
        self.gateway_pid = gateway_pid
        self.spawned: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        seen: set[int] = set()
        while not self._stop.is_set():
            for p in backend_children(self.gateway_pid):
                try:
                    if p.pid not in seen:
                        seen.add(p.pid)
                        self.spawned.append((time.monotonic(), p.pid))
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.01)


def backend_state(gw) -> dict:
    return gw.stats()["backends"][0]


@pytest.mark.timeout(120)
def test_backend_that_keeps_dying_backs_off_then_is_unavailable(fault_gateway):
    gw = fault_gateway("--max-failures", str(MAX_FAILURES))
    reaper = Reaper(gw.proc.pid)
    t_kill = time.monotonic()
    reaper.start()  # kills the running backend now, then each restart
    try:
        deadline = t_kill + sum(BACKOFFS_S) + 15
        while len(reaper.spawned) < MAX_FAILURES:
            assert time.monotonic() < deadline, reaper.spawned
            time.sleep(0.05)
        time.sleep(0.5)  # the last one's failure is seen
        # the restarts were spaced by the backoff: exponential, never a tight loop
        times = [t_kill] + [t for t, _ in reaper.spawned[1:]]
        gaps = [b - a for a, b in zip(times, times[1:])]
        for gap, want in zip(gaps, BACKOFFS_S):
            assert gap >= want * 0.9, (gaps, BACKOFFS_S)
        # unavailable: a request gets 503 at once, with a code and retry-after; /readyz says not ready
        t0 = time.monotonic()
        r = post_json(gw, "/v1/chat/completions", chat_body(gw, "Hi.", max_tokens=2), timeout=30)
        took = time.monotonic() - t0
        assert r.status_code == 503, r.text
        assert took < 2.0, took
        err = r.json()["error"]
        assert err["code"] == "model_unavailable" and err["type"] == "server_error", err
        assert 1 <= int(r.headers["retry-after"]) <= 30, r.headers
        rz = httpx.get(gw.base_url + "/readyz", timeout=10)
        assert rz.status_code == 503 and rz.json()["error"]["code"] == "model_unavailable", rz.text
        assert rz.json()["error"]["message"].startswith(f"model '{gw.model}': "), rz.text  # names the model
        assert 1 <= int(rz.headers["retry-after"]) <= 30, rz.headers
        st = backend_state(gw)
        assert st["state"] == "unavailable" and st["failures"] >= MAX_FAILURES, st
        assert len(reaper.spawned) == MAX_FAILURES, reaper.spawned  # no attempt since
        # SIGTERM during the (30 s) backoff: prompt exit, nothing left behind
        tree = descendants(gw.proc.pid)
        t0 = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(PROMPT_EXIT_S) == 0
        assert time.monotonic() - t0 < PROMPT_EXIT_S
        assert not alive(tree), alive(tree)
    finally:
        reaper.stop()
        gw.stop()


FAKE_BACKEND = """
import os, socket, sys, time
sys.path.insert(0, {root!r})
from backend import protocol as P

model = sys.argv[sys.argv.index("--model") + 1]
listen = sys.argv[sys.argv.index("--listen") + 1]
if not os.path.exists(model):
    print(P.load_error_line(model, "no such file or directory"), file=sys.stderr, flush=True)
    sys.exit(P.EXIT_MODEL_LOAD_FAILED)
if open(model).read() == "slow":
    time.sleep(600)  # a load that does not end
s = socket.socket(socket.AF_UNIX)
s.bind(listen[len("unix:"):])
s.listen(1)
conn, _ = s.accept()
dec = P.to_backend_decoder()
card = P.ModelCard(name="fake")
while data := conn.recv(65536):
    for m in dec.feed(data):
        if isinstance(m, P.Hello):
            ready = P.Ready(version=P.PROTOCOL_VERSION, model_card=card, kv_blocks_total=1, block_size=16,
                            max_num_seqs=1, max_num_batched_tokens=16)
            conn.sendall(P.encode_frame(ready))
        elif isinstance(m, P.Shutdown):
            sys.exit(0)
"""


def fake_backend(tmp_path: Path) -> str:
    """An executable that a ``SpawnSpec(python=...)`` runs as ``EXE -m backend --model M --listen unix:S``: a
    backend without torch that answers the handshake at once, fails to load (status 3 and the load-error
    line) when M does not exist, and loads forever when M holds ``slow``."""
    exe = tmp_path / "fake-python"
    exe.write_text(f"#!{sys.executable}\n" + FAKE_BACKEND.format(root=str(ROOT)))
    exe.chmod(0o755)
    return str(exe)


@pytest.mark.timeout(60)
async def test_restart_that_cannot_load_the_model_is_unavailable_at_once(tmp_path):
    """The model file is removed after a good start, then the backend dies: the restart fails to load it,
    and the model is unavailable at once (no backoff ladder: waiting would not bring the file back)."""
    import trio

    from gateway.backends import supervisor as S

    model = tmp_path / "m.gguf"
    model.write_text("fast")
    sup = S.BackendSupervisor(spawn=S.SpawnSpec(model=str(model), python=fake_backend(tmp_path)))
    async with trio.open_nursery() as nursery:
        with trio.fail_after(20):
            await nursery.start(sup.run)
        pid = sup.pid
        model.unlink()
        os.kill(pid, signal.SIGKILL)
        with trio.fail_after(10):
            while sup.state != "unavailable":  # noqa: ASYNC110 - polling the actor from outside
                await trio.sleep(0.02)
        assert sup.restarts == 1 and sup.last_error == f"cannot load model {model}: no such file or directory"
        t0 = trio.current_time()
        with pytest.raises(S.ModelUnavailable) as err:
            await sup.wait_client(30)
        assert trio.current_time() - t0 < 0.5  # at once, not after the 30 s wait
        assert err.value.code == "model_unavailable" and str(tmp_path) not in err.value.message  # no path
        assert 25 <= int(err.value.headers["retry-after"]) <= 30
        with trio.fail_after(PROMPT_EXIT_S):
            await sup.stop()
    assert sup.state == "stopped"


@pytest.mark.timeout(60)
async def test_stop_during_a_restart_that_is_still_loading(tmp_path):
    """SIGTERM's path (``stop()``) while a restarted backend loads: the process is SIGTERMed at once (it has
    no link to get ``Shutdown`` on) and ``stop()`` returns in well under its 10 s grace."""
    import trio

    from gateway.backends import supervisor as S

    model = tmp_path / "m.gguf"
    model.write_text("fast")
    sup = S.BackendSupervisor(spawn=S.SpawnSpec(model=str(model), python=fake_backend(tmp_path)))
    async with trio.open_nursery() as nursery:
        with trio.fail_after(20):
            await nursery.start(sup.run)
        first = sup.pid
        model.write_text("slow")
        os.kill(first, signal.SIGKILL)
        with trio.fail_after(10):
            while sup.pid == first or sup.state == "ready":  # noqa: ASYNC110 - polling from outside
                await trio.sleep(0.02)
        await trio.sleep(0.3)  # the restarted one is loading
        loading = psutil.Process(sup.pid)
        assert sup.state == "restarting" and loading.is_running()
        t0 = trio.current_time()
        await sup.stop()
        assert trio.current_time() - t0 < 2.0
    assert not alive([loading])
