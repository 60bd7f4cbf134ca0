"""The backend process's socket server and busy loop.

Threads:

* **main thread** - the busy loop; owns the ``Engine`` and every piece of
  engine and connection-protocol state. Each iteration drains the inbox
  (``queue.Queue``), handles the messages, runs one engine step when there
  is work, and hands the step's outputs, batched per connection into one
  ``StepOutputs`` frame, to the writers. With no work it blocks on the inbox.
* **acceptor thread** - accepts connections (the gateway may reconnect).
* per connection, a **reader thread** (recv -> ``FrameDecoder`` -> inbox) and
  a **writer thread** (outbox queue -> ``sendall``).

Protocol handling: the first message must be ``Hello`` with our
``PROTOCOL_VERSION`` (else ``Fatal`` + close). A frame that does not decode
but carries a ``request_id`` gets a ``RequestError`` for that request only; a
frame without one, or an oversized frame, is connection-level garbage:
``Fatal`` + close. When a connection closes, everything it submitted is
aborted. ``Shutdown`` or SIGTERM/SIGINT: abort all, close, exit 0.

Source followed: vLLM v1 ``EngineCoreProc`` (busy loop + I/O threads around
ZMQ sockets), here over plain stream sockets with ``backend.protocol`` frames.
"""

from __future__ import annotations

import itertools
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

from backend import protocol as P
from backend.engine import Engine


def parse_listen(addr: str) -> tuple[int, Any]:
    """``unix:/path`` -> ``(AF_UNIX, path)``; ``tcp://host:port`` -> ``(AF_INET, (host, port))``.

    Raises:
        ValueError: any other form.
    """
    if addr.startswith("unix:"):
        path = addr[len("unix:") :]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise ValueError("empty unix socket path")
        return socket.AF_UNIX, path
    if addr.startswith("tcp://"):
        hostport = addr[len("tcp://") :]
        host, _, port = hostport.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        return (socket.AF_INET6 if ":" in host else socket.AF_INET), (host, int(port))
    raise ValueError(f"--listen must be unix:PATH or tcp://HOST:PORT, got {addr!r}")


class Connection:
    """One accepted socket with its reader and writer threads."""

    _ids = itertools.count(1)

    def __init__(self, sock: socket.socket, inbox: queue.Queue) -> None:
        self.id = next(self._ids)
        self.sock = sock
        self.inbox = inbox
        self.outbox: queue.Queue[bytes | None] = queue.Queue()
        self.greeted = False  # main thread only
        self.closed = False  # main thread only
        self.reader = threading.Thread(target=self._read, name=f"conn{self.id}-reader", daemon=True)
        self.writer = threading.Thread(target=self._write, name=f"conn{self.id}-writer", daemon=True)

    def start(self) -> None:
        self.reader.start()
        self.writer.start()

    # reader thread
    def _read(self) -> None:
        dec = P.to_backend_decoder()
        try:
            while True:
                data = self.sock.recv(1 << 16)
                if not data:
                    break
                while True:
                    try:
                        for msg in dec.feed(data):
                            self.inbox.put(("msg", self, (msg, time.monotonic())))
                        break
                    except P.FrameTooLarge as exc:
                        self.inbox.put(("fatal", self, str(exc)))
                        return
                    except P.ProtocolError as exc:
                        for msg in getattr(exc, "decoded", []):
                            self.inbox.put(("msg", self, (msg, time.monotonic())))
                        rid = getattr(exc, "request_id", None)
                        if rid is None:
                            self.inbox.put(("fatal", self, f"undecodable message: {exc}"))
                            return
                        self.inbox.put(("bad", self, (rid, str(exc))))
                        data = b""  # continue with the frames after the bad one
        except OSError:
            pass
        finally:
            self.inbox.put(("closed", self, None))

    # writer thread
    def _write(self) -> None:
        try:
            while True:
                frame = self.outbox.get()
                if frame is None:
                    break
                self.sock.sendall(frame)
        except OSError:
            pass
        finally:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()

    # main thread
    def send(self, msg: Any) -> None:
        if not self.closed:
            self.outbox.put(P.encode_frame(msg))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.outbox.put(None)


class Server:
    """Listens, accepts connections and runs the engine's busy loop in the calling (main) thread."""

    def __init__(self, engine: Engine, listen: str) -> None:
        self.engine = engine
        self.listen = listen
        self.inbox: queue.Queue = queue.Queue()
        self.conns: set[Connection] = set()
        self._stop = False
        self.family, self.address = parse_listen(listen)
        self.lsock = socket.socket(self.family, socket.SOCK_STREAM)
        if self.family == socket.AF_UNIX:
            if os.path.exists(self.address):
                os.unlink(self.address)
        else:
            self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(self.address)
        self.lsock.listen(16)
        self.bound = self.lsock.getsockname()

    def bound_address(self) -> str:
        if self.family == socket.AF_UNIX:
            return f"unix:{self.bound}"
        return f"tcp://{self.bound[0]}:{self.bound[1]}"

    # ------------------------------------------------------------------ threads

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.lsock.accept()
            except OSError:
                return
            if self.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(sock, self.inbox)
            self.inbox.put(("open", conn, None))
            conn.start()

    def request_stop(self, *_: Any) -> None:
        """Signal handler / Shutdown: stop after aborting everything."""
        self._stop = True
        self.inbox.put(("wake", None, None))

    # ------------------------------------------------------------------ loop

    def serve_forever(self) -> None:
        """Run until Shutdown or a signal. Prints the readiness line to stderr."""
        threading.Thread(target=self._accept, name="acceptor", daemon=True).start()
        eng = self.engine
        print(
            f"backend ready: listening on {self.bound_address()} model={eng.card.name} "
            f"device={eng.card.device} dtype={eng.card.dtype} kv_blocks={eng.block_manager.num_blocks} "
            f"block_size={eng.block_manager.block_size} pid={os.getpid()}",
            file=sys.stderr,
            flush=True,
        )
        try:
            while not self._stop:
                if not eng.has_work():
                    try:
                        item = self.inbox.get(timeout=1.0)
                    except queue.Empty:
                        continue
                    self._handle(item)
                self._drain()
                if self._stop:
                    break
                if eng.has_work():
                    self._step()
        finally:
            self._shutdown()

    def _drain(self) -> None:
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(item)

    def _step(self) -> None:
        eng = self.engine
        try:
            results = eng.step()
        except Exception as exc:  # a bug in the step itself: fail what was in flight, keep serving
            traceback.print_exc(file=sys.stderr)
            results = []
            for rid in list(eng.requests):
                owner = eng.owner_of(rid)
                req = eng.requests[rid]
                results.append((owner, eng._fail(req, f"engine step failed: {type(exc).__name__}: {exc}")))
        if not results:
            return
        per_conn: dict[Connection, list[P.RequestOutput]] = {}
        for owner, msg in results:
            if owner is None or owner.closed:
                continue
            if isinstance(msg, P.RequestOutput):
                per_conn.setdefault(owner, []).append(msg)
            else:
                owner.send(msg)
        for conn, outs in per_conn.items():
            conn.send(P.StepOutputs(outputs=outs, step=eng.num_steps))

    def _fatal(self, conn: Connection, message: str) -> None:
        if not conn.closed:
            conn.send(P.Fatal(message=message))
            conn.close()
        self.engine.abort_owner(conn)

    def _handle(self, item: tuple) -> None:
        kind, conn, payload = item
        eng = self.engine
        if kind == "wake":
            return
        if kind == "open":
            self.conns.add(conn)
            return
        if kind == "closed":
            conn.close()
            self.conns.discard(conn)
            eng.abort_owner(conn)
            return
        if conn.closed:
            return
        if kind == "fatal":
            self._fatal(conn, payload)
            return
        if kind == "bad":
            rid, message = payload
            if conn.greeted:
                conn.send(
                    P.RequestError(
                        request_id=rid, code="invalid_request_error", message=f"bad message: {message}"
                    )
                )
            else:
                self._fatal(conn, "expected Hello first")
            return
        msg, received = payload  # received: monotonic time the reader thread decoded it
        if not conn.greeted:
            if isinstance(msg, P.Hello) and msg.version == P.PROTOCOL_VERSION:
                conn.greeted = True
                conn.send(
                    P.Ready(
                        version=P.PROTOCOL_VERSION,
                        model_card=eng.card,
                        kv_blocks_total=eng.block_manager.num_blocks,
                        block_size=eng.block_manager.block_size,
                        max_num_seqs=eng.max_num_seqs,
                        max_num_batched_tokens=eng.max_num_batched_tokens,
                        features=eng.features,
                    )
                )
            elif isinstance(msg, P.Hello):
                self._fatal(
                    conn,
                    f"protocol version {msg.version} not supported (backend speaks {P.PROTOCOL_VERSION})",
                )
            else:
                self._fatal(conn, "expected Hello first")
            return
        if isinstance(msg, P.Submit):
            try:
                err = eng.add_request(msg, owner=conn, received_at=received)
            except Exception as exc:  # never let one bad submit kill the loop
                traceback.print_exc(file=sys.stderr)
                err = P.RequestError(request_id=msg.request_id, code="internal_error", message=str(exc))
            if err is not None:
                conn.send(err)
        elif isinstance(msg, P.Abort):
            if eng.owner_of(msg.request_id) is conn:
                if msg.index is None:
                    outs = eng.abort_request(msg.request_id)
                else:
                    outs = eng.abort_choice(msg.request_id, msg.index)
                if outs:
                    conn.send(P.StepOutputs(outputs=outs, step=eng.num_steps))
        elif isinstance(msg, P.GetStats):
            conn.send(eng.stats(msg.nonce))
        elif isinstance(msg, P.Shutdown):
            self.request_stop()
        elif isinstance(msg, P.Hello):
            self._fatal(conn, "duplicate Hello")

    def _shutdown(self) -> None:
        for owner, out in self.engine.abort_all():
            if owner is not None and not owner.closed:
                owner.send(P.StepOutputs(outputs=[out], step=self.engine.num_steps))
        for conn in list(self.conns):
            conn.close()
        for conn in list(self.conns):
            conn.writer.join(timeout=2.0)
        try:
            self.lsock.close()
        finally:
            if self.family == socket.AF_UNIX:
                try:
                    os.unlink(self.address)
                except OSError:
                    pass


def install_signal_handlers(server: Server) -> None:
    """SIGTERM and SIGINT stop the server cleanly (abort all, exit 0)."""
    signal.signal(signal.SIGTERM, server.request_stop)
    signal.signal(signal.SIGINT, server.request_stop)


__all__ = ["Server", "Connection", "parse_listen", "install_signal_handlers", "time"]
