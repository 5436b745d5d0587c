"""The train stage's loader on shards used in place: a sample whose image does not decode is
replaced by the next one of the epoch's order and counted, the batch keeps its size, and the
batches stay a function of their number alone."""

from __future__ import annotations

import json

import torch
import yaml
from torchvision import transforms

from clipforge.data.stage import main
from clipforge.train.config import BatchPlan
from clipforge.train.loader import MicroBatches, micro_batch_loader, split_files
from tests.support.shards import textured_jpeg, write_tar


def _tokens(captions: list[str]) -> torch.Tensor:
    return torch.tensor([[len(c)] for c in captions])


def _in_place_data(tmp_path):
    members = []
    for n in range(30):
        jpeg = textured_jpeg(n) if n % 10 else b"\xff\xd8\xff\xe0 not an image"  # 0, 10, 20
        members += [(f"k{n:03d}.jpg", jpeg), (f"k{n:03d}.txt", f"caption {n}".encode())]
    write_tar(tmp_path / "shard-0.tar", members)
    params = {
        "data": {
            "source": "webdataset",
            "paths": [str(tmp_path / "shard-0.tar")],
            "in_place": True,
            "verify": "none",
            "decontaminate": "off",
            "val_fraction": 0.0,
            "test_fraction": 0.4,
        }
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    assert main(["--params", str(tmp_path / "params.yaml"), "--out", str(tmp_path / "data")]) == 0
    return tmp_path / "data"


def test_corrupt_images_are_replaced_counted_and_batches_stay_reproducible(tmp_path):
    data = _in_place_data(tmp_path)
    files = split_files(data, "train")
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["skipped"]["counts"] == {}  # verify: none: the stage decoded nothing
    transform = transforms.Compose([transforms.Resize((16, 16)), transforms.PILToTensor()])
    plan = BatchPlan(8, 8, 1, 1)
    steps = 2 * (files.num_samples // 8)  # two epochs

    def run(start: int):
        dataset = MicroBatches(files, plan, 0, 3, steps, transform, _tokens, 4)
        loader = micro_batch_loader(dataset, start, 0, False, 2)
        return [torch.cat([c[0] for c in group]) for group in loader], loader.skipped

    batches, skipped = run(0)
    assert all(b.shape == (8, 3, 16, 16) for b in batches)
    assert skipped.counts["corrupt_image"] >= 1
    assert all("shard-0.tar#" in e for e in skipped.examples["corrupt_image"])
    resumed, _ = run(3)
    assert all(torch.equal(a, b) for a, b in zip(batches[3:], resumed, strict=True))
