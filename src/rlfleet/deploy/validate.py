"""Offline validation of rendered manifests (no API server needed).

- ``RayJob`` / ``RayCluster``: ``jsonschema`` against the KubeRay CRDs' ``openAPIV3Schema`` (version ``v1``),
  by default the copy shipped in ``rlfleet/deploy/schemas`` (KubeRay v1.7 line, Apache-2.0; see its README).
  Those schemas accept unknown fields (an API server would silently prune them), so each pod template inside
  is also checked as a core ``Pod``, strictly (see next item): a misspelled ``volumeMount`` is an error here.
- Core objects (``ConfigMap``, pods from the templates, ...): ``kubernetes-validate`` with its bundled
  strict schemas of the given Kubernetes minor version (offline; unknown fields are errors).
- ``networking.gke.io/v1`` ``GKENetworkParamSet`` / ``Network``: GKE installs these CRDs itself and publishes
  no schema, so a structural JSON schema here encodes the fields GKE documents for them.
- Policy: an env var named like a secret (``*_TOKEN``, ``*_API_KEY``, ...) must come from a ``secretKeyRef``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from rlfleet.deploy.gke import DeployError

__all__ = [
    "CRD_FILES",
    "PACKAGED_CRD_DIR",
    "check_documents",
    "crd_schema",
    "find_crd_dir",
    "pod_templates",
    "validate_documents",
]

CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}
CRD_DIR_ENV = "RLFLEET_KUBERAY_CRDS"
PACKAGED_CRD_DIR = Path(__file__).resolve().parent / "schemas"
"""KubeRay's CRDs as shipped in the wheel (the default of :func:`find_crd_dir`)."""
DEFAULT_K8S_VERSION = "1.32"
_SECRET_LIKE = re.compile(r"(TOKEN|SECRET|PASSWORD|API_KEY|CREDENTIALS?)$")

_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": _NAME, "labels": {"type": "object"}, "annotations": {"type": "object"}},
    "additionalProperties": False,
}
GKE_NETWORK_SCHEMAS: dict[str, dict[str, Any]] = {
    "GKENetworkParamSet": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "networking.gke.io/v1"},
            "kind": {"const": "GKENetworkParamSet"},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "required": ["vpc", "vpcSubnet"],
                "additionalProperties": False,
                "properties": {
                    "vpc": {"type": "string", "minLength": 1},
                    "vpcSubnet": {"type": "string", "minLength": 1},
                    "deviceMode": {"enum": ["NetDevice", "DPDK-VFIO", "RDMA"]},
                    "podIPv4Ranges": {"type": "object"},
                },
            },
        },
    },
    "Network": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "networking.gke.io/v1"},
            "kind": {"const": "Network"},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "required": ["type"],
                "additionalProperties": False,
                "properties": {
                    "type": {"enum": ["L3", "Device"]},
                    "provider": {"type": "string"},
                    "parametersRef": {
                        "type": "object",
                        "required": ["group", "kind", "name"],
                        "additionalProperties": False,
                        "properties": {
                            "group": {"const": "networking.gke.io"},
                            "kind": {"const": "GKENetworkParamSet"},
                            "name": _NAME,
                        },
                    },
                },
            },
        },
    },
}


def _need_validators() -> None:
    try:
        import jsonschema  # noqa: F401
        import kubernetes_validate  # noqa: F401
    except ImportError:
        raise DeployError(
            "offline validation needs jsonschema and kubernetes-validate: pip install 'rlfleet[k8s]' "
            "(or skip it: rlfleet k8s render --no-validate)"
        ) from None


def find_crd_dir(explicit: str | Path | None = None) -> Path:
    """The directory with KubeRay's CRD YAML files: ``explicit``, else ``$RLFLEET_KUBERAY_CRDS``, else the
    copy shipped with rlfleet (:data:`PACKAGED_CRD_DIR`).

    Raises:
        DeployError: the directory lacks ``ray.io_rayclusters.yaml`` or ``ray.io_rayjobs.yaml``.
    """
    value = explicit or os.environ.get(CRD_DIR_ENV)
    path = Path(value).expanduser() if value else PACKAGED_CRD_DIR
    missing = [f for f in CRD_FILES.values() if not (path / f).is_file()]
    if missing and not value:
        raise DeployError(f"this rlfleet install lacks its KubeRay CRDs {missing} in {path}; reinstall it")
    if missing:
        source = "--crd-dir" if explicit else f"${CRD_DIR_ENV}"
        raise DeployError(
            f"{path} ({source}) lacks {missing}; point it at KubeRay's helm-chart/kuberay-operator/crds "
            "folder, or leave it unset to use the CRDs shipped with rlfleet"
        )
    return path


@cache
def crd_schema(path: Path, version: str = "v1") -> dict[str, Any]:
    """``spec.versions[name=version].schema.openAPIV3Schema`` of a CRD file (parsed once per process)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(path.read_text(encoding="utf-8"), Loader=loader)  # a SafeLoader
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return dict(entry["schema"]["openAPIV3Schema"])
    raise DeployError(f"{path} has no version {version!r} of {crd['spec']['names']['kind']}")


def _where(error: Any) -> str:
    return "/".join(str(p) for p in error.absolute_path) or "<root>"


def _jsonschema_problems(doc: dict[str, Any], schema: dict[str, Any], label: str) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{label}: {_where(e)}: {e.message}" for e in errors]


def _core_problems(doc: dict[str, Any], label: str, k8s_version: str) -> list[str]:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, k8s_version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{label}: {_where(exc)}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [f"{label}: {exc.message}"]
    return []


def pod_templates(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod template) of a RayCluster or RayJob: head, each worker group, the submitter."""
    spec = doc.get("spec", {})
    cluster = spec.get("rayClusterSpec", spec) if doc.get("kind") == "RayJob" else spec
    if "headGroupSpec" in cluster:
        yield "head", cluster["headGroupSpec"]["template"]
    for group in cluster.get("workerGroupSpecs", []):
        yield f"worker group {group.get('groupName')}", group["template"]
    if "submitterPodTemplate" in spec:
        yield "submitter", spec["submitterPodTemplate"]


def _template_as_pod(template: dict[str, Any], name: str) -> dict[str, Any]:
    meta = {"name": name, **template.get("metadata", {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template.get("spec", {})}


def _secret_literal_problems(template: dict[str, Any], label: str) -> list[str]:
    problems = []
    for container in template.get("spec", {}).get("containers", []):
        for var in container.get("env", []):
            if _SECRET_LIKE.search(var.get("name", "")) and "value" in var:
                problems.append(
                    f"{label}: container {container.get('name')}: env {var['name']} has a literal value; "
                    "reference the Secret with valueFrom.secretKeyRef instead"
                )
    return problems


def _ray_problems(doc: dict[str, Any], crd_dir: Path, label: str, k8s_version: str) -> list[str]:
    problems = _jsonschema_problems(doc, crd_schema(crd_dir / CRD_FILES[doc["kind"]]), label)
    for where, template in pod_templates(doc):
        pod_label = f"{label} {where} pod template"
        problems += _core_problems(_template_as_pod(template, "template-check"), pod_label, k8s_version)
        problems += _secret_literal_problems(template, pod_label)
    return problems


def validate_documents(
    docs: Sequence[dict[str, Any]], crd_dir: str | Path | None = None, k8s_version: str = DEFAULT_K8S_VERSION
) -> list[str]:
    """Every problem found in ``docs``; empty when all are valid.

    Args:
        docs: Parsed manifests.
        crd_dir: Folder with KubeRay's CRD files; None: ``$RLFLEET_KUBERAY_CRDS``, else the shipped copy.
        k8s_version: Kubernetes minor version of the core schemas.

    Raises:
        DeployError: the validators or the KubeRay CRD files are missing.
    """
    _need_validators()
    problems: list[str] = []
    for index, doc in enumerate(docs):
        if not isinstance(doc, dict):
            problems.append(f"document {index + 1}: not a mapping ({type(doc).__name__})")
            continue
        kind = doc.get("kind", "?")
        label = f"document {index + 1} ({kind} {doc.get('metadata', {}).get('name', '?')})"
        if kind in CRD_FILES and str(doc.get("apiVersion", "")).startswith("ray.io/"):
            problems += _ray_problems(doc, find_crd_dir(crd_dir), label, k8s_version)
        elif kind in GKE_NETWORK_SCHEMAS:
            problems += _jsonschema_problems(doc, GKE_NETWORK_SCHEMAS[kind], label)
        else:
            problems += _core_problems(doc, label, k8s_version)
    return problems


def check_documents(
    docs: Sequence[dict[str, Any]], crd_dir: str | Path | None = None, k8s_version: str = DEFAULT_K8S_VERSION
) -> None:
    """Raises unless :func:`validate_documents` finds nothing wrong with ``docs``.

    Raises:
        DeployError: a problem in ``docs`` (each listed with its document and field), or missing validators.
    """
    problems = validate_documents(docs, crd_dir, k8s_version)
    if problems:
        listed = "\n".join(f"  {problem}" for problem in problems)
        raise DeployError(
            f"the rendered manifests fail offline validation ({len(problems)} problem(s); a bug in rlfleet "
            f"or an option value it did not check):\n{listed}\nfix the option behind the field named above, "
            "or write them anyway with --no-validate"
        )
