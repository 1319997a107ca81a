"""Command-line wiring of the deployment commands (called from :mod:`rlfleet.cli`).

``add_deploy_commands(subparsers)`` registers::

    rlfleet k8s render RECIPE [OVERRIDES...] --gpu {b200,h200} ...   # manifests for kubectl apply, validated
    rlfleet k8s validate FILE... [--crd-dir DIR]                      # offline schema validation
    rlfleet gke plan --gpu ... --region ... --zone ... --cluster ...  # gcloud/kubectl/helm setup script
    rlfleet submit --address URL RECIPE [OVERRIDES...]                # Ray Jobs API
    rlfleet status --address URL JOB_ID [--wait SECONDS]
    rlfleet logs --address URL JOB_ID [--follow]
    rlfleet stop --address URL JOB_ID

Each handler returns the exit code: 0 success, 1 a job that failed/stopped or invalid manifests given to
``k8s validate``, 2 a usage problem (the message says what to change). ``k8s render`` validates what it
writes (KubeRay CRDs shipped with rlfleet, Kubernetes schemas) unless ``--no-validate``: a problem is exit 2.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import rlfleet
from rlfleet.config import ConfigError
from rlfleet.deploy.gke import (
    DEFAULT_IMAGE,
    DEFAULT_KSA,
    DEFAULT_LUSTRE_PVC,
    DEFAULT_NETWORK_PREFIX,
    DEFAULT_SECRET_NAME,
    GPUS,
    DeployError,
)

__all__ = ["add_deploy_commands"]

Handler = Callable[[argparse.Namespace], int]


def _guarded(func: Handler) -> Handler:
    """Print user-facing errors (no traceback) and turn them into exit code 2."""

    @functools.wraps(func)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except (DeployError, ConfigError) as exc:
            print(f"rlfleet: error: {exc}", file=sys.stderr)
            return 2
        except TimeoutError as exc:
            print(f"rlfleet: timed out: {exc}", file=sys.stderr)
            return 1

    return wrapper


def _write(text: str, output: str | None) -> None:
    if output and output != "-":
        Path(output).write_text(text, encoding="utf-8")
        print(f"wrote {output}", file=sys.stderr)
    else:
        sys.stdout.write(text)


# --------------------------------------------------------------------------------------------- k8s


@_guarded
def cmd_k8s_render(args: argparse.Namespace) -> int:
    from rlfleet.deploy.manifests import RenderOptions, dump_documents, render_job

    opts = RenderOptions(
        gpu=args.gpu,
        name=args.name,
        namespace=args.namespace,
        image=args.image,
        bucket=args.bucket,
        lustre_pvc=args.lustre_pvc,
        service_account=args.service_account,
        secret_name=args.secret_name,
        ray_version=args.ray_version,
        cluster_only=args.cluster_only,
        backoff_limit=args.backoff_limit,
        ttl_seconds=args.ttl_seconds,
        spot=args.spot,
        network_prefix=args.network_prefix,
        head_cpu=args.head_cpu,
        head_memory=args.head_memory,
    )
    job = render_job(args.recipe, args.overrides, opts)
    if args.validate:
        from rlfleet.deploy.validate import check_documents

        check_documents(job.documents)  # before writing: an invalid manifest is never written
    kind = "RayCluster" if opts.cluster_only else "RayJob"
    header = [
        f"rlfleet {rlfleet.__version__} k8s render: {kind} {job.name} ({opts.gpu}, image {opts.image})",
        f"checkpoints: {job.checkpoint_dir}  logs: {job.log_dir}",
        f"apply: kubectl apply -f <this file>   (secret {opts.secret_name} must exist; see rlfleet gke plan)",
    ]
    _write(dump_documents(job.documents, header), args.output)
    for note in job.notes:
        print(f"rlfleet: note: {note}", file=sys.stderr)
    return 0


@_guarded
def cmd_k8s_validate(args: argparse.Namespace) -> int:
    import yaml

    from rlfleet.deploy.validate import validate_documents

    docs: list[Any] = []
    for name in args.files:
        try:
            text = sys.stdin.read() if name == "-" else Path(name).read_text(encoding="utf-8")
        except OSError as exc:
            raise DeployError(f"cannot read {name}: {exc.strerror}") from None
        docs += [d for d in yaml.safe_load_all(text) if d is not None]
    problems = validate_documents(docs, args.crd_dir, args.k8s_version)
    for problem in problems:
        print(problem)
    print(f"{len(docs)} document(s), {len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0


def _add_k8s(subparsers: Any) -> None:
    k8s = subparsers.add_parser("k8s", help="Kubernetes manifests (KubeRay RayJob/RayCluster) for GKE")
    sub = k8s.add_subparsers(dest="k8s_command", required=True)
    p = sub.add_parser("render", help="write the manifests of a recipe's run (networks, recipe, RayJob)")
    p.add_argument("recipe", help="recipe YAML path or shipped recipe name")
    p.add_argument("overrides", nargs="*", help="overrides such as grpo.max_num_steps=10")
    p.add_argument("--gpu", required=True, choices=sorted(GPUS), help="GPU node type (8 GPUs per node)")
    p.add_argument("--name", help="RayJob/RayCluster name (default: from the recipe file name)")
    p.add_argument("--namespace", default="default")
    p.add_argument("--image", default=DEFAULT_IMAGE, help="pinned image with rlfleet and ray (no :latest)")
    p.add_argument("--bucket", help="GCS bucket to mount at /gcs with GCS FUSE (optional)")
    p.add_argument(
        "--lustre-pvc", default=DEFAULT_LUSTRE_PVC, help="PVC mounted at /data (checkpoints, logs)"
    )
    p.add_argument("--service-account", default=DEFAULT_KSA, help="Kubernetes SA bound to the bucket")
    p.add_argument("--secret-name", default=DEFAULT_SECRET_NAME, help="Secret with HF_TOKEN etc.")
    p.add_argument("--ray-version", default="2.60.0", help="Ray version in the image")
    p.add_argument("--cluster-only", action="store_true", help="a standalone RayCluster for rlfleet submit")
    p.add_argument("--backoff-limit", type=int, default=3, help="retries of the job (e.g. after preemption)")
    p.add_argument("--ttl-seconds", type=int, default=3600, help="keep the finished job's cluster this long")
    p.add_argument("--spot", action="store_true", help="run the GPU workers on spot nodes")
    p.add_argument("--network-prefix", default=DEFAULT_NETWORK_PREFIX, help="as given to rlfleet gke plan")
    p.add_argument("--head-cpu", default="8")
    p.add_argument("--head-memory", default="32Gi")
    p.add_argument(
        "--no-validate",
        dest="validate",
        action="store_false",
        help="skip the offline validation of the manifests (KubeRay CRDs shipped with rlfleet, or "
        "$RLFLEET_KUBERAY_CRDS; Kubernetes schemas); needs no 'rlfleet[k8s]' extra",
    )
    p.add_argument("--output", "-o", help="write to this file (default: stdout)")
    p.set_defaults(func=cmd_k8s_render)
    p = sub.add_parser("validate", help="validate manifests offline (KubeRay CRDs, Kubernetes schemas)")
    p.add_argument("files", nargs="+", help="YAML files ('-' for stdin)")
    p.add_argument(
        "--crd-dir",
        help="folder with KubeRay's ray.io_rayclusters.yaml and ray.io_rayjobs.yaml (default: "
        "$RLFLEET_KUBERAY_CRDS, else the copy shipped with rlfleet)",
    )
    p.add_argument("--k8s-version", default="1.32", help="Kubernetes minor version of the core schemas")
    p.set_defaults(func=cmd_k8s_validate)


# --------------------------------------------------------------------------------------------- gke


@_guarded
def cmd_gke_plan(args: argparse.Namespace) -> int:
    from rlfleet.deploy.gke_plan import GkePlanOptions, gke_plan

    opts = GkePlanOptions(
        gpu=args.gpu,
        region=args.region,
        zone=args.zone,
        cluster=args.cluster,
        project=args.project,
        autopilot=args.autopilot,
        bucket=args.bucket,
        node_count=args.node_count,
        spot=args.spot,
        gke_version=args.gke_version,
        namespace=args.namespace,
        service_account=args.service_account,
        secret_name=args.secret_name,
        lustre_pvc=args.lustre_pvc,
        network_prefix=args.network_prefix,
        kuberay_version=args.kuberay_version,
    )
    _write(gke_plan(opts), args.output)
    return 0


def _add_gke(subparsers: Any) -> None:
    from rlfleet.deploy.gke_plan import KUBERAY_CHART_VERSION

    gke = subparsers.add_parser("gke", help="Google Kubernetes Engine setup")
    sub = gke.add_subparsers(dest="gke_command", required=True)
    p = sub.add_parser("plan", help="print the gcloud/kubectl/helm commands that prepare a project")
    p.add_argument("--gpu", required=True, choices=sorted(GPUS))
    p.add_argument("--region", required=True, help="e.g. us-central1")
    p.add_argument("--zone", required=True, help="a zone of --region with the GPU machines")
    p.add_argument("--cluster", required=True, help="GKE cluster name")
    p.add_argument("--project", help="Google Cloud project (default: gcloud's configured project)")
    p.add_argument("--autopilot", action="store_true", help="Autopilot instead of a Standard cluster")
    p.add_argument("--bucket", help="GCS bucket name (default: <project>-rlfleet)")
    p.add_argument("--node-count", type=int, default=2, help="GPU nodes (>= the recipe's cluster.num_nodes)")
    p.add_argument("--spot", action="store_true", help="spot GPU nodes")
    p.add_argument("--gke-version", help="GKE version (default: the minimum for the GPU)")
    p.add_argument("--namespace", default="default")
    p.add_argument("--service-account", default=DEFAULT_KSA)
    p.add_argument("--secret-name", default=DEFAULT_SECRET_NAME)
    p.add_argument("--lustre-pvc", default=DEFAULT_LUSTRE_PVC)
    p.add_argument("--network-prefix", default=DEFAULT_NETWORK_PREFIX)
    p.add_argument("--kuberay-version", default=KUBERAY_CHART_VERSION, help="KubeRay operator Helm chart")
    p.add_argument("--output", "-o", help="write to this file (default: stdout)")
    p.set_defaults(func=cmd_gke_plan)


# --------------------------------------------------------------------------------------------- jobs


def _parse_env(pairs: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise DeployError(f"--env {pair!r}: expected KEY=VALUE")
        env[key] = value
    return env


def _exit_for(status: str) -> int:
    return 1 if status in ("FAILED", "STOPPED") else 0


@_guarded
def cmd_submit(args: argparse.Namespace) -> int:
    from rlfleet.deploy import jobs

    job_id = jobs.submit_recipe(
        args.address,
        args.recipe,
        args.overrides,
        entrypoint=args.entrypoint,
        submission_id=args.submission_id,
        env_vars=_parse_env(args.env),
    )
    print(job_id)
    if not args.follow:
        print(
            f"follow it: rlfleet logs --address {args.address or '$RAY_ADDRESS'} {job_id} --follow",
            file=sys.stderr,
        )
        return 0
    jobs.follow_logs(args.address, job_id, sys.stdout.write)
    view = jobs.wait_for_job(args.address, job_id, timeout_s=60)
    print(view.line(), file=sys.stderr)
    return _exit_for(view.status)


@_guarded
def cmd_status(args: argparse.Namespace) -> int:
    from rlfleet.deploy import jobs

    if args.wait:
        view = jobs.wait_for_job(args.address, args.job_id, timeout_s=args.wait)
    else:
        view = jobs.job_status(args.address, args.job_id)
    print(view.line())
    return _exit_for(view.status)


@_guarded
def cmd_logs(args: argparse.Namespace) -> int:
    from rlfleet.deploy import jobs

    if args.follow:
        jobs.follow_logs(args.address, args.job_id, sys.stdout.write, timeout_s=args.timeout)
    else:
        sys.stdout.write(jobs.job_logs(args.address, args.job_id))
    return 0


@_guarded
def cmd_stop(args: argparse.Namespace) -> int:
    from rlfleet.deploy import jobs

    stopped = jobs.stop_job(args.address, args.job_id)
    print(f"{args.job_id}: {'stop requested' if stopped else 'already finished'}")
    return 0


def _add_jobs(subparsers: Any) -> None:
    address_help = "Ray dashboard URL, e.g. http://127.0.0.1:8265 (default: $RAY_ADDRESS)"
    p = subparsers.add_parser("submit", help="submit a recipe to a Ray cluster (Ray Jobs API)")
    p.add_argument("--address", help=address_help)
    p.add_argument("recipe", help="recipe YAML path or shipped recipe name (uploaded with the job)")
    p.add_argument("overrides", nargs="*", help="overrides such as grpo.max_num_steps=10")
    p.add_argument("--submission-id", help="job id (default: rlfleet-<recipe>-<UTC timestamp>)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="non-secret env var")
    p.add_argument("--entrypoint", help="run this command instead of `rlfleet grpo recipe.yaml ...`")
    p.add_argument("--follow", action="store_true", help="stream the logs until the job ends")
    p.set_defaults(func=cmd_submit)
    for name, func, help_text in (
        ("status", cmd_status, "a job's status (exit 1 if it failed or was stopped)"),
        ("logs", cmd_logs, "a job's logs"),
        ("stop", cmd_stop, "stop a job"),
    ):
        p = subparsers.add_parser(name, help=help_text)
        p.add_argument("--address", help=address_help)
        p.add_argument("job_id", help="the submission id printed by rlfleet submit")
        if name == "status":
            p.add_argument("--wait", type=float, default=0, metavar="SECONDS", help="wait for the job to end")
        if name == "logs":
            p.add_argument("--follow", "-f", action="store_true", help="stream until the job ends")
            p.add_argument("--timeout", type=float, help="stop following after this many seconds")
        p.set_defaults(func=func)


def add_deploy_commands(subparsers: Any) -> None:
    """Register ``k8s``, ``gke``, ``submit``, ``status``, ``logs`` and ``stop`` on ``subparsers``.

    ``subparsers`` is the object returned by ``ArgumentParser.add_subparsers()``; each command sets
    ``func`` (``args -> int`` exit code) with ``set_defaults``.
    """
    _add_k8s(subparsers)
    _add_gke(subparsers)
    _add_jobs(subparsers)
