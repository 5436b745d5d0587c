"""Params: loading, layering (recipe, params.yaml, --set) and the errors users see."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import yaml

from clipforge.config import Config, ConfigError, batch_plan, field_docs, load_config
from clipforge.recipes import RECIPES
from tests.conftest import REPO, subprocess_env, write_params
from tests.support.checkout import committed_text
from tests.support.memory import run_measured


def _error(tmp_path, params: dict, overrides=()) -> str:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    with pytest.raises(ConfigError) as excinfo:
        load_config(path, list(overrides))
    return str(excinfo.value)


def test_committed_params_file_loads_as_the_embedded_default(tmp_path):
    """params.yaml in the repository is exactly the embedded default, so `make demo` runs it."""
    committed = tmp_path / "params.yaml"
    committed.write_text(committed_text(REPO, "params.yaml"), encoding="utf-8")
    assert load_config(committed) == Config()


def _params_docs():
    """scripts/params_section.py, the writer and checker of params.yaml's knob docs."""
    spec = importlib.util.spec_from_file_location(
        "params_section", REPO / "scripts" / "params_section.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_knob_is_in_params_yaml_under_its_doc():
    """Each key of the typed config appears in its own section of params.yaml, with its doc in
    the schema (fields, recipes) as the comment right above it: the docs have one source."""
    text = (REPO / "params.yaml").read_text(encoding="utf-8")
    assert _params_docs().doc_problems(text) == []
    sections = {
        name: set(values) for name, values in yaml.safe_load(text).items() if name != "recipe"
    }
    assert sections == {
        name: {key.split(".", 1)[1] for key in field_docs() if key.startswith(f"{name}.")}
        for name in sections
    }


@pytest.mark.parametrize(
    ("removed", "problem"),
    [
        # a key whose name another section also has (train.keep_checkpoints, data.image_size)
        (
            "  # Checkpoints kept in the store per run (older ones are deleted there).\n"
            "  keep_checkpoints: 2\n",
            "storage.keep_checkpoints: missing from params.yaml",
        ),
        (
            "  # Override the model's input image size (null: the model's own).\n",
            "model.image_size: the comment above it is not its doc",
        ),
        ("`production` (ViT-B-32, laion-parquet zh, ZeRO-1", "recipe: the comment above it"),
    ],
)
def test_the_doc_check_catches_a_deleted_key_or_doc_in_any_section(removed, problem):
    """Deleting a knob (with its comment), only its comment, or a recipe's line of the `recipe`
    doc is caught, whatever the section and however common the key's name."""
    text = (REPO / "params.yaml").read_text(encoding="utf-8")
    assert removed in text
    problems = _params_docs().doc_problems(text.replace(removed, "", 1))
    assert len(problems) == 1 and problems[0].startswith(problem)


def test_the_recipe_doc_is_read_off_the_recipes():
    """The `recipe` knob's doc names each recipe's ZeRO stage from the recipe itself, so it
    cannot say ZeRO-3 where the recipe runs ZeRO-1."""
    doc = field_docs()["recipe"]
    for name, recipe in RECIPES.items():
        expected = f"ZeRO-{recipe['train']['zero_stage']}" if recipe else "CPU"
        assert f"`{name}` (" in doc and expected in doc.split(f"`{name}` (", 1)[1].split(")")[0]


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
    assert load_config(path).eval.baseline_model == "local-dir:models/base"


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
        load_config(
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
    config = load_config(None, ["train.lr=1e-4", "train.max_steps=null", "data.seed=7"])
    assert (config.train.lr, config.train.max_steps, config.data.seed) == (1e-4, None, 7)


def test_malformed_override_is_rejected():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["train.lr"])


def test_production_recipe_is_one_switch():
    """recipe: production turns the embedded default into the reference ViT-B/32 run."""
    config = load_config(None, ["recipe=production"])
    assert config.model.name == "ViT-B-32"
    assert (
        config.train.zero_stage,
        config.train.global_batch_size,
        config.train.lr,
        config.train.warmup_steps,
        config.train.precision,
    ) == (1, 4096, 5e-4, 500, "bf16")


def test_user_choice_in_params_wins_over_the_recipe(tmp_path):
    """Under a recipe, a key the user changed in params.yaml keeps the user's value."""
    path = tmp_path / "params.yaml"
    path.write_text(
        yaml.safe_dump({"recipe": "production", "train": {"lr": 1e-4, "max_steps": None}})
    )
    config = load_config(path)
    assert config.train.lr == 1e-4  # changed from the embedded default: the user's
    assert config.train.max_steps == 42_000  # still the embedded default: the recipe's
    assert load_config(path, ["train.max_steps=null"]).train.max_steps is None  # --set wins


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


TRAIN_STAGE_SECTIONS = ("model", "train", "alerts", "storage")


def test_a_stage_loads_only_the_sections_it_reads(tmp_path):
    """A bad train value is no error for a loader of the data section; the train stage's sections
    fail on it, naming the key."""
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"train": {"lr": -1.0}, "data": {"seed": 3}}))
    config = load_config(path, sections=("data",))
    assert config.data.seed == 3 and config.train is None
    assert "train" not in config.to_dict() and "lr" not in config.to_yaml()
    with pytest.raises(ConfigError, match=r"^train\.lr: got -1\.0; must be > 0\.0$"):
        load_config(path, sections=TRAIN_STAGE_SECTIONS)


def test_unknown_keys_and_broken_yaml_stop_every_stage(tmp_path):
    """A typo in a section a stage does not read still stops it: the check is shared."""
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"train": {"learning_rate": 0.1}}))
    with pytest.raises(ConfigError, match="train.learning_rate: unknown key"):
        load_config(path, sections=("eval",))
    path.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match=r"params\.yaml:2:1: expected ',' or ']'"):
        load_config(path, sections=("eval",))


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
        train = load_config(
            None, [f"train.ranks_per_node={ranks}", f"train.grad_accum_steps={accum}"]
        ).train
        plan = batch_plan(train)
        assert (plan.micro_batch_size, plan.world_size) == (micro, ranks)
        assert plan.micro_batch_size * plan.grad_accum_steps * ranks == 128


def test_a_probed_micro_batch_sets_the_accumulation():
    """A memory probe's choice for `auto` is used as the micro batch; accumulation follows."""
    train = load_config(None, ["train.global_batch_size=4096", "train.ranks_per_node=4"]).train
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
        ("recipe: default\n", ["recipe=[a]"], "recipe: got ['a']; must be the name of a recipe"),
        ("1: a\nfoo: b\n", [], "params: key 1 is not a name"),
        ("recipe: default\ntrain:\n  1: a\n  lr: 0.1\n", [], "train: key 1 is not a name"),
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
    from clipforge.config import load_config
    from clipforge.train.stage import _check_warmup

    config = load_config(
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
    assert load_config(params, [f"train.seed={2**64 - 1}", f"data.seed={2**64 - 1}"])
    with pytest.raises(ConfigError, match=r"^data\.seed: got 18446744073709551616; must be"):
        load_config(params, [f"data.seed={2**64}"])


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
            load_config(params, [f"model.name={typo}"])
    with pytest.raises(ConfigError, match="^data.pretokenize_model: unknown model 'ViT-B32'"):
        load_config(params, ["data.pretokenize_model=ViT-B32"])


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
    path.write_text("recipe: default\ndata:\n  paths: &p [a.tar, b.tar]\neval: {}\n")
    assert load_config(path).data.paths == ["a.tar", "b.tar"]
    lists = "".join(f"  - &l{n} [" + ", ".join([f"*l{n - 1}"] * 10) + "]\n" for n in range(1, 6))
    path.write_text("recipe: default\nx:\n  - &l0 [a]\n" + lists)
    with pytest.raises(
        ConfigError, match=r"params\.yaml:8:5: aliases \(\*name\) expand to 211,111 "
    ):
        load_config(path)
    path.write_text("recipe: default\ndata:\n  paths: &p [*p]\n")
    with pytest.raises(
        ConfigError, match=r"params\.yaml:3:10: an alias \(\*name\) inside its own anchor"
    ):
        load_config(path)


def test_a_value_is_quoted_in_at_most_200_characters(tmp_path):
    """A 10 MB string gave a 10 MB "one line"; a nested list, its whole repr."""
    message = _error(tmp_path, {"data": {"source": "x" * 10_000_000}})
    assert message.startswith("data.source: got 'xxx") and len(message) < 300
    assert message.endswith("xxx'; allowed: builtin, local, laion-parquet, webdataset")
    message = _error(
        tmp_path, {"data": {"paths": [[[f"{i}-{j}" for j in range(40)] for i in range(40)]]}}
    )
    assert message.startswith("data.paths[0]: got [[") and len(message) < 300
