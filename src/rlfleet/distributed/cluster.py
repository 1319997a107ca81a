"""Connecting to (or starting) a Ray cluster and reserving one placement group per node.

The layout is NeMo RL's: a node's workers share a ``STRICT_PACK`` placement group with one bundle per GPU
(CPU-only: one ``{"CPU": 1}`` bundle per worker process). Reserving never hangs: a layout the cluster cannot
hold raises ``ClusterCapacityError`` within the timeout, after removing what it reserved.
"""

from __future__ import annotations

import logging
import os
import socket

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from rlfleet.errors import UserError

logger = logging.getLogger(__name__)

RAY_ADDRESS_ENV = "RAY_ADDRESS"
_REPORTED = ("CPU", "GPU", "memory")


class ClusterCapacityError(RuntimeError, UserError):
    """The Ray cluster cannot hold the requested placement groups."""


class ClusterConnectionError(ConnectionError, UserError):
    """The Ray cluster at the given address could not be reached."""


def _answers_grpc(address: str, timeout_s: float) -> bool:
    """Whether ``host:port`` completes a gRPC (HTTP/2) handshake within ``timeout_s``, as a Ray GCS does.

    Ray's own connect retries a port that accepts connections but is no GCS (the dashboard's, say) for
    minutes; this answers in ``timeout_s``. True when it cannot tell (no grpcio, or a TLS cluster).
    """
    if os.environ.get("RAY_USE_TLS", "0").strip().lower() in ("1", "true"):
        return True  # an insecure probe cannot complete a TLS handshake
    try:
        import grpc
    except ImportError:
        return True
    channel = grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)])  # as the socket above
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


def _check_reachable(address: str, timeout_s: float) -> None:
    """Fails fast when ``address`` is no Ray cluster that answers: a dashboard URL, a ``host:port`` that
    refuses connections, or one that accepts them but is no GCS (``auto`` and ``ray://`` pass through)."""
    if address.startswith(("http://", "https://")):
        raise ClusterConnectionError(
            f"the Ray address {address!r} ({RAY_ADDRESS_ENV}) is a dashboard URL, which `rlfleet submit` "
            f"takes; training connects to the cluster's GCS: set {RAY_ADDRESS_ENV}=<head host>:<GCS port> "
            "(the head's `ray start --port`, 6379 by default), or unset it to start a local cluster"
        )
    if address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ClusterConnectionError(
            f"cannot reach the Ray cluster at {address!r} within {timeout_s:.0f}s ({exc}); "
            f"check that the head node is up, or unset {RAY_ADDRESS_ENV} to start a local cluster"
        ) from exc
    if not _answers_grpc(address, timeout_s):
        raise ClusterConnectionError(
            f"{address!r} ({RAY_ADDRESS_ENV}) accepts connections but did not answer as a Ray cluster's GCS "
            f"within {timeout_s:.0f}s; point {RAY_ADDRESS_ENV} at the head's GCS port (`ray start --port`, "
            f"6379 by default), not its dashboard (8265) or another service, or unset {RAY_ADDRESS_ENV} to "
            "start a local cluster"
        )


def check_ray_address(timeout_s: float, address: str | None = None) -> None:
    """Fails fast when ``address`` (default: ``RAY_ADDRESS``) names no Ray cluster that answers; nothing
    when neither is set (a local cluster will be started). The command line calls it before it loads any
    data or model, so a wrong address costs a second, not a model load.

    Raises:
        ClusterConnectionError: A dashboard URL, a port that refuses connections, or one that is no GCS.
    """
    target = address or os.environ.get(RAY_ADDRESS_ENV) or None
    if target is not None:
        _check_reachable(target, timeout_s)


def connect_or_start(address: str | None, num_cpus: int | None, timeout_s: float) -> bool:
    """Connects to an existing Ray cluster, or starts a local one.

    Args:
        address: The cluster's address; when None, ``RAY_ADDRESS`` is used (as set on KubeRay pods), and
            when that is unset too, a local cluster is started.
        num_cpus: CPUs a *local* cluster advertises (None: all of the machine's); ignored when connecting.
        timeout_s: How long to wait for a ``host:port`` address to accept connections.

    Returns:
        True when this call initialised Ray (the caller then owns ``ray.shutdown``); False when Ray was
        already initialised in this process, in which case nothing is done.
    """
    if ray.is_initialized():
        return False
    target = address or os.environ.get(RAY_ADDRESS_ENV) or None
    if target is None:
        logger.info("starting a local Ray cluster (num_cpus=%s)", num_cpus)
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
        return True
    _check_reachable(target, timeout_s)
    logger.info("connecting to the Ray cluster at %s", target)
    ray.init(address=target, log_to_driver=True)
    return True


def bundle_resources(use_gpus: bool, gpus: int = 1) -> dict[str, float]:
    """The resources one worker process reserves: ``gpus`` GPUs and a CPU, or one CPU."""
    return {"GPU": float(gpus), "CPU": 1.0} if use_gpus else {"CPU": 1.0}


def _capacity_message(num_nodes: int, bundles_per_node: int, resources: dict[str, float]) -> str:
    total = {k: v for k, v in ray.cluster_resources().items() if k in _REPORTED}
    free = {k: v for k, v in ray.available_resources().items() if k in _REPORTED}
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    return (
        f"asked for {num_nodes} node(s) x {bundles_per_node} bundle(s) x {resources} "
        f"(each node's bundles packed on one node); the cluster has {nodes} alive node(s) with {total} "
        f"in total and {free} available. Lower cluster.num_nodes / cluster.gpus_per_node, "
        "free resources held by other jobs, or add nodes"
    )


def create_node_placement_groups(
    num_nodes: int,
    bundles_per_node: int,
    use_gpus: bool,
    timeout_s: float,
    name: str = "rlfleet",
    gpus_per_bundle: int = 1,
) -> list[PlacementGroup]:
    """Reserves one ``STRICT_PACK`` placement group per node, ``bundles_per_node`` bundles each.

    ``name`` prefixes the groups' names (``<name>-node-<i>``), so a training and a generation pool can be
    told apart in ``ray status``. A bundle holds ``gpus_per_bundle`` GPUs (a tensor-parallel vLLM engine's
    process takes its group's GPUs in one bundle).

    Raises:
        ValueError: ``num_nodes`` or ``bundles_per_node`` is below 1.
        ClusterCapacityError: The groups were not all ready within ``timeout_s``; the message states the
            request and the cluster's resources. Every group this call created has been removed.
    """
    if num_nodes < 1 or bundles_per_node < 1:
        raise ValueError(
            f"num_nodes={num_nodes}, bundles_per_node={bundles_per_node}: both must be at least 1"
        )
    resources = bundle_resources(use_gpus, gpus_per_bundle)
    groups: list[PlacementGroup] = []
    try:
        for node in range(num_nodes):
            bundles = [dict(resources) for _ in range(bundles_per_node)]
            groups.append(placement_group(bundles, strategy="STRICT_PACK", name=f"{name}-node-{node}"))
        ready, pending = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout_s)
        if pending:
            raise ClusterCapacityError(
                f"placement groups not ready after {timeout_s:.0f}s: "
                + _capacity_message(num_nodes, bundles_per_node, resources)
            )
        ray.get(ready, timeout=timeout_s)
    except BaseException:
        remove_placement_groups(groups)
        raise
    return groups


def remove_placement_groups(groups: list[PlacementGroup]) -> None:
    """Removes placement groups (Ray kills their actors); failures on removed ones are only logged."""
    for group in groups:
        try:
            remove_placement_group(group)
        except (ValueError, RuntimeError, ray.exceptions.RayError) as exc:
            logger.warning("could not remove placement group %s: %s", group.id, exc)
