"""Routing among one model's replicas: which ready backend serves a request (plain Python, no Trio).

Two policies (``[backend] routing``):

* ``least-loaded``: the replica with the fewest requests in flight (ties: the next one after the last
  chosen, so an idle pool is used in turn).
* ``prefix`` (default): requests whose prompts start with the same full KV blocks go to the same replica,
  whose prefix cache then holds those blocks (the backend's cache, backend/block_manager.py, keys full
  blocks of ``block_size`` tokens by a chain salted with ``Submit.cache_salt``). The route key is the chained
  key of the prompt's first ``prefix_blocks`` full blocks (fewer when the prompt has fewer; a prompt shorter
  than one block has none and goes least-loaded), computed with BLAKE2b, salted the same way: the same
  tenant's same leading blocks give the same key in every gateway process, across restarts. The replica is
  chosen by rendezvous (highest-random-weight) hashing of that key with each ready replica's id: adding or
  removing a replica moves only the keys that it wins or held. Load bound: when the preferred replica has
  more than ``max_waiting`` requests in flight beyond the least-loaded replica's count (requests that would
  wait behind it while another replica has room), the request goes least-loaded instead.

Sources followed: rendezvous hashing, D. Thaler and C. Ravishankar, "A Name-Based Mapping Scheme for
Rendezvous" (1996) and "Using name-based mappings to increase hit rates" (IEEE/ACM ToN 6(1), 1998); the
idea of routing by prompt prefix with a load bound, SGLang's cache-aware router (sgl-router: cache
affinity unless the load is imbalanced) and vLLM's prefix-aware routing (production-stack router).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from gateway.sections import BackendSettings

Policy = Literal["prefix", "least-loaded"]

_KEY_BYTES = 16  # BLAKE2b digest size of a chained block key
_ROOT = b"gateway-prefix-route-v1"  # the chain's starting parent (and the BLAKE2b key of every hash)
_U32 = next(c for c in "IL" if array(c).itemsize == 4)  # array typecode of a 4-byte unsigned int


@dataclass(frozen=True)
class RoutingConfig:
    """The routing settings of one pool (``[backend] routing``, ``route_prefix_blocks``,
    ``route_max_waiting``)."""

    policy: Policy = "prefix"
    prefix_blocks: int = 8  # leading full blocks hashed into the route key (>= 1; measured: docs/perf.md)
    max_waiting: int = 4  # requests beyond the least-loaded replica's before falling back to it (>= 0)


def routing_config(backend: BackendSettings) -> RoutingConfig:
    """The ``[backend]`` table's routing options as a ``RoutingConfig``."""
    return RoutingConfig(backend.routing, backend.route_prefix_blocks, backend.route_max_waiting)


def _block_key(parent: bytes, salt: bytes, tokens: Sequence[int]) -> bytes:
    """One chained block key: BLAKE2b-128 over ``len(salt) | salt | parent | token ids (uint32 LE)``."""
    h = hashlib.blake2b(digest_size=_KEY_BYTES, key=_ROOT)
    h.update(len(salt).to_bytes(4, "little"))
    h.update(salt)
    h.update(parent)
    ids = array(_U32, tokens)
    if sys.byteorder == "big":  # pragma: no cover
        ids.byteswap()
    h.update(ids.tobytes())
    return h.digest()


def prefix_key(prompt_ids: Sequence[int], block_size: int, salt: str, blocks: int = 1) -> bytes | None:
    """The route key of a prompt: the chained key of its first ``min(blocks, full blocks)`` full blocks
    (16 bytes), or None when the prompt has no full block.

    Args:
        prompt_ids: the token ids the request's ``Submit`` carries.
        block_size: the backend's tokens per KV block (``Ready.block_size``, >= 1).
        salt: the request's ``Submit.cache_salt`` (the tenant id).
        blocks: leading full blocks to hash (>= 1).

    Raises:
        ValueError: ``block_size`` or ``blocks`` below 1.
        OverflowError: a token id outside 0..2**32-1.
    """
    if block_size < 1 or blocks < 1:
        raise ValueError("block_size and blocks must be >= 1")
    n = min(blocks, len(prompt_ids) // block_size)
    if n == 0:
        return None
    key, salt_bytes = _ROOT, salt.encode()
    for i in range(n):
        key = _block_key(key, salt_bytes, prompt_ids[i * block_size : (i + 1) * block_size])
    return key


def rendezvous(key: bytes, ids: Sequence[str]) -> int:
    """Index of the replica with the highest weight ``BLAKE2b-64(key | id)`` (rendezvous hashing).

    Raises:
        ValueError: ``ids`` is empty.
    """
    if not ids:
        raise ValueError("no replica to choose from")
    best, best_w = 0, -1
    for i, rid in enumerate(ids):
        w = int.from_bytes(hashlib.blake2b(key + rid.encode(), digest_size=8, key=_ROOT).digest(), "big")
        if w > best_w:
            best, best_w = i, w
    return best


class Router:
    """Chooses one replica per request by ``config``; the only state is the tie-break position.

    ``choose(ids, loads, ...)`` takes the ready replicas' stable ids (a spawned backend's name, an external
    backend's URL) and their requests in flight, index for index, and returns an index.
    """

    def __init__(self, config: RoutingConfig | None = None) -> None:
        self.config = config or RoutingConfig()
        self._next = 0  # where the tie-break of least-loaded starts
        self.routed_prefix = 0  # requests sent to their preferred replica
        self.routed_fallback = 0  # requests with a preferred replica sent least-loaded (load bound)

    def least_loaded(self, loads: Sequence[int]) -> int:
        """Index of the smallest load; among equal ones the first at or after the last choice + 1.

        Raises:
            ValueError: ``loads`` is empty.
        """
        n = len(loads)
        if n == 0:
            raise ValueError("no replica to choose from")
        low = min(loads)
        start = self._next % n
        for k in range(n):
            i = (start + k) % n
            if loads[i] == low:
                self._next = i + 1
                return i
        raise AssertionError("unreachable")  # pragma: no cover

    def choose(
        self,
        ids: Sequence[str],
        loads: Sequence[int],
        prompt_ids: Sequence[int] | None = None,
        salt: str = "",
        block_size: int = 16,
    ) -> int:
        """Index of the replica for one request (see the module docstring).

        Args:
            ids: stable replica ids (rendezvous names), one per ready replica.
            loads: requests in flight on each replica.
            prompt_ids: the prompt's token ids (None: least-loaded).
            salt: ``Submit.cache_salt`` of the request.
            block_size: tokens per KV block of these replicas.

        Raises:
            ValueError: no replica, or ``ids`` and ``loads`` of different lengths.
        """
        if len(ids) != len(loads):
            raise ValueError("ids and loads differ in length")
        cfg = self.config
        if cfg.policy == "least-loaded" or prompt_ids is None or len(ids) == 1:
            return self.least_loaded(loads)
        key = prefix_key(prompt_ids, block_size, salt, cfg.prefix_blocks)
        if key is None:
            return self.least_loaded(loads)
        preferred = rendezvous(key, ids)
        if loads[preferred] - min(loads) > cfg.max_waiting:
            self.routed_fallback += 1
            return self.least_loaded(loads)
        self.routed_prefix += 1
        return preferred
