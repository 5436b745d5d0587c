"""data.source: mixture: each source prepared as it would be alone into its own folders, every one
checked against the one test set, the manifest recording each source's name, pairs and share;
bad mixtures refused in one line naming the key."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from clipforge.data import testset
from clipforge.data.config import DataConfig
from clipforge.data.splits import split_of_identity
from clipforge.data.stage import main
from clipforge.fields import ConfigError
from clipforge.train.loader import split_files
from tests.conftest import REPO
from tests.data.test_inplace_source import TEST_SEEDS, make_planted_shard
from tests.support.shards import textured_jpeg, write_tar

SEED = 0


def _local_folder(root: Path, count: int, planted: dict[str, bytes] | None = None) -> Path:
    """A folder of images with same-named .txt captions (`自己 <name>`), and `planted` ones."""
    root.mkdir()
    images = {f"own-{n:03d}": textured_jpeg(1000 + n) for n in range(count)}
    for name, jpeg in {**images, **(planted or {})}.items():
        (root / f"{name}.jpg").write_bytes(jpeg)
        (root / f"{name}.txt").write_text(f"自己 {name}", encoding="utf-8")
    return root


def _run(tmp_path: Path, data: dict) -> tuple[Path, dict]:
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"data": data}), encoding="utf-8")
    out = tmp_path / "data"
    assert main(["--params", str(tmp_path / "params.yaml"), "--out", str(out)]) == 0
    return out, json.loads((out / "manifest.json").read_text(encoding="utf-8"))


def _captions(data: Path, split: str) -> list[str]:
    """Every caption of a split, read as the train loader reads it."""
    files = split_files(data, split)
    reader = files.reader()
    return [
        reader.read(shard, index)["txt"].decode()
        for shard, count in enumerate(files.counts)
        for index in range(count)
    ]


@pytest.mark.parametrize("in_place", [False, True], ids=["copied", "in place"])
def test_a_mixture_checks_every_source_against_a_given_test_set(tmp_path, in_place):
    """A webdataset source (copied, or used in place) holding three test images (a copy, a
    re-encoding, a resize) and a local folder holding a fourth: all four found and dropped, each
    in its own source's record; each source's shards in its own folders, read through one
    reader; the manifest gives each source's pairs and share."""
    tests = [(i, textured_jpeg(seed), [f"测试 {i}"]) for i, seed in enumerate(TEST_SEEDS)]
    testset.write_test_set(tmp_path / "flickr", tests)
    (tmp_path / "shards").mkdir()
    make_planted_shard(tmp_path / "shards" / "shard-0000.tar")  # 20 clean pairs + 3 planted
    own = _local_folder(tmp_path / "own", 12, planted={"leak": textured_jpeg(TEST_SEEDS[3])})
    data, manifest = _run(
        tmp_path,
        {
            "source": "mixture",
            "mixture": [
                {
                    "name": "laion-zh",
                    "source": "webdataset",
                    "paths": [f"{tmp_path}/shards/*.tar"],
                    "weight": 3,
                },
                {"name": "own", "source": "local", "path": str(own), "weight": 1},
            ],
            "in_place": in_place,
            "test_dir": str(tmp_path / "flickr"),
            "val_fraction": 0.0,
        },
    )
    record = manifest["decontamination"]
    assert record["checked"] and record["dropped"] == 4
    assert record["found"]["total"] == 4
    by_source = record["sources"]
    # the local source re-encodes what it reads: its copy of a test image is a near match
    assert by_source["laion-zh"]["found"]["total"] == 3 and by_source["own"]["found"]["total"] == 1
    captions = _captions(data, "train")
    assert not [c for c in captions if c.startswith("照片 p-") or c == "自己 leak"]
    assert len([c for c in captions if c.startswith("照片 q-")]) == 20
    assert len([c for c in captions if c.startswith("自己 own-")]) == 12

    train = manifest["splits"]["train"]
    assert train["count"] == 32 == len(captions)
    assert [(p["name"], p["count"], p["weight"], p["share"]) for p in train["mixture"]] == [
        ("laion-zh", 20, 3.0, 0.75),
        ("own", 12, 1.0, 0.25),
    ]
    names = [s["name"] for s in train["shards"]]
    first = "000000.npz" if in_place else "shard-000000.tar"
    assert names == [f"train/laion-zh/{first}", "train/own/shard-000000.tar"]
    assert [p["in_place"] for p in train["mixture"]] == [in_place, False]
    assert [(s["name"], s["train"], s["share"]) for s in manifest["source"]["sources"]] == [
        ("laion-zh", 20, 0.75),
        ("own", 12, 0.25),
    ]
    assert not (data / ".sources").exists()
    assert (data / "test" / testset.IMAGES_FILE).is_file()  # the given test set, copied
    files = split_files(data, "train")  # as the train loader reads it
    assert files.weights == (3.0, 1.0) and [len(p.counts) for p in files.parts] == [1, 1]


def _test_keys(shard: str, keys: list[str], val: float, test: float) -> list[str]:
    return [k for k in keys if split_of_identity(f"{shard}/{k}", SEED, val, test) == "test"]


def test_without_a_test_dir_the_first_source_gives_the_test_set_the_others_are_checked_against(
    tmp_path,
):
    """The test split comes off the first source; an image of it planted in the second (local)
    source is found there and dropped, and the test set is the first source's."""
    fraction = 0.3
    keys = [f"s-{n:03d}" for n in range(40)]
    images = {key: textured_jpeg(2000 + n) for n, key in enumerate(keys)}
    (tmp_path / "shards").mkdir()
    write_tar(
        tmp_path / "shards" / "a.tar",
        [m for k in keys for m in ((f"{k}.jpg", images[k]), (f"{k}.txt", f"甲 {k}".encode()))],
    )
    in_test = _test_keys("a.tar", keys, 0.0, fraction)
    assert len(in_test) >= 2  # fewer is refused as a test split that measures nothing
    own = _local_folder(tmp_path / "own", 8, planted={"leak": images[in_test[0]]})
    data, manifest = _run(
        tmp_path,
        {
            "source": "mixture",
            "mixture": [
                {
                    "name": "a",
                    "source": "webdataset",
                    "paths": [f"{tmp_path}/shards/a.tar"],
                    "weight": 1,
                },
                {"name": "own", "source": "local", "path": str(own), "weight": 1},
            ],
            "in_place": False,
            "seed": SEED,
            "val_fraction": 0.0,
            "test_fraction": fraction,
        },
    )
    assert manifest["splits"]["test"]["images"] == len(in_test)
    record = manifest["decontamination"]
    assert record["checked"] and record["sources"]["own"]["dropped"] == 1
    assert record["sources"]["a"]["dropped"] == 0
    assert "自己 leak" not in _captions(data, "train")
    assert manifest["splits"]["train"]["count"] == 40 - len(in_test) + 8


def test_a_source_left_with_no_training_pair_stops_the_stage_naming_it(tmp_path, capsys):
    """A source whose every pair is skipped would get its share of the positions and have no
    sample to give: the stage stops, naming it, and writes no data/."""
    own = tmp_path / "own"
    own.mkdir()
    (own / "x.jpg").write_bytes(b"not an image")
    (own / "x.txt").write_text("坏图", encoding="utf-8")
    (tmp_path / "shards").mkdir()
    make_planted_shard(tmp_path / "shards" / "shard-0000.tar")
    data = {
        "source": "mixture",
        "mixture": [
            {"name": "laion-zh", "source": "webdataset", "paths": [f"{tmp_path}/shards/*.tar"]}
            | {"weight": 1},
            {"name": "own", "source": "local", "path": str(own), "weight": 1},
        ],
        "in_place": False,
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"data": data}), encoding="utf-8")
    argv = ["--params", str(tmp_path / "params.yaml"), "--out", str(tmp_path / "data")]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "data.mixture[1] (own): no training pairs after filtering" in error
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"weight": 0}, "data.mixture[1].weight: got 0.0; must be > 0.0"),
        ({"weight": -1}, "data.mixture[1].weight: got -1.0; must be > 0.0"),
        ({"source": "builtin"}, "data.mixture[1].source: got 'builtin'; allowed: local"),
        ({"name": "laion-zh"}, "data.mixture[1].name: 'laion-zh' names an earlier source too"),
        ({"name": "a/b"}, "data.mixture[1].name: got 'a/b'; must be letters, digits"),
        ({"path": None}, "data.mixture[1].path: required for a `local` source"),
        ({"paths": ["x.tar"]}, "data.mixture[1].paths: not for a `local` source"),
        ({"weight": 0.002}, "data.mixture[1].weight: 0.002 is a share of 0.00067"),
        ({"colour": "red"}, "data.mixture[1].colour: unknown key; allowed: name, source"),
    ],
)
def test_a_bad_mixture_source_is_refused_in_one_line_naming_its_key(change, message):
    mixture = [
        {"name": "laion-zh", "source": "webdataset", "paths": ["a/*.tar"], "weight": 3},
        {"name": "own", "source": "local", "path": "own", "weight": 1, **change},
    ]
    with pytest.raises(ConfigError) as excinfo:
        DataConfig(source="mixture", mixture=mixture)
    assert str(excinfo.value).startswith(message)
    assert "\n" not in str(excinfo.value)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"source": "local", "path": "x"}, "data.mixture: only read with data.source: mixture"),
        ({"source": "mixture", "mixture": "one"}, "data.mixture: a mixture needs at least two"),
        ({"source": "mixture", "path": "x"}, "data.path: not read with data.source: mixture"),
        ({"source": "mixture", "test_fraction": 0}, "data.test_fraction: 0 with data.source"),
    ],
)
def test_a_bad_mixture_is_refused_in_one_line_naming_its_key(data, message):
    sources = [
        {"name": "laion-zh", "source": "webdataset", "paths": ["a/*.tar"], "weight": 3},
        {"name": "own", "source": "local", "path": "own", "weight": 1},
    ]
    mixture = {"both": sources, "one": sources[:1]}.get(data.pop("mixture", "both"))
    with pytest.raises(ConfigError) as excinfo:
        DataConfig(**{"source": "mixture", "mixture": mixture, **data})
    assert str(excinfo.value).startswith(message)
    assert "\n" not in str(excinfo.value)


def test_the_documented_mixture_is_a_valid_data_section():
    """docs/real-data.md's example (LAION-zh shards beside a local folder) loads as written."""
    text = (REPO / "docs" / "real-data.md").read_text(encoding="utf-8")
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.DOTALL) if "mixture:" in b]
    data = DataConfig(**yaml.safe_load(block)["data"])
    assert data.mixture_shares() == {"laion-zh": 0.8, "own": 0.2}
    assert [s.source for s in data.mixture] == ["webdataset", "local"]
