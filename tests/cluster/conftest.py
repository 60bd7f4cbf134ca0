"""Fixtures of the cluster tests (``tests/cluster/``): several gateways as one service, on one machine.

* ``cluster`` (session scope): one shared store, one Redis, one backend and two gateways ``A`` and ``B``
  (:mod:`cluster_nodes`), started once for all the cluster tests and stopped after them; a test that kills or
  stops a part gets it back through the :class:`cluster_nodes.Cluster` methods.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster_nodes import Cluster, open_cluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = open_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield c
    finally:
        c.close()
