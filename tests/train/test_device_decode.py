"""train.decode_on_device: JPEGs decoded, cropped and resized by the device, crops drawn by the
loader workers; refused where there is no GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision import transforms

from clipforge.data import builtin
from clipforge.data.shards import write_shards
from clipforge.fields import ConfigError
from clipforge.model.config import ModelConfig
from clipforge.model.factory import build_model
from clipforge.train import loader as data
from clipforge.train.config import BatchPlan


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    def pair(index: int):
        rng = np.random.default_rng([3, index])
        scene = builtin.random_scene(rng)
        image = builtin.render(scene, rng, 96 + 8 * (index % 3))  # sizes differ: real crops
        return f"{index:04d}", builtin.encode_jpeg(image, quality=95), builtin.captions(scene)[0]

    root = tmp_path_factory.mktemp("shards")
    infos = write_shards([pair(i) for i in range(12)], root, "train", 12)
    return data.SplitFiles([root / i.name for i in infos], [i.count for i in infos])


def _chunk(files, bundle, transform):
    plan = BatchPlan(8, 8, 1, 1)
    return data.MicroBatches(files, plan, 0, 5, 1, transform, bundle.tokenizer, 4)[0]


def test_the_device_path_crops_and_resizes_what_the_worker_path_does(shards):
    """Same sample, same seed: the same random crop box, pixels within JPEG/resampling noise."""
    bundle = build_model(ModelConfig())
    cpu_transform, mean, std = data.uint8_transform(bundle.preprocess_train)
    crop, mean_d, std_d = data.device_decode_transform(bundle.preprocess_train)
    assert (mean_d, std_d) == (mean, std)
    pixels, tokens, _ = _chunk(shards, bundle, cpu_transform)
    (jpegs, boxes), tokens_d, _ = _chunk(shards, bundle, crop)
    assert torch.equal(tokens, tokens_d) and len(jpegs) == len(pixels) == len(boxes)
    cpu = torch.device("cpu")
    on_device = data.decode_crop_resize(jpegs, boxes.tolist(), crop, cpu)
    assert on_device.dtype == torch.uint8 and on_device.shape == pixels.shape
    difference = (on_device.float() - pixels.float()).abs().mean()
    assert difference < 3.0  # of 255: two bicubic implementations, the same crop
    # and DeviceBatches takes either kind of chunk to the same normalised batch
    plain = data.DeviceBatches(mean, std, cpu, torch.float32)
    decoding = data.DeviceBatches(mean, std, cpu, torch.float32, crop)
    images, texts = decoding([((jpegs, boxes), tokens_d)])
    reference, _ = plain([(pixels, tokens)])
    assert torch.equal(texts, tokens)
    assert (images - reference).abs().mean() < 0.05


def test_without_a_gpu_the_option_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="train.decode_on_device: needs a CUDA device"):
        data.check_decode_on_device("cpu")
    data.check_decode_on_device("cuda")


def test_a_training_transform_the_device_path_cannot_do_is_refused():
    preprocess = transforms.Compose(
        [
            transforms.RandomResizedCrop(64),
            transforms.ColorJitter(0.4),
            transforms.ToTensor(),
            transforms.Normalize([0.5] * 3, [0.5] * 3),
        ]
    )
    with pytest.raises(ConfigError, match="ColorJitter"):
        data.device_decode_transform(preprocess)
