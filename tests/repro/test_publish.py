"""`fab publish` and `fab pull` (clipforge.repro.publish): a model handed on and fetched back,
every file verified; what open_clip loads from the pulled folder is the model that was trained."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from clipforge.repro.publish import CHECKSUMS, PublishError, pull
from clipforge.repro.run_folder import read_run
from tests.conftest import subprocess_env
from tests.support.repro_runs import fab, make_run

# A user without clipforge: open_clip alone loads each folder and embeds the same inputs.
PLAIN_OPEN_CLIP = r"""
import sys, json
sys.modules["clipforge"] = None
import open_clip, torch
out = {}
for folder in sys.argv[2:]:
    model, _, _ = open_clip.create_model_and_transforms("local-dir:" + folder)
    tokenizer = open_clip.get_tokenizer("local-dir:" + folder)
    model.eval()
    size = model.visual.image_size
    size = size if isinstance(size, int) else size[0]
    images = torch.rand(3, 3, size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out[folder] = {
            "image": model.encode_image(images, normalize=True).tolist(),
            "text": model.encode_text(tokenizer(["红色的圆", "a blue square"]), normalize=True).tolist(),
        }
json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.mark.slow
def test_publish_pull_and_load_with_plain_open_clip_gives_the_same_embeddings(
    reference_run, tmp_path
):
    published, pulled = tmp_path / "hub" / "model", tmp_path / "pulled"
    result = fab("publish", str(reference_run), "--to", str(published))
    assert result.returncode == 0, result.stderr
    result = fab("pull", str(published), "--to", str(pulled))
    assert result.returncode == 0, result.stderr
    assert "verified" in result.stdout

    card = (pulled / "README.md").read_text()
    record = json.loads((pulled / "clipforge.json").read_text())
    info = json.loads((reference_run / "metrics" / "train.info.json").read_text())
    assert record["environment"] == info["environment"]
    assert record["data_manifest_sha256"] in card
    assert info["environment"]["stack"]["torch"] in card
    assert record["rerun"] is None  # a local run: `fab rerun` repeats what `fab train` launched
    assert (pulled / "transformers" / "config.json").is_file()

    out = tmp_path / "embeddings.json"
    original = reference_run / "models" / "clip"
    done = subprocess.run(
        [sys.executable, "-c", PLAIN_OPEN_CLIP, str(out), str(original), str(pulled)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    embeddings = json.loads(out.read_text())
    assert embeddings[str(pulled)] == embeddings[str(original)]


@pytest.mark.slow
def test_the_pulled_transformers_export_gives_the_originals_embeddings(reference_run, tmp_path):
    import torch
    from transformers import CLIPModel

    published, pulled = tmp_path / "hub", tmp_path / "pulled"
    assert fab("publish", str(reference_run), "--to", str(published)).returncode == 0
    assert fab("pull", str(published), "--to", str(pulled)).returncode == 0
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    features = []
    for folder in (reference_run / "models" / "clip" / "transformers", pulled / "transformers"):
        model = CLIPModel.from_pretrained(folder).eval()
        with torch.no_grad():
            features.append(model.get_image_features(pixel_values=pixels))
    assert torch.equal(features[0], features[1])


def test_a_file_changed_after_publishing_is_refused_by_name_and_nothing_is_pulled(tmp_path):
    run = make_run(tmp_path / "run")
    published = tmp_path / "hub"
    assert fab("publish", str(run), "--to", str(published)).returncode == 0
    (published / "open_clip_model.safetensors").write_bytes(b"tampered")
    result = fab("pull", str(published), "--to", str(tmp_path / "pulled"))
    assert result.returncode == 1
    assert "open_clip_model.safetensors does not match its sha256" in result.stderr
    assert not (tmp_path / "pulled").exists()


def test_publishing_twice_to_one_place_is_refused(tmp_path):
    run = make_run(tmp_path / "run")
    assert fab("publish", str(run), "--to", str(tmp_path / "hub")).returncode == 0
    again = fab("publish", str(run), "--to", str(tmp_path / "hub"))
    assert again.returncode == 1 and "already published" in again.stderr


def test_publish_to_s3_and_pull_back(s3, tmp_path):
    """`fab publish runs/ID --to s3://...` and `fab pull s3://... --to DIR`, as README.md writes
    them, against the S3 server (this environment reaches it, as a user's reaches theirs)."""
    run = make_run(tmp_path / "run")
    url = f"{s3.new_bucket()}/models/tiny"
    published = fab("publish", str(run), "--to", url)
    assert published.returncode == 0, published.stderr
    assert s3.filesystem().exists(f"{url}/{CHECKSUMS}")
    pulled = tmp_path / "pulled"
    done = fab("pull", url, "--to", str(pulled))
    assert done.returncode == 0, done.stderr
    assert (pulled / "open_clip_model.safetensors").read_bytes() == b"weights"
    assert read_run(run).weights_sha256 in (pulled / "clipforge.json").read_text()
    with pytest.raises(PublishError, match="no SHA256SUMS"):
        pull(f"{url}-missing", tmp_path / "none", print)
