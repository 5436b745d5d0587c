"""The launcher's settings (fabric.yaml's `clipforge` section), `fab train`'s options and the
supervisor's restart policy: each knob declared once (clipforge.fields), checked by one rule
raising the launcher's user error, its doc in docs/launcher.md written from the declaration."""

from __future__ import annotations

from pathlib import Path

import pytest
from invoke import Config

from clipforge.errors import LauncherError, UserError
from clipforge.launcher.host.plan import PhasePlan, RestartPolicy
from clipforge.launcher.options import make_options
from clipforge.launcher.recovery import RecoveryRule
from clipforge.launcher.session import Settings, defaults, settings_from, settings_table
from tests.conftest import REPO
from tests.support.doc_tables import table_in_order, table_problems

DOC = REPO / "docs" / "launcher.md"


def test_the_settings_table_is_the_declarations():
    """docs/launcher.md's table is `settings_table()`: every key, its default and its doc, in
    the declarations' order."""
    text = DOC.read_text(encoding="utf-8")
    assert table_problems(text, "## Settings", settings_table()) == []
    assert table_in_order(text, settings_table())


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ("| `min_free_gb` | 20 | the disk row of the preflight |\n", "", "min_free_gb: declared"),
        ("first miss to last", "first to last", "gone_after_seconds: the row is not"),
        ("| `shm_size` | `16g`", "| `shm_size` | `8g`", "shm_size: the row is not"),
        ("| `shm_size`", "| `shm_sizes`", "shm_size: declared"),
    ],
)
def test_a_deleted_or_drifted_row_is_named(old, new, problem):
    text = DOC.read_text(encoding="utf-8")
    assert old in text
    assert table_problems(text.replace(old, new), "## Settings", settings_table())[0].startswith(
        problem
    )


def test_the_launcher_error_is_a_user_error():
    assert issubclass(LauncherError, UserError)
    assert Settings.ERROR is RestartPolicy.ERROR is LauncherError


def _config(**section) -> Config:
    return Config(overrides={"clipforge": {**defaults(), **section}})


def test_settings_read_from_fabric_config_are_typed():
    """Env variables arrive as strings: `""` unsets a key whose default is null, a quoted
    number is a number, a YAML number given for a string key is its text."""
    settings = settings_from(_config(remote_root="", min_free_gb="5", shm_size=16, registry="r"))
    assert settings.remote_root is None and settings.min_free_gb == 5.0
    assert settings.shm_size == "16" and settings.registry == "r"
    assert settings == Settings(min_free_gb=5, shm_size="16", registry="r")
    assert settings.stack_outputs == Path("infra/stack-outputs.json")  # a path, from its text


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"min_free_gb": -1}, "clipforge.min_free_gb: got -1.0; must be >= 0"),
        ({"min_free_gb": "lots"}, "clipforge.min_free_gb: got 'lots'; must be a number >= 0"),
        ({"stop_timeout_seconds": 0}, "clipforge.stop_timeout_seconds: got 0.0; must be > 0"),
        (
            {"backoff_seconds": 60, "backoff_max_seconds": 30},
            "clipforge.backoff_seconds: got 60; must be <= clipforge.backoff_max_seconds (30)",
        ),
        ({"gone_after_misses": 1}, "clipforge.gone_after_misses: got 1; must be >= 2"),
    ],
)
def test_a_bad_setting_is_a_launcher_error_naming_its_key(section, message):
    with pytest.raises(LauncherError) as excinfo:
        settings_from(_config(**section))
    assert str(excinfo.value) == message


def test_the_restart_policy_checks_the_same_knobs_the_same_way():
    """The plan's policy (built from the settings and `fab train`'s options, read back on the
    host) applies the rule the settings and options do, with the same words."""
    policy = dict(
        max_restarts=5, backoff_seconds=60, backoff_max_seconds=30, stop_timeout_seconds=9
    )
    with pytest.raises(LauncherError) as from_policy:
        RestartPolicy(**policy)
    with pytest.raises(LauncherError) as from_settings:
        Settings(backoff_seconds=60, backoff_max_seconds=30)
    assert str(from_policy.value) == str(from_settings.value)
    bad = PhasePlan(phases=[], policy=RestartPolicy(**{**policy, "backoff_seconds": 1})).to_json()
    with pytest.raises(LauncherError, match="^--max-restarts: got -1; must be >= 0$"):
        PhasePlan.from_json(bad.replace('"max_restarts": 5', '"max_restarts": -1'))
    options = dict(gpus=1, nodes=1, sets=[], smoke=False, runtime="host", allow_dirty=False)
    with pytest.raises(LauncherError, match="^--max-restarts: got -1; must be >= 0$"):
        make_options(**options, data="build", max_restarts=-1)
    with pytest.raises(LauncherError, match="^--max-moves: got -1; must be >= 0$"):
        RecoveryRule(max_moves=-1)
