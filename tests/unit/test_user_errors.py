"""User errors and bugs: a UserError, raised where the problem is found, is one line and exit 2;
anything else is a bug and keeps its traceback (the CLI shell relabels nothing)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from clipforge.alerts.targets import WebhookError
from clipforge.cli import EXIT_USAGE, StageError
from clipforge.data.stage import main as data_main
from clipforge.data.testset import TestSetError
from clipforge.errors import UserError
from clipforge.fields import ConfigError
from clipforge.image_env import ImageEnvError
from clipforge.launcher import LauncherError
from clipforge.model_files import ModelFilesError
from clipforge.yamlfile import YamlFileError
from tests.conftest import REPO, run_train, subprocess_env, write_params


def test_every_user_error_type_is_a_user_error():
    """The CLI shell catches UserError alone, so each type the code raises for the user is one;
    the builtin bases stay, for callers that catch those."""
    for error in (StageError, ConfigError, TestSetError, ModelFilesError, YamlFileError):
        assert issubclass(error, UserError), error
    for error in (ImageEnvError, LauncherError, WebhookError):
        assert issubclass(error, UserError), error
    assert issubclass(ConfigError, ValueError) and issubclass(StageError, RuntimeError)


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

    def bug(cfg):
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
