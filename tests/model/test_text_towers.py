"""Where Hugging Face text towers come from, and the error when one cannot be had offline."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from clipforge.model.text_towers import resolve_tower
from clipforge.pipeline.params import load_pipeline_params
from clipforge.pipeline.recipe import recipe_params
from tests.conftest import subprocess_env

# transformers reads HF_HUB_OFFLINE when imported, so the probes run in a fresh interpreter
# with an empty cache: exactly a GPU host without network that never downloaded the towers.
OFFLINE_PROBE = r"""
import json, sys
from clipforge.pipeline.recipe import recipe_params
from clipforge.model.names import resolve_model_name
errors = {}
for recipe in sys.argv[1:]:
    try:
        resolve_model_name(recipe_params(recipe).model)
        errors[recipe] = None
    except ValueError as exc:
        errors[recipe] = str(exc)
print(json.dumps(errors))
"""


@pytest.fixture(scope="module")
def offline_errors(tmp_path_factory) -> dict:
    home = tmp_path_factory.mktemp("hf-home")
    env = subprocess_env() | {"HF_HUB_OFFLINE": "1", "HF_HOME": str(home)}
    env.pop("HF_HUB_CACHE", None)
    result = subprocess.run(
        [sys.executable, "-c", OFFLINE_PROBE, "production-zh-roberta", "production-xlm-roberta"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return {"home": str(home), **json.loads(result.stdout.strip().splitlines()[-1])}


def test_offline_uncached_hub_tower_names_the_key_and_the_remedy(offline_errors):
    """model.text_tower=hfl/chinese-roberta-wwm-ext offline with an empty cache: one clear
    message naming the key, the model, the cache and how to fix it."""
    error = offline_errors["production-zh-roberta"]
    assert error.startswith(
        "model.text_tower: Hugging Face model 'hfl/chinese-roberta-wwm-ext' "
        "is not in the local cache"
    )
    assert "HF_HUB_OFFLINE is set" in error and "hf download hfl/chinese-roberta-wwm-ext" in error
    assert offline_errors["home"] in error


def test_offline_xlm_roberta_preset_names_model_name(offline_errors):
    """The xlm-roberta preset's tower comes from open_clip's config: the error names model.name."""
    assert offline_errors["production-xlm-roberta"].startswith(
        "model.name: Hugging Face model 'xlm-roberta-base' is not in the local cache"
    )


def test_local_folder_without_config_is_refused(tmp_path):
    """A folder that is not a Hugging Face model folder is named in the error."""
    (tmp_path / "tower").mkdir()
    with pytest.raises(ValueError, match=r"model.text_tower: .*tower has no config.json"):
        resolve_tower(str(tmp_path / "tower"), "model.text_tower")


def test_relative_local_folder_is_made_absolute(tmp_path, monkeypatch):
    """A local tower is recorded by absolute path, so the exported config finds it from anywhere."""
    (tmp_path / "tower").mkdir()
    (tmp_path / "tower" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_tower("./tower", "model.text_tower") == str(tmp_path / "tower")


def test_chinese_tower_recipes_change_only_the_model():
    """production-zh-roberta / production-xlm-roberta are production with another text tower
    (and the data stage's stored token ids made by that tower's tokenizer)."""
    base = recipe_params("production")
    roberta = recipe_params("production-zh-roberta")
    xlmr = recipe_params("production-xlm-roberta")
    assert (roberta.model.name, roberta.model.text_tower) == (
        "ViT-B-32",
        "hfl/chinese-roberta-wwm-ext",
    )
    assert (xlmr.model.name, xlmr.model.text_tower) == ("xlm-roberta-base-ViT-B-32", None)
    for derived in (roberta, xlmr):
        tokens = (derived.data.pretokenize_model, derived.data.pretokenize_text_tower)
        assert tokens == (derived.model.name, derived.model.text_tower)
        same = dataclasses.replace(
            derived.data,
            pretokenize_model=base.data.pretokenize_model,
            pretokenize_text_tower=base.data.pretokenize_text_tower,
        )
        assert same == base.data and derived.train == base.train


def test_derived_model_config_is_registered_and_leaves_no_temp_files(tmp_path, monkeypatch):
    """A text tower derives a new open_clip config; open_clip keeps it, no temp folder stays."""
    import tempfile

    import open_clip

    from clipforge.model.names import resolve_model_name

    (tmp_path / "tower").mkdir()
    (tmp_path / "tower" / "config.json").write_text("{}")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    cfg = load_pipeline_params(
        None, ["model.name=clipforge-tiny", f"model.text_tower={tmp_path / 'tower'}"]
    )
    name = resolve_model_name(cfg.model)
    assert open_clip.get_model_config(name)["text_cfg"]["hf_model_name"] == str(tmp_path / "tower")
    assert list(scratch.iterdir()) == []
