"""Kubernetes manifests for a GRPO run on GKE: the GPU networks, the recipe, and a KubeRay RayJob.

``rlfleet k8s render`` writes, as one multi-document YAML for ``kubectl apply -f``:

1. ``GKENetworkParamSet`` + ``Network`` for ``gvnic-1`` and ``rdma-0..7`` (cluster-scoped, idempotent);
2. a ``ConfigMap`` holding the resolved recipe (every key: ``defaults:`` parents merged, command-line
   overrides applied, checkpoint and log directories on the shared volume), mounted on the Ray head at
   ``/etc/rlfleet/recipe.yaml``. The entrypoint is ``rlfleet grpo /etc/rlfleet/recipe.yaml`` with no
   overrides: none of the run's settings passes through the two shells that KubeRay's submitter and
   Ray's job manager put in between, so an override's quotes or spaces (the seed's ``+data.subset="main"``)
   mean what they mean to ``rlfleet validate``; the settings stay readable (``kubectl get configmap``);
3. a ``RayJob`` (or, with ``--cluster-only``, a ``RayCluster`` for ``rlfleet submit``) with a CPU head and
   one GPU worker group of ``cluster.num_nodes`` pods x 8 GPUs.

Failure policy: spot preemption kills pods, so the RayJob has ``backoffLimit`` retries, each on a new
RayCluster; the entrypoint always writes checkpoints and logs under the Lustre volume at ``/data``, and
``rlfleet grpo`` resumes from the newest complete ``step_N`` there, so a retry continues the run.
Secrets (``HF_TOKEN``, ``WANDB_API_KEY``, ``RAY_AUTH_TOKEN``) only appear as ``secretKeyRef`` references.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from rlfleet.config import (
    MasterConfig,
    check_config,
    config_to_yaml,
    load_recipe,
    quote_override_value,
    recipe_algorithm,
    resolve_recipe_path,
    unsupported_settings,
)
from rlfleet.config.algorithm import algorithm_spec
from rlfleet.config.layout import resource_layout
from rlfleet.deploy.gke import (
    DEFAULT_IMAGE,
    DEFAULT_KSA,
    DEFAULT_LUSTRE_PVC,
    DEFAULT_NETWORK_PREFIX,
    DEFAULT_SECRET_NAME,
    GPU_NETWORK_NAMES,
    GVNIC_NETWORK,
    RDMA_NETWORKS,
    DeployError,
    GpuProfile,
    NetworkNames,
    check_image,
    check_k8s_name,
    default_k8s_name,
    gpu_profile,
)

__all__ = ["RenderOptions", "RenderedJob", "dump_documents", "network_documents", "render_job"]

DATA_MOUNT = "/data"
RECIPE_MOUNT = "/etc/rlfleet"
RECIPE_FILE = "recipe.yaml"
GCS_MOUNT = "/gcs"
DASHBOARD_PORT = 8265
SECRET_KEYS = ("HF_TOKEN", "WANDB_API_KEY", "RAY_AUTH_TOKEN")
"""Keys of the Kubernetes Secret (created by the `gke plan` commands from the user's environment)."""

_LABELS = {"app.kubernetes.io/name": "rlfleet", "app.kubernetes.io/managed-by": "rlfleet"}


@dataclass(frozen=True)
class RenderOptions:
    """Command-line options of ``rlfleet k8s render`` (defaults match ``rlfleet gke plan``)."""

    gpu: str
    name: str | None = None
    namespace: str = "default"
    image: str = DEFAULT_IMAGE
    bucket: str | None = None
    lustre_pvc: str = DEFAULT_LUSTRE_PVC
    service_account: str = DEFAULT_KSA
    secret_name: str = DEFAULT_SECRET_NAME
    ray_version: str = "2.60.0"
    cluster_only: bool = False
    backoff_limit: int = 3
    ttl_seconds: int = 3600
    spot: bool = False
    network_prefix: str = DEFAULT_NETWORK_PREFIX
    head_cpu: str = "8"
    head_memory: str = "32Gi"

    @property
    def profile(self) -> GpuProfile:
        return gpu_profile(self.gpu)


@dataclass
class RenderedJob:
    """The manifests of one run, and what ``render`` decided on the user's behalf."""

    documents: list[dict[str, Any]]
    name: str
    entrypoint: str
    checkpoint_dir: str
    log_dir: str
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------- networks


def network_documents(prefix: str = DEFAULT_NETWORK_PREFIX) -> list[dict[str, Any]]:
    """``GKENetworkParamSet`` + ``Network`` pairs for ``gvnic-1`` and ``rdma-0..7`` (the seed's mapping)."""
    names = NetworkNames(prefix)
    names.check()
    params = [(GVNIC_NETWORK, names.gvnic_vpc, names.gvnic_subnet, "NetDevice")]
    params += [(net, names.rdma_vpc, names.rdma_subnet(i), "RDMA") for i, net in enumerate(RDMA_NETWORKS)]
    docs: list[dict[str, Any]] = []
    for net, vpc, subnet, mode in params:
        meta = {"name": net, "labels": dict(_LABELS)}
        docs.append(
            {
                "apiVersion": "networking.gke.io/v1",
                "kind": "GKENetworkParamSet",
                "metadata": meta,
                "spec": {"vpc": vpc, "vpcSubnet": subnet, "deviceMode": mode},
            }
        )
        ref = {"group": "networking.gke.io", "kind": "GKENetworkParamSet", "name": net}
        docs.append(
            {
                "apiVersion": "networking.gke.io/v1",
                "kind": "Network",
                "metadata": dict(meta),
                "spec": {"type": "Device", "parametersRef": ref},
            }
        )
    return docs


def interfaces_annotation() -> str:
    """``networking.gke.io/interfaces``: eth0 on the default network, eth1 gVNIC, eth2..eth9 RDMA."""
    entries = [{"interfaceName": "eth0", "network": "default"}]
    entries += [{"interfaceName": f"eth{i + 1}", "network": n} for i, n in enumerate(GPU_NETWORK_NAMES)]
    return json.dumps(entries)


# --------------------------------------------------------------------------------------------- pod parts


def _env(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def _secret_env(name: str, secret: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": name}}}


def _common_env(opts: RenderOptions, wandb: bool) -> list[dict[str, Any]]:
    """Ray token auth and API tokens, all by reference to the Secret; caches on the shared volume."""
    env = [_env("RAY_AUTH_MODE", "token"), _secret_env("RAY_AUTH_TOKEN", opts.secret_name)]
    env.append(_secret_env("HF_TOKEN", opts.secret_name))
    if wandb:
        env.append(_secret_env("WANDB_API_KEY", opts.secret_name))
    env += [_env("HF_HOME", f"{DATA_MOUNT}/huggingface"), _env("PYTHONUNBUFFERED", "1")]
    return env


def _nccl_env(profile: GpuProfile) -> list[dict[str, Any]]:
    """The gIB NCCL settings of the seed for GPUDirect RDMA over the eight RoCE NICs."""
    return [
        _env("NCCL_NET", "gIB"),
        _env("NCCL_IB_GID_INDEX", "3"),
        _env("NCCL_CROSS_NIC", "0"),
        _env("NCCL_SOCKET_IFNAME", "eth0"),
        _env("GLOO_SOCKET_IFNAME", "eth0"),
        _env("TP_SOCKET_IFNAME", "eth0"),
        _env("NCCL_NET_GDR_LEVEL", "PIX"),
        _env("NCCL_TUNER_CONFIG_PATH", profile.tuner_config),
        _env("LD_LIBRARY_PATH", "/usr/local/nvidia/lib64"),
    ]


def _volumes(opts: RenderOptions, *, gpu: bool, recipe_cm: str | None) -> tuple[list[Any], list[Any]]:
    """(volumes, volumeMounts) of a Ray pod: Lustre at /data, /dev/shm, GPU host paths, recipe, GCS."""
    volumes: list[dict[str, Any]] = [
        {"name": "data", "persistentVolumeClaim": {"claimName": opts.lustre_pvc}},
        {
            "name": "dshm",
            "emptyDir": {"medium": "Memory", **({"sizeLimit": opts.profile.shm_size} if gpu else {})},
        },
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "data", "mountPath": DATA_MOUNT},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if gpu:
        for name, host, path in (
            ("nvidia-install-dir-host", "/home/kubernetes/bin/nvidia", "/usr/local/nvidia"),
            ("gib-nccl-plugin", "/home/kubernetes/bin/gib", "/usr/local/gib"),
        ):
            volumes.append({"name": name, "hostPath": {"path": host}})
            mounts.append({"name": name, "mountPath": path})
    if recipe_cm:
        volumes.append({"name": "recipe", "configMap": {"name": recipe_cm}})
        mounts.append({"name": "recipe", "mountPath": RECIPE_MOUNT, "readOnly": True})
    if opts.bucket:
        attrs = {"bucketName": opts.bucket, "mountOptions": "implicit-dirs"}
        volumes.append(
            {"name": "gcs", "csi": {"driver": "gcsfuse.csi.storage.gke.io", "volumeAttributes": attrs}}
        )
        mounts.append({"name": "gcs", "mountPath": GCS_MOUNT})
    return volumes, mounts


def _resources(cpu: str, memory: str, gpus: int = 0) -> dict[str, Any]:
    amounts: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if gpus:
        amounts["nvidia.com/gpu"] = gpus
    return {"requests": dict(amounts), "limits": dict(amounts)}


_HEAD_START = "ulimit -n 65536; exec ${KUBERAY_GEN_RAY_START_CMD}"
_WORKER_START = (
    "ulimit -n 65536; "
    "if [ ! -f /usr/local/gib/scripts/set_nccl_env.sh ]; then "
    "echo 'rlfleet: /usr/local/gib is empty: apply the NCCL RDMA installer DaemonSet "
    "(see rlfleet gke plan) and recreate this pod' >&2; exit 1; fi; "
    'export LD_LIBRARY_PATH="/usr/local/gib/lib64:${LD_LIBRARY_PATH}"; '
    "source /usr/local/gib/scripts/set_nccl_env.sh; "
    "exec ${KUBERAY_GEN_RAY_START_CMD}"
)
"""KubeRay runs these instead of its own command (``ray.io/overwrite-container-cmd``); the generated
``ray start`` is in ``$KUBERAY_GEN_RAY_START_CMD``. Workers load the gIB plugin's NCCL settings first."""


def _head_template(opts: RenderOptions, recipe_cm: str | None, wandb: bool) -> dict[str, Any]:
    volumes, mounts = _volumes(opts, gpu=False, recipe_cm=recipe_cm)
    container = {
        "name": "ray-head",
        "image": opts.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["/bin/bash", "-lc", "--"],
        "args": [_HEAD_START],
        "env": _common_env(opts, wandb),
        "ports": [
            {"containerPort": 6379, "name": "gcs-server"},
            {"containerPort": DASHBOARD_PORT, "name": "dashboard"},
            {"containerPort": 10001, "name": "client"},
        ],
        "resources": _resources(opts.head_cpu, opts.head_memory),
        "volumeMounts": mounts,
    }
    # No spot toleration: the head (and with it the job driver) stays on on-demand CPU nodes.
    spec = {"serviceAccountName": opts.service_account, "containers": [container], "volumes": volumes}
    return {"metadata": _pod_metadata(opts, {}), "spec": spec}


def _spot_toleration() -> dict[str, Any]:
    return {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}


def _pod_metadata(opts: RenderOptions, annotations: dict[str, str]) -> dict[str, Any]:
    notes = dict(annotations)
    if opts.bucket:
        notes["gke-gcsfuse/volumes"] = "true"
    meta: dict[str, Any] = {"labels": dict(_LABELS)}
    if notes:
        meta["annotations"] = notes
    return meta


def _worker_template(opts: RenderOptions, wandb: bool) -> dict[str, Any]:
    profile = opts.profile
    volumes, mounts = _volumes(opts, gpu=True, recipe_cm=None)
    container = {
        "name": "ray-worker",
        "image": opts.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["/bin/bash", "-lc", "--"],
        "args": [_WORKER_START],
        "env": _common_env(opts, wandb) + _nccl_env(profile),
        "resources": _resources(profile.worker_cpu, profile.worker_memory, profile.gpus_per_node),
        "volumeMounts": mounts,
    }
    selector = {"cloud.google.com/gke-accelerator": profile.accelerator}
    if opts.spot:
        selector["cloud.google.com/gke-spot"] = "true"
    annotations = {
        "networking.gke.io/default-interface": "eth0",
        "networking.gke.io/interfaces": interfaces_annotation(),
    }
    spec = {
        "serviceAccountName": opts.service_account,
        "nodeSelector": selector,
        "tolerations": [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            _spot_toleration(),
        ],
        "containers": [container],
        "volumes": volumes,
    }
    return {"metadata": _pod_metadata(opts, annotations), "spec": spec}


def ray_cluster_spec(
    opts: RenderOptions, num_nodes: int, recipe_cm: str | None, wandb: bool
) -> dict[str, Any]:
    """The ``RayCluster`` spec: CPU head with the dashboard, ``num_nodes`` GPU workers (no autoscaling)."""
    return {
        "rayVersion": opts.ray_version,
        "enableInTreeAutoscaling": False,
        "headGroupSpec": {
            "serviceType": "ClusterIP",
            "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
            "template": _head_template(opts, recipe_cm, wandb),
        },
        "workerGroupSpecs": [
            {
                "groupName": "gpu-workers",
                "replicas": num_nodes,
                "minReplicas": num_nodes,
                "maxReplicas": num_nodes,
                "rayStartParams": {},
                "template": _worker_template(opts, wandb),
            }
        ],
    }


# --------------------------------------------------------------------------------------------- the run


def _persistent(path: str, kind: str, name: str) -> tuple[str, str | None]:
    """(a path under /data, a note if it had to move there): retries only see what is on /data."""
    if PurePosixPath(path).is_absolute() and PurePosixPath(path).is_relative_to(DATA_MOUNT):
        return path, None
    moved = f"{DATA_MOUNT}/{kind}/{name}"
    return moved, f"{kind} directory {path!r} is not on the shared volume; the job uses {moved}"


def _check_sizing(cfg: MasterConfig, profile: GpuProfile) -> None:
    if cfg.cluster.gpus_per_node != profile.gpus_per_node:
        raise DeployError(
            f"recipe has cluster.gpus_per_node={cfg.cluster.gpus_per_node}, but {profile.key} nodes "
            f"({profile.machine_type}) have {profile.gpus_per_node} GPUs and rlfleet runs one Ray worker pod "
            f"per node; fix: add the override cluster.gpus_per_node={profile.gpus_per_node} and set "
            "cluster.num_nodes to the number of nodes"
        )


def resolved_recipe(cfg: MasterConfig, recipe: Path, overrides: Sequence[str]) -> str:
    """The whole config as a recipe (``load_recipe`` of it equals ``cfg``), headed by where it came from.

    Only schema keys are written, and the schema has no field for a secret (tokens come from the
    environment, i.e. the Secret), so no token can reach the ConfigMap.
    """
    header = [
        f"{recipe.name} resolved by rlfleet k8s render: `defaults:` parents merged, overrides applied,",
        "checkpoint and log directories on the shared volume. The job runs it with no overrides.",
        *(f"override: {json.dumps(o, ensure_ascii=False)}" for o in overrides),
    ]
    return "".join(f"# {line}\n" for line in header) + config_to_yaml(cfg)


def _recipe_configmap(opts: RenderOptions, name: str, recipe_text: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-recipe", "namespace": opts.namespace, "labels": dict(_LABELS)},
        "data": {RECIPE_FILE: recipe_text},
    }


def render_job(recipe: str, overrides: Sequence[str], opts: RenderOptions) -> RenderedJob:
    """Load and check ``recipe`` + ``overrides`` and build every manifest of the run.

    The overrides are resolved into the recipe that travels in the ConfigMap (``resolved_recipe``); the
    job's entrypoint carries none, so any override ``rlfleet validate`` accepts renders as it is.

    Raises:
        DeployError: an option is invalid or the recipe does not fit the GPU nodes.
        ConfigError: the recipe or an override is invalid.
    """
    profile = opts.profile
    check_image(opts.image)
    if opts.backoff_limit < 0 or opts.ttl_seconds < 0:
        raise DeployError("--backoff-limit and --ttl-seconds must be >= 0 (retries after preemption: use 3)")
    path = resolve_recipe_path(recipe)
    name = check_k8s_name(opts.name or default_k8s_name(path.stem))
    first = load_recipe(path, list(overrides))
    ckpt, ckpt_note = _persistent(first.checkpointing.checkpoint_dir, "checkpoints", name)
    logs, log_note = _persistent(first.logger.log_dir, "logs", name)
    run_overrides = [
        *overrides,
        f"checkpointing.checkpoint_dir={quote_override_value(ckpt)}",
        f"logger.log_dir={quote_override_value(logs)}",
    ]
    cfg = load_recipe(path, run_overrides)
    _check_sizing(cfg, profile)
    layout = resource_layout(cfg)
    algorithm = algorithm_spec(recipe_algorithm(path))  # the recipe's own: its key, or its one section
    check_config(cfg, algorithm, layout=layout)
    notes = [n for n in (ckpt_note, log_note) if n]
    unsupported = unsupported_settings(cfg, here=False, layout=layout)
    notes += [f"this rlfleet build cannot run yet: {p}" for p in unsupported]
    if Path(cfg.policy.model_name).expanduser().exists():
        notes.append(
            f"policy.model_name {cfg.policy.model_name!r} is a local path here; the pods need it too "
            f"(copy it under {DATA_MOUNT} and override policy.model_name, or use a hub id)"
        )
    entrypoint = shlex.join(["rlfleet", algorithm.command, f"{RECIPE_MOUNT}/{RECIPE_FILE}"])
    docs = network_documents(opts.network_prefix)
    wandb = cfg.logger.wandb_enabled
    if opts.cluster_only:
        spec = ray_cluster_spec(opts, cfg.cluster.num_nodes, None, wandb)
        docs.append(_ray_object("RayCluster", name, opts, spec))
    else:
        configmap = _recipe_configmap(opts, name, resolved_recipe(cfg, path, overrides))
        docs.append(configmap)
        spec = ray_cluster_spec(opts, cfg.cluster.num_nodes, configmap["metadata"]["name"], wandb)
        docs.append(_ray_object("RayJob", name, opts, _rayjob_spec(opts, entrypoint, spec)))
    return RenderedJob(docs, name, entrypoint, ckpt, logs, notes)


def _ray_object(kind: str, name: str, opts: RenderOptions, spec: dict[str, Any]) -> dict[str, Any]:
    # The annotation makes KubeRay keep our container commands (and copy it from a RayJob to its cluster).
    meta = {
        "name": name,
        "namespace": opts.namespace,
        "labels": dict(_LABELS),
        "annotations": {"ray.io/overwrite-container-cmd": "true"},
    }
    return {"apiVersion": "ray.io/v1", "kind": kind, "metadata": meta, "spec": spec}


def _rayjob_spec(opts: RenderOptions, entrypoint: str, cluster: dict[str, Any]) -> dict[str, Any]:
    submitter = {
        "name": "ray-job-submitter",
        "image": opts.image,
        "env": [_env("RAY_AUTH_MODE", "token"), _secret_env("RAY_AUTH_TOKEN", opts.secret_name)],
        "resources": _resources("500m", "1Gi"),
    }
    return {
        "entrypoint": entrypoint,
        "submissionMode": "K8sJobMode",
        "backoffLimit": opts.backoff_limit,
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": opts.ttl_seconds,
        "rayClusterSpec": cluster,
        "submitterPodTemplate": {"spec": {"restartPolicy": "Never", "containers": [submitter]}},
    }


def dump_documents(docs: Sequence[dict[str, Any]], header: Sequence[str] = ()) -> str:
    """A multi-document YAML stream (``---`` separated), ``header`` lines as leading comments."""
    lines = "".join(f"# {line}\n" for line in header)
    body = "---\n".join(yaml.safe_dump(d, sort_keys=False, width=1 << 20) for d in docs)
    return lines + body
