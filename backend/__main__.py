"""``python -m backend``: run one backend process (one model on one device).

Usage::

    python -m backend --model PATH --listen unix:PATH|tcp://HOST:PORT
        [--secret-file PATH] [--tls-cert PEM --tls-key PEM] [--handshake-timeout S]
        [--device cpu|cuda] [--dtype bfloat16|float32|float16]
        [--attention-backend torch|cupy]
        [--kv-cache-memory BYTES | --num-kv-blocks N] [--block-size 16]
        [--max-num-seqs N] [--max-num-batched-tokens N]
        [--long-prefill-token-threshold N] [--no-prefix-caching]
        [--num-speculative-tokens K] [--speculative-max-batch B] [--prompt-lookup-min/--prompt-lookup-max N]

Prints one readiness line to stderr (``backend ready: listening on ...``)
once the model is loaded and the socket listens. Exits 0 on Shutdown or
SIGTERM/SIGINT, 2 on bad arguments, and ``EXIT_MODEL_LOAD_FAILED`` (3) when the
model cannot be loaded, after ONE line on stderr naming the file and the reason
(``error: cannot load model /m/x.gguf: tensor 'token_embd.weight' missing``;
``backend.protocol.load_error_line``): the gateway that spawned it reads that
line and does not retry a first start that failed so.

A ``tcp://`` listener needs the shared secret of the link (``--secret-file PATH``, or the environment variable
``LLM_BACKEND_SECRET``; at least 16 bytes): every connection must prove it in the handshake before anything
else it sends is read (``backend.protocol`` module docstring). Without one the process refuses to start (one
line, exit 2); on a ``unix:`` socket the secret is optional (the socket file's permissions guard it). The
variable is removed from the environment once read, so nothing the backend starts inherits it.
``--tls-cert``/``--tls-key`` (PEM files) put the link under TLS (TCP only).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from backend import cpu_isa
from backend.model_path import WEIGHTS, default_dtype, default_model_path, generated_int4, prompt_int4
from backend.proposer import (
    DRAFT_TOKENS_DENSE,
    DRAFT_TOKENS_INT4,
    PROMPT_LOOKUP_MAX,
    PROMPT_LOOKUP_MIN,
    default_draft_tokens,
)

if TYPE_CHECKING:
    from backend.server import LinkConfig


def _bytes(s: str) -> int:
    """``123``, ``256MiB``, ``2GiB``, ``1G`` -> bytes."""
    s = s.strip()
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    low = s.lower().rstrip("b").rstrip("i")
    if low and low[-1] in units:
        return int(float(low[:-1]) * units[low[-1]])
    return int(s)


# measured: docs/perf.md, "Speculative decoding" (past 4 decoding sequences a step is bound by compute); the
# default draft length is backend.proposer.default_draft_tokens
SPEC_MAX_BATCH = 4


def add_engine_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> list[argparse.Action]:
    """Add the engine options (every option but ``--model`` and ``--listen``) to ``parser``; returns their
    actions. ``python -m gateway serve`` lists and validates them from here and passes them on to the
    backends it spawns, so the two programs never keep separate lists."""
    acts = [
        parser.add_argument("--device", default="cpu", help="torch device: cpu or cuda[:N] (default cpu)"),
        parser.add_argument(
            "--dtype",
            default=None,
            choices=["bfloat16", "float32", "float16"],
            help="compute + KV dtype (default: bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16/AMX), "
            "float32 on other CPUs; with the default --weights auto both are the fast mode, and --dtype float32 "
            "--weights dense is the exact mode)",
        ),
        parser.add_argument(
            "--weights",
            default="auto",
            choices=list(WEIGHTS),
            help="weight formats on CPU: int4 (every row through the row-invariant int4 x int8 kernel, no dense "
            "copy), mixed (generated rows int4, prompt rows dense), dense (with --dtype float32: the exact mode) or "
            "auto (default: with a 4-bit GGUF where the CPU kernels have the int4 kernel, AVX2 or AVX-512, "
            "generated rows int4 and prompt rows through whichever of int4 and dense measures faster at load; "
            "dense elsewhere)",
        ),
        parser.add_argument(
            "--attention-backend",
            default="torch",
            choices=["torch", "cupy"],
            help="attention kernels: torch (CPU reference, C++ kernels) or cupy (CUDA) (default torch)",
        ),
    ]
    kv = parser.add_mutually_exclusive_group()
    acts += [
        kv.add_argument(
            "--kv-cache-memory",
            type=_bytes,
            default=None,
            metavar="BYTES",
            help="KV pool budget (e.g. 256MiB; default 512MiB on CPU, 4GiB on CUDA)",
        ),
        kv.add_argument(
            "--num-kv-blocks",
            type=int,
            default=None,
            metavar="N",
            help="KV pool size in blocks (instead of --kv-cache-memory)",
        ),
        parser.add_argument(
            "--memory-budget",
            type=_bytes,
            default=None,
            metavar="BYTES",
            help="host memory the model load may take (default: available RAM minus max(1GiB, 10%%); 0: no check)",
        ),
        parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)"),
        parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step (default 64)"),
        parser.add_argument(
            "--max-num-batched-tokens", type=int, default=512, help="token budget of one step (default 512)"
        ),
        parser.add_argument(
            "--long-prefill-token-threshold",
            type=int,
            default=None,
            help="first-pass cap of one prefill chunk in tokens (default max(block size, batched tokens / 4))",
        ),
        parser.add_argument(
            "--no-prefix-caching", action="store_true", help="disable automatic prefix caching"
        ),
        parser.add_argument(
            "--threads",
            type=int,
            default=None,
            help="torch CPU threads, fixed (default on CPU: all cores while the machine is free, one while "
            "other processes hold the cores)",
        ),
        parser.add_argument(
            "--omp-wait-policy",
            default=None,
            choices=["passive", "active"],
            help="how idle OpenMP threads wait: passive (sleep at once) or active (spin) (default: libgomp's spin, "
            "or OMP_WAIT_POLICY/GOMP_SPINCOUNT from the environment)",
        ),
        parser.add_argument(
            "--itl-target-ms",
            type=float,
            default=150.0,
            help="inter-token latency the scheduler keeps running decodes under (ms): prefill tokens per step "
            "are cut to what fits and admission waits past 60%% of it (default 150; 0: off, every step may take "
            "the whole --max-num-batched-tokens)",
        ),
        parser.add_argument(
            "--num-speculative-tokens",
            type=int,
            default=None,
            help="n-gram (prompt lookup) draft tokens verified per sequence and step; lossless: the output "
            f"is the same with it on or off (default {DRAFT_TOKENS_INT4} where generated rows take the int4 "
            f"kernel, the bf16 CPU mode; {DRAFT_TOKENS_DENSE} on dense paths: float32, CUDA; 0: off)",
        ),
        parser.add_argument(
            "--speculative-max-batch",
            type=int,
            default=SPEC_MAX_BATCH,
            help=f"speculate only in steps with at most this many decoding sequences (default {SPEC_MAX_BATCH})",
        ),
        parser.add_argument(
            "--prompt-lookup-min",
            type=int,
            default=PROMPT_LOOKUP_MIN,
            help=f"shortest n-gram the draft proposer matches (tokens, default {PROMPT_LOOKUP_MIN}; a match of "
            "k tokens drafts at most k + 1)",
        ),
        parser.add_argument(
            "--prompt-lookup-max",
            type=int,
            default=PROMPT_LOOKUP_MAX,
            help=f"longest n-gram the draft proposer matches, tried first (tokens, default {PROMPT_LOOKUP_MAX})",
        ),
    ]
    return acts


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m backend`` (``--model``, ``--listen`` and :func:`add_engine_args`)."""
    ap = argparse.ArgumentParser(
        prog="python -m backend", description="LLM inference backend (token-in, token-out)."
    )
    ap.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--listen", required=True, help="unix:PATH or tcp://HOST:PORT")
    add_link_args(ap)
    add_engine_args(ap)
    return ap


def add_link_args(parser: argparse.ArgumentParser) -> None:
    """The options of the link to the gateway: the shared secret, TLS, the handshake's time limit."""
    link = parser.add_argument_group("link")
    link.add_argument(
        "--secret-file",
        default=None,
        metavar="PATH",
        help="file holding the shared secret connections must prove (default: $LLM_BACKEND_SECRET); "
        "required with tcp://",
    )
    link.add_argument("--tls-cert", default=None, metavar="PEM", help="TLS certificate chain (tcp:// only)")
    link.add_argument("--tls-key", default=None, metavar="PEM", help="TLS private key (with --tls-cert)")
    link.add_argument(
        "--handshake-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds a connection gets to complete TLS and the handshake (default 5)",
    )


def link_config(args: argparse.Namespace, family: int, environ: dict[str, str]) -> LinkConfig:
    """The ``LinkConfig`` of the parsed options.

    Raises:
        ValueError: one line: no secret for a TCP listener, an unreadable or short secret, TLS files that
            do not load, TLS on a unix socket, a handshake timeout that is not positive.
    """
    import socket
    import ssl

    from backend.protocol import load_secret
    from backend.server import LinkConfig

    secret = load_secret(args.secret_file, environ)
    tcp = family != socket.AF_UNIX
    if tcp and secret is None:
        raise ValueError(
            "a tcp:// listener needs the link's shared secret: --secret-file PATH or LLM_BACKEND_SECRET"
        )
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if not args.handshake_timeout > 0:
        raise ValueError("--handshake-timeout must be > 0")
    tls = None
    if args.tls_cert is not None:
        if not tcp:
            raise ValueError("TLS needs a tcp:// listener")
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            tls.load_cert_chain(args.tls_cert, args.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the TLS certificate {args.tls_cert}: {exc}") from None
    return LinkConfig(secret=secret, tls=tls, handshake_timeout=args.handshake_timeout)


def load_reason(model: str, exc: BaseException) -> str:
    """The reason part of the load-error line: the loaders' own ``ValueError``/``FileNotFoundError`` text
    (``no such file or directory`` for a path that does not exist), else ``TypeName: text``."""
    if isinstance(exc, FileNotFoundError) and not os.path.exists(model):
        return "no such file or directory"
    if isinstance(exc, (ValueError, FileNotFoundError)) and str(exc):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def log_warning(message: str) -> None:
    """One warning line on stderr (the backend logs nothing else before it is ready)."""
    print(f"python -m backend: warning: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the backend until Shutdown or a signal; the exit statuses are in the module docstring."""
    args = build_parser().parse_args(argv)
    cpu_isa.apply_or_exit("python -m backend")  # before anything imports torch: a forced ISA caps ATen/oneDNN
    from backend.allocator import ThreadGovernor, openmp_wait_policy

    openmp_wait_policy(os.environ, args.omp_wait_policy)  # before anything imports torch
    from backend.protocol import EXIT_MODEL_LOAD_FAILED, SECRET_ENV, load_error_line
    from backend.server import Server, install_signal_handlers, parse_listen

    try:
        family, _ = parse_listen(args.listen)
        link = link_config(args, family, dict(os.environ))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    os.environ.pop(SECRET_ENV, None)  # read: what the backend starts does not inherit it
    if args.max_num_batched_tokens < args.max_num_seqs:
        print("error: --max-num-batched-tokens must be >= --max-num-seqs", file=sys.stderr)
        return 2
    if (args.num_speculative_tokens or 0) < 0 or args.speculative_max_batch < 0:
        print("error: --num-speculative-tokens and --speculative-max-batch must be >= 0", file=sys.stderr)
        return 2
    if not 1 <= args.prompt_lookup_min <= args.prompt_lookup_max:
        print("error: need 1 <= --prompt-lookup-min <= --prompt-lookup-max", file=sys.stderr)
        return 2
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    governor = None
    if not args.threads and args.device == "cpu" and torch.get_num_threads() > 1:
        governor = ThreadGovernor(torch.set_num_threads, torch.get_num_threads())
    from backend.engine import Engine
    from backend.model_runner import ModelRunner

    model = args.model
    try:
        if model is None:
            model = default_model_path()
        dtype = args.dtype or default_dtype(args.device)
        if dtype == "bfloat16" and args.device.startswith("cpu") and not cpu_isa.native_bf16():
            log_warning("--dtype bfloat16 on a CPU without native bf16 (AVX512-BF16/AMX): emulated and slow")
        runner = ModelRunner(
            model,
            device=args.device,
            dtype=dtype,
            generated_int4=generated_int4(args.weights, args.device),
            prompt_int4=prompt_int4(args.weights),
            attention_backend=args.attention_backend,
            block_size=args.block_size,
            kv_cache_bytes=args.kv_cache_memory,
            num_kv_blocks=args.num_kv_blocks,
            memory_budget=args.memory_budget,
        )
        engine = Engine(
            runner,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            itl_target_ms=args.itl_target_ms,
            threads=governor,
            num_speculative_tokens=(
                default_draft_tokens(runner.generated_int4)
                if args.num_speculative_tokens is None
                else args.num_speculative_tokens
            ),
            speculative_max_batch=args.speculative_max_batch,
            prompt_lookup_min=args.prompt_lookup_min,
            prompt_lookup_max=args.prompt_lookup_max,
        )
    except Exception as exc:  # noqa: BLE001 - any load failure is reported as one line and a status
        name = model or "(default model)"
        print(load_error_line(name, load_reason(name, exc)), file=sys.stderr, flush=True)
        return EXIT_MODEL_LOAD_FAILED
    server = Server(engine, args.listen, link)
    install_signal_handlers(server)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
