"""The `storage` section: a place, never a credential, and no part of what a run is."""

from __future__ import annotations

import pytest

from clipforge.fields import ConfigError
from clipforge.pipeline.params import load_pipeline_params
from clipforge.train.config import run_id
from tests.conftest import write_params


@pytest.mark.parametrize(
    "url",
    [
        "s3://AKIAEXAMPLE:wJalrXUtnFEMI@bucket/runs",
        "https://user:hunter2@storage.example.org/runs",
        "az://container/runs?sig=abc123",
    ],
)
def test_a_store_url_carrying_a_credential_is_refused_naming_where_credentials_go(tmp_path, url):
    params = write_params(tmp_path / "params.yaml", {"storage": {"remote": url}})
    with pytest.raises(ConfigError) as excinfo:
        load_pipeline_params(params)
    message = str(excinfo.value)
    assert message.startswith("storage.remote: holds a credential")
    assert "environment" in message and url not in message


def test_where_a_run_is_stored_does_not_change_its_id(tmp_path):
    """storage.* changes no weight: the same run, stored anywhere, has the same id (and resumes
    from its checkpoints wherever they are)."""
    manifest = b'{"splits": {}}'
    plain = load_pipeline_params(write_params(tmp_path / "a.yaml"))
    stored = load_pipeline_params(
        write_params(
            tmp_path / "b.yaml",
            {"storage": {"remote": "s3://bucket/runs", "keep_checkpoints": 5}},
        )
    )
    assert run_id(plain, manifest) == run_id(stored, manifest)
    # (twice the base lr: the README's `dvc exp run -S train.lr=...` may have changed the base)
    other = load_pipeline_params(
        write_params(tmp_path / "c.yaml", {"train": {"lr": 2 * plain.train.lr}})
    )
    assert run_id(other, manifest) != run_id(plain, manifest)


def test_a_store_whose_protocol_has_no_library_stops_the_stage_before_training(
    tmp_path, small_data, capsys
):
    """An fsspec protocol whose package is not installed: one line naming what to install, exit
    code 2, nothing written."""
    from tests.conftest import run_train

    assert run_train(tmp_path, small_data, "storage.remote=gcs://bucket/runs") == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert line.startswith("clipforge.train: error: storage.remote gcs://bucket/runs:")
    assert "gcsfs" in line
    assert not (tmp_path / "checkpoints").exists()
