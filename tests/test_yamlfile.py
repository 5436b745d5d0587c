"""A params file that cannot be what the user meant stops every stage with one line naming it:
exit code 2, nothing written or changed."""

from __future__ import annotations

import shutil

import pytest

from clipforge.data.stage import main as data_main
from clipforge.eval.stage import main as eval_main
from clipforge.train.stage import main as train_main
from clipforge.yamlfile import read_yaml_file
from tests.conftest import train_argv, write_params

BAD_FILES = {
    "empty": (
        b"",
        "{path}: sets no parameters; write the defaults into it with `python -m clipforge.pipeline.recipe default`",
    ),
    "whitespace only": (
        b"  \n\t\n\n",
        "{path}: sets no parameters; write the defaults into it with `python -m clipforge.pipeline.recipe default`",
    ),
    "comments only": (
        b"# data:\n#   seed: 3\n",
        "{path}: sets no parameters; write the defaults into it with `python -m clipforge.pipeline.recipe default`",
    ),
    "an empty mapping": (
        b"{}\n",
        "{path}: sets no parameters; write the defaults into it with `python -m clipforge.pipeline.recipe default`",
    ),
    "a mis-indented section": (
        b"data:\n  seed: 3\n train:\n  lr: 1e-4\n",
        "{path}:3:2: expected <block end>, but found '<block mapping start>' (while parsing a "
        "block mapping on line 1)",
    ),
    "a mis-indented key": (
        b"data:\n  seed: 3\ntrain:\n lr: 1\n  epochs: 2\n",
        "{path}:5:9: mapping values are not allowed here",
    ),
    "an unclosed list": (
        b"data:\n  paths: [a.parquet, b.parquet\ntrain:\n  lr: 1e-4\n",
        "{path}:3:6: expected ',' or ']', but got ':' (while parsing a flow sequence on line 2)",
    ),
    "a section given twice": (
        b"train:\n  lr: 1e-4\ndata:\n  seed: 1\ntrain:\n  epochs: 3\n",
        "{path}:5:1: key 'train' appears twice in one mapping (first on line 1)",
    ),
    "a key given twice": (
        b"train:\n  lr: 1e-4\n  lr: 5e-4\n",
        "{path}:3:3: key 'lr' appears twice in one mapping (first on line 2)",
    ),
    "bytes that are not UTF-8": (
        b"data:\n  path: caf\xe9.csv\n",
        "{path}:2:12: not UTF-8 text (byte 0xe9); save the file as UTF-8",
    ),
    "a list instead of sections": (
        b"- train\n- data\n",
        "{path}: must be a mapping of sections (data, model, train, eval, alerts, storage), got a list",
    ),
}


def _stage_argv(stage: str, root, params) -> tuple:
    if stage == "data":
        return data_main, ["--params", str(params), "--out", str(root / "data")]
    if stage == "train":
        return train_main, train_argv(root, root / "data", params)
    model = "local-dir:" + str(root / "models" / "clip")
    return eval_main, [
        *("--params", str(params), "--model", model, "--data", str(root / "data" / "test")),
        *("--out", str(root / "metrics" / "eval.json")),
    ]


def _snapshot(root) -> dict:
    return {
        p.relative_to(root): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize("stage", ["data", "train", "eval"])
@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_params_file_stops_every_stage_with_one_line(
    case, stage, tmp_path, small_data, capsys
):
    """An empty params.yaml ran the whole pipeline on the embedded defaults, rewriting data/; a
    YAML error printed eight lines. Now: exit 2, `FILE[:LINE:COLUMN]: reason`, data/ untouched."""
    content, expected = BAD_FILES[case]
    shutil.copytree(small_data, tmp_path / "data")
    params = tmp_path / "params.yaml"
    params.write_bytes(content)
    before = _snapshot(tmp_path)
    main, argv = _stage_argv(stage, tmp_path, params)
    assert main(argv) == 2
    assert capsys.readouterr().err == f"clipforge.{stage}: error: {expected.format(path=params)}\n"
    assert _snapshot(tmp_path) == before


def test_a_params_file_that_sets_one_key_still_runs_on_the_defaults(tmp_path):
    """A file that sets one key is a deliberate choice of the defaults for the rest, not an
    empty file."""
    (tmp_path / "params.yaml").write_text("data:\n  seed: 0\n")
    assert (
        data_main(
            [
                "--params",
                str(tmp_path / "params.yaml"),
                "--set",
                "data.num_train=8",
                "--set",
                "data.num_val=2",
                "--set",
                "data.num_test_images=10",
                "--set",
                "data.image_size=32",
                "--out",
                str(tmp_path / "data"),
            ]
        )
        == 0
    )


def test_yaml_errors_name_the_file_line_and_column_wherever_a_yaml_file_is_read(tmp_path):
    """The same reader serves params, Pulumi stack files and fabric.yaml."""
    path = write_params(tmp_path / "params.yaml")
    assert read_yaml_file(path)["train"]["device"] == "cpu"
    path.write_text("a: 1\nb: [2\n")
    with pytest.raises(ValueError, match=r"^.*params\.yaml:3:1: expected ',' or ']'"):
        read_yaml_file(path)
