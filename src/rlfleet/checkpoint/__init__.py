"""Checkpointing: atomic, verified ``step_N`` directories (NeMo RL layout), DCP policy I/O, HF export."""

from rlfleet.checkpoint.dcp_io import (
    capture_rng_state,
    load_model_state_dict,
    load_policy,
    restore_rng_state,
    save_policy,
)
from rlfleet.checkpoint.export import build_model_from_name, export_hf
from rlfleet.checkpoint.manager import CheckpointManager, is_complete_checkpoint, verify_checkpoint
from rlfleet.checkpoint.manifest import MANIFEST_FILE, CheckpointError, verify_manifest, write_manifest
from rlfleet.config.metric_names import normalize_metric_name

__all__ = [
    "MANIFEST_FILE",
    "CheckpointError",
    "CheckpointManager",
    "build_model_from_name",
    "capture_rng_state",
    "export_hf",
    "is_complete_checkpoint",
    "load_model_state_dict",
    "load_policy",
    "normalize_metric_name",
    "restore_rng_state",
    "save_policy",
    "verify_checkpoint",
    "verify_manifest",
    "write_manifest",
]
