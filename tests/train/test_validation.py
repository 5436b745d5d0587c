"""Validation recall across ranks: 2 gloo ranks, each with half of the batches, report exactly
what one rank with all of them reports (features are gathered, the loss averaged)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import REPO

CAPTIONS = [
    "左上角有一个红色的圆形",
    "右下角有一个蓝色的三角形",
    "中间有一个绿色的正方形",
    "左侧有一个黄色的十字形",
    "上方有一个紫色的圆形",
    "左上角有一个红色的圆形",
]  # repeated
NUM_BATCHES, BATCH = 4, 6


class TinyClip(torch.nn.Module):
    """A small real two-tower model (no open_clip, so the spawned ranks start fast), with dropout:
    in train mode its features are random, so only eval mode gives every rank the same answer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.image = torch.nn.Linear(3 * 8 * 8, 16)
        self.text = torch.nn.EmbeddingBag(4096, 16)
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, image, text):
        normalize = torch.nn.functional.normalize
        return {
            "image_features": normalize(self.dropout(self.image(image.flatten(1))), dim=-1),
            "text_features": normalize(self.text(text % 4096), dim=-1),
            "logit_scale": torch.tensor(10.0),
        }


def contrastive_loss(image_features, text_features, logit_scale):
    logits = logit_scale * image_features @ text_features.T
    labels = torch.arange(len(logits))
    cross_entropy = torch.nn.functional.cross_entropy
    return (cross_entropy(logits, labels) + cross_entropy(logits.T, labels)) / 2


def _tokens(texts: list[str]) -> torch.Tensor:
    """Character codes, zero-padded: identical captions give identical rows, as a tokenizer's."""
    rows = torch.zeros(len(texts), 16, dtype=torch.long)
    for i, text in enumerate(texts):
        rows[i, : len(text)] = torch.tensor([ord(c) for c in text])
    return rows


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.rand(BATCH, 3, 8, 8, generator=generator),
            _tokens([CAPTIONS[(b + i) % len(CAPTIONS)] for i in range(BATCH)]),
        )
        for b in range(NUM_BATCHES)
    ]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from clipforge.train.validation import validation_metrics

    model = TinyClip()  # in train mode, as the training loop leaves it
    metrics = validation_metrics(
        model, contrastive_loss, _batches()[rank::world], lambda b: b, "cpu", 1000
    )
    metrics["back_in_train_mode"] = model.training
    Path(out, f"world{world}-rank{rank}.json").write_text(json.dumps(metrics))
    dist.destroy_process_group()


def _run(world: int, out: Path) -> list[dict]:
    from clipforge.train.dist import free_port

    os.environ["PYTHONPATH"] = str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")
    mp.start_processes(
        _worker, args=(world, free_port(), str(out)), nprocs=world, start_method="spawn"
    )
    return [json.loads((out / f"world{world}-rank{r}.json").read_text()) for r in range(world)]


def test_two_ranks_report_what_one_rank_reports(tmp_path):
    """Loss and every recall agree between 1 rank with all batches (this process, no process
    group) and 2 gloo ranks with half each: in eval mode (no dropout), and each rank's model is
    in train mode again afterwards."""
    from clipforge.train.validation import validation_metrics

    first, second = _run(2, tmp_path)
    assert first.pop("back_in_train_mode") and second.pop("back_in_train_mode")
    one = validation_metrics(TinyClip(), contrastive_loss, _batches(), lambda b: b, "cpu", 1000)
    assert first == second  # every rank ends with the same numbers
    assert one.keys() == first.keys()
    for key in one:
        assert first[key] == pytest.approx(one[key], abs=1e-4), key


class CaptionClassModel(torch.nn.Module):
    """Features that are one-hot in the caption's class: the image carries its class in a pixel,
    the text's class is looked up from its token ids. Identical captions -> identical features."""

    def __init__(self, classes: list[torch.Tensor]):
        super().__init__()
        self.classes = classes

    def forward(self, image, text):
        image_class = image[:, 0, 0, 0].long()
        text_class = torch.tensor(
            [next(c for c, t in enumerate(self.classes) if torch.equal(t, row)) for row in text]
        )
        size = len(self.classes)
        return {
            "image_features": torch.nn.functional.one_hot(image_class, size).float(),
            "text_features": torch.nn.functional.one_hot(text_class, size).float(),
            "logit_scale": torch.tensor(10.0),
        }


def test_identical_captions_count_as_relevant():
    """Two pairs share a caption: both images are right answers for it, so a perfect model gets
    t2i R@1 = 100 although the two tied images are ranked in arbitrary order."""
    from clipforge.train.validation import validation_metrics

    distinct = sorted(set(CAPTIONS))
    images = torch.zeros(len(CAPTIONS), 3, 32, 32)
    images[:, 0, 0, 0] = torch.tensor([float(distinct.index(c)) for c in CAPTIONS])
    model = CaptionClassModel(list(_tokens(distinct)))
    metrics = validation_metrics(
        model, contrastive_loss, [(images, _tokens(CAPTIONS))], lambda b: b, "cpu", 1000
    )
    assert metrics["t2i_r01"] == pytest.approx(100.0) and metrics["i2t_r01"] == pytest.approx(100.0)


def test_only_the_first_retrieval_samples_are_ranked():
    """val_retrieval_samples caps the gallery: 3 of 6 pairs ranked, all batches in the loss."""
    from clipforge.train.validation import validation_metrics

    distinct = sorted(set(CAPTIONS))
    images = torch.zeros(len(CAPTIONS), 3, 32, 32)
    # the last three images carry wrong classes: ranked, they would pull recall below 100
    truth = [distinct.index(c) for c in CAPTIONS]
    images[:, 0, 0, 0] = torch.tensor(
        [float(t) for t in truth[:3]] + [float((t + 1) % len(distinct)) for t in truth[3:]]
    )
    model = CaptionClassModel(list(_tokens(distinct)))
    capped = validation_metrics(
        model, contrastive_loss, [(images, _tokens(CAPTIONS))], lambda b: b, "cpu", 3
    )
    full = validation_metrics(
        model, contrastive_loss, [(images, _tokens(CAPTIONS))], lambda b: b, "cpu", 1000
    )
    assert capped["t2i_r01"] == pytest.approx(100.0) and full["t2i_r01"] < 100.0
    assert capped["loss"] == pytest.approx(full["loss"])
