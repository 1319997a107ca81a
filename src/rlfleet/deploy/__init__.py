"""Running rlfleet on Kubernetes (GKE + KubeRay) and on Ray clusters through the Ray Jobs API.

Modules: :mod:`~rlfleet.deploy.gke` (GPU profiles and shared names), :mod:`~rlfleet.deploy.gke_plan`
(``rlfleet gke plan``), :mod:`~rlfleet.deploy.manifests` (``rlfleet k8s render``),
:mod:`~rlfleet.deploy.validate` (offline schema checks), :mod:`~rlfleet.deploy.jobs` (``submit``,
``status``, ``logs``, ``stop``) and :mod:`~rlfleet.deploy.cli` (their argparse wiring).
"""
