"""An exported model as a user without clipforge has it: loaded by open_clip alone in a separate
interpreter (where `import clipforge` fails), its weights loaded strictly, the test set encoded
and its retrieval recall computed from scratch (plain torch, not clipforge.metrics)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.workers import json_from

_SCRIPT = r"""
import base64, io, json, sys
sys.modules["clipforge"] = None  # any `import clipforge...` now raises ImportError
import open_clip, torch
from PIL import Image
from safetensors.torch import load_file
model_dir, test_dir, out = sys.argv[1:4]
model, _, preprocess = open_clip.create_model_and_transforms("local-dir:" + model_dir)
weights = load_file(model_dir + "/open_clip_model.safetensors")
model.load_state_dict(weights, strict=True)  # every weight the architecture has, nothing else
tokenizer = open_clip.get_tokenizer("local-dir:" + model_dir)
model.eval()
rows = [line.split("\t") for line in open(test_dir + "/test_imgs.tsv").read().splitlines()]
image_ids = [int(row[0]) for row in rows]
images = torch.stack([preprocess(Image.open(io.BytesIO(base64.b64decode(row[1]))).convert("RGB"))
                      for row in rows])
texts = [json.loads(line) for line in open(test_dir + "/test_texts.jsonl").read().splitlines()]
with torch.no_grad():
    image_features = model.encode_image(images, normalize=True)
    text_features = model.encode_text(tokenizer([t["text"] for t in texts]), normalize=True)
similarity = text_features @ image_features.T
relevant = torch.tensor([[i in t["image_ids"] for i in image_ids] for t in texts])

def recall(similarity, relevant, k):  # percent of queries with a right answer among the k best
    best = similarity.argsort(dim=1, descending=True)[:, :k]
    return 100.0 * relevant.gather(1, best).any(dim=1).float().mean().item()

described = relevant.any(dim=0)  # an image no text describes is no image->text query
recalls = {f"t2i_r{k:02d}": recall(similarity, relevant, k) for k in (1, 5, 10)}
recalls |= {f"i2t_r{k:02d}": recall(similarity.T[described], relevant.T[described], k)
            for k in (1, 5, 10)}
recalls["mean_recall"] = sum(recalls.values()) / len(recalls)
bias = getattr(model, "logit_bias", None)  # SigLIP's, where the config has init_logit_bias
json.dump({"dtypes": sorted({str(w.dtype) for w in weights.values()}),
           "logit_bias": None if bias is None else bias.item(),
           "image": image_features.tolist(), "text": text_features.tolist(),
           "recall": recalls}, open(out, "w"))
"""


def plain_open_clip(model_dir: Path, test_dir: Path, out: Path) -> dict:
    """The weights' dtypes, SigLIP's learned bias (None: the model has none), the embeddings of
    the test set's images and texts (in file order) and its recall, as open_clip alone gives them
    for `model_dir`; `out` holds them too."""
    return json_from(["-c", _SCRIPT, str(model_dir), str(test_dir), str(out)], out, timeout=300)


def assert_plain_recall_is_evals(model_dir: Path, test_dir: Path, tmp_path: Path) -> dict:
    """The export loads strictly in plain open_clip, in fp32, and the recall computed there from
    scratch is the one the eval stage writes in eval.json; returns what plain open_clip gave."""
    from clipforge.eval.stage import main as eval_main
    from tests.conftest import eval_argv, write_params

    plain = plain_open_clip(model_dir, test_dir, tmp_path / "plain.json")
    assert plain["dtypes"] == ["torch.float32"]
    params = write_params(tmp_path / "params.yaml")
    out = tmp_path / "eval.json"
    assert eval_main(eval_argv(params, f"local-dir:{model_dir}", test_dir, out)) == 0
    reported = json.loads(out.read_text())["test"]
    assert reported.keys() == plain["recall"].keys()
    for key, value in plain["recall"].items():
        # one hit more or less moves a recall by 100/48 points: this is equality of the hits
        assert reported[key] == pytest.approx(value, abs=1e-4), key
    return plain
