"""`rlfleet k8s render`: the seed's run (gemma3-27b-it + the seed's overrides) on B200 and H200 nodes."""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlfleet.config import (
    ConfigError,
    MasterConfig,
    load_recipe,
    quote_override_value,
    resolve_recipe_path,
)
from rlfleet.deploy import manifests
from rlfleet.deploy.cli import add_deploy_commands
from rlfleet.deploy.gke import GPUS, DeployError, NetworkNames
from rlfleet.deploy.manifests import RenderedJob, RenderOptions, dump_documents, render_job
from rlfleet.deploy.validate import (
    CRD_DIR_ENV,
    CRD_FILES,
    PACKAGED_CRD_DIR,
    find_crd_dir,
    pod_templates,
    validate_documents,
)
from tests.conftest import SEED_COMMAND_LINE

REPO = Path(__file__).resolve().parents[2]

GEMMA = "grpo-gemma3-27b-it-2n8g-fsdp2tp8-noncolocated"
SEED_OVERRIDES = SEED_COMMAND_LINE.split()  # quotes kept: what rlfleet gets when the line is quoted once more
SHELL_OVERRIDES = shlex.split(SEED_COMMAND_LINE)  # quotes removed: what rlfleet gets from a shell
SECRET_VALUES = {
    "HF_TOKEN": "hf_SEEKRIT_value_123456",
    "WANDB_API_KEY": "wandb_SEEKRIT_0123456789abcdef",
    "RAY_AUTH_TOKEN": "ray_SEEKRIT_deadbeefdeadbeef",
}


def seed_job(gpu: str, **options: Any) -> RenderedJob:
    return render_job(GEMMA, SEED_OVERRIDES, RenderOptions(gpu=gpu, **options))


def by_kind(job: RenderedJob, kind: str) -> list[dict[str, Any]]:
    return [d for d in job.documents if d["kind"] == kind]


def worker_group(job: RenderedJob) -> dict[str, Any]:
    (rayjob,) = by_kind(job, "RayJob")
    (group,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    return group


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


@pytest.fixture(params=sorted(GPUS))
def gpu(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_network_objects_match_the_seed_mapping(gpu: str) -> None:
    job = seed_job(gpu, network_prefix="myproj")
    params = {d["metadata"]["name"]: d["spec"] for d in by_kind(job, "GKENetworkParamSet")}
    networks = {d["metadata"]["name"]: d["spec"] for d in by_kind(job, "Network")}
    expected = ["gvnic-1", *(f"rdma-{i}" for i in range(8))]
    assert sorted(params) == sorted(networks) == sorted(expected)
    names = NetworkNames("myproj")
    assert params["gvnic-1"] == {
        "vpc": names.gvnic_vpc,
        "vpcSubnet": names.gvnic_subnet,
        "deviceMode": "NetDevice",
    }
    for i in range(8):
        assert params[f"rdma-{i}"] == {
            "vpc": names.rdma_vpc,
            "vpcSubnet": names.rdma_subnet(i),
            "deviceMode": "RDMA",
        }
    for name, spec in networks.items():
        assert spec == {
            "type": "Device",
            "parametersRef": {"group": "networking.gke.io", "kind": "GKENetworkParamSet", "name": name},
        }
    assert all(d["apiVersion"] == "networking.gke.io/v1" for d in job.documents[:18])


def test_worker_group_is_sized_by_the_recipe(gpu: str) -> None:
    job = seed_job(gpu)
    group = worker_group(job)
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 2  # cluster.num_nodes
    (container,) = group["template"]["spec"]["containers"]
    for amounts in container["resources"].values():
        assert amounts["nvidia.com/gpu"] == 8
    spec = group["template"]["spec"]
    assert spec["nodeSelector"] == {"cloud.google.com/gke-accelerator": GPUS[gpu].accelerator}
    assert GPUS["b200"].accelerator == "nvidia-b200" and GPUS["h200"].accelerator == "nvidia-h200-141gb"
    keys = {t["key"] for t in spec["tolerations"]}
    assert keys == {"nvidia.com/gpu", "cloud.google.com/gke-spot"}
    head = by_kind(job, "RayJob")[0]["spec"]["rayClusterSpec"]["headGroupSpec"]
    (head_container,) = head["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in head_container["resources"]["limits"]  # CPU head
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"


def test_gpu_pods_get_multi_networking_and_gib_nccl(gpu: str) -> None:
    template = worker_group(seed_job(gpu))["template"]
    notes = template["metadata"]["annotations"]
    assert notes["networking.gke.io/default-interface"] == "eth0"
    interfaces = json.loads(notes["networking.gke.io/interfaces"])
    assert interfaces[0] == {"interfaceName": "eth0", "network": "default"}
    assert interfaces[1] == {"interfaceName": "eth1", "network": "gvnic-1"}
    assert interfaces[2:] == [{"interfaceName": f"eth{i + 2}", "network": f"rdma-{i}"} for i in range(8)]
    (container,) = template["spec"]["containers"]
    env = {k: v.get("value") for k, v in env_of(container).items()}
    tuner = {"b200": "tuner_config_a4.txtpb", "h200": "tuner_config_a3u.txtpb"}[gpu]
    assert env["NCCL_TUNER_CONFIG_PATH"] == f"/usr/local/gib/configs/{tuner}"
    expected = {
        "NCCL_NET": "gIB",
        "NCCL_IB_GID_INDEX": "3",
        "NCCL_CROSS_NIC": "0",
        "NCCL_SOCKET_IFNAME": "eth0",
        "GLOO_SOCKET_IFNAME": "eth0",
        "NCCL_NET_GDR_LEVEL": "PIX",
        "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64",
    }
    assert expected.items() <= env.items()
    assert "source /usr/local/gib/scripts/set_nccl_env.sh" in container["args"][0]


def test_volumes_service_account_and_shm(gpu: str) -> None:
    job = seed_job(gpu, lustre_pvc="my-lustre", service_account="my-ksa", bucket="my-bucket")
    for where, template in pod_templates(by_kind(job, "RayJob")[0]):
        if where == "submitter":
            continue
        spec = template["spec"]
        assert spec["serviceAccountName"] == "my-ksa"
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
        assert volumes[mounts["/data"]]["persistentVolumeClaim"] == {"claimName": "my-lustre"}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert volumes[mounts["/gcs"]]["csi"]["volumeAttributes"]["bucketName"] == "my-bucket"
        assert template["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"
        if where.startswith("worker"):
            assert volumes[mounts["/usr/local/nvidia"]]["hostPath"]["path"] == "/home/kubernetes/bin/nvidia"
            assert volumes[mounts["/usr/local/gib"]]["hostPath"]["path"] == "/home/kubernetes/bin/gib"


def test_rayjob_retries_and_resumes_from_data(gpu: str) -> None:
    job = seed_job(gpu)
    (rayjob,) = by_kind(job, "RayJob")
    spec = rayjob["spec"]
    assert spec["backoffLimit"] > 0
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["ttlSecondsAfterFinished"] > 0
    assert shlex.split(spec["entrypoint"]) == ["rlfleet", "grpo", "/etc/rlfleet/recipe.yaml"]  # no overrides
    assert spec["entrypoint"] == job.entrypoint
    assert recipe_in(job).checkpointing.checkpoint_dir == "/data/nemo_rl_gemma3_27b_3_17"
    assert rayjob["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"


def test_no_git_pull_sed_or_kubectl_exec_anywhere(gpu: str) -> None:
    for options in ({}, {"cluster_only": True}):
        text = dump_documents(seed_job(gpu, **options).documents)
        for bad in ("git pull", "git checkout", "sed -i", "sed ", "kubectl exec", "pip install"):
            assert bad not in text


def recipe_text(job: RenderedJob) -> str:
    (configmap,) = by_kind(job, "ConfigMap")
    return str(configmap["data"]["recipe.yaml"])


def recipe_in(job: RenderedJob) -> MasterConfig:
    """The config the job runs: the ConfigMap's recipe, loaded as ``rlfleet grpo`` loads it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recipe.yaml"
        path.write_text(recipe_text(job), encoding="utf-8")
        return load_recipe(path)


def test_recipe_travels_resolved_in_a_configmap_and_round_trips() -> None:
    job = seed_job("b200")
    (configmap,) = by_kind(job, "ConfigMap")
    head = by_kind(job, "RayJob")[0]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (recipe_volume,) = [v for v in head["volumes"] if "configMap" in v]
    assert recipe_volume["configMap"]["name"] == configmap["metadata"]["name"]
    here = load_recipe(resolve_recipe_path(GEMMA), [*SEED_OVERRIDES, f"logger.log_dir={job.log_dir}"])
    assert recipe_in(job) == here  # every override is in the recipe; the entrypoint has none
    assert job.entrypoint == "rlfleet grpo /etc/rlfleet/recipe.yaml"
    raw = yaml.safe_load(recipe_text(job))
    assert (
        "defaults" not in raw and raw["data"]["subset"] == "main" and raw["data"]["input_key"] == "question"
    )
    assert raw["logger"]["wandb"]["name"] == "nemo_rl_gemma3_27b_3_17"
    assert raw["cluster"]["num_nodes"] == 2 and raw["grpo"]["num_prompts_per_step"] == 16


def test_quoted_and_shell_split_overrides_render_the_same_recipe() -> None:
    quoted, split = seed_job("h200"), render_job(GEMMA, SHELL_OVERRIDES, RenderOptions(gpu="h200"))
    assert recipe_in(quoted) == recipe_in(split)
    assert '+data.subset=\\"main\\"' in recipe_text(quoted)  # the header names the overrides as given
    body = [line for line in recipe_text(quoted).splitlines() if not line.startswith("#")]
    assert body == [line for line in recipe_text(split).splitlines() if not line.startswith("#")]


def test_values_with_spaces_and_shell_characters_reach_the_recipe() -> None:
    name = "two words; $HOME `x` 'q' \"d\""
    job = render_job(
        GEMMA,
        [*SHELL_OVERRIDES, f"logger.wandb.name={quote_override_value(name)}"],
        RenderOptions(gpu="b200"),
    )
    assert recipe_in(job).logger.wandb.name == name
    assert shlex.split(job.entrypoint) == ["rlfleet", "grpo", "/etc/rlfleet/recipe.yaml"]


def test_secrets_are_references_only(gpu: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in SECRET_VALUES.items():
        monkeypatch.setenv(key, value)
    for options in ({}, {"cluster_only": True}):
        job = seed_job(gpu, **options)
        text = dump_documents(job.documents)
        assert not [v for v in SECRET_VALUES.values() if v in text]
        ray = next(d for d in job.documents if d["kind"] in ("RayJob", "RayCluster"))
        for _, template in pod_templates(ray):
            for container in template["spec"]["containers"]:
                env = env_of(container)
                assert env["RAY_AUTH_MODE"]["value"] == "token"
                for key in set(SECRET_VALUES) & set(env):
                    assert "value" not in env[key]
                    assert env[key]["valueFrom"]["secretKeyRef"] == {"name": "rlfleet-secrets", "key": key}
        head = ray["spec"].get("rayClusterSpec", ray["spec"])["headGroupSpec"]["template"]["spec"]
        assert {"HF_TOKEN", "WANDB_API_KEY", "RAY_AUTH_TOKEN"} <= set(env_of(head["containers"][0]))


@pytest.fixture
def no_crd_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CRD_DIR_ENV, raising=False)


def test_the_kuberay_crds_ship_in_the_package(no_crd_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert PACKAGED_CRD_DIR == REPO / "src" / "rlfleet" / "deploy" / "schemas"
    assert find_crd_dir() == PACKAGED_CRD_DIR
    names = {path.name for path in PACKAGED_CRD_DIR.iterdir()}
    assert {*CRD_FILES.values(), "LICENSE", "README.md"} <= names
    assert "Apache License" in (PACKAGED_CRD_DIR / "LICENSE").read_text(encoding="utf-8")
    monkeypatch.setenv(CRD_DIR_ENV, str(PACKAGED_CRD_DIR))  # an override still wins
    assert find_crd_dir() == PACKAGED_CRD_DIR
    monkeypatch.setenv(CRD_DIR_ENV, str(REPO))
    with pytest.raises(DeployError, match=r"\$RLFLEET_KUBERAY_CRDS\) lacks .*leave it unset"):
        find_crd_dir()
    with pytest.raises(DeployError, match=r"\(--crd-dir\) lacks"):
        find_crd_dir(REPO)


@pytest.mark.parametrize("cluster_only", [False, True])
def test_manifests_validate_offline(gpu: str, cluster_only: bool, no_crd_env: None) -> None:
    job = seed_job(gpu, cluster_only=cluster_only, bucket="b", spot=True)
    kinds = [d["kind"] for d in job.documents]
    assert ("RayCluster" in kinds) == cluster_only and ("RayJob" in kinds) != cluster_only
    assert validate_documents(job.documents) == []
    reloaded = list(yaml.safe_load_all(dump_documents(job.documents, ["a header"])))
    assert reloaded == job.documents


def test_validation_catches_what_an_api_server_would_prune_or_reject(no_crd_env: None) -> None:
    job = seed_job("h200")
    rayjob = by_kind(job, "RayJob")[0]
    group = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    del group["minReplicas"]
    container = group["template"]["spec"]["containers"][0]
    container["volumeMount"] = container.pop("volumeMounts")
    container["env"].append({"name": "HF_TOKEN", "value": "literal"})
    problems = "\n".join(validate_documents([rayjob]))
    assert "'minReplicas' is a required property" in problems
    assert "'volumeMount' was unexpected" in problems
    assert "HF_TOKEN has a literal value" in problems


@pytest.mark.parametrize(
    "image", ["ghcr.io/rlfleet/rlfleet", "ghcr.io/rlfleet/rlfleet:latest", "localhost:5000/rlfleet"]
)
def test_unpinned_images_are_refused(image: str) -> None:
    with pytest.raises(DeployError, match="pin it"):
        seed_job("b200", image=image)


def test_pinned_images_are_accepted() -> None:
    for image in ("localhost:5000/rlfleet:0.1.0", "ghcr.io/x/rlfleet@sha256:" + "a" * 64):
        worker = worker_group(seed_job("b200", image=image))["template"]["spec"]["containers"][0]
        assert worker["image"] == image


def test_recipe_must_use_all_eight_gpus_of_a_node() -> None:
    with pytest.raises(DeployError, match=r"cluster.gpus_per_node=4.*cluster.gpus_per_node=8"):
        render_job(GEMMA, [*SEED_OVERRIDES, "cluster.gpus_per_node=4"], RenderOptions(gpu="h200"))


def test_replicas_follow_num_nodes() -> None:
    overrides = [*SEED_OVERRIDES, "cluster.num_nodes=5"]  # 1 generation node + 4 training nodes (DP 4)
    job = render_job(GEMMA, overrides, RenderOptions(gpu="b200"))
    assert worker_group(job)["replicas"] == 5


def test_local_paths_move_to_the_shared_volume() -> None:
    overrides = [*SEED_OVERRIDES, "checkpointing.checkpoint_dir=results/ckpt", "logger.log_dir=logs"]
    job = render_job(GEMMA, overrides, RenderOptions(gpu="b200", name="tiny"))
    assert job.checkpoint_dir == "/data/checkpoints/tiny" and job.log_dir == "/data/logs/tiny"
    cfg = recipe_in(job)
    assert (
        cfg.checkpointing.checkpoint_dir == "/data/checkpoints/tiny"
        and cfg.logger.log_dir == "/data/logs/tiny"
    )
    assert any("not on the shared volume" in n for n in job.notes)


def test_bad_inputs_fail_loudly() -> None:
    with pytest.raises(DeployError, match="DNS-1035"):
        seed_job("b200", name="Bad_Name")
    with pytest.raises(DeployError, match="at most 47"):
        seed_job("b200", name="a" * 48)
    with pytest.raises(ConfigError):
        render_job(GEMMA, [*SEED_OVERRIDES, "grpo.not_a_key=1"], RenderOptions(gpu="b200"))
    with pytest.raises(DeployError, match="use one of"):
        render_job(GEMMA, SEED_OVERRIDES, RenderOptions(gpu="a100"))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet")
    add_deploy_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli_render_then_validate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_crd_env: None
) -> None:
    out = tmp_path / "job.yaml"
    args = _parser().parse_args(
        ["k8s", "render", GEMMA, *SEED_OVERRIDES, "--gpu", "h200", "--output", str(out)]
    )
    assert args.validate  # by default
    assert args.func(args) == 0
    docs = list(yaml.safe_load_all(out.read_text()))
    assert docs[-1]["kind"] == "RayJob" and len(docs) == 20
    assert "cannot run" not in capsys.readouterr().err  # the seed's vLLM layout runs
    args = _parser().parse_args(["k8s", "validate", str(out)])  # the shipped CRDs, no --crd-dir
    assert args.func(args) == 0
    args = _parser().parse_args(["k8s", "validate", str(out), "--crd-dir", str(PACKAGED_CRD_DIR)])
    assert args.func(args) == 0
    args = _parser().parse_args(["k8s", "render", GEMMA, "--gpu", "b200", "--image", "x/y:latest"])
    assert args.func(args) == 2
    assert "pin it" in capsys.readouterr().err


def _render_without_min_replicas(recipe: str, overrides: list[str], opts: RenderOptions) -> RenderedJob:
    """``render_job`` with a bug: the worker group lacks ``minReplicas`` (which the KubeRay CRD requires)."""
    job = render_job(recipe, overrides, opts)
    del worker_group(job)["minReplicas"]
    return job


def test_cli_render_refuses_to_write_invalid_manifests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, no_crd_env: None
) -> None:
    monkeypatch.setattr(manifests, "render_job", _render_without_min_replicas)
    out = tmp_path / "job.yaml"
    argv = ["k8s", "render", GEMMA, *SEED_OVERRIDES, "--gpu", "h200", "--output", str(out)]
    args = _parser().parse_args(argv)
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "fail offline validation (1 problem(s)" in err
    assert "spec/rayClusterSpec/workerGroupSpecs/0: 'minReplicas' is a required property" in err
    assert "--no-validate" in err
    assert not out.exists()  # nothing invalid is written
    args = _parser().parse_args([*argv, "--no-validate"])
    assert args.func(args) == 0
    assert "minReplicas" not in out.read_text()
