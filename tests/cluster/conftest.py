"""Fixtures of the cluster tests (``tests/cluster/``): several gateways as one service, on one machine.

* ``cluster``: one shared store, one Redis, one backend and two gateways ``A`` and ``B``
  (:mod:`cluster_nodes`), started once for all the cluster tests (``cluster_session``) and stopped after them.
  Each test gets its database server and Redis running (started again if an earlier test failed while they
  were stopped); a gateway a test killed is started again by ``Cluster.node``.

Each test's ``timeout`` mark is ``func_only``: it bounds the test itself, not the cluster's start, which the
first test pays and which its own timeouts bound (``BACKEND_START_S``, ``GATEWAY_TEST_STARTUP_TIMEOUT``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster_nodes import Cluster, open_cluster


@pytest.fixture(scope="session")
def cluster_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = open_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def cluster(cluster_session: Cluster) -> Cluster:
    cluster_session.heal()  # a test that failed while its database or Redis was stopped leaves them so
    return cluster_session
