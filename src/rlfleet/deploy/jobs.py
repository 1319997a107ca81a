"""Submit, watch, read and stop rlfleet runs on a Ray cluster through the Ray Jobs API.

The cluster is any Ray head whose dashboard is reachable, typically a KubeRay RayCluster rendered with
``rlfleet k8s render --cluster-only`` and reached with
``kubectl port-forward svc/<name>-head-svc 8265:8265``. Unlike ``kubectl exec`` into the head pod, a Jobs
API submission has an id, a status, logs that survive the terminal, and ``stop``.

Authentication: Ray 2.60 heads run with token authentication by default. As with Ray's own clients, the
token is sent only when ``RAY_AUTH_MODE=token`` is set, and read from ``RAY_AUTH_TOKEN``, else the file named
by ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``. The token is resolved here (not inside Ray, whose
loader caches it per process) and sent as a bearer header; it is never printed or put in a runtime env.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from rlfleet.config import load_recipe, load_yaml_with_defaults, recipe_algorithm, resolve_recipe_path
from rlfleet.config.algorithm import algorithm_spec
from rlfleet.deploy.gke import DeployError, default_k8s_name

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient

__all__ = [
    "TERMINAL_STATUSES",
    "JobInfoView",
    "auth_headers",
    "connect",
    "follow_logs",
    "job_logs",
    "job_status",
    "normalize_address",
    "stop_job",
    "submission_id_for",
    "submit_recipe",
    "wait_for_job",
]

TERMINAL_STATUSES = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
RECIPE_IN_JOB = "recipe.yaml"
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|API_KEY|CREDENTIAL", re.IGNORECASE)


class JobsApiError(DeployError):
    """The Jobs API could not be reached or refused the request; the message says what to do."""


def normalize_address(address: str | None, env: Mapping[str, str] | None = None) -> str:
    """``--address``, else ``$RAY_ADDRESS``, as an ``http(s)://`` dashboard URL."""
    env = os.environ if env is None else env
    value = (address or env.get("RAY_ADDRESS") or "").strip().rstrip("/")
    if not value:
        raise JobsApiError(
            "no Ray dashboard address: pass --address http://127.0.0.1:8265 (after `kubectl port-forward "
            "svc/<name>-head-svc 8265:8265`) or set RAY_ADDRESS"
        )
    if "://" not in value:
        value = f"http://{value}"
    if not value.startswith(("http://", "https://")):
        raise JobsApiError(
            f"address {value!r}: the Jobs API needs the dashboard's http(s):// URL (port 8265)"
        )
    return value


def _read_token_file(path: Path, source: str) -> str:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise JobsApiError(
            f"{source}: cannot read {path} ({exc.strerror}); fix the path or unset it"
        ) from None
    if not token:
        raise JobsApiError(f"{source}: {path} is empty; put the cluster's Ray auth token in it")
    return token


def auth_headers(env: Mapping[str, str] | None = None, home: Path | None = None) -> dict[str, str]:
    """The ``Authorization`` header Ray's clients would send, from ``env`` (default: ``os.environ``).

    Raises:
        JobsApiError: ``RAY_AUTH_MODE=token`` but no readable token, or an unknown auth mode.
    """
    env = os.environ if env is None else env
    mode = env.get("RAY_AUTH_MODE", "").strip().lower()
    if mode in ("", "disabled"):
        return {}
    if mode != "token":
        raise JobsApiError(f"RAY_AUTH_MODE={mode!r} is not a Ray auth mode; use 'token' or unset it")
    if env.get("RAY_AUTH_TOKEN", "").strip():
        token = env["RAY_AUTH_TOKEN"].strip()
    elif env.get("RAY_AUTH_TOKEN_PATH"):
        token = _read_token_file(Path(env["RAY_AUTH_TOKEN_PATH"]).expanduser(), "RAY_AUTH_TOKEN_PATH")
    else:
        default = (home or Path.home()) / ".ray" / "auth_token"
        if not default.is_file():
            raise JobsApiError(
                "RAY_AUTH_MODE=token but no token: set RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH to a file "
                f"holding it, or write it to {default}"
            )
        token = _read_token_file(default, "default token file")
    return {"Authorization": f"Bearer {token}"}


_K8S_TOKEN_HINT = (
    "for an rlfleet KubeRay cluster: export RAY_AUTH_TOKEN=$(kubectl get secret rlfleet-secrets "
    "-o jsonpath='{.data.RAY_AUTH_TOKEN}' | base64 -d)"
)


def _auth_hint(address: str, env: Mapping[str, str], status: int) -> str:
    if status == 403:
        return (
            f"the Ray cluster at {address} rejected the auth token (HTTP 403): the token in RAY_AUTH_TOKEN / "
            f"RAY_AUTH_TOKEN_PATH / ~/.ray/auth_token is not this cluster's; {_K8S_TOKEN_HINT}"
        )
    missing = "RAY_AUTH_MODE is not set" if env.get("RAY_AUTH_MODE", "") != "token" else "no token was sent"
    parts = [
        f"the Ray cluster at {address} requires token authentication (HTTP 401; {missing}):",
        "export RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN",
        "(or RAY_AUTH_TOKEN_PATH=<file>, or ~/.ray/auth_token);",
        "a local `ray start --head` writes it to ~/.ray/auth_token;",
        _K8S_TOKEN_HINT,
    ]
    return " ".join(parts)


def _status_of_auth_error(exc: Exception) -> int:
    return 403 if "Authentication failed" in str(exc) or "403" in str(exc) else 401


def _call(address: str, env: Mapping[str, str], action: Callable[[], Any]) -> Any:
    """Run a Jobs API call, turning Ray's connection and auth errors into ``JobsApiError``."""
    from ray.exceptions import AuthenticationError

    try:
        return action()
    except AuthenticationError as exc:
        raise JobsApiError(_auth_hint(address, env, _status_of_auth_error(exc))) from None
    except ConnectionError as exc:
        raise JobsApiError(
            f"cannot reach the Ray dashboard at {address} ({exc}); is the head running and the port "
            "forwarded (kubectl port-forward svc/<name>-head-svc 8265:8265)?"
        ) from None


def connect(address: str | None, env: Mapping[str, str] | None = None) -> JobSubmissionClient:
    """A ``JobSubmissionClient`` for the dashboard at ``address``, with the auth header when configured."""
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError:
        raise JobsApiError(
            "the Ray Jobs API client is not installed; pip install 'rlfleet[ray]' (ray[default])"
        ) from None
    env = os.environ if env is None else env
    url = normalize_address(address, env)
    headers = auth_headers(env)
    return _call(url, env, lambda: JobSubmissionClient(url, headers=headers))


def submission_id_for(recipe: str, now: datetime | None = None) -> str:
    """``rlfleet-<recipe>-<UTC timestamp>``: readable, unique per second, valid as a Ray submission id."""
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%d-%H%M%S")
    stem = default_k8s_name(Path(recipe).name.removesuffix(".yaml"), limit=60).removeprefix("rlfleet-")
    return f"rlfleet-{stem}-{stamp}"


def _check_env_vars(env_vars: Mapping[str, str]) -> None:
    secret = sorted(k for k in env_vars if _SECRET_NAME.search(k))
    if secret:
        raise JobsApiError(
            f"--env {secret}: secrets must not travel in a Ray runtime env (the dashboard shows it); on "
            "Kubernetes they come from the Secret referenced by the pods (rlfleet k8s render)"
        )


@dataclass(frozen=True)
class JobInfoView:
    """What ``status`` prints about a job."""

    job_id: str
    status: str
    message: str
    entrypoint: str

    def line(self) -> str:
        return f"{self.job_id}: {self.status}" + (f" ({self.message})" if self.message else "")


def submit_recipe(
    address: str | None,
    recipe: str,
    overrides: Sequence[str] = (),
    *,
    entrypoint: str | None = None,
    submission_id: str | None = None,
    env_vars: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
) -> str:
    """Submit ``rlfleet <algorithm> <recipe> <overrides>`` as a Ray job (the recipe's algorithm: its
    ``algorithm:`` key, or its one algorithm section); returns the submission id.

    The recipe (its ``defaults:`` parents merged in) is uploaded as the job's ``working_dir``, so the cluster
    runs exactly the local file; the image provides rlfleet itself. ``entrypoint`` replaces the command
    (tests, or a different script) while keeping the same upload.

    Raises:
        ConfigError: the recipe or an override is invalid (checked before anything is sent).
        JobsApiError: the cluster is unreachable or refuses the request.
    """
    path = resolve_recipe_path(recipe)
    algorithm = algorithm_spec(recipe_algorithm(path))
    load_recipe(path, list(overrides))
    env_vars = dict(env_vars or {})
    _check_env_vars(env_vars)
    command = entrypoint or shlex.join(["rlfleet", algorithm.command, RECIPE_IN_JOB, *overrides])
    job_id = submission_id or submission_id_for(path.name)
    metadata = {"rlfleet_recipe": path.name, "rlfleet_overrides": shlex.join(overrides)}
    with tempfile.TemporaryDirectory(prefix="rlfleet-job-") as tmp:
        # merged with its defaults, so it says its algorithm itself (its parents' sections are in it too)
        merged = {**load_yaml_with_defaults(path), "algorithm": algorithm.name}
        text = yaml.safe_dump(merged, sort_keys=False, allow_unicode=True)
        (Path(tmp) / RECIPE_IN_JOB).write_text(text, encoding="utf-8")
        runtime_env: dict[str, Any] = {"working_dir": tmp}
        if env_vars:
            runtime_env["env_vars"] = env_vars
        submitted = _client_call(
            address,
            env,
            lambda c: c.submit_job(
                entrypoint=command, submission_id=job_id, runtime_env=runtime_env, metadata=metadata
            ),
            hint="a job with this submission id may exist already; pass another --submission-id",
        )
    return str(submitted)


def _client_call(
    address: str | None,
    env: Mapping[str, str] | None,
    fn: Callable[[Any], Any],
    hint: str = "check the job id with `ray job list --address <address>`",
) -> Any:
    env = os.environ if env is None else env
    client = connect(address, env)
    url = normalize_address(address, env)
    try:
        return _call(url, env, lambda: fn(client))
    except RuntimeError as exc:  # the SDK's "Request failed with status code 4xx: ..."
        raise JobsApiError(f"{url}: {exc}; {hint}") from None


def job_status(address: str | None, job_id: str, env: Mapping[str, str] | None = None) -> JobInfoView:
    """Status, message and entrypoint of ``job_id``."""
    info = _client_call(address, env, lambda c: c.get_job_info(job_id))
    return JobInfoView(job_id, str(info.status), info.message or "", info.entrypoint or "")


def wait_for_job(
    address: str | None,
    job_id: str,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    poll_s: float = 0.5,
) -> JobInfoView:
    """Poll until ``job_id`` is SUCCEEDED, FAILED or STOPPED; raises ``TimeoutError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        view = job_status(address, job_id, env)
        if view.status in TERMINAL_STATUSES:
            return view
        if time.monotonic() >= deadline:
            raise TimeoutError(f"job {job_id} still {view.status} after {timeout_s:.0f} s")
        time.sleep(poll_s)


def job_logs(address: str | None, job_id: str, env: Mapping[str, str] | None = None) -> str:
    """All logs of ``job_id`` so far (driver stdout and stderr)."""
    return str(_client_call(address, env, lambda c: c.get_job_logs(job_id)))


def follow_logs(
    address: str | None,
    job_id: str,
    write: Callable[[str], Any],
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
) -> None:
    """Stream ``job_id``'s logs to ``write`` until the job ends (or ``timeout_s`` passes: TimeoutError)."""

    async def pump(client: Any) -> None:
        async for chunk in client.tail_job_logs(job_id):
            write(chunk)

    async def bounded(client: Any) -> None:
        await asyncio.wait_for(pump(client), timeout=timeout_s)

    _client_call(address, env, lambda c: asyncio.run(bounded(c)))


def stop_job(address: str | None, job_id: str, env: Mapping[str, str] | None = None) -> bool:
    """Ask Ray to stop ``job_id``; False if it had already finished."""
    return bool(_client_call(address, env, lambda c: c.stop_job(job_id)))
