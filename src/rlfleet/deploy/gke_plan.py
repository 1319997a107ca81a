"""``rlfleet gke plan``: the gcloud / kubectl / helm commands that prepare a GKE project for rlfleet.

The output is a bash script to read, then run step by step (it starts nothing itself). It follows the seed
tutorial, parameterised, with its gaps closed: Workload Identity is enabled on Standard clusters, the KubeRay
operator comes from a pinned Helm chart (not also from GKE's add-on: two operators would fight over the same
objects), and the Kubernetes Secret is created from the user's environment variables, so no token is ever
written into a file or this output. Network, service-account and secret names match ``rlfleet k8s render``.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.deploy.gke import (
    DEFAULT_KSA,
    DEFAULT_LUSTRE_PVC,
    DEFAULT_NETWORK_PREFIX,
    DEFAULT_SECRET_NAME,
    DeployError,
    GpuProfile,
    NetworkNames,
    gke_version_key,
    gpu_profile,
)

__all__ = ["KUBERAY_CHART_VERSION", "NCCL_INSTALLER_URL", "GkePlanOptions", "gke_plan"]

KUBERAY_CHART_VERSION = "1.7.0"
"""KubeRay operator chart; its CRDs are the ones ``rlfleet k8s validate`` checks manifests against."""

NCCL_INSTALLER_URL = (
    "https://raw.githubusercontent.com/GoogleCloudPlatform/container-engine-accelerators/"
    "refs/heads/master/gpudirect-rdma/{name}"
)


@dataclass(frozen=True)
class GkePlanOptions:
    """Command-line options of ``rlfleet gke plan``."""

    gpu: str
    region: str
    zone: str
    cluster: str
    project: str | None = None
    autopilot: bool = False
    bucket: str | None = None
    node_count: int = 2
    spot: bool = False
    gke_version: str | None = None
    namespace: str = "default"
    service_account: str = DEFAULT_KSA
    secret_name: str = DEFAULT_SECRET_NAME
    lustre_pvc: str = DEFAULT_LUSTRE_PVC
    network_prefix: str = DEFAULT_NETWORK_PREFIX
    kuberay_version: str = KUBERAY_CHART_VERSION

    @property
    def profile(self) -> GpuProfile:
        return gpu_profile(self.gpu)

    def checked_version(self) -> str:
        """The GKE version to create, refusing one below the GPU's minimum."""
        minimum = self.profile.min_gke_version
        version = self.gke_version or minimum
        if gke_version_key(version) < gke_version_key(minimum):
            raise DeployError(
                f"--gke-version {version} is older than {minimum}, the minimum for {self.gpu} "
                f"({self.profile.machine_type}) nodes; pass --gke-version {minimum} or newer"
            )
        return version

    def check(self) -> None:
        """Raises ``DeployError`` for inconsistent options."""
        self.checked_version()
        NetworkNames(self.network_prefix).check()
        if not self.zone.startswith(f"{self.region}-"):
            raise DeployError(
                f"--zone {self.zone} is not in --region {self.region}; pick a zone of that region that "
                f"offers {self.profile.machine_type} (gcloud compute machine-types list "
                f"--filter=name={self.profile.machine_type})"
            )
        if self.node_count < 1:
            raise DeployError("--node-count must be >= 1 (the recipe's cluster.num_nodes, e.g. 2)")


def _cmd(*parts: str) -> str:
    """One shell command, its arguments on continuation lines."""
    return " \\\n    ".join(parts)


def _section(title: str, *body: str) -> str:
    return "\n".join([f"# --- {title} " + "-" * max(0, 100 - len(title)), *body, ""])


def _header(opts: GkePlanOptions) -> str:
    project = opts.project or "$(gcloud config get project)"
    bucket = opts.bucket or "${PROJECT_ID}-rlfleet"
    return "\n".join(
        [
            "#!/usr/bin/env bash",
            f"# rlfleet gke plan: {opts.gpu} ({opts.profile.machine_type}) x {opts.node_count}, "
            f"{'Autopilot' if opts.autopilot else 'Standard'} cluster {opts.cluster}.",
            "# Read it, then run it step by step. Needs HF_TOKEN and WANDB_API_KEY in your environment.",
            "set -euo pipefail",
            "",
            f'export PROJECT_ID="{project}"',
            "export CLOUDSDK_CORE_PROJECT=${PROJECT_ID}",
            'export PROJECT_NUMBER=$(gcloud projects describe "${PROJECT_ID}" '
            '--format="value(projectNumber)")',
            f"export REGION={opts.region}",
            f"export ZONE={opts.zone}",
            f"export CLUSTER_NAME={opts.cluster}",
            f"export NAMESPACE={opts.namespace}",
            f"export KSA_NAME={opts.service_account}",
            f'export GS_BUCKET="{bucket}"',
            "",
        ]
    )


def _networks(opts: GkePlanOptions) -> str:
    net = NetworkNames(opts.network_prefix)
    gvnic = [
        _cmd(f"gcloud compute networks create {net.gvnic_vpc}", "--subnet-mode=custom"),
        _cmd(
            f"gcloud compute networks subnets create {net.gvnic_subnet}",
            f"--network={net.gvnic_vpc}",
            "--region=${REGION}",
            "--range=192.168.0.0/24",
        ),
        _cmd(
            f"gcloud compute firewall-rules create {opts.network_prefix}-gvnic-internal",
            f"--network={net.gvnic_vpc}",
            "--action=ALLOW",
            "--rules=tcp:0-65535,udp:0-65535,icmp",
            "--source-ranges=192.168.0.0/16",
        ),
    ]
    rdma = [
        _cmd(
            f"gcloud compute networks create {net.rdma_vpc}",
            "--network-profile=${REGION}-vpc-roce",
            "--subnet-mode=custom",
        ),
        "for N in $(seq 0 7); do",
        "  "
        + _cmd(
            f"gcloud compute networks subnets create {opts.network_prefix}-rdma-sub-$N",
            f"--network={net.rdma_vpc}",
            "--region=${REGION}",
            "--range=192.168.$((N+1)).0/24",
        ),
        "done",
    ]
    return "\n".join(
        [
            _section(
                "1. APIs",
                "gcloud services enable container.googleapis.com storage.googleapis.com "
                "compute.googleapis.com",
            ),
            _section("2. gVNIC VPC (eth1 of GPU pods): 192.168.0.0/24", *gvnic),
            _section("3. RDMA VPC, one subnet per GPU NIC (eth2..eth9): 192.168.1-8.0/24", *rdma),
        ]
    )


def _cluster(opts: GkePlanOptions) -> str:
    version = opts.checked_version()
    if opts.autopilot:
        create = _cmd(
            "gcloud container clusters create-auto ${CLUSTER_NAME}",
            "--location=${REGION}",
            f"--cluster-version={version}",
            "--enable-multi-networking",
        )
        note = "# Autopilot adds GPU nodes on demand from the pods' node selectors (no node pool to create)."
    else:
        create = _cmd(
            "gcloud container clusters create ${CLUSTER_NAME}",
            "--location=${REGION}",
            "--node-locations=${ZONE}",
            f"--cluster-version={version}",
            "--enable-dataplane-v2",
            "--enable-ip-alias",
            "--enable-multi-networking",
            "--workload-pool=${PROJECT_ID}.svc.id.goog",
            "--addons=GcsFuseCsiDriver",
            "--machine-type=e2-standard-16",
            "--num-nodes=1",
        )
        note = "# The default pool (1 x e2-standard-16) hosts the CPU-only Ray head and the KubeRay operator."
    credentials = _cmd("gcloud container clusters get-credentials ${CLUSTER_NAME}", "--location=${REGION}")
    title = (
        f"4. {'Autopilot' if opts.autopilot else 'Standard'} cluster (GKE >= {opts.profile.min_gke_version})"
    )
    return _section(title, note, create, credentials)


def _node_pool(opts: GkePlanOptions) -> str:
    if opts.autopilot:
        return _section(
            "5. GPU nodes: none to create",
            f"# Autopilot creates {opts.profile.machine_type} nodes for the worker pods' node selector "
            f"({opts.profile.accelerator}); render with --spot for spot capacity.",
        )
    net = NetworkNames(opts.network_prefix)
    profile = opts.profile
    extra = [f"--additional-node-network=network={net.gvnic_vpc},subnetwork={net.gvnic_subnet}"]
    extra += [
        f"--additional-node-network=network={net.rdma_vpc},subnetwork={net.rdma_subnet(i)}" for i in range(8)
    ]
    pool = _cmd(
        "gcloud container node-pools create gpu-pool",
        "--cluster=${CLUSTER_NAME}",
        "--location=${REGION}",
        "--node-locations=${ZONE}",
        f"--machine-type={profile.machine_type}",
        f"--accelerator=type={profile.accelerator},count={profile.gpus_per_node}",
        f"--num-nodes={opts.node_count}",
        *(["--spot"] if opts.spot else []),
        *extra,
    )
    spot = (
        "# Spot nodes: a preempted run is retried by the RayJob (backoffLimit) and resumes from /data."
        if opts.spot
        else "# On-demand nodes (--spot for spot capacity: the RayJob retries and resumes after preemption)."
    )
    return _section(f"5. GPU node pool: {opts.node_count} x {profile.machine_type}", spot, pool)


def _installs(opts: GkePlanOptions) -> str:
    installer = "nccl-rdma-installer-autopilot.yaml" if opts.autopilot else "nccl-rdma-installer.yaml"
    rdma = f"kubectl apply -f {NCCL_INSTALLER_URL.format(name=installer)}"
    helm = [
        "helm repo add kuberay https://ray-project.github.io/kuberay-helm/",
        "helm repo update kuberay",
        _cmd(
            "helm upgrade --install kuberay-operator kuberay/kuberay-operator",
            f"--version {opts.kuberay_version}",
            "--namespace kuberay-system --create-namespace --wait",
        ),
    ]
    return "\n".join(
        [
            _section(
                "6. NCCL RDMA installer DaemonSet (gIB plugin into /home/kubernetes/bin/gib on GPU nodes)",
                "# Pin it: replace refs/heads/master by a commit of "
                "GoogleCloudPlatform/container-engine-accelerators.",
                rdma,
            ),
            _section(
                "7. KubeRay operator (pinned chart; do not also enable GKE's Ray add-on)",
                *helm,
            ),
        ]
    )


def _storage(opts: GkePlanOptions) -> str:
    member = (
        "principal://iam.googleapis.com/projects/${PROJECT_NUMBER}/locations/global/workloadIdentityPools/"
        "${PROJECT_ID}.svc.id.goog/subject/ns/${NAMESPACE}/sa/${KSA_NAME}"
    )
    return _section(
        "8. Storage: GCS bucket bound to the Kubernetes service account; Managed Lustre at /data",
        _cmd(
            "gcloud storage buckets create gs://${GS_BUCKET}",
            "--location=${REGION}",
            "--enable-hierarchical-namespace",
            "--uniform-bucket-level-access",
        ),
        "kubectl create serviceaccount ${KSA_NAME} --namespace ${NAMESPACE} --dry-run=client -o yaml "
        "| kubectl apply -f -",
        _cmd(
            "gcloud storage buckets add-iam-policy-binding gs://${GS_BUCKET}",
            f'--member "{member}"',
            '--role "roles/storage.objectUser"',
        ),
        "# Managed Lustre: create an instance on the cluster's VPC and a PersistentVolumeClaim named "
        f"{opts.lustre_pvc}",
        "# in ${NAMESPACE} (https://cloud.google.com/managed-lustre/docs/lustre-csi-driver-new-volume). "
        "Checkpoints,",
        "# logs and the Hugging Face cache live there, so a retried job resumes. Check it is bound:",
        f"kubectl get pvc {opts.lustre_pvc} --namespace ${{NAMESPACE}}",
    )


def _secret(opts: GkePlanOptions) -> str:
    create = _cmd(
        f"kubectl create secret generic {opts.secret_name}",
        "--namespace ${NAMESPACE}",
        '--from-literal=HF_TOKEN="${HF_TOKEN:?export HF_TOKEN=<your Hugging Face token> first}"',
        '--from-literal=WANDB_API_KEY="${WANDB_API_KEY:?export WANDB_API_KEY=<your W&B key> first}"',
        '--from-literal=RAY_AUTH_TOKEN="${RAY_AUTH_TOKEN:-$(openssl rand -hex 32)}"',
        "--dry-run=client -o yaml | kubectl apply -f -",
    )
    return _section(
        f"9. Secret {opts.secret_name}: tokens read from your environment, never written down",
        create,
        "# The Ray dashboard / Jobs API token, for `rlfleet submit` through a port-forward, is then:",
        f"#   export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$(kubectl get secret {opts.secret_name} "
        "-n ${NAMESPACE} -o jsonpath='{.data.RAY_AUTH_TOKEN}' | base64 -d)",
    )


def _next(opts: GkePlanOptions) -> str:
    flags = [
        f"--gpu {opts.gpu}",
        "--namespace ${NAMESPACE}",
        "--service-account ${KSA_NAME}",
        f"--secret-name {opts.secret_name}",
        f"--lustre-pvc {opts.lustre_pvc}",
        "--bucket ${GS_BUCKET}",
        f"--network-prefix {opts.network_prefix}",
        *(["--spot"] if opts.spot else []),
        "--image <your pinned image>",
    ]
    return _section(
        "10. Run a recipe (cluster.num_nodes <= the GPU node count); see docs/deploy-gke.md",
        "# " + " ".join(["rlfleet k8s render RECIPE [OVERRIDES...]", *flags, "--output job.yaml"]),
        "# kubectl apply -f job.yaml && kubectl get rayjob --namespace ${NAMESPACE} -w",
    )


def gke_plan(opts: GkePlanOptions) -> str:
    """The whole setup script for ``opts``.

    Raises:
        DeployError: an option is invalid (unknown GPU, zone outside region, GKE version too old, ...).
    """
    opts.check()
    parts = [_header(opts), _networks(opts), _cluster(opts), _node_pool(opts)]
    parts += [_installs(opts), _storage(opts), _secret(opts), _next(opts)]
    return "\n".join(parts)
