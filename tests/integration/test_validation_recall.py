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

CAPTIONS = ["左上角有一个红色的圆形", "右下角有一个蓝色的三角形", "中间有一个绿色的正方形",
            "左侧有一个黄色的十字形", "上方有一个紫色的圆形", "左上角有一个红色的圆形"]  # repeated
NUM_BATCHES, BATCH = 4, 6


def _batches(tokenizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    batches = []
    for b in range(NUM_BATCHES):
        images = torch.rand(BATCH, 3, 32, 32, generator=generator)
        texts = [CAPTIONS[(b + i) % len(CAPTIONS)] for i in range(BATCH)]
        batches.append((images, tokenizer(texts)))
    return batches


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import open_clip
    from open_clip.loss import ClipLoss

    from clipforge.model import register_bundled_configs
    from clipforge.train.validation import validation_metrics

    register_bundled_configs()
    torch.manual_seed(0)
    model = open_clip.create_model("clipforge-tiny", force_image_size=32, output_dict=True).eval()
    batches = _batches(open_clip.get_tokenizer("clipforge-tiny"))[rank::world]
    metrics = validation_metrics(model, ClipLoss(), batches, lambda b: b, "cpu", 1000)
    Path(out, f"world{world}-rank{rank}.json").write_text(json.dumps(metrics))
    dist.destroy_process_group()


def _run(world: int, out: Path) -> list[dict]:
    from clipforge.train.dist import free_port

    os.environ["PYTHONPATH"] = str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")
    mp.start_processes(_worker, args=(world, free_port(), str(out)), nprocs=world,
                       start_method="spawn")
    return [json.loads((out / f"world{world}-rank{r}.json").read_text()) for r in range(world)]


def _one_rank() -> dict:
    """The same model and batches in this process, without a process group: a world of one."""
    import open_clip
    from open_clip.loss import ClipLoss

    from clipforge.model import register_bundled_configs
    from clipforge.train.validation import validation_metrics

    register_bundled_configs()
    torch.manual_seed(0)
    model = open_clip.create_model("clipforge-tiny", force_image_size=32, output_dict=True).eval()
    batches = _batches(open_clip.get_tokenizer("clipforge-tiny"))
    return validation_metrics(model, ClipLoss(), batches, lambda b: b, "cpu", 1000)


def test_two_ranks_report_what_one_rank_reports(tmp_path):
    """Loss and every recall agree between 1 rank with all batches and 2 ranks with half each."""
    first, second = _run(2, tmp_path)
    one = _one_rank()
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
        text_class = torch.tensor([next(c for c, t in enumerate(self.classes) if torch.equal(t, row))
                                   for row in text])
        size = len(self.classes)
        return {"image_features": torch.nn.functional.one_hot(image_class, size).float(),
                "text_features": torch.nn.functional.one_hot(text_class, size).float(),
                "logit_scale": torch.tensor(10.0)}


def test_identical_captions_count_as_relevant():
    """Two pairs share a caption: both images are right answers for it, so a perfect model gets
    t2i R@1 = 100 although the two tied images are ranked in arbitrary order."""
    import open_clip
    from open_clip.loss import ClipLoss

    from clipforge.model import register_bundled_configs
    from clipforge.train.validation import validation_metrics

    register_bundled_configs()
    tokenizer = open_clip.get_tokenizer("clipforge-tiny")
    distinct = sorted(set(CAPTIONS))
    images = torch.zeros(len(CAPTIONS), 3, 32, 32)
    images[:, 0, 0, 0] = torch.tensor([float(distinct.index(c)) for c in CAPTIONS])
    model = CaptionClassModel(list(tokenizer(distinct)))
    metrics = validation_metrics(model, ClipLoss(), [(images, tokenizer(CAPTIONS))], lambda b: b,
                                 "cpu", 1000)
    assert metrics["t2i_r1"] == pytest.approx(100.0) and metrics["i2t_r1"] == pytest.approx(100.0)


def test_only_the_first_retrieval_samples_are_ranked():
    """val_retrieval_samples caps the gallery: 3 of 6 pairs ranked, all batches in the loss."""
    import open_clip
    from open_clip.loss import ClipLoss

    from clipforge.model import register_bundled_configs
    from clipforge.train.validation import validation_metrics

    register_bundled_configs()
    tokenizer = open_clip.get_tokenizer("clipforge-tiny")
    distinct = sorted(set(CAPTIONS))
    images = torch.zeros(len(CAPTIONS), 3, 32, 32)
    # the last three images carry wrong classes: ranked, they would pull recall below 100
    truth = [distinct.index(c) for c in CAPTIONS]
    images[:, 0, 0, 0] = torch.tensor([float(t) for t in truth[:3]] +
                                      [float((t + 1) % len(distinct)) for t in truth[3:]])
    model = CaptionClassModel(list(tokenizer(distinct)))
    capped = validation_metrics(model, ClipLoss(), [(images, tokenizer(CAPTIONS))], lambda b: b,
                                "cpu", 3)
    full = validation_metrics(model, ClipLoss(), [(images, tokenizer(CAPTIONS))], lambda b: b,
                              "cpu", 1000)
    assert capped["t2i_r1"] == pytest.approx(100.0) and full["t2i_r1"] < 100.0
    assert capped["loss"] == pytest.approx(full["loss"])
