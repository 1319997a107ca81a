"""The ``rlfleet`` command line.

An error the user must fix (a config key, a data row, a checkpoint, cluster capacity, a missing optional
extra, a path that does not exist) prints its message alone and exits with code 2; ``--debug`` (or the
environment variable ``RLFLEET_DEBUG=1``) prints the traceback as well. Any other error is a bug: Python's
traceback, exit code 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from rlfleet.config import (
    DEMO_TASKS,
    ConfigError,
    MasterConfig,
    check_config,
    config_to_yaml,
    ensure_runnable,
    load_recipe,
    recipe_algorithm,
    resolve_recipe_path,
    unsupported_settings,
)
from rlfleet.config.algorithm import algorithm_names, algorithm_spec, algorithm_specs
from rlfleet.config.capabilities import uses_ray
from rlfleet.config.layout import resource_layout
from rlfleet.deploy.cli import add_deploy_commands
from rlfleet.errors import UserError
from rlfleet.logging.capture import ConsoleCapture
from rlfleet.memory.allocator import run_on_jemalloc

log = logging.getLogger("rlfleet")

DEBUG_ENV = "RLFLEET_DEBUG"
ALGORITHM_HELP = (
    "what the recipe is checked for (default: the recipe's algorithm key, else the one algorithm section "
    "it sets, e.g. grpo:)"
)
# Top-level module of an optional dependency -> the extra of pyproject.toml that installs it.
OPTIONAL_EXTRAS = {
    "ray": "ray",
    "wandb": "wandb",
    "mlflow": "mlflow",
    "kubernetes_validate": "k8s",
    "jsonschema": "k8s",
}


def _quiet_third_party() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _load(recipe: str, overrides: Sequence[str]) -> MasterConfig:
    return load_recipe(resolve_recipe_path(recipe), list(overrides))


def quiet_console(args: argparse.Namespace, log_dir: str | Path) -> AbstractContextManager[object]:
    """Library output to ``log_dir``'s log file for the run (``--verbose``: everything stays here)."""
    return nullcontext() if args.verbose else ConsoleCapture(log_dir)


def cmd_train(args: argparse.Namespace) -> int:
    cfg = _load(args.recipe, args.overrides)
    if uses_ray(cfg):  # a wrong RAY_ADDRESS fails here, before the data, the model and torch load
        from rlfleet.distributed.cluster import check_ray_address

        check_ray_address(cfg.cluster.placement_timeout_s)
    with quiet_console(args, cfg.logger.log_dir):
        args.spec.train(cfg)
    return 0


def check_inputs(cfg: MasterConfig) -> list[str]:
    """What the run would refuse in its inputs, found without loading a model: every row of the local data
    files (file:line, reason, fix) and every environment class the rows use, imported and built. Returns the
    hub datasets it could not read offline.

    Raises:
        DataError: A missing file or a bad row (with ``data.on_bad_row=error``).
        UserError: An environment that is not configured, does not import or cannot be built.
    """
    from rlfleet.data import hub_sources, load_task
    from rlfleet.rollouts.environment_setup import load_environments
    from rlfleet.rollouts.pairs import PairSource

    hub = hub_sources(cfg.data)
    if not hub and not PairSource.of(cfg.data).sampled:  # preference rows read and checked
        return hub
    rows = [] if hub else [row for split in load_task(cfg.data) for row in split]
    load_environments(cfg, rows, also=cfg.env.custom(), build=False)  # and configured ones no row names
    return hub


def cmd_validate(args: argparse.Namespace) -> int:
    cfg = _load(args.recipe, args.overrides)
    spec = algorithm_spec(args.algorithm or recipe_algorithm(args.recipe))
    layout = resource_layout(cfg)
    check_config(cfg, spec, layout=layout)
    from rlfleet.memory.planner import ensure_fits, resolve_batching

    batching = resolve_batching(cfg, layout, spec.name)
    ensure_fits(cfg, layout, batching, spec.name)
    from rlfleet.checkpoint.space import ensure_disk, run_steps

    ensure_disk(cfg, run_steps(cfg, spec.name))
    spec.run_preflight(cfg)  # what needs files but no weights (a teacher's tokenizer against the student's)
    unread = check_inputs(cfg)
    print(config_to_yaml(cfg), end="")
    if unread:
        print(f"# not read by validate (the run downloads them): hub datasets {', '.join(unread)}")
    if spec.describe is not None:
        described = spec.describe(cfg, batching)
        print(f"# {spec.name} as configured:", *[f"#   {k}: {v}" for k, v in described], sep="\n")
    not_here = unsupported_settings(cfg, layout=layout)
    if not_here:
        print("# valid; this build cannot run it as given yet:", *[f"#   - {p}" for p in not_here], sep="\n")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from rlfleet.memory.report import format_plan, make_plan

    cfg = _load(args.recipe, args.overrides)
    algorithm = algorithm_spec(args.algorithm or recipe_algorithm(args.recipe)).name
    check_config(cfg, algorithm)
    plan, _ = make_plan(cfg, algorithm)
    print(format_plan(cfg, plan, args.recipe))
    from rlfleet.checkpoint.space import describe_disk, run_steps

    disk = describe_disk(cfg, run_steps(cfg, algorithm))
    if disk is not None:
        print(f"  {'checkpoints':<20}{disk}")
    return 0


def cmd_rehearse(args: argparse.Namespace) -> int:
    from rlfleet.runtime.rehearse import format_rehearsal, rehearse

    cfg = _load(args.recipe, args.overrides)
    spec = algorithm_spec(args.algorithm or recipe_algorithm(args.recipe))
    check_config(cfg, spec)
    cfg = cfg.model_copy(update={"algorithm": spec.name})
    print(format_rehearsal(cfg, args.recipe, rehearse(cfg)))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from rlfleet.runtime.eval_command import run_eval

    recipe, checkpoint = _target(args.target)
    cfg = _load(recipe, args.overrides)
    ensure_runnable(cfg)
    # the scored responses go beside the report, or under the recipe's log directory without one
    out = Path(args.out) if args.out else None
    samples = out.with_suffix(".samples.jsonl") if out else Path(cfg.logger.log_dir) / "eval_samples.jsonl"
    with quiet_console(args, cfg.logger.log_dir):
        report = run_eval(cfg, checkpoint, samples)
    print(report.table())
    if args.out:
        Path(args.out).write_text(report.to_json() + "\n")
        print(f"wrote {args.out}")
    return 0


def _target(target: str) -> tuple[str, Path | None]:
    """A command's recipe and checkpoint: a ``step_N`` checkpoint directory (checked) runs its own
    ``config.yaml``; anything else is a recipe."""
    path = Path(target)
    checkpoint = path if (path / "config.yaml").is_file() else None
    if checkpoint is None:
        return target, None
    from rlfleet.checkpoint import verify_checkpoint

    verify_checkpoint(checkpoint)
    return str(checkpoint / "config.yaml"), checkpoint


def cmd_serve(args: argparse.Namespace) -> int:
    from rlfleet.runtime.serve_command import serve
    from rlfleet.serving.server import ServerSettings

    recipe, checkpoint = _target(args.target)
    cfg = _load(recipe, args.overrides)
    ensure_runnable(cfg)
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise UserError(f"--api-key-env {args.api_key_env}: that environment variable is not set")
    settings = ServerSettings(host=args.host, port=args.port, api_key=api_key)

    def ready(url: str) -> None:
        from rlfleet.logging.capture import terminal

        out, model = terminal(), args.served_model_name
        request = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}]})
        print(f"serving {model!r} at {url} (Ctrl-C stops); try:", file=out, flush=True)
        print(
            f"  curl {url}/chat/completions -H 'Content-Type: application/json' -d '{request}'",
            file=out,
            flush=True,
        )

    try:
        with quiet_console(args, cfg.logger.log_dir):
            serve(cfg, checkpoint, settings, args.served_model_name, ready)
    except KeyboardInterrupt:
        print("rlfleet: server stopped", file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from rlfleet.checkpoint import export_hf

    out = export_hf(Path(args.checkpoint), Path(args.out_dir), adapter_only=args.adapter_only)
    print(f"exported {args.checkpoint} -> {out}")
    return 0


def cmd_arithmetic_pairs(args: argparse.Namespace) -> int:
    from rlfleet.data.arithmetic import write_arithmetic_pairs

    train, val = write_arithmetic_pairs(
        Path(args.out_dir),
        num_train=args.num_train,
        num_val=args.num_val,
        seed=args.seed,
        max_operand=args.max_operand,
    )
    print(f"wrote {args.num_train} pairs to {train} and {args.num_val} to {val}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from rlfleet.demo import run_demo

    out = Path(args.out or DEMO_TASKS[args.task][2])
    with quiet_console(args, out):
        run_demo(out, args.overrides, task=args.task)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlfleet",
        description=(
            "Reinforcement-learning post-training of language models (GRPO, SFT, DPO, reward models, "
            "on-policy distillation): "
            "recipes are YAML files with key=value overrides. A mistake in the input (a config key, a data "
            "row, a checkpoint, cluster capacity, a missing extra) prints its message and exits with code 2; "
            "--debug (or RLFLEET_DEBUG=1) adds the traceback."
        ),
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="debug logging, and library output (vLLM, Triton, warnings) on the console instead of "
        "logger.log_dir/output.log",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help=f"print the traceback of errors that are reported as a message only (or set {DEBUG_ENV}=1)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for spec in algorithm_specs():  # one subcommand per algorithm description, plugins' included
        p = sub.add_parser(
            spec.command, help=spec.summary, description=f"{spec.summary}: RECIPE plus key=value overrides"
        )
        p.add_argument("recipe", help="recipe YAML path or shipped recipe name")
        p.add_argument("overrides", nargs="*", help=f"overrides such as {spec.name}.max_num_steps=10")
        p.set_defaults(func=cmd_train, spec=spec)
    p = sub.add_parser("validate", help="print the resolved config, or every error in it")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--algorithm", choices=algorithm_names(), help=ALGORITHM_HELP)
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("plan", help="print the resource layout and memory estimate; starts nothing")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--algorithm", choices=algorithm_names(), help=ALGORITHM_HELP)
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser(
        "rehearse",
        help="run one training micro-batch of each rank role at the recipe's real scale on a fake process "
        "group, and print each rank's measured peak memory beside plan's estimate; no GPU needed",
    )
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--algorithm", choices=algorithm_names(), help=ALGORITHM_HELP)
    p.set_defaults(func=cmd_rehearse)
    p = sub.add_parser("eval", help="pass@1 / pass@k of a recipe's model or of a checkpoint")
    p.add_argument("target", help="recipe (path or shipped name) or a step_N checkpoint directory")
    p.add_argument("overrides", nargs="*")
    p.add_argument(
        "--out",
        help="also write the report as JSON to this file, and every scored response to FILE.samples.jsonl "
        "(else to logger.log_dir/eval_samples.jsonl)",
    )
    p.set_defaults(func=cmd_eval)
    p = sub.add_parser("serve", help="an OpenAI-compatible endpoint serving a recipe's model or a checkpoint")
    p.add_argument("target", help="recipe (path or shipped name) or a step_N checkpoint directory")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument(
        "--api-key-env",
        help="name of the environment variable holding the API key requests must send (required to listen "
        "on an address other than loopback)",
    )
    p.add_argument(
        "--served-model-name", default="policy", help="the model name requests use (default policy)"
    )
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("export", help="write a Hugging Face model directory from a checkpoint")
    p.add_argument("checkpoint", help="a step_N checkpoint directory")
    p.add_argument("out_dir")
    p.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA run: write the adapter alone in PEFT's format (adapter_config.json + "
        "adapter_model.safetensors) instead of the merged model",
    )
    p.set_defaults(func=cmd_export)
    add_deploy_commands(sub)
    _add_data_commands(sub)
    p = sub.add_parser("demo", help="the embedded default: tiny model, SFT warm start, GRPO (CPU, offline)")
    p.add_argument(
        "--task",
        choices=sorted(DEMO_TASKS),
        default="arithmetic",
        help="arithmetic (tiny model), tools (the calculator task), gemma3 (Gemma 3 270M on GSM8k, "
        "make setup-gemma3) or gemma3-arithmetic",
    )
    p.add_argument(
        "--out", help="where models, checkpoints and logs go (default: runs/demo, runs/tools, runs/gemma3...)"
    )
    p.add_argument("overrides", nargs="*", help="overrides for the GRPO stage (sft.* ones: the SFT stage)")
    p.set_defaults(func=cmd_demo)
    return parser


def _add_data_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    data = sub.add_parser("data", help="write data files the shipped recipes train on")
    kinds = data.add_subparsers(dest="data_command", required=True)
    p = kinds.add_parser(
        "arithmetic-pairs",
        help="arithmetic preference pairs (worked answer chosen, a slip in its last step rejected) as "
        "OUT_DIR/train.jsonl and OUT_DIR/val.jsonl, for rm-tiny-arithmetic-cpu",
    )
    p.add_argument("out_dir")
    p.add_argument("--num-train", type=int, default=2048, help="training pairs (default 2048)")
    p.add_argument("--num-val", type=int, default=128, help="validation pairs, other questions (default 128)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--max-operand", type=int, default=9, help="operands in [1, N] (default 9: the tiny model's)"
    )
    p.set_defaults(func=cmd_arithmetic_pairs)


def user_error_message(exc: BaseException) -> str | None:
    """What to print for an error the user must fix, or None when ``exc`` is a bug (shown with a traceback).

    An exception raised inside a Ray actor arrives wrapped (a ``RayTaskError`` whose ``cause`` is the
    original); it is judged, and printed, by that original.
    """
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    if isinstance(exc, ConfigError):
        return f"configuration error:\n{exc}"
    if isinstance(exc, UserError | FileNotFoundError):
        return f"error: {exc}"
    if isinstance(exc, ModuleNotFoundError):
        module = (exc.name or "").split(".")[0]
        if module in OPTIONAL_EXTRAS:
            return (
                f"error: this needs the optional package {module!r}, which is not installed; "
                f"fix: pip install 'rlfleet[{OPTIONAL_EXTRAS[module]}]'"
            )
    return None


def debug_requested(flag: bool) -> bool:
    """``--debug``, or ``RLFLEET_DEBUG`` set to 1/true/yes/on."""
    return flag or os.environ.get(DEBUG_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a pod being stopped), raised in the main thread as Ctrl-C is, so that the run's
    clean-up runs: generation engines' processes, Ray actors, environment workers, loggers. Python's default
    for SIGTERM ends the process at once and leaves a vLLM engine's processes running, orphaned."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None:
        try:  # before anything is loaded: rlfleet runs on jemalloc where one is installed (and plans for it)
            run_on_jemalloc()
        except UserError as exc:
            print(f"rlfleet: {exc}", file=sys.stderr)
            return 2
        signal.signal(signal.SIGTERM, _raise_terminated)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    _quiet_third_party()
    try:
        return int(args.func(args))
    except Exception as exc:
        message = user_error_message(exc)
        if message is None:
            raise
        if debug_requested(args.debug):
            traceback.print_exception(exc, file=sys.stderr)
        print(f"rlfleet: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        how, code = ("terminated", 143) if isinstance(exc, Terminated) else ("interrupted", 130)
        print(f"rlfleet: {how}; rerun the same command to resume from the last checkpoint", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
