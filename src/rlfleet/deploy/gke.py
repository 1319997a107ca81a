"""GKE facts shared by ``rlfleet gke plan`` and ``rlfleet k8s render``, so the two always agree.

One place holds the GPU machine profiles (machine type, node label, NCCL tuner file, minimum GKE version),
the names of the two extra VPCs and their Kubernetes ``Network`` objects, and the checks of user-given
names and images.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import rlfleet
from rlfleet.errors import UserError

__all__ = [
    "DEFAULT_IMAGE",
    "DEFAULT_KSA",
    "DEFAULT_LUSTRE_PVC",
    "DEFAULT_NETWORK_PREFIX",
    "DEFAULT_SECRET_NAME",
    "GPUS",
    "GPU_NETWORK_NAMES",
    "GVNIC_NETWORK",
    "MAX_RAYJOB_NAME",
    "RDMA_NETWORKS",
    "DeployError",
    "GpuProfile",
    "NetworkNames",
    "check_image",
    "check_k8s_name",
    "default_k8s_name",
    "gke_version_key",
]


class DeployError(UserError, ValueError):
    """A user-facing problem with deployment options; the message says what to change."""


@dataclass(frozen=True)
class GpuProfile:
    """One GKE GPU machine family: everything that differs between B200 and H200 nodes."""

    key: str
    machine_type: str
    accelerator: str
    """The ``cloud.google.com/gke-accelerator`` node label (also ``--accelerator type=``)."""
    gpus_per_node: int
    tuner_config: str
    """The gIB NCCL tuner file for this machine family (``NCCL_TUNER_CONFIG_PATH``)."""
    min_gke_version: str
    worker_cpu: str
    worker_memory: str
    shm_size: str


GPUS: dict[str, GpuProfile] = {
    "b200": GpuProfile(
        key="b200",
        machine_type="a4-highgpu-8g",
        accelerator="nvidia-b200",
        gpus_per_node=8,
        tuner_config="/usr/local/gib/configs/tuner_config_a4.txtpb",
        min_gke_version="1.32.2-gke.1422000",
        worker_cpu="206",
        worker_memory="2400Gi",
        shm_size="240Gi",
    ),
    "h200": GpuProfile(
        key="h200",
        machine_type="a3-ultragpu-8g",
        accelerator="nvidia-h200-141gb",
        gpus_per_node=8,
        tuner_config="/usr/local/gib/configs/tuner_config_a3u.txtpb",
        min_gke_version="1.31.4-gke.1183000",
        worker_cpu="206",
        worker_memory="2400Gi",
        shm_size="240Gi",
    ),
}


def gpu_profile(gpu: str) -> GpuProfile:
    """The machine profile for ``--gpu``; a clear error naming the supported ones otherwise."""
    try:
        return GPUS[gpu]
    except KeyError:
        raise DeployError(f"--gpu {gpu!r} is not supported; use one of {sorted(GPUS)}") from None


DEFAULT_NETWORK_PREFIX = "rlfleet"
DEFAULT_KSA = "rlfleet-ksa"
DEFAULT_SECRET_NAME = "rlfleet-secrets"
DEFAULT_LUSTRE_PVC = "lustre-pvc"
DEFAULT_IMAGE = f"ghcr.io/rlfleet/rlfleet:{rlfleet.__version__}"

GVNIC_NETWORK = "gvnic-1"
RDMA_NETWORKS: tuple[str, ...] = tuple(f"rdma-{i}" for i in range(8))
GPU_NETWORK_NAMES: tuple[str, ...] = (GVNIC_NETWORK, *RDMA_NETWORKS)
"""Kubernetes ``Network`` objects a GPU pod attaches, in interface order eth1, eth2, ... eth9."""

MAX_RAYJOB_NAME = 47
"""KubeRay appends 6 characters to a RayJob's name for its RayCluster, whose names stop at 53."""


@dataclass(frozen=True)
class NetworkNames:
    """VPC and subnet names of the gVNIC network and the RDMA network (8 subnets, one per GPU NIC)."""

    prefix: str = DEFAULT_NETWORK_PREFIX

    @property
    def gvnic_vpc(self) -> str:
        return f"{self.prefix}-gvnic-net"

    @property
    def gvnic_subnet(self) -> str:
        return f"{self.prefix}-gvnic-sub"

    @property
    def rdma_vpc(self) -> str:
        return f"{self.prefix}-rdma-net"

    def rdma_subnet(self, index: int) -> str:
        return f"{self.prefix}-rdma-sub-{index}"

    def check(self) -> None:
        """Raises ``DeployError`` unless the prefix makes valid GCE resource names."""
        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,40}[a-z0-9])?", self.prefix):
            raise DeployError(
                f"--network-prefix {self.prefix!r} is not a valid GCE name prefix; use lowercase letters, "
                "digits and '-', starting with a letter, at most 42 characters (e.g. rlfleet)"
            )


_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def default_k8s_name(recipe_stem: str, limit: int = MAX_RAYJOB_NAME) -> str:
    """A valid RayJob name from a recipe file name: lowercase, '.'/'_' to '-', cut to ``limit``."""
    name = re.sub(r"[^a-z0-9-]+", "-", recipe_stem.lower()).strip("-")
    if not name or not name[0].isalpha():
        name = f"rlfleet-{name}".rstrip("-")
    return name[:limit].rstrip("-")


def check_k8s_name(name: str, what: str = "--name", limit: int = MAX_RAYJOB_NAME) -> str:
    """Return ``name`` if KubeRay accepts it as a RayJob/RayCluster name, else raise ``DeployError``."""
    if len(name) > limit or not _DNS1035.fullmatch(name):
        raise DeployError(
            f"{what} {name!r} is not a valid RayJob name: KubeRay needs a DNS-1035 label of at most "
            f"{limit} characters (lowercase letters, digits and '-', starting with a letter, not ending "
            f"with '-'); e.g. {default_k8s_name(name, limit)!r}"
        )
    return name


def check_image(image: str) -> str:
    """Return ``image`` if it is pinned (a tag other than ``latest``, or a digest), else raise."""
    if "@sha256:" in image:
        return image
    last = image.rsplit("/", 1)[-1]
    tag = last.split(":", 1)[1] if ":" in last else ""
    if not tag or tag == "latest":
        problem = "has no tag" if not tag else "uses the moving tag ':latest'"
        raise DeployError(
            f"--image {image!r} {problem}; every pod and every retry must run the same code, so pin it: "
            f"push the image with a version tag (e.g. {DEFAULT_IMAGE}) or pass it by digest "
            "(image@sha256:...)"
        )
    return image


def gke_version_key(version: str) -> tuple[int, int, int, int]:
    """``1.32.2-gke.1422000`` -> ``(1, 32, 2, 1422000)`` for ordering; raises ``DeployError`` if malformed."""
    match = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(?:-gke\.(\d+))?", version.strip())
    if not match:
        raise DeployError(
            f"GKE version {version!r} is not of the form MAJOR.MINOR.PATCH-gke.BUILD "
            "(e.g. 1.32.2-gke.1422000); list valid ones with `gcloud container get-server-config`"
        )
    major, minor, patch, build = match.groups()
    return int(major), int(minor), int(patch), int(build or 0)
