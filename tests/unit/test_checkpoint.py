"""Tests for rlfleet.checkpoint: DCP policy I/O, CheckpointManager, HF export."""

from __future__ import annotations

import json
import logging
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from rlfleet.checkpoint import (
    MANIFEST_FILE,
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    export_hf,
    load_model_state_dict,
    load_policy,
    restore_rng_state,
    save_policy,
    verify_checkpoint,
)

VOCAB = 64

Trio = tuple[LlamaForCausalLM, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


def make_trio(seed: int = 0) -> Trio:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=8)
    return model, optimizer, scheduler


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object) -> None:
    """One step whose batch is drawn from the global torch RNG (so RNG restore matters)."""
    ids = torch.randint(0, VOCAB, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler.step()  # type: ignore[attr-defined]
    optimizer.zero_grad(set_to_none=True)


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "[PAD]": 1, "hello": 2, "world": 3}
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")


@pytest.fixture
def base_model_dir(tmp_path: Path) -> Path:
    """A 'base model' directory holding only the HF config (architecture source for export)."""
    path = tmp_path / "base_model"
    tiny_config().save_pretrained(path)
    return path


def recipe_yaml(model_name: Path | str) -> str:
    return yaml.safe_dump({"policy": {"model_name": str(model_name)}, "grpo": {"max_num_steps": 4}})


def policy_writer(trio: Trio, tokenizer: object = None) -> Callable[[Path], None]:
    model, optimizer, scheduler = trio
    return lambda step_dir: save_policy(step_dir, model, optimizer, scheduler, tokenizer)


def save_step(
    manager: CheckpointManager,
    step: int,
    info: dict | None = None,
    writer: Callable[[Path], None] | None = None,
) -> Path:
    if writer is None:
        linear = nn.Linear(2, 2)
        writer = lambda d: save_policy(d, linear, None, None, None)  # noqa: E731
    return manager.save(
        step,
        config_yaml=recipe_yaml("unused"),
        training_info=info or {},
        dataloader_state={"epoch": 0, "index": step},
        write_policy=writer,
    )


def assert_same_params(a: nn.Module, b: nn.Module) -> None:
    sd_a, sd_b = a.state_dict(), b.state_dict()
    assert sd_a.keys() == sd_b.keys()
    for key in sd_a:
        assert torch.equal(sd_a[key], sd_b[key]), key


# --------------------------------------------------------------------------- dcp_io


def test_policy_round_trip_restores_weights_optimizer_scheduler(tmp_path: Path) -> None:
    trio = make_trio()
    for _ in range(2):
        train_step(*trio)
    save_policy(tmp_path, *trio, tokenizer=None)
    assert (tmp_path / "policy/weights/.metadata").is_file()
    assert (tmp_path / "policy/optimizer/.metadata").is_file()
    assert (tmp_path / "policy/scheduler.pt").is_file()
    assert not (tmp_path / "policy/tokenizer").exists()

    model, optimizer, scheduler = make_trio(seed=1)
    load_policy(tmp_path, model, optimizer, scheduler)
    assert_same_params(trio[0], model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ref_opt, new_opt = trio[1].state_dict(), optimizer.state_dict()
    assert ref_opt["param_groups"] == new_opt["param_groups"]
    for idx, ref_state in ref_opt["state"].items():
        for name, value in ref_state.items():
            assert torch.equal(value, new_opt["state"][idx][name]), (idx, name)
    assert scheduler.state_dict() == trio[2].state_dict()
    assert scheduler.get_last_lr() == trio[2].get_last_lr()


def test_load_weights_only_and_plain_state_dict(tmp_path: Path) -> None:
    trio = make_trio()
    train_step(*trio)
    save_policy(tmp_path, *trio, tokenizer=None)
    model, _, _ = make_trio(seed=3)
    load_policy(tmp_path, model)
    assert_same_params(trio[0], model)

    plain = load_model_state_dict(tmp_path)
    reference = trio[0].state_dict()
    assert plain.keys() == reference.keys()
    assert all(torch.equal(plain[k], reference[k]) for k in reference)
    # The policy dir itself is accepted too.
    assert load_model_state_dict(tmp_path / "policy").keys() == reference.keys()


def distcp_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.distcp"))


def saved_weight_keys(step_dir: Path) -> set[str]:
    metadata = dcp.FileSystemReader(step_dir / "policy" / "weights").read_metadata()
    return set(metadata.state_dict_metadata)


def test_a_tied_weight_is_written_once_and_read_back_under_both_names(tmp_path: Path) -> None:
    """lm_head.weight is the embedding: a plain state dict would write it twice (Gemma 3 270M: 0.6 GiB)."""
    trio = make_trio()
    train_step(*trio)
    save_policy(tmp_path, *trio, tokenizer=None)
    keys = saved_weight_keys(tmp_path)
    assert "model.model.embed_tokens.weight" in keys and "model.lm_head.weight" not in keys
    tied = json.loads((tmp_path / "policy" / "tied_weights.json").read_text())
    assert tied == {"lm_head.weight": "model.embed_tokens.weight"}
    both = tmp_path / "both"  # what the plain state dict writes: the embedding twice
    dcp.save({"model": get_model_state_dict(trio[0])}, checkpoint_id=both, no_dist=True)
    embedding = trio[0].lm_head.weight
    saved = distcp_bytes(both) - distcp_bytes(tmp_path / "policy" / "weights")
    assert saved >= embedding.numel() * embedding.element_size()

    plain = load_model_state_dict(tmp_path)
    assert plain.keys() == trio[0].state_dict().keys()
    assert plain["lm_head.weight"] is plain["model.embed_tokens.weight"]  # shared, as in a tied model
    model, optimizer, scheduler = make_trio(seed=1)
    load_policy(tmp_path, model, optimizer, scheduler)
    assert_same_params(trio[0], model)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_an_untied_model_writes_every_weight_and_no_tied_file(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = tiny_config()
    config.tie_word_embeddings = False
    model = LlamaForCausalLM(config)
    save_policy(tmp_path, model, None, None, None)
    assert "model.lm_head.weight" in saved_weight_keys(tmp_path)
    assert not (tmp_path / "policy" / "tied_weights.json").exists()
    restored = LlamaForCausalLM(config)
    load_policy(tmp_path, restored)
    assert_same_params(model, restored)


def test_a_model_untied_where_the_checkpoint_was_tied_gets_the_weight_under_both_names(
    tmp_path: Path,
) -> None:
    """A layout that does not keep the tie (one that splits the output layer) reads the one saved copy."""
    trio = make_trio()
    train_step(*trio)
    save_policy(tmp_path, trio[0], None, None, None)
    config = tiny_config()
    config.tie_word_embeddings = False
    untied = LlamaForCausalLM(config)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    load_policy(tmp_path, untied)
    embedding = trio[0].model.embed_tokens.weight
    assert torch.equal(untied.lm_head.weight, embedding) and torch.equal(
        untied.model.embed_tokens.weight, embedding
    )
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight  # still two parameters


def test_a_checkpoint_holding_a_tied_weight_twice_still_loads(tmp_path: Path) -> None:
    """Checkpoints written before tied weights were deduplicated hold lm_head.weight as well."""
    trio = make_trio()
    train_step(*trio)
    save_policy(tmp_path, *trio, tokenizer=None)
    weights = tmp_path / "policy" / "weights"
    shutil.rmtree(weights)
    (tmp_path / "policy" / "tied_weights.json").unlink()
    dcp.save({"model": get_model_state_dict(trio[0])}, checkpoint_id=weights, no_dist=True)
    assert "model.lm_head.weight" in saved_weight_keys(tmp_path)
    model, optimizer, scheduler = make_trio(seed=2)
    load_policy(tmp_path, model, optimizer, scheduler)
    assert_same_params(trio[0], model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert load_model_state_dict(tmp_path).keys() == trio[0].state_dict().keys()


def test_load_policy_reports_missing_parts(tmp_path: Path) -> None:
    model, optimizer, scheduler = make_trio()
    with pytest.raises(FileNotFoundError, match="complete"):
        load_policy(tmp_path, model)
    save_policy(tmp_path, model, None, None, None)
    with pytest.raises(FileNotFoundError, match="optimizer"):
        load_policy(tmp_path, model, optimizer)
    with pytest.raises(FileNotFoundError, match="scheduler"):
        load_policy(tmp_path, model, None, scheduler)


def test_saving_unstepped_optimizer_is_side_effect_free_and_exact(tmp_path: Path) -> None:
    """DCP initialises empty optimizers with a fake step; that must not leak into training."""
    reference = make_trio()
    torch.manual_seed(7)
    for _ in range(2):
        train_step(*reference)

    trio = make_trio()
    save_policy(tmp_path, *trio, tokenizer=None)
    assert not trio[1].state
    restored = make_trio(seed=5)
    load_policy(tmp_path, *restored)
    assert not restored[1].state
    for run in (trio, restored):
        torch.manual_seed(7)
        for _ in range(2):
            train_step(*run)
        assert_same_params(reference[0], run[0])


def test_rng_capture_restore_reproduces_draws() -> None:
    state = capture_rng_state()
    expected = (torch.rand(5), np.random.rand(3), random.random())
    torch.rand(7), np.random.rand(2), random.random()
    restore_rng_state(state)
    assert torch.equal(torch.rand(5), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]


def test_rng_state_survives_weights_only_round_trip(tmp_path: Path) -> None:
    torch.save(capture_rng_state(), tmp_path / "rng.pt")
    expected = torch.rand(4)
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert torch.equal(torch.rand(4), expected)


# --------------------------------------------------------------------------- manager: resume


def test_resume_equals_uninterrupted_run(tmp_path: Path) -> None:
    torch.manual_seed(123)
    reference = make_trio()
    torch.manual_seed(123)
    for _ in range(4):
        train_step(*reference)

    manager = CheckpointManager(tmp_path / "ckpt", metric_name=None, higher_is_better=True, keep_top_k=None)
    first = make_trio()
    torch.manual_seed(123)
    for _ in range(2):
        train_step(*first)
    saved = manager.save(
        2,
        config_yaml=recipe_yaml("base"),
        training_info={"consumed_samples": 8, "val/accuracy": torch.tensor(0.5)},
        dataloader_state={"epoch": 0, "index": 2, "order": torch.arange(4)},
        write_policy=policy_writer(first),
    )
    del first
    torch.manual_seed(999)  # a different process would start from arbitrary RNG state

    latest = manager.latest()
    assert latest == saved == tmp_path / "ckpt" / "step_2"
    resumed = make_trio(seed=42)
    load_policy(latest, *resumed)
    manager.restore_rng(latest)
    for _ in range(2):
        train_step(*resumed)
    assert_same_params(reference[0], resumed[0])
    ref_state, new_state = reference[1].state_dict()["state"], resumed[1].state_dict()["state"]
    assert ref_state.keys() == new_state.keys()
    for idx, values in ref_state.items():
        assert all(torch.equal(value, new_state[idx][k]) for k, value in values.items())

    info = manager.load_training_info(latest)
    assert info == {"step": 2, "consumed_samples": 8, "val/accuracy": 0.5, "manifest": MANIFEST_FILE}
    loader = manager.load_dataloader_state(latest)
    assert loader["index"] == 2 and torch.equal(loader["order"], torch.arange(4))
    assert yaml.safe_load((latest / "config.yaml").read_text())["policy"]["model_name"] == "base"


# --------------------------------------------------------------------------- manager: discovery


def test_latest_ignores_tmp_dirs_with_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    manager = CheckpointManager(tmp_path, metric_name=None, higher_is_better=True, keep_top_k=None)
    assert manager.latest() is None
    save_step(manager, 3)
    # Simulate an interrupted save of a later step that is otherwise fully written.
    step_5 = save_step(manager, 5)
    step_5.rename(tmp_path / "tmp_step_5")
    with caplog.at_level(logging.WARNING, logger="rlfleet.checkpoint.manager"):
        assert manager.latest() == tmp_path / "step_3"
    assert "tmp_step_5" in caplog.text


def test_latest_ignores_incomplete_and_junk(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, metric_name=None, higher_is_better=True, keep_top_k=None)
    save_step(manager, 2)
    save_step(manager, 10)
    (tmp_path / "step_20").mkdir()  # nothing inside
    (tmp_path / "step_30" / "policy").mkdir(parents=True)
    (tmp_path / "step_30" / "training_info.json").write_text("{}")  # no weights metadata
    (tmp_path / "step_x").mkdir()
    (tmp_path / "step_40.bak").mkdir()
    (tmp_path / "step_50").write_text("a file, not a dir")
    (tmp_path / "notes").mkdir()
    assert manager.latest() == tmp_path / "step_10"  # numeric, not lexicographic, order
    assert [step for step, _ in manager.checkpoints()] == [2, 10]


# --------------------------------------------------------------------------- manager: saving


def test_save_is_atomic_and_replaces_stale_dirs(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, metric_name=None, higher_is_better=True, keep_top_k=None)
    stale_tmp = tmp_path / "tmp_step_1"
    stale_tmp.mkdir(parents=True)
    (stale_tmp / "garbage").write_text("x")
    path = save_step(manager, 1, {"val/accuracy": 0.1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
    assert not (path / "garbage").exists()
    expected = {
        "config.yaml",
        "training_info.json",
        "train_dataloader.pt",
        "rng_state.pt",
        "policy",
        MANIFEST_FILE,
    }
    assert {p.name for p in path.iterdir()} == expected

    path = save_step(manager, 1, {"val/accuracy": 0.9})  # re-saving a step replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
    assert manager.load_training_info(path)["val/accuracy"] == 0.9


def test_failed_save_leaves_no_step_dir(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, metric_name=None, higher_is_better=True, keep_top_k=None)
    save_step(manager, 1)

    def broken_writer(step_dir: Path) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_step(manager, 2, writer=broken_writer)
    assert not (tmp_path / "step_2").exists()
    assert manager.latest() == tmp_path / "step_1"

    with pytest.raises(RuntimeError, match="write_policy"):
        save_step(manager, 3, writer=lambda d: None)
    assert not (tmp_path / "step_3").exists()


class OpaqueSamplerState:
    """A custom class: picklable, but not loadable with ``weights_only=True``."""


@pytest.mark.parametrize("bad_value", [OpaqueSamplerState(), lambda: 0], ids=["custom-class", "lambda"])
def test_non_weights_only_dataloader_state_fails_at_save(tmp_path: Path, bad_value: object) -> None:
    manager = CheckpointManager(tmp_path, metric_name=None, higher_is_better=True, keep_top_k=None)
    linear = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="weights_only"):
        manager.save(
            1,
            config_yaml="",
            training_info={},
            dataloader_state={"sampler": bad_value},
            write_policy=lambda d: save_policy(d, linear, None, None, None),
        )
    assert manager.latest() is None
    assert not (tmp_path / "step_1").exists()


# --------------------------------------------------------------------------- manager: corrupt checkpoints

SHARD = "policy/weights/__0_0.distcp"


def truncate(path: Path) -> None:
    """What a node dying mid-copy leaves on a non-atomic filesystem: the file cut in half."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


CORRUPTIONS: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated": (truncate, "truncated"),
    "missing": (lambda path: path.unlink(), "missing"),
    "altered": (flip_last_byte, "SHA-256 differs"),
}


def test_manifest_lists_every_file_and_is_written_last(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, metric_name=None, higher_is_better=True, keep_top_k=None)
    path = save_step(manager, 1)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    on_disk = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == [name for name in on_disk if name != MANIFEST_FILE]
    assert SHARD in manifest["files"] and "rng_state.pt" in manifest["files"]
    newest_other = max((path / name).stat().st_mtime_ns for name in manifest["files"])
    assert (path / MANIFEST_FILE).stat().st_mtime_ns >= newest_other
    assert verify_checkpoint(path) is True


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_resume_skips_a_corrupt_checkpoint_and_picks_the_previous_good_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, corruption: str
) -> None:
    trio = make_trio()
    manager = CheckpointManager(tmp_path, metric_name=None, higher_is_better=True, keep_top_k=None)
    good = manager.save(
        1, config_yaml="", training_info={}, dataloader_state={}, write_policy=policy_writer(trio)
    )
    train_step(*trio)
    bad = save_step(manager, 2, writer=policy_writer(trio))
    damage, reason = CORRUPTIONS[corruption]
    damage(bad / SHARD)
    with caplog.at_level(logging.WARNING, logger="rlfleet.checkpoint.manager"):
        assert manager.latest() == good
    warning = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Skipping"))
    assert "step_2" in warning
    assert SHARD in warning and reason in warning
    model, optimizer, scheduler = make_trio(seed=9)
    load_policy(good, model, optimizer, scheduler)  # the fallback really loads
    with pytest.raises(CheckpointError, match=reason):
        verify_checkpoint(bad)


def test_missing_manifest_is_damage_but_a_pre_manifest_checkpoint_is_accepted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager = CheckpointManager(tmp_path, metric_name=None, higher_is_better=True, keep_top_k=None)
    legacy = save_step(manager, 1)
    (legacy / MANIFEST_FILE).unlink()
    info = json.loads((legacy / "training_info.json").read_text())
    del info["manifest"]
    (legacy / "training_info.json").write_text(json.dumps(info))
    cut_short = save_step(manager, 2)
    (cut_short / MANIFEST_FILE).unlink()  # training_info.json records one: the copy was interrupted
    with caplog.at_level(logging.WARNING, logger="rlfleet.checkpoint.manager"):
        assert manager.latest() == legacy
    assert "manifest.json: missing" in caplog.text
    assert "cannot be verified" in caplog.text


def test_unreadable_manifest_is_skipped(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, metric_name=None, higher_is_better=True, keep_top_k=None)
    save_step(manager, 1)
    truncate(save_step(manager, 2) / MANIFEST_FILE)
    assert manager.latest() == tmp_path / "step_1"


def test_no_usable_checkpoint_is_one_clear_error(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, metric_name=None, higher_is_better=True, keep_top_k=None)
    truncate(save_step(manager, 1) / SHARD)
    flip_last_byte(save_step(manager, 2) / "rng_state.pt")
    (save_step(manager, 3) / "training_info.json").unlink()
    with pytest.raises(CheckpointError) as info:
        manager.latest()
    message = str(info.value)
    assert "none of the 3 checkpoint(s)" in message and "fix:" in message
    assert f"step_1: {SHARD}:" in message and "truncated" in message
    assert "step_2: rng_state.pt: SHA-256 differs" in message
    assert "step_3: training_info.json: missing" in message


def test_retention_never_deletes_what_resume_would_pick(tmp_path: Path) -> None:
    """A corrupt step_6 left by an earlier attempt: after every save of the resumed run, ``latest()`` is the
    checkpoint just saved, and it survives retention."""
    earlier = CheckpointManager(tmp_path, metric_name=None, higher_is_better=True, keep_top_k=None)
    truncate(save_step(earlier, 6, {"val/accuracy": 0.0}) / SHARD)
    manager = CheckpointManager(tmp_path, metric_name="val/accuracy", higher_is_better=True, keep_top_k=1)
    for step, acc in [(1, 0.9), (2, 0.1), (3, 0.2), (4, 0.0), (5, 0.0)]:
        path = save_step(manager, step, {"val/accuracy": acc})
        assert manager.latest() == path  # step_6 fails verification; the one just saved is kept
    assert surviving_steps(tmp_path) == [1, 5, 6]
    save_step(manager, 6, {"val/accuracy": 0.0})  # reaching step 6 again replaces the corrupt one
    assert verify_checkpoint(tmp_path / "step_6") and surviving_steps(tmp_path) == [1, 6]


# --------------------------------------------------------------------------- manager: retention


def surviving_steps(path: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in path.iterdir() if p.name.startswith("step_"))


def test_keep_top_k_higher_is_better_keeps_best_plus_newest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, metric_name="val:accuracy", higher_is_better=True, keep_top_k=2)
    for step, acc in [(1, 0.2), (2, 0.9), (3, 0.5), (4, 0.7), (5, 0.1)]:
        save_step(manager, step, {"val/accuracy": acc})
    assert surviving_steps(tmp_path) == [2, 4, 5]  # top-2 (0.9, 0.7) plus the newest
    save_step(manager, 6, {"val/accuracy": 0.8})
    assert surviving_steps(tmp_path) == [2, 6]


def test_keep_top_k_lower_is_better_and_missing_metric_ranks_last(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, metric_name="val/loss", higher_is_better=False, keep_top_k=2)
    save_step(manager, 1, {"val/loss": 0.3})
    save_step(manager, 2, {})  # no metric
    save_step(manager, 3, {"val/loss": 0.9})
    save_step(manager, 4, {"val/loss": float("nan")})
    assert surviving_steps(tmp_path) == [1, 3, 4]
    save_step(manager, 5, {"val/loss": 0.1})
    assert surviving_steps(tmp_path) == [1, 5]


def test_keep_top_k_without_metric_keeps_most_recent(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, metric_name=None, higher_is_better=True, keep_top_k=2)
    for step in range(1, 5):
        save_step(manager, step)
    assert surviving_steps(tmp_path) == [3, 4]


def test_keep_all_when_keep_top_k_none(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, metric_name="val/accuracy", higher_is_better=True, keep_top_k=None)
    for step in range(1, 5):
        save_step(manager, step, {"val/accuracy": float(step)})
    assert surviving_steps(tmp_path) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="keep_top_k"):
        CheckpointManager(tmp_path, metric_name=None, higher_is_better=True, keep_top_k=0)


# --------------------------------------------------------------------------- export


def test_export_hf_round_trips_logits_and_tokenizer(tmp_path: Path, base_model_dir: Path) -> None:
    trio = make_trio()
    for _ in range(2):
        train_step(*trio)
    manager = CheckpointManager(tmp_path / "ckpt", metric_name=None, higher_is_better=True, keep_top_k=None)
    step_dir = manager.save(
        2,
        config_yaml=recipe_yaml(base_model_dir),
        training_info={},
        dataloader_state={},
        write_policy=policy_writer(trio, make_tokenizer()),
    )
    out = export_hf(step_dir, tmp_path / "export")
    assert (out / "model.safetensors").is_file()

    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, VOCAB, (2, 10))
    trio[0].eval()
    with torch.no_grad():
        assert torch.equal(trio[0](input_ids=ids).logits, exported(input_ids=ids).logits)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("hello world")["input_ids"] == [2, 3]


def test_export_hf_rejects_incomplete_checkpoints(tmp_path: Path, base_model_dir: Path) -> None:
    manager = CheckpointManager(tmp_path / "ckpt", metric_name=None, higher_is_better=True, keep_top_k=None)
    save_step(manager, 1)
    with pytest.raises(FileNotFoundError, match="step_N"):
        export_hf(tmp_path / "ckpt", tmp_path / "out")
    (tmp_path / "tmp_step_2").mkdir()
    with pytest.raises(FileNotFoundError, match="not a complete"):
        export_hf(tmp_path / "tmp_step_2", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_hf_refuses_a_corrupt_checkpoint(tmp_path: Path, base_model_dir: Path) -> None:
    manager = CheckpointManager(tmp_path / "ckpt", metric_name=None, higher_is_better=True, keep_top_k=None)
    trio = make_trio()
    step_dir = manager.save(
        1,
        config_yaml=recipe_yaml(base_model_dir),
        training_info={},
        dataloader_state={},
        write_policy=policy_writer(trio),
    )
    truncate(step_dir / SHARD)
    with pytest.raises(CheckpointError, match="truncated"):
        export_hf(step_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()
