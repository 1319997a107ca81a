"""Fixtures of the functional tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local 4-CPU Ray cluster for the module, never the one ``RAY_ADDRESS`` may name.

    Runs find Ray initialised and leave it up; the fixture shuts it down after the module.
    """
    import ray

    from rlfleet.distributed.cluster import connect_or_start

    address = os.environ.pop("RAY_ADDRESS", None)
    try:
        connect_or_start(None, num_cpus=4, timeout_s=30.0)
        yield
    finally:
        ray.shutdown()
        if address is not None:
            os.environ["RAY_ADDRESS"] = address
