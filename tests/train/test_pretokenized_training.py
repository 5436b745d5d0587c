"""data.pretokenize_model changes where the loader gets token ids, never what they are: a training
run on shards with stored ids takes the same steps as one that tokenises, loss for loss and weight
for weight (the shared reference run: the same reduced config on data without ids)."""

from __future__ import annotations

import json
import logging

import pytest
from safetensors.torch import load_file

from clipforge.data.stage import main as data_main
from tests.conftest import run_train, write_params

# One more run of the reduced config (about a minute on 2 cores with its data stage): in make
# test-tier2. make test keeps the stored ids against the tokenizer (data/test_pretokenize.py).
pytestmark = [pytest.mark.slow, pytest.mark.tier2]


def _column(tsv: str, name: str) -> list[str]:
    header, *rows = tsv.splitlines()
    index = header.split("\t").index(name)
    return [row.split("\t")[index] for row in rows]


def test_training_on_stored_ids_gives_bit_identical_losses_and_weights(
    tmp_path, reference_run, caplog
):
    params = write_params(
        tmp_path / "params.yaml", {"data": {"pretokenize_model": "clipforge-tiny"}}
    )
    assert data_main(["--params", str(params), "--out", str(tmp_path / "data")]) == 0
    assert "tokens" in json.loads((tmp_path / "data" / "manifest.json").read_text())
    root = tmp_path / "run"
    root.mkdir()
    with caplog.at_level(logging.INFO, logger="clipforge.train"):
        assert run_train(root, tmp_path / "data") == 0
    assert "token ids: read from data/" in caplog.text

    for tsv in ("train.tsv", "val.tsv"):
        ours = (root / "metrics" / tsv).read_text()
        reference = (reference_run / "metrics" / tsv).read_text()
        assert _column(ours, "loss") == _column(reference, "loss") and _column(ours, "loss")
    ours = json.loads((root / "metrics" / "train.json").read_text())
    reference = json.loads((reference_run / "metrics" / "train.json").read_text())
    assert ours["loss"] == reference["loss"]
    expected = load_file(str(reference_run / "models" / "clip" / "open_clip_model.safetensors"))
    got = load_file(str(root / "models" / "clip" / "open_clip_model.safetensors"))
    assert expected.keys() == got.keys()
    for name in expected:
        assert (expected[name] == got[name]).all(), f"{name} differs from the tokenising run"
