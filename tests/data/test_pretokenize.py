"""data.pretokenize_model: the data stage stores each caption's token ids, made by that model's
tokenizer (open_clip's own, or a Hugging Face one built here from a vocabulary file: no download,
no weights), and the train loader reads them instead of tokenising, only where they are its own
model's tokenizer's ids; otherwise it tokenises as before and says why."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch

from clipforge.data import builtin
from clipforge.data.shards import (
    TOKENS_MEMBER,
    InPlaceReader,
    ShardReader,
    TokenFormat,
    write_shards,
)
from clipforge.data.stage import main as data_main
from clipforge.model.config import ModelConfig
from clipforge.model.names import model_tokenizer, resolve_model_name
from clipforge.pipeline.recipe import recipe_params
from clipforge.recipes import RECIPES
from clipforge.train.config import BatchPlan
from clipforge.train.loader import MicroBatches, split_files, stored_tokens, uint8_transform
from tests.conftest import write_params

# Smaller than the shared small data: three shards of train, one of val.
TINY_DATA = {"num_train": 60, "num_val": 12, "num_test_images": 10, "samples_per_shard": 25}


def tiny_chinese_tokenizer(directory: Path) -> Path:
    """A BERT-style Chinese tokenizer folder, as hfl/chinese-roberta-wwm-ext lays one out
    (vocab.txt, tokenizer_config.json, config.json), with no weights: the tokenizer needs none."""
    text = "".join(builtin.COLOURS) + "".join(builtin.SHAPES) + "".join(builtin.POSITIONS)
    chars = sorted(set(text + "有一个的,图中只位于"))  # `,`: ftfy's NFKC makes `，` one
    directory.mkdir(parents=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars]
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": True})
    )
    (directory / "config.json").write_text(json.dumps({"model_type": "bert"}))
    return directory


def make_data(root: Path, **data) -> Path:
    """data/ made by the data stage; the model section is the default (clipforge-tiny), which
    the stage does not read: only data.pretokenize_* name the tokenizer."""
    root.mkdir(parents=True, exist_ok=True)
    params = write_params(root / "params.yaml", {"data": {**TINY_DATA, **data}})
    assert data_main(["--params", str(params), "--out", str(root / "data")]) == 0
    return root / "data"


@pytest.fixture(scope="module")
def hf_tower(tmp_path_factory) -> Path:
    return tiny_chinese_tokenizer(tmp_path_factory.mktemp("tower") / "tiny-chinese-bert")


@pytest.fixture(scope="module")
def open_clip_data(tmp_path_factory) -> Path:
    return make_data(tmp_path_factory.mktemp("oc"), pretokenize_model="clipforge-tiny")


@pytest.fixture(scope="module")
def hf_data(tmp_path_factory, hf_tower) -> Path:
    return make_data(
        tmp_path_factory.mktemp("hf"),
        pretokenize_model="clipforge-tiny",
        pretokenize_text_tower=str(hf_tower),
    )


def stored_and_captions(data_dir: Path, split: str) -> tuple[np.ndarray, list[str]]:
    """Every sample's stored ids (as the manifest's format reads them) and caption."""
    token_format = TokenFormat(
        **{
            k: v
            for k, v in json.loads((data_dir / "manifest.json").read_text())["tokens"].items()
            if k in ("dtype", "context_length")
        }
    )
    files = split_files(data_dir, split)
    reader = files.reader()
    samples = [reader.read(s, i) for s, n in enumerate(files.counts) for i in range(n)]
    stored = token_format.decode([sample[TOKENS_MEMBER] for sample in samples])
    return stored, [sample["txt"].decode("utf-8") for sample in samples]


def test_open_clip_ids_stored_for_the_builtin_captions_are_its_tokenizers_output(open_clip_data):
    """Every train and val sample: the stored row is open_clip's tokenize() of the Chinese
    caption at the model's context length (clipforge-tiny: 72), padding and end token included."""
    for split in ("train", "val"):
        stored, captions = stored_and_captions(open_clip_data, split)
        assert stored.shape == (len(captions), 72) and len(captions) > 0
        assert np.array_equal(stored, open_clip.tokenize(captions, context_length=72).numpy())
    entry = json.loads((open_clip_data / "manifest.json").read_text())["tokens"]
    assert (entry["dtype"], entry["tokenizer"]["class"]) == ("<u2", "SimpleTokenizer")


def test_hf_ids_stored_for_the_builtin_captions_are_the_towers_tokenizers_output(hf_data, hf_tower):
    """With data.pretokenize_text_tower, the ids are that tower's tokenizer's as the model uses it
    (open_clip's HFTokenizer: ftfy, whitespace clean-up, then transformers' from the folder:
    [CLS] ... [SEP], [PAD] to the context length), and no character of the builtin captions is
    [UNK]."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(hf_tower))
    model = open_clip.get_tokenizer(resolve_model_name(ModelConfig(text_tower=str(hf_tower))))
    for split in ("train", "val"):
        stored, captions = stored_and_captions(hf_data, split)
        cleaned = [caption.replace("，", ",") for caption in captions]  # ftfy's only change here
        expected = hf(cleaned, padding="max_length", max_length=72, truncation=True)
        assert np.array_equal(stored, np.array(expected["input_ids"]))
        assert np.array_equal(stored, model(captions).numpy())
        assert not (stored == hf.unk_token_id).any()
    entry = json.loads((hf_data / "manifest.json").read_text())["tokens"]
    assert entry["tokenizer"]["class"] == "HFTokenizer(BertTokenizerFast)"


def _batches(data_dir: Path, split: str, tokenizer, tokens) -> list:
    files = split_files(data_dir, split)
    plan = BatchPlan(8, 4, 2, 1)
    transform = uint8_transform(
        open_clip.image_transform(32, is_train=True, mean=(0.5,) * 3, std=(0.5,) * 3)
    )[0]
    dataset = MicroBatches(files, plan, 0, 3, 4, transform, tokenizer, 2, tokens)
    return [dataset[i] for i in range(len(dataset))]


@pytest.mark.parametrize("which", ["open_clip", "hf"])
def test_the_loader_gives_the_same_batches_from_stored_ids_as_from_captions(
    which, open_clip_data, hf_data, hf_tower
):
    """Two epochs of micro-batches (images, ids, skips), read with the stored ids and tokenised
    on the fly: equal, element for element, and of the same dtype."""
    data_dir = open_clip_data if which == "open_clip" else hf_data
    cfg = ModelConfig(text_tower=str(hf_tower) if which == "hf" else None)
    tokenizer = model_tokenizer(cfg)
    files = split_files(data_dir, "train")
    tokens = stored_tokens(data_dir, files, tokenizer, cfg)
    assert tokens is not None
    read = _batches(data_dir, "train", tokenizer, tokens)
    made = _batches(data_dir, "train", tokenizer, None)
    assert len(read) == len(made) == 4 * 2 * 1
    for (images_a, ids_a, skips_a), (images_b, ids_b, skips_b) in zip(read, made, strict=True):
        assert torch.equal(images_a, images_b) and skips_a == skips_b
        assert ids_a.dtype == ids_b.dtype == torch.int64 and torch.equal(ids_a, ids_b)


def test_another_models_tokenizer_tokenises_on_the_fly_and_says_why(
    open_clip_data, hf_data, hf_tower, caplog
):
    """Ids stored for clipforge-tiny (context 72) are not used by ViT-B-32 (77), nor an HF
    tower's by open_clip's tokenizer: one warning each, naming both tokenizers, what differs and
    the remedy (the data section's knobs set to this model's, or nothing: ids left unused)."""
    files = split_files(open_clip_data, "train")
    with caplog.at_level(logging.INFO, logger="clipforge.train"):
        vit_b32 = ModelConfig(name="ViT-B-32")
        assert stored_tokens(open_clip_data, files, model_tokenizer(vit_b32), vit_b32) is None
    (line,) = [r.message for r in caplog.records]
    assert line == (
        "the loader tokenises the captions: data/'s token ids are of clipforge-tiny's tokenizer, "
        "not this model's (ViT-B-32: context length 72 vs the model's 77); set "
        "data.pretokenize_model: ViT-B-32 and data.pretokenize_text_tower: null to store its "
        "ids, or leave them: they are then just not used"
    )
    assert caplog.records[0].levelno == logging.WARNING
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="clipforge.train"):
        tiny = ModelConfig()
        hf_files = split_files(hf_data, "train")
        assert stored_tokens(hf_data, hf_files, model_tokenizer(tiny), tiny) is None
    (line,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert f"are of {hf_tower}'s tokenizer, not this model's (clipforge-tiny: " in line.message
    assert "class HFTokenizer(BertTokenizerFast) vs the model's SimpleTokenizer" in line.message
    assert "set data.pretokenize_model: clipforge-tiny and data.pretokenize_text_tower: null" in (
        line.message
    )


def test_a_model_of_the_same_tokenizer_reads_the_ids_another_models_name_stored(
    open_clip_data, tmp_path, caplog
):
    """The ids' fingerprint, not the model's name, decides: ids stored for ViT-B-32 are read by
    ViT-B-16 (open_clip's tokenizer at context 77 both), so a new model.name (which leaves
    data/ as it is) keeps them where they still fit."""
    data_dir = make_data(tmp_path, pretokenize_model="ViT-B-32")
    vit_b16 = ModelConfig(name="ViT-B-16")
    with caplog.at_level(logging.INFO, logger="clipforge.train"):
        files = split_files(data_dir, "train")
        assert stored_tokens(data_dir, files, model_tokenizer(vit_b16), vit_b16) is not None
    assert "token ids: read from data/ (ViT-B-32's tokenizer" in caplog.text


def test_data_without_ids_is_tokenised_as_before(small_data, caplog):
    """The default (data.pretokenize_model: null): no `tok` member, no manifest entry, and the
    loader tokenises, saying so in one line."""
    files = split_files(small_data, "train")
    assert TOKENS_MEMBER not in files.reader().read(0, 0)
    with caplog.at_level(logging.INFO, logger="clipforge.train"):
        assert (
            stored_tokens(small_data, files, model_tokenizer(ModelConfig()), ModelConfig()) is None
        )
    assert [r.message for r in caplog.records] == [
        "the loader tokenises the captions: data/ holds no token ids (data.pretokenize_model)"
    ]


def test_ids_that_are_not_the_captions_are_caught_before_they_are_used(
    open_clip_data, tmp_path, caplog
):
    """Behind the fingerprint, a spot check: a manifest that claims this tokenizer over shards
    whose ids are something else (here: every id shifted by one) is tokenised on the fly."""
    data_dir = tmp_path / "data"
    shutil.copytree(open_clip_data, data_dir)
    files = split_files(data_dir, "train")
    token_format = TokenFormat("<u2", 72)
    tiny = ModelConfig()
    tokenizer = model_tokenizer(tiny)
    reader = ShardReader(files.paths)
    first = [reader.read(0, i) for i in range(files.counts[0])]
    (data_dir / "train" / "shard-000000.tar").unlink()
    write_shards(
        ((f"k{i}", s["jpg"], s["txt"].decode()) for i, s in enumerate(first)),
        data_dir,
        "train",
        len(first),
        lambda captions: token_format.encode(tokenizer(captions).numpy() + 1),
    )
    with caplog.at_level(logging.WARNING, logger="clipforge.train"):
        assert stored_tokens(data_dir, split_files(data_dir, "train"), tokenizer, tiny) is None
    assert "stored ids differ from its own for the same captions" in caplog.text
    assert "rerun the data stage" in caplog.text


def test_the_stored_dtype_holds_every_id_of_the_vocabulary():
    """uint16 where the largest id fits (open_clip's 49407, a Chinese BERT's 21127), int32 for
    larger vocabularies (XLM-RoBERTa's 250001); an id outside the dtype is an error, never a
    wrapped-around id."""
    assert TokenFormat.for_vocabulary(49407, 77).dtype == "<u2"
    large = TokenFormat.for_vocabulary(250001, 3)
    assert large.dtype == "<i4"
    ids = np.array([[0, 250001, 7]])
    assert np.array_equal(large.decode(large.encode(ids)), ids)
    with pytest.raises(ValueError, match="do not fit <u2"):
        TokenFormat("<u2", 3).encode(np.array([[0, 70000, 1]]))


def test_shards_used_in_place_carry_their_ids_in_the_index_files(tmp_path, open_clip_data):
    """The webdataset source in place: the shards stay as they are (no `tok` member), the ids
    go into data/<split>/NNNNNN.npz, and the reader serves them as a copied shard's member."""
    source = tmp_path / "source"
    reader = split_files(open_clip_data, "train").reader()
    pairs = [
        (f"s{i:04d}", sample["jpg"], sample["txt"].decode())
        for i, sample in enumerate(reader.read(s, i) for s in range(2) for i in range(25))
    ]
    for shard in range(2):
        write_shards(pairs[shard * 25 : (shard + 1) * 25], source, f"in{shard}", 25)
    data_dir = make_data(
        tmp_path / "out",
        source="webdataset",
        paths=[str(source / "in*" / "*.tar")],
        in_place=True,
        decontaminate="off",
        verify="none",
        workers=2,  # the tokenizer goes to each worker process once
        test_fraction=0.2,
        val_fraction=0.2,
        pretokenize_model="clipforge-tiny",
    )
    files = split_files(data_dir, "train")
    assert isinstance(files.reader(), InPlaceReader) and files.num_samples > 0
    stored, captions = stored_and_captions(data_dir, "train")
    assert np.array_equal(stored, open_clip.tokenize(captions, context_length=72).numpy())
    assert stored_tokens(data_dir, files, model_tokenizer(ModelConfig()), ModelConfig()) is not None


def test_a_text_tower_without_its_model_is_a_config_error():
    """data.pretokenize_text_tower replaces a model's text tower, as model.text_tower does: alone
    it names no tokenizer (no context length), so it is refused where the config is read."""
    from clipforge.data.config import DataConfig
    from clipforge.fields import ConfigError

    with pytest.raises(ConfigError, match="^data.pretokenize_text_tower: needs data.pretoken"):
        DataConfig(pretokenize_text_tower="hfl/chinese-roberta-wwm-ext")


@pytest.mark.parametrize("recipe", sorted(set(RECIPES) - {"default"}))
def test_each_production_recipe_stores_its_own_models_ids(recipe):
    """The data section names the tokenizer (model.* are not the data stage's params): every
    production recipe names its own model's, so `recipe: X` stores the ids X trains on."""
    config = recipe_params(recipe)
    assert config.data.pretokenize_model == config.model.name
    assert config.data.pretokenize_text_tower == config.model.text_tower
