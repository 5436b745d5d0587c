"""User errors and bugs: a UserError, raised where the problem is found, is one line and exit 2;
anything else is a bug and keeps its traceback (the CLI shell relabels nothing)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from clipforge.alerts.targets import WebhookError
from clipforge.cli import EXIT_USAGE
from clipforge.data.stage import main as data_main
from clipforge.data.testset import TestSetError
from clipforge.errors import LauncherError, StageError, UserError
from clipforge.fields import ConfigError
from clipforge.fsutil import UnsafeNameError
from clipforge.ids import IdError
from clipforge.image_env import ImageEnvError
from clipforge.launcher.host.gpus import GpuRecordError
from clipforge.launcher.host.record import RunRecordError
from clipforge.launcher.host.state import StateFileError
from clipforge.launcher.recovery import RecordError
from clipforge.launcher.run_source import StoredRun
from clipforge.model.files import ModelFilesError
from clipforge.store.remote import LAUNCHES, StoreError
from clipforge.store.sync_state import SyncStateError
from clipforge.yamlfile import YamlFileError
from tests.conftest import REPO, run_train, subprocess_env, write_params


def test_every_user_error_type_is_a_user_error():
    """The CLI shell catches UserError alone, so each type the code raises for the user is one;
    the builtin bases stay, for callers that catch those."""
    for error in (StageError, ConfigError, TestSetError, ModelFilesError, YamlFileError):
        assert issubclass(error, UserError), error
    for error in (ImageEnvError, LauncherError, WebhookError, IdError, UnsafeNameError):
        assert issubclass(error, UserError), error
    assert issubclass(ConfigError, ValueError) and issubclass(StageError, RuntimeError)


def test_a_damaged_record_or_an_unusable_store_is_a_user_error():
    """The file's reader (or the store's opener) raises it where it finds the problem, naming the
    file: the user's to look at. Callers that read a record and go on (status rows, the
    supervisor) still catch the record's own type, and ValueError stays its base."""
    for error in (StateFileError, RunRecordError, GpuRecordError, SyncStateError, RecordError):
        assert issubclass(error, UserError) and issubclass(error, ValueError), error
    assert issubclass(StoreError, UserError) and issubclass(StoreError, RuntimeError)
    assert issubclass(RecordError, LauncherError)


def test_a_damaged_run_record_in_the_store_reaches_the_shell_as_itself(tmp_path):
    """No relabelling on the way: `fab status --run ID --from-store` on a damaged launch record
    raises the reader's RunRecordError, which the fab task wrapper prints as one line."""
    launches = tmp_path / "store" / LAUNCHES
    launches.mkdir(parents=True)
    (launches / "20260101-000000-abc1234.json").write_text('{"training_run": "run-0123456789ab"}')
    with pytest.raises(RunRecordError, match="launches/20260101-000000-abc1234.json"):
        StoredRun.open(str(tmp_path / "store"), "20260101-000000-abc1234")


def _local_source(tmp_path, csv_text: str):
    source = tmp_path / "pairs.csv"
    source.write_text(csv_text, encoding="utf-8")
    return write_params(
        tmp_path / "params.yaml", {"data": {"source": "local", "path": str(source)}}
    )


def test_a_user_error_in_the_data_stage_is_one_line_and_exit_2(tmp_path, capsys):
    """A .csv without its header is found by the reader, which raises the user error itself."""
    params = _local_source(tmp_path, "a.jpg,a caption\n")
    assert data_main(["--params", str(params), "--out", str(tmp_path / "data")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("clipforge.data: error: ") and "columns `image` and `caption`" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_bug_deep_in_the_data_stage_keeps_its_traceback(tmp_path):
    """A ValueError from the code (here: the resizing every image goes through) is no user error:
    the process prints the traceback and exits 1, not 2 with a one-line message."""
    (tmp_path / "a.jpg").write_bytes(_jpeg())
    params = _local_source(tmp_path, "image,caption\na.jpg,a red square\n")
    script = (
        "import sys\n"
        "import clipforge.data.stage as stage\n"
        "def bug(jpeg, side):\n"
        "    raise ValueError('an injected bug')\n"
        "stage.shorter_side_at_most = bug\n"
        "raise SystemExit(stage.main(sys.argv[1:]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, "--params", str(params), "--out", str(tmp_path / "data")],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode not in (0, EXIT_USAGE)
    assert "Traceback (most recent call last)" in result.stderr
    assert "in bug" in result.stderr and "ValueError: an injected bug" in result.stderr
    assert "clipforge.data: error:" not in result.stderr


def test_a_bug_in_building_the_model_reaches_the_caller(tmp_path, small_data, monkeypatch):
    """The train stage does not wrap build_model: a ValueError from it (open_clip's, or ours)
    leaves main() as itself, so `python -m clipforge.train` shows where it came from."""
    import clipforge.train.run as run

    def bug(*args, **kwargs):
        raise ValueError("an injected bug")

    monkeypatch.setattr(run, "build_model", bug)
    with pytest.raises(ValueError, match="an injected bug"):
        run_train(tmp_path, small_data)


def _jpeg() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buffer, format="JPEG")
    return buffer.getvalue()
