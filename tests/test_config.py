"""Params: loading (params.yaml, --set over it), recipes written into the file, and the errors users
see."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import yaml

from clipforge.config import SECTION_NAMES, load_params
from clipforge.data.config import DataParams
from clipforge.eval.config import EvalParams
from clipforge.fields import ConfigError
from clipforge.pipeline.params import PipelineParams, load_pipeline_params
from clipforge.pipeline.params_file import rewritten
from clipforge.pipeline.recipe import main as recipe_main
from clipforge.pipeline.recipe import recipe_params
from clipforge.recipes import RECIPES, RECIPES_DOC
from clipforge.train.config import TrainParams, batch_plan
from tests.conftest import REPO, subprocess_env, write_params
from tests.support.checkout import committed_text
from tests.support.memory import run_measured


def _error(tmp_path, params: dict, overrides=()) -> str:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    with pytest.raises(ConfigError) as excinfo:
        load_pipeline_params(path, list(overrides))
    return str(excinfo.value)


def test_committed_params_file_loads_as_the_embedded_default(tmp_path):
    """params.yaml in the repository is exactly the embedded default, so `make demo` runs it."""
    committed = tmp_path / "params.yaml"
    committed.write_text(committed_text(REPO, "params.yaml"), encoding="utf-8")
    assert load_pipeline_params(committed) == PipelineParams()


def test_params_yaml_is_every_knob_under_its_doc_as_the_writer_writes_it():
    """The committed params.yaml is what `python -m clipforge.pipeline.params_file` writes of its
    own values: every key of every section, each under its doc from the schema, and the recipes'
    gists in the header: the docs have one source."""
    committed = REPO / "params.yaml"
    assert committed.read_text(encoding="utf-8") == rewritten(committed)
    sections = yaml.safe_load(committed.read_text(encoding="utf-8"))
    assert {name: set(values) for name, values in sections.items()} == {
        name: {f.name for f in section.knobs()}
        for name, section in PipelineParams.sections().items()
    }


@pytest.mark.parametrize(
    "removed",
    [
        # a key whose name another section also has (train.keep_checkpoints, data.image_size)
        "  # Checkpoints kept in the store per run (older ones are deleted there).\n"
        "  keep_checkpoints: 2\n",
        "  # Override the model's input image size (null: the model's own).\n",
        "`production-large` (ViT-bigG-14, laion-parquet zh, ZeRO-3",
    ],
    ids=["a key", "a doc", "a recipe's gist"],
)
def test_a_deleted_key_doc_or_recipe_gist_is_caught(removed, tmp_path):
    """Deleting a knob (with its comment), only its comment, or a recipe's gist from the header
    makes the file differ from what the writer writes, whatever the section and however common
    the key's name."""
    text = (REPO / "params.yaml").read_text(encoding="utf-8")
    assert removed in text
    edited = tmp_path / "params.yaml"
    edited.write_text(text.replace(removed, "", 1))
    assert rewritten(edited) == text


def test_the_recipes_gist_is_read_off_the_recipes():
    """params.yaml's list of recipes names each recipe's ZeRO stage from the recipe itself, so
    it cannot say ZeRO-3 where the recipe runs ZeRO-1."""
    for name, recipe in RECIPES.items():
        expected = f"ZeRO-{recipe['train']['zero_stage']}" if recipe else "CPU"
        gist = RECIPES_DOC.split(f"`{name}` (", 1)[1].split(")")[0]
        assert expected in gist


def test_unknown_key_names_the_key_and_lists_the_allowed_ones(tmp_path):
    message = _error(tmp_path, {"train": {"learning_rate": 0.1}})
    assert "train.learning_rate: unknown key" in message and "lr" in message


def test_wrong_type_names_key_and_expected_type(tmp_path):
    message = _error(tmp_path, {"train": {"epochs": "three"}})
    assert message == "train.epochs: got 'three'; must be an integer >= 1"


def test_out_of_range_value_names_the_range(tmp_path):
    message = _error(tmp_path, {"train": {"zero_stage": 4}})
    assert message == "train.zero_stage: got 4; must be >= 0 and <= 3"


def test_choice_outside_the_allowed_values(tmp_path):
    message = _error(tmp_path, {"train": {"precision": "fp16"}})
    assert message == "train.precision: got 'fp16'; allowed: auto, bf16, fp32"


def test_a_baseline_architecture_needs_its_pretrained_weights(tmp_path):
    """eval.baseline_model naming an open_clip architecture without eval.baseline_pretrained
    would compare against random weights: refused, naming the key; a local-dir: model brings
    its own weights."""
    message = _error(tmp_path, {"eval": {"baseline_model": "ViT-B-32"}})
    assert message.startswith("eval.baseline_pretrained: required") and "ViT-B-32" in message
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"eval": {"baseline_model": "local-dir:models/base"}}))
    assert load_pipeline_params(path).eval.baseline_model == "local-dir:models/base"


def test_inconsistent_batch_names_every_factor(tmp_path):
    message = _error(
        tmp_path,
        {
            "train": {
                "global_batch_size": 4096,
                "micro_batch_size": 256,
                "grad_accum_steps": 2,
                "ranks_per_node": 4,
            }
        },
    )
    assert "train.global_batch_size: 4096 != train.micro_batch_size=256" in message
    assert "train.num_nodes=1 x train.ranks_per_node=4" in message
    assert "train.grad_accum_steps=2 = 2048" in message


def test_auto_accumulation_is_derived_from_the_other_factors():
    plan = batch_plan(
        load_pipeline_params(
            None,
            [
                "train.global_batch_size=4096",
                "train.micro_batch_size=256",
                "train.ranks_per_node=4",
            ],
        ).train
    )
    assert (plan.grad_accum_steps, plan.world_size) == (4, 4)


def test_set_overrides_are_yaml_like_dvc(tmp_path):
    """--set parses values as YAML: numbers in e-notation, null, booleans."""
    config = load_pipeline_params(None, ["train.lr=1e-4", "train.max_steps=null", "data.seed=7"])
    assert (config.train.lr, config.train.max_steps, config.data.seed) == (1e-4, None, 7)


def test_malformed_override_is_rejected():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_pipeline_params(None, ["train.lr"])


def test_the_production_recipe_written_into_params_yaml_is_what_runs(tmp_path, capsys):
    """`python -m clipforge.pipeline.recipe production` turns the embedded default into the
    reference ViT-B/32 run: the file then holds its values, each under its doc, and says which
    changed; writing `default` again gives the file back byte for byte."""
    path = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", path)
    assert recipe_main(["production", "--params", str(path)]) == 0
    assert "train.lr: 0.001 -> 0.0005" in capsys.readouterr().out
    config = load_pipeline_params(path)
    assert config == recipe_params("production")
    assert config.model.name == "ViT-B-32"
    assert (
        config.train.zero_stage,
        config.train.global_batch_size,
        config.train.lr,
        config.train.warmup_steps,
        config.train.precision,
    ) == (1, 4096, 5e-4, 500, "bf16")
    assert path.read_text(encoding="utf-8") == rewritten(path)
    assert recipe_main(["default", "--params", str(path)]) == 0
    assert path.read_text(encoding="utf-8") == (REPO / "params.yaml").read_text(encoding="utf-8")


@pytest.mark.parametrize("recipe", ["lit-zh", "finetune-zh", "distill-b32-from-b16"])
def test_an_open_weights_recipe_written_into_params_yaml_is_what_runs(tmp_path, recipe):
    """`python -m clipforge.pipeline.recipe lit-zh`, `... finetune-zh` and `...
    distill-b32-from-b16` (docs/real-data.md, docs/pipeline.md): the file then holds the
    recipe's values."""
    path = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", path)
    assert recipe_main([recipe, "--params", str(path)]) == 0
    assert load_pipeline_params(path) == recipe_params(recipe)


def test_a_recipe_keeps_the_keys_no_recipe_sets(tmp_path):
    """Writing a recipe decides what recipes decide (model, data, schedule...): the run store and
    the alerts keep the file's values."""
    path = write_params(tmp_path / "params.yaml", {"storage": {"remote": "s3://bucket/runs"}})
    assert recipe_main(["production", "--params", str(path)]) == 0
    assert load_pipeline_params(path).storage.remote == "s3://bucket/runs"


def test_a_value_in_params_yaml_runs_even_when_it_equals_a_default(tmp_path):
    """What params.yaml says is what trains: after the production recipe, `train.lr: 0.001`
    (the embedded default's value) trains at 0.001, and --set wins over the file."""
    path = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", path)
    assert recipe_main(["production", "--params", str(path)]) == 0
    values = yaml.safe_load(path.read_text(encoding="utf-8"))
    values["train"]["lr"] = 0.001
    path.write_text(yaml.safe_dump(values))
    assert load_pipeline_params(path).train.lr == 0.001
    assert load_params(TrainParams, path, ["train.lr=3e-4"]).train.lr == 3e-4


@pytest.mark.parametrize("where", ["params.yaml", "--set"])
def test_a_recipe_key_is_refused_naming_what_it_would_change_and_the_command(where, tmp_path):
    """`recipe: production` beside `train.lr: 0.001` (or `--set recipe=production`) is one
    refusal naming the conflict (the value given first) and the command that writes the recipe,
    not a silent choice between them."""
    path = tmp_path / "params.yaml"
    sets = []
    if where == "params.yaml":
        path.write_text("recipe: production\ntrain:\n  lr: 0.001\n")
    else:
        path.write_text("train:\n  lr: 0.001\n")
        sets = ["recipe=production"]
    with pytest.raises(ConfigError) as refused:
        load_params(TrainParams, path, sets)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("recipe: ")
    assert (
        "production would change 14 of this stage's values (train.lr: 0.001 here, 0.0005 in"
        in message
    )
    assert "`python -m clipforge.pipeline.recipe production`" in message


def test_stage_reports_config_error_with_exit_code_2_and_writes_nothing(tmp_path):
    """A bad --set fails fast, before heavy imports, and no output directory appears."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "clipforge.data",
            "--params",
            str(REPO / "params.yaml"),
            "--set",
            "data.num_train=-5",
            "--out",
            str(tmp_path / "data"),
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert result.returncode == 2
    assert "data.num_train: got -5; must be >= 1" in result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_pipeline_params_hold_every_section_once_in_the_files_order():
    """The sections every stage checks the names of are those of the whole pipeline, which `fab
    train` checks and params.yaml documents."""
    assert tuple(PipelineParams.sections()) == SECTION_NAMES


def test_a_stage_loads_only_the_sections_it_reads(tmp_path):
    """A bad train value is no error for the data stage's params, which hold its section alone;
    the train stage's fail on it, naming the key."""
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"train": {"lr": -1.0}, "data": {"seed": 3}}))
    config = load_params(DataParams, path)
    assert config.data.seed == 3 and not hasattr(config, "train")
    assert "train" not in config.to_dict() and "lr" not in config.to_yaml()
    with pytest.raises(ConfigError, match=r"^train\.lr: got -1\.0; must be > 0\.0$"):
        load_params(TrainParams, path)


def test_a_typo_stops_the_stages_that_read_its_section_and_broken_yaml_every_stage(tmp_path):
    """A stage checks the keys of its own sections (and every section's name): a typo in train
    stops the train stage and `fab train`, which checks every section, not the eval stage, whose
    params cannot depend on train's code. YAML that does not parse stops every stage."""
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"train": {"learning_rate": 0.1}}))
    assert load_params(EvalParams, path).eval.batch_size == 256
    for params in (TrainParams, PipelineParams):
        with pytest.raises(ConfigError, match="train.learning_rate: unknown key"):
            load_params(params, path)
    path.write_text(yaml.safe_dump({"trian": {"lr": 0.1}}))
    with pytest.raises(ConfigError, match="unknown top-level key 'trian'"):
        load_params(EvalParams, path)
    path.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match=r"params\.yaml:2:1: expected ',' or ']'"):
        load_params(EvalParams, path)


def test_bad_train_value_stops_the_train_stage_but_not_the_data_stage(tmp_path, capsys):
    """`dvc repro data` runs with a broken train.lr; `python -m clipforge.train` stops on it with
    one line and exit code 2, before writing anything."""
    from clipforge.data.stage import main as data_main
    from clipforge.train.stage import main as train_main

    params = write_params(tmp_path / "params.yaml", {"train": {"lr": -1.0}})
    assert data_main(["--params", str(params), "--out", str(tmp_path / "data")]) == 0
    assert "lr" not in (tmp_path / "data" / "config.yaml").read_text()
    capsys.readouterr()
    code = train_main(
        [
            "--params",
            str(params),
            "--data",
            str(tmp_path / "data"),
            "--checkpoints",
            str(tmp_path / "checkpoints"),
        ]
    )
    assert code == 2
    assert capsys.readouterr().err == "clipforge.train: error: train.lr: got -1.0; must be > 0.0\n"
    assert not (tmp_path / "checkpoints").exists()


def test_auto_micro_batch_is_each_ranks_share_of_the_global_batch():
    """The global batch holds whatever the world size: `auto` divides it among the ranks (and
    among an explicit accumulation), so the default params run on 1 or 4 ranks alike."""
    for ranks, accum, micro in ((1, "auto", 128), (4, "auto", 32), (4, 2, 16)):
        train = load_pipeline_params(
            None, [f"train.ranks_per_node={ranks}", f"train.grad_accum_steps={accum}"]
        ).train
        plan = batch_plan(train)
        assert (plan.micro_batch_size, plan.world_size) == (micro, ranks)
        assert plan.micro_batch_size * plan.grad_accum_steps * ranks == 128


def test_a_probed_micro_batch_sets_the_accumulation():
    """A memory probe's choice for `auto` is used as the micro batch; accumulation follows."""
    train = load_pipeline_params(
        None, ["train.global_batch_size=4096", "train.ranks_per_node=4"]
    ).train
    plan = batch_plan(train, micro_batch_size=256)
    assert (plan.micro_batch_size, plan.grad_accum_steps) == (256, 4)


def test_a_global_batch_the_ranks_cannot_share_names_every_factor(tmp_path):
    message = _error(tmp_path, {"train": {"global_batch_size": 130, "ranks_per_node": 4}})
    assert message == (
        "train.global_batch_size: 130 is not a multiple of world size 4 (train.num_nodes=1 x "
        "train.ranks_per_node=4); choose a global batch that is"
    )


# -- params that gave tracebacks: one line, exit 2, nothing run ------------------------------
@pytest.mark.parametrize(
    ("params_text", "sets", "said"),
    [
        (
            "data: {}\n",
            ["recipe=[a]"],
            "recipe: --set recipe is ['a'], but params.yaml is what runs",
        ),
        ("1: a\nfoo: b\n", [], "params: key 1 is not a name"),
        ("train:\n  1: a\n  lr: 0.1\n", [], "train: key 1 is not a name"),
        ("train: false\n", [], "train: must be a mapping of keys, got False"),
        ("train: []\n", [], "train: must be a mapping of keys, got []"),
    ],
)
def test_params_of_the_wrong_shape_are_one_line(tmp_path, capsys, params_text, sets, said):
    """Each ends the stage with exit 2 and one error line naming the key (they gave a TypeError
    traceback, or were taken as an empty section)."""
    from clipforge.train.stage import main

    (tmp_path / "params.yaml").write_text(params_text)
    argv = ["--params", str(tmp_path / "params.yaml"), "--print-config"]
    assert main([*argv, *[a for s in sets for a in ("--set", s)]]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"clipforge.train: error: {said}")


def test_a_store_that_cannot_be_opened_is_one_line_before_any_training(
    tmp_path, small_data, capsys
):
    """storage.remote=ftp://x (a protocol that connects when opened, to no such host): exit 2,
    one line naming it, before the training stack is imported; nothing written."""
    from clipforge.train.stage import main
    from tests.conftest import train_argv

    params = write_params(tmp_path / "params.yaml")
    argv = [*train_argv(tmp_path, small_data, params), "--set", "storage.remote=ftp://x"]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("clipforge.train: error: storage.remote ftp://x: cannot be opened (")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


def test_a_warm_up_longer_than_the_run_says_the_peak_it_reaches(tmp_path, small_data, caplog):
    """train.warmup_steps=100 on a 4-step run: one warning with the peak lr (4/100 of train.lr),
    before the training stack is imported."""
    from clipforge.pipeline.params import load_pipeline_params
    from clipforge.train.stage import _check_warmup

    config = load_pipeline_params(
        write_params(tmp_path / "params.yaml"), ["train.warmup_steps=100", "train.lr=1e-3"]
    )
    _check_warmup(config, 4)
    (record,) = caplog.records
    assert record.getMessage() == (
        "train.warmup_steps=100 is longer than the run's 4 steps: the learning rate peaks at "
        "4e-05, not train.lr=0.001; lower train.warmup_steps to train at train.lr"
    )
    caplog.clear()
    _check_warmup(config, 100)
    assert caplog.records == []


# -- values that gave tracebacks, memory blow-ups or a late refusal: one line, with the params ---
def test_every_seed_is_checked_against_torchs_range_with_the_params(tmp_path, capsys):
    """train.seed=2**64 failed in torch.manual_seed after the whole start-up: now the train stage
    stops before reading anything else (its data folder here does not exist); 2**64 - 1 is
    torch's largest and is taken, for data.seed too."""
    from clipforge.train.stage import main

    params = write_params(tmp_path / "params.yaml")
    code = main(
        ["--params", str(params), "--data", str(tmp_path / "none"), "--set", f"train.seed={2**64}"]
    )
    assert code == 2
    assert capsys.readouterr().err == (
        "clipforge.train: error: train.seed: got 18446744073709551616; must be >= 0 and "
        "<= 18446744073709551615\n"
    )
    assert load_pipeline_params(params, [f"train.seed={2**64 - 1}", f"data.seed={2**64 - 1}"])
    with pytest.raises(ConfigError, match=r"^data\.seed: got 18446744073709551616; must be"):
        load_pipeline_params(params, [f"data.seed={2**64}"])


_IMPORTED = "import sys; print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))"


def _train_stage_until_refused(argv: list[str]) -> subprocess.CompletedProcess:
    """The train stage in a process of its own; stdout: which of torch and DeepSpeed it had
    imported when it returned."""
    program = f"from clipforge.train.stage import main; code = main({argv!r}); {_IMPORTED}"
    program += "; sys.exit(code)"
    return subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )


def test_a_typo_in_the_model_name_is_refused_with_the_params_naming_the_closest(tmp_path):
    """model.name was checked after DeepSpeed's start-up (243 s): now with the params, before
    torch is imported, against open_clip's config files and clipforge's bundled ones."""
    params = write_params(tmp_path / "params.yaml")
    argv = ["--params", str(params), "--set", "model.name=ViT-B-23", "--data", str(tmp_path)]
    result = _train_stage_until_refused(argv)
    assert result.returncode == 2 and result.stdout == "[]\n"
    (line,) = result.stderr.splitlines()
    assert line.startswith(
        "clipforge.train: error: model.name: unknown model 'ViT-B-23'; did you mean ViT-B-32"
    )
    for typo, meant in (("clipforge-tni", "clipforge-tiny"), ("vit-b-32", "ViT-B-32")):
        with pytest.raises(ConfigError, match=f"did you mean {meant}"):
            load_pipeline_params(params, [f"model.name={typo}"])
    with pytest.raises(ConfigError, match="^data.pretokenize_model: unknown model 'ViT-B32'"):
        load_pipeline_params(params, ["data.pretokenize_model=ViT-B32"])


def test_a_text_tower_that_is_not_there_is_refused_before_the_training_stack(tmp_path, small_data):
    params = write_params(tmp_path / "params.yaml")
    tower = tmp_path / "no-such-tower"
    argv = [
        "--params",
        str(params),
        "--data",
        str(small_data),
        "--set",
        f"model.text_tower={tower}",
    ]
    result = _train_stage_until_refused(argv)
    assert result.returncode == 2 and "deepspeed" not in result.stdout
    assert result.stderr.splitlines() == [
        f"clipforge.train: error: model.text_tower: folder {tower} not found"
    ]


LONG_NAME = "名" * 100  # 300 bytes of UTF-8: one more than a file system takes is enough


@pytest.mark.parametrize(
    "stage, argv, said",
    [
        ("data", ["--set", f"data.path=/tmp/{LONG_NAME}/pairs.csv"], "data.path: the name '名名"),
        (
            "eval",
            ["--set", f"eval.suites=[{{name: a, kind: retrieval, path: data/{LONG_NAME}}}]"],
            "eval.suites[0].path: the name '名名",
        ),
        ("eval", ["--set", f"eval.baseline_model=local-dir:{LONG_NAME}"], "eval.baseline_model"),
        ("eval", ["--out", f"metrics/{LONG_NAME}.json"], "argument --out: the name '名名"),
        ("train", ["--checkpoints", LONG_NAME], "argument --checkpoints: the name '名名"),
    ],
)
def test_a_path_with_a_name_over_255_bytes_is_one_line_before_any_work(
    tmp_path, capsys, stage, argv, said
):
    """`OSError: File name too long` came from deep inside a stage (eval/suites.py, data.path):
    every path knob and path option is held to the file systems' 255 bytes a name, with the
    params or by the argument parser, one line and exit 2."""
    import importlib

    main = importlib.import_module(f"clipforge.{stage}.stage").main
    params = write_params(tmp_path / "params.yaml")
    try:
        code = main(["--params", str(params), *argv])
    except SystemExit as exc:  # the argument parser's refusals end the process
        code = exc.code
    assert code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith(f"clipforge.{stage}: error: {said}")
    assert "bytes long; file systems take names of at most 255 bytes" in lines[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


def test_an_alias_bomb_on_set_is_one_line_in_bounded_memory():
    """Nine lists of nine aliases (300 characters) expand to 490 million values; PyYAML shares
    them, but the error message's repr expanded them until MemoryError. Refused by the loader, in
    the memory of any --print-config (the limit keeps a regression from taking the machine's)."""
    bomb = "[&a [x,x,x,x,x,x,x,x,x]"
    for this, alias in zip("bcdefghi", "abcdefgh"):
        bomb += f", &{this} [" + ",".join([f"*{alias}"] * 9) + "]"
    bomb += "]"
    argv = [
        sys.executable,
        "-m",
        "clipforge.data",
        "--print-config",
        "--set",
        f"data.test_dir={bomb}",
    ]
    result, peak = run_measured(
        argv, max_address_space=4 * 2**30, env=subprocess_env(), timeout=120
    )
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("clipforge.data: error: --set 'data.test_dir=[&a [x,x,x,x,x,x,x,x,x], ")
    assert line.endswith(
        "value is not valid YAML (aliases (*name) expand to 597,871 values, over the 100,000 "
        "read: write the values out)"
    )
    assert peak < 500 * 2**20, f"peak resident set {peak / 2**20:.0f} MiB"


def test_aliases_in_the_params_file_are_expanded_within_the_budget(tmp_path):
    """A params file may share a value with an alias; one that expands past 100,000 values, or
    into itself, is its file, line and column."""
    path = tmp_path / "params.yaml"
    path.write_text("data:\n  paths: &p [a.tar, b.tar]\neval: {}\n")
    assert load_pipeline_params(path).data.paths == ["a.tar", "b.tar"]
    lists = "".join(f"  - &l{n} [" + ", ".join([f"*l{n - 1}"] * 10) + "]\n" for n in range(1, 6))
    path.write_text("x:\n  - &l0 [a]\n" + lists)
    with pytest.raises(
        ConfigError, match=r"params\.yaml:7:5: aliases \(\*name\) expand to 211,111 "
    ):
        load_pipeline_params(path)
    path.write_text("data:\n  paths: &p [*p]\n")
    with pytest.raises(
        ConfigError, match=r"params\.yaml:2:10: an alias \(\*name\) inside its own anchor"
    ):
        load_pipeline_params(path)


def test_a_value_is_quoted_in_at_most_200_characters(tmp_path):
    """A megabyte string gave a megabyte "one line"; a nested list, its whole repr. (A megabyte,
    not more: PyYAML reads about half a megabyte a second here.)"""
    message = _error(tmp_path, {"data": {"source": "x" * 1_000_000}})
    assert message.startswith("data.source: got 'xxx") and len(message) < 300
    assert message.endswith("xxx'; allowed: builtin, local, laion-parquet, webdataset, mixture")
    message = _error(
        tmp_path, {"data": {"paths": [[[f"{i}-{j}" for j in range(40)] for i in range(40)]]}}
    )
    assert message.startswith("data.paths[0]: got [[") and len(message) < 300
