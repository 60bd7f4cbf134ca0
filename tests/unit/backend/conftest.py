"""Fixtures shared by the backend tests that run the real model in-process."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from backend.model_path import generated_int4, prompt_int4
from backend.model_runner import ModelRunner


@pytest.fixture(scope="session")
def _runner_cache() -> dict[str, ModelRunner]:
    return {}


@pytest.fixture(scope="module")
def one_thread_runner(model_path, _runner_cache) -> Iterator[Callable[..., ModelRunner]]:
    """``get(dtype, weights="dense")``: the default model in ``dtype`` with ``--weights``-style ``weights``
    (``auto``: the served default, ``backend.model_path.generated_int4``) on one thread with 400 KV blocks,
    loaded once per session (the load and the matmul row-tile probe take seconds). One thread: two threads
    on the shared 2-core test VM were ~15x slower under load; the row tiles are probed for the thread count
    in use. Torch's thread count is restored after the module."""
    threads = torch.get_num_threads()

    def get(dtype: str, weights: str = "dense") -> ModelRunner:
        torch.set_num_threads(1)
        key = f"{dtype}/{weights}"
        if key not in _runner_cache:
            _runner_cache[key] = ModelRunner(
                model_path,
                dtype=dtype,
                num_kv_blocks=400,
                num_threads=1,
                generated_int4=generated_int4(weights, "cpu"),
                prompt_int4=prompt_int4(weights),
            )
        return _runner_cache[key]

    yield get
    torch.set_num_threads(threads)
