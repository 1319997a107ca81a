"""`rlfleet gke plan`: the seed's setup commands, parameterised and consistent with `k8s render`."""

from __future__ import annotations

import argparse
import re

import pytest

from rlfleet.deploy.cli import add_deploy_commands
from rlfleet.deploy.gke import GPUS, DeployError
from rlfleet.deploy.gke_plan import GkePlanOptions, gke_plan
from rlfleet.deploy.manifests import RenderOptions, render_job

SECRETS = {
    "HF_TOKEN": "hf_PLANSECRET_1234",
    "WANDB_API_KEY": "wandb_PLANSECRET_5678",
    "RAY_AUTH_TOKEN": "r" * 40,
}


def plan(gpu: str = "b200", **options: object) -> str:
    base: dict[str, object] = {"region": "us-central1", "zone": "us-central1-b", "cluster": "rl"}
    return gke_plan(GkePlanOptions(gpu=gpu, **{**base, **options}))  # type: ignore[arg-type]


@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_standard_cluster_commands(gpu: str) -> None:
    text = plan(gpu, spot=True, node_count=3, project="my-proj")
    profile = GPUS[gpu]
    assert f"--cluster-version={profile.min_gke_version}" in text
    assert {"b200": "1.32.2-gke.1422000", "h200": "1.31.4-gke.1183000"}[gpu] == profile.min_gke_version
    assert f"--machine-type={profile.machine_type}" in text
    assert f"--accelerator=type={profile.accelerator},count=8" in text
    assert "--num-nodes=3" in text and "--spot" in text
    assert 'export PROJECT_ID="my-proj"' in text
    assert "gcloud container clusters create ${CLUSTER_NAME}" in text and "create-auto" not in text
    assert "--enable-multi-networking" in text and "--workload-pool=${PROJECT_ID}.svc.id.goog" in text
    assert "gpudirect-rdma/nccl-rdma-installer.yaml" in text
    assert "helm upgrade --install kuberay-operator kuberay/kuberay-operator" in text
    assert re.search(r"--version \d+\.\d+\.\d+", text)


def test_vpcs_subnets_and_firewall() -> None:
    text = plan()
    assert "--range=192.168.0.0/24" in text
    assert "--network-profile=${REGION}-vpc-roce" in text
    assert "for N in $(seq 0 7)" in text and "--range=192.168.$((N+1)).0/24" in text
    assert "gcloud compute firewall-rules create rlfleet-gvnic-internal" in text
    assert "--source-ranges=192.168.0.0/16" in text
    assert text.count("--additional-node-network=") == 9


def test_autopilot_cluster() -> None:
    text = plan("h200", autopilot=True)
    assert "gcloud container clusters create-auto ${CLUSTER_NAME}" in text
    assert "gcloud container node-pools create" not in text
    assert "nccl-rdma-installer-autopilot.yaml" in text
    assert "--cluster-version=1.31.4-gke.1183000" in text


def test_bucket_workload_identity_and_secret_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    text = plan(bucket="my-bucket", namespace="ml", service_account="trainer")
    assert 'export GS_BUCKET="my-bucket"' in text
    assert "export NAMESPACE=ml" in text and "export KSA_NAME=trainer" in text
    assert "gcloud storage buckets create gs://${GS_BUCKET}" in text
    assert '--role "roles/storage.objectUser"' in text
    assert "/subject/ns/${NAMESPACE}/sa/${KSA_NAME}" in text
    assert '--from-literal=HF_TOKEN="${HF_TOKEN:?' in text
    assert '--from-literal=WANDB_API_KEY="${WANDB_API_KEY:?' in text
    assert not [v for v in SECRETS.values() if v in text]


def test_plan_and_render_agree_on_names() -> None:
    text = plan(network_prefix="team1", secret_name="s1", service_account="ksa1")
    job = render_job(
        "grpo-gemma3-27b-it-2n8g-fsdp2tp8-noncolocated",
        [],
        RenderOptions(gpu="b200", network_prefix="team1", secret_name="s1", service_account="ksa1"),
    )
    pairs = set(re.findall(r"--additional-node-network=network=([\w-]+),subnetwork=([\w-]+)", text))
    rendered = {
        (d["spec"]["vpc"], d["spec"]["vpcSubnet"]) for d in job.documents if d["kind"] == "GKENetworkParamSet"
    }
    assert pairs == rendered and len(pairs) == 9
    assert "kubectl create secret generic s1" in text and "export KSA_NAME=ksa1" in text
    assert "--secret-name s1" in text


def test_invalid_options_fail_loudly() -> None:
    with pytest.raises(DeployError, match=r"older than 1\.32\.2-gke\.1422000"):
        plan("b200", gke_version="1.31.9-gke.1000")
    assert "--cluster-version=1.33.1-gke.100" in plan("b200", gke_version="1.33.1-gke.100")
    with pytest.raises(DeployError, match="not in --region"):
        plan(zone="europe-west4-a")
    with pytest.raises(DeployError, match=r"MAJOR\.MINOR\.PATCH"):
        plan(gke_version="latest")
    with pytest.raises(DeployError, match="network-prefix"):
        plan(network_prefix="Bad_Prefix")


def test_cli_gke_plan(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="rlfleet")
    add_deploy_commands(parser.add_subparsers(dest="command", required=True))
    argv = ["gke", "plan", "--gpu", "h200", "--region", "us-east5", "--zone", "us-east5-a", "--cluster", "c"]
    args = parser.parse_args([*argv, "--autopilot"])
    assert args.func(args) == 0
    assert "create-auto" in capsys.readouterr().out
    args = parser.parse_args([*argv, "--gke-version", "1.30.0-gke.1"])
    assert args.func(args) == 2
    assert "minimum for h200" in capsys.readouterr().err
