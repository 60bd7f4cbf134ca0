"""The backend process's socket server and busy loop.

Threads:

* **main thread** - the busy loop; owns the ``Engine`` and every piece of
  engine and connection-protocol state. Each iteration drains the inbox
  (``queue.Queue``), handles the messages, runs one engine step when there
  is work, and hands the step's outputs, batched per connection into one
  ``StepOutputs`` frame, to the writers. With no work it blocks on the inbox.
* **acceptor thread** - accepts connections (the gateway may reconnect).
* per connection, a **reader thread** (TLS handshake, the protocol's handshake,
  then recv -> ``FrameDecoder`` -> inbox) and, once the peer is authenticated,
  a **writer thread** (outbox queue -> ``sendall``).

Handshake (``backend.protocol`` module docstring), all in the reader thread
before the main thread hears of the connection: the first frame must be
``Hello`` with our ``PROTOCOL_VERSION``; with a secret (``LinkConfig.secret``,
required on TCP) a ``Challenge`` follows and the peer's ``Proof`` must match
(``hmac.compare_digest``). Frames are read one at a time, each at most
``MAX_HANDSHAKE_FRAME_BYTES``, and the whole exchange (TLS included) within
``LinkConfig.handshake_timeout``; at most ``MAX_PENDING_HANDSHAKES`` run at once
(more connections are closed at once). A failure writes one line to stderr
(``backend: refused <peer>: <reason>``), sends ``Fatal`` and closes; no frame
after the failing one is read. Only an authenticated connection reaches the
inbox (``open``, then its ``Hello``, answered ``Ready`` with the backend's
proof by the main thread).

Protocol handling after it: a frame that does not decode
but carries a ``request_id`` gets a ``RequestError`` for that request only; a
frame without one, or an oversized frame, is connection-level garbage:
``Fatal`` + close. When a connection closes, everything it submitted is
aborted. ``Shutdown`` or SIGTERM/SIGINT: abort all, close, exit 0.

TLS (``LinkConfig.tls``, an ``ssl.SSLContext``): the socket is wrapped in the
reader thread; after the handshake it is non-blocking and each ``recv``/``send``
runs under one lock (``_TLSIO``), since one ``SSLSocket`` must not be used by
two threads at once; waits (``select``) happen outside the lock.

Source followed: vLLM v1 ``EngineCoreProc`` (busy loop + I/O threads around
ZMQ sockets), here over plain stream sockets with ``backend.protocol`` frames;
Python's ``ssl`` module ("Notes on non-blocking sockets").
"""

from __future__ import annotations

import itertools
import os
import queue
import select
import signal
import socket
import ssl
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from backend import protocol as P

if TYPE_CHECKING:
    from backend.engine import Engine

MAX_PENDING_HANDSHAKES = 64  # connections that may be in their handshake at once
TLS_WAIT_S = 1.0  # seconds a TLS reader waits on select before it asks the SSL object again
# TCP keepalive on accepted connections (tcp(7)): probes after KEEPIDLE s idle, every KEEPINTVL s, KEEPCNT of
# them: a vanished gateway's requests are aborted within about 10 s
KEEPIDLE_S, KEEPINTVL_S, KEEPCNT = 5, 2, 3


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


@dataclass(frozen=True)
class LinkConfig:
    """How connections are admitted: ``secret`` (the shared secret, bytes; None: no proof asked), ``tls`` (a
    server ``ssl.SSLContext`` or None) and ``handshake_timeout`` (seconds for TLS + the protocol handshake)."""

    secret: bytes | None = None
    tls: ssl.SSLContext | None = None
    handshake_timeout: float = P.HANDSHAKE_TIMEOUT_S


class HandshakeRefused(Exception):
    """The peer failed the handshake; ``str()`` is the log reason, ``fatal`` the text sent in ``Fatal``."""

    def __init__(self, reason: str, fatal: str = "handshake failed") -> None:
        super().__init__(reason)
        self.fatal = fatal


_handshake_decoder = msgspec.msgpack.Decoder(P.Handshake)


class _TLSIO:
    """``recv``/``sendall`` on a non-blocking ``SSLSocket`` shared by a reader and a writer thread: each SSL
    call runs under one lock, and the waits for the socket (``select``) outside it."""

    def __init__(self, sock: ssl.SSLSocket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        sock.setblocking(False)

    def _wait(self, want_write: bool, timeout: float | None) -> None:
        fd = self.sock.fileno()
        if fd < 0:
            raise OSError("socket closed")
        try:
            select.select([] if want_write else [fd], [fd] if want_write else [], [], timeout)
        except ValueError as exc:  # closed by the other thread meanwhile
            raise OSError(str(exc)) from None

    def recv(self, n: int) -> bytes:
        while True:
            with self.lock:
                try:
                    return self.sock.recv(n)
                except ssl.SSLWantReadError:
                    want_write = False
                except ssl.SSLWantWriteError:
                    want_write = True
                except ssl.SSLZeroReturnError:
                    return b""
                except ValueError as exc:  # closed by the writer thread
                    raise OSError(str(exc)) from None
            self._wait(want_write, TLS_WAIT_S)  # the timeout covers records the writer's call took in

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            with self.lock:
                try:
                    view = view[self.sock.send(view) :]
                    continue
                except ssl.SSLWantWriteError:
                    want_write = True
                except ssl.SSLWantReadError:
                    want_write = False
                except ValueError as exc:
                    raise OSError(str(exc)) from None
            self._wait(want_write, TLS_WAIT_S)


class Connection:
    """One accepted socket with its reader and writer threads (the writer starts after the handshake).

    ``ready_proof``: the backend's ``Ready.proof`` for this connection (set by the reader's handshake).
    """

    _ids = itertools.count(1)

    def __init__(
        self,
        sock: socket.socket,
        inbox: queue.Queue,
        *,
        link: LinkConfig = LinkConfig(),
        peer: str = "",
        gate: threading.BoundedSemaphore | None = None,
    ) -> None:
        self.id = next(self._ids)
        self.sock = sock
        self.io: socket.socket | _TLSIO = sock
        self.inbox = inbox
        self.link = link
        self.peer = peer or f"connection {self.id}"
        self._gate = gate
        self.ready_proof = b""
        self.outbox: queue.Queue[bytes | None] = queue.Queue()
        self.greeted = False  # main thread only
        self.closed = False  # main thread only
        self.reader = threading.Thread(target=self._read, name=f"conn{self.id}-reader", daemon=True)
        self.writer = threading.Thread(target=self._write, name=f"conn{self.id}-writer", daemon=True)

    def start(self) -> None:
        self.reader.start()

    # reader thread: the handshake
    def _recv_exact(self, n: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HandshakeRefused("handshake timed out", "handshake timed out")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(n - len(buf))
            except TimeoutError:
                raise HandshakeRefused("handshake timed out", "handshake timed out") from None
            if not data:
                raise HandshakeRefused("closed during the handshake")
            buf += data
        return bytes(buf)

    def _handshake_frame(self, deadline: float, refusal: HandshakeRefused) -> P.Hello | P.Proof:
        """The next frame, a ``Hello`` or a ``Proof``; ``refusal`` is raised for any other frame."""
        n = P.frame_length(self._recv_exact(4, deadline))
        if n > P.MAX_HANDSHAKE_FRAME_BYTES:
            raise HandshakeRefused(f"{refusal} (a frame of {n} bytes)", refusal.fatal)
        try:
            return _handshake_decoder.decode(self._recv_exact(n, deadline))
        except msgspec.DecodeError:
            raise refusal from None

    def _send_now(self, msg: msgspec.Struct) -> None:
        """Write one frame from the reader thread (before the writer runs)."""
        try:
            self.sock.sendall(P.encode_frame(msg))
        except OSError:
            pass

    def _handshake(self) -> P.Hello:
        """TLS, then ``Hello`` [-> ``Challenge``, ``Proof``]; returns the ``Hello``. Raises HandshakeRefused,
        OSError."""
        link = self.link
        deadline = time.monotonic() + link.handshake_timeout
        if link.tls is not None:
            self.sock.settimeout(link.handshake_timeout)
            try:
                self.sock = link.tls.wrap_socket(self.sock, server_side=True)
            except (ssl.SSLError, TimeoutError) as exc:
                raise HandshakeRefused(f"TLS handshake failed: {exc}", "") from None
        no_hello = HandshakeRefused("a message before Hello", "expected Hello first")
        hello = self._handshake_frame(deadline, no_hello)
        if not isinstance(hello, P.Hello):
            raise no_hello
        if hello.version != P.PROTOCOL_VERSION:
            message = f"protocol version {hello.version} not supported (backend speaks {P.PROTOCOL_VERSION})"
            raise HandshakeRefused(message, message)
        if link.secret is not None:
            server_nonce = P.new_nonce()
            self._send_now(P.Challenge(nonce=server_nonce))
            refused = "wrong or missing proof of the shared secret"
            no_proof = HandshakeRefused("no proof of the secret", refused)
            proof = self._handshake_frame(deadline, no_proof)
            if not isinstance(proof, P.Proof):
                raise no_proof
            if not P.proof_matches(proof.proof, "gateway", link.secret, hello.nonce, server_nonce):
                raise HandshakeRefused("wrong proof of the secret", refused)
            self.ready_proof = P.proof_of("backend", link.secret, hello.nonce, server_nonce)
        self.sock.settimeout(None)
        if isinstance(self.sock, ssl.SSLSocket):
            self.io = _TLSIO(self.sock)
        else:
            self.io = self.sock
        return hello

    def _admit(self) -> bool:
        """Run the handshake; on success start the writer and hand the connection to the main thread."""
        try:
            hello = self._handshake()
        except (HandshakeRefused, OSError) as exc:
            fatal = exc.fatal if isinstance(exc, HandshakeRefused) else ""
            print(f"backend: refused {self.peer}: {exc}", file=sys.stderr, flush=True)
            if fatal:
                self._send_now(P.Fatal(message=fatal))
            _close_socket(self.sock)
            return False
        finally:
            if self._gate is not None:
                self._gate.release()
        self.writer.start()
        self.inbox.put(("open", self, None))
        self.inbox.put(("msg", self, (hello, time.monotonic())))
        return True

    # reader thread
    def _read(self) -> None:
        if not self._admit():
            return
        dec = P.to_backend_decoder()
        try:
            while True:
                data = self.io.recv(1 << 16)
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
                self.io.sendall(frame)
        except OSError:
            pass
        finally:
            _close_socket(self.sock)

    # main thread
    def send(self, msg: Any) -> None:
        if not self.closed:
            self.outbox.put(P.encode_frame(msg))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.outbox.put(None)


def _close_socket(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class Server:
    """Listens, accepts connections and runs the engine's busy loop in the calling (main) thread.

    ``link``: the secret, TLS context and handshake timeout every connection is admitted with.
    """

    def __init__(self, engine: Engine, listen: str, link: LinkConfig = LinkConfig()) -> None:
        self.engine = engine
        self.listen = listen
        self.link = link
        self._gate = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
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
        return f"{'tls' if self.link.tls else 'tcp'}://{self.bound[0]}:{self.bound[1]}"

    # ------------------------------------------------------------------ threads

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self.lsock.accept()
            except OSError:
                return
            peer = "unix peer"
            if self.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for opt in P.keepalive_options(KEEPIDLE_S, KEEPINTVL_S, KEEPCNT):
                    sock.setsockopt(*opt)
                peer = f"{addr[0]}:{addr[1]}"
            if not self._gate.acquire(blocking=False):
                print(f"backend: refused {peer}: too many handshakes at once", file=sys.stderr, flush=True)
                _close_socket(sock)
                continue
            Connection(sock, self.inbox, link=self.link, peer=peer, gate=self._gate).start()

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
            f"auth={'hmac' if self.link.secret else 'none'} "
            f"device={eng.card.device} dtype={eng.card.dtype} weights={eng.card.weights} kv_blocks={eng.block_manager.num_blocks} "
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
        if not conn.greeted:  # the reader admitted it: its first message is a checked Hello
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
                    proof=conn.ready_proof,
                )
            )
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
        elif isinstance(msg, (P.Hello, P.Proof)):
            self._fatal(conn, f"unexpected {type(msg).__name__} after the handshake")

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


__all__ = ["Server", "Connection", "LinkConfig", "parse_listen", "install_signal_handlers", "time"]
