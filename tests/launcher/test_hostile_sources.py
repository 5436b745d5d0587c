"""Nothing a host or a run store sends is written outside `runs/`: `fab fetch`, `fab status` and
`fab tensorboard` against a hostile host (a real sshd, whose `current` marker, listing and
results archive the test writes) and a hostile store (moto's S3, whose keys and launch records
the test writes) that name `..`, absolute paths, symbolic links and odd names.

Each refusal is one line naming the name and exits non-zero, and nothing is written: the project
(its `runs/` included), an existing directory the names point at (`victim`, beside the project as
`runs/../../victim` reaches it) and the home folder are as they were, byte for byte and mtime
for mtime, and no marker file appears where the names point. (Only `runs/`'s own mtime may
change: a fetch stages the new copy beside the old one, and removes it when it is refused.)"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from tests.launcher.conftest import make_fab
from tests.support.records import run_record
from tests.support.sshd import free_port, start_sshd

LAUNCH_ID = "20261201-120000-0123456789"
RUN_ID = "run-0123456789ab"
EVIL = "EVIL-MARKER"
LONG = "x" * 300  # over the 255 bytes a path component may have


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under `root` (itself too): its kind, mode, size, mtime and link target."""
    found = {}
    for path in [root, *root.rglob("*")] if root.exists() or root.is_symlink() else []:
        info = path.lstat()
        target = os.readlink(path) if path.is_symlink() else None
        found[str(path.relative_to(root))] = (info.st_mode, info.st_size, info.st_mtime_ns, target)
    return found


class Machine:
    """The user's machine as these tests watch it: the project, a directory a hostile name points
    at, the fab process's home; and the places where the names point."""

    def __init__(self, project: Path, home: Path):
        self.project, self.home = project, home
        (project / "runs").mkdir(exist_ok=True)
        shutil.rmtree(project / "runs" / LAUNCH_ID, ignore_errors=True)
        self.victim = project.parent / "victim"  # runs/../../victim
        self.victim.mkdir(exist_ok=True)
        (self.victim / "precious.txt").write_text("keep me\n")
        self.before = self.state()

    def state(self) -> dict[str, tuple]:
        """Every entry of the watched folders but git's own bookkeeping (`fab fetch` asks git
        for the repository's root, which may refresh .git/index)."""
        found = {
            f"{name}/{path}": entry
            for name, root in (
                ("project", self.project),
                ("victim", self.victim),
                ("home", self.home),
            )
            for path, entry in snapshot(root).items()
            if not (name == "project" and path.split("/")[0] == ".git")
        }
        runs = found["project/runs"]
        found["project/runs"] = runs[:2] + runs[3:]  # not its mtime: a fetch's staging, removed
        return found

    def markers(self) -> list[Path]:
        """Marker files where the names of these tests point (none should exist)."""
        places = [Path("/"), Path("/tmp"), self.project.parent, self.project, self.home]
        return [p / n for p in places if p.is_dir() for n in os.listdir(p) if EVIL in n]

    def assert_untouched(self) -> None:
        assert self.markers() == []
        now = self.state()
        changed = {k for k in now.keys() | self.before.keys() if now.get(k) != self.before.get(k)}
        assert not changed, sorted(changed)

    def close(self) -> None:
        shutil.rmtree(self.project / "runs" / LAUNCH_ID, ignore_errors=True)
        for path in sorted(self.victim.rglob("*"), reverse=True):
            path.unlink() if not path.is_dir() or path.is_symlink() else path.rmdir()
        self.victim.rmdir()


def refused(result, *fragments: str) -> None:
    """A one-line refusal naming the fragments, exit non-zero, no traceback."""
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# -- a hostile host ------------------------------------------------------------------------------
FAKE_TAR = """#!/bin/sh
# The host's `tar`: the archive the test put beside it, if any, instead of the real one.
for arg; do case "$prev" in -chzf) out="$arg";; esac; prev="$arg"; done
if [ -f "$(dirname "$0")/archive.tgz" ] && [ -n "$out" ]; then
    exec cp "$(dirname "$0")/archive.tgz" "$out"
fi
exec /usr/bin/tar "$@"
"""


@pytest.fixture(scope="module")
def hostile_sshd(tmp_path_factory):
    """An sshd whose sessions find the test's `tar` first on PATH: the host packs what the test
    says."""
    fakebin = tmp_path_factory.mktemp("fakebin")
    (fakebin / "tar").write_text(FAKE_TAR)
    (fakebin / "tar").chmod(0o755)
    server = start_sshd(
        tmp_path_factory.mktemp("hostile-sshd"),
        set_env={"PATH": f"{fakebin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
    )
    server.fakebin = fakebin
    yield server
    server.stop()


@pytest.fixture
def host(project, tmp_path, hostile_sshd):
    """The hostile host's run root, the machine watched, and `fab` pointed at the host."""
    root = tmp_path / "remote"
    fab = make_fab(project, tmp_path / "home", root, hostile_sshd)
    machine = Machine(project, tmp_path / "home")
    (hostile_sshd.fakebin / "archive.tgz").unlink(missing_ok=True)

    def run_fab(*args: str):
        return fab(*args, hosts=hostile_sshd.address, key=hostile_sshd.client_key, timeout=120)

    yield root, machine, run_fab
    (hostile_sshd.fakebin / "archive.tgz").unlink(missing_ok=True)
    machine.close()


def _plant_run(root: Path) -> None:
    """A run on the host as `fab fetch` finds one: its marker, record and a metrics file."""
    node = root / "runs" / LAUNCH_ID / "node-0"
    (node / "code" / "metrics").mkdir(parents=True)
    (node / "code" / "metrics" / "train.tsv").write_text("run_id\tstep\n")
    (root / "runs" / LAUNCH_ID / "run.json").write_text(run_record().to_json())
    (root / "current").write_text(LAUNCH_ID + "\n")


@pytest.mark.parametrize(
    "marker",
    ["../../victim", "/tmp", "20261201-120000-01234567/../../../victim", "２０２６１２０１-120000-ab",
     f"20261201-120000-{LONG}", "a\x1b[2Jb"],
)  # fmt: skip
def test_a_host_marker_that_is_no_launch_id_is_refused_and_nothing_is_written(host, marker):
    """The host's `current` marker names a folder here (`runs/<launch id>`) and there: `fab fetch`
    refuses a marker that is no launch id (`..`, an absolute path, digits of another script, an
    over-long or escape-laden name) in one line naming the marker file, before any copy."""
    root, machine, fab = host
    _plant_run(root)
    (root / "current").write_text(marker + "\n")
    result = fab("fetch")
    refused(result, f"{root}/current", "not a launch id")
    assert "\x1b" not in result.stderr  # shown escaped: it cannot rewrite the user's terminal
    machine.assert_untouched()


def test_every_task_reading_a_host_refuses_its_marker_alike(host):
    """`fab status`, `fab tensorboard` and `fab logs` read the marker through the same check."""
    root, machine, fab = host
    _plant_run(root)
    (root / "current").write_text("../../victim\n")
    for task in ("status", "tensorboard", "logs"):
        refused(fab(task), f"{root}/current", "not a launch id: '../../victim'")
    machine.assert_untouched()


def test_a_run_argument_that_is_no_launch_id_is_refused_and_nothing_is_written(host):
    """`--run ../../victim`: every task refuses it as the user typed it, before the host is asked
    anything; the run on the host is untouched (`fab stop` and `fab clean` act on hosts)."""
    root, machine, fab = host
    _plant_run(root)
    for task in ("fetch", "status", "tensorboard", "logs", "stop", "clean"):
        refused(fab(task, "--run", "../../victim"), "--launch", "not a launch id: '../../victim'")
    machine.assert_untouched()
    assert (root / "runs" / LAUNCH_ID / "run.json").is_file()


def _archive(*members: tuple[str, bytes | str | None]) -> bytes:
    """A results archive: (name, bytes) files, (name, None) folders, (name, "->target") links."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, content in members:
            info = tarfile.TarInfo(name)
            if content is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                archive.addfile(info)
            elif isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content.removeprefix("->")
                archive.addfile(info)
            else:
                info.size = len(content)
                archive.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


@pytest.mark.parametrize(
    "members, named",
    [
        ([("./metrics", None), (f"./../../{EVIL}", b"x")], f"'../../{EVIL}'"),
        ([("./metrics", None), (f"/tmp/{EVIL}-abs", b"x")], f"'/tmp/{EVIL}-abs'"),
        ([("./metrics", "->VICTIM"), (f"./metrics/{EVIL}", b"x")], "'./metrics'"),
        ([("./logs", None), (f"./logs/{LONG}", b"x")], "over 255 bytes"),
        ([("./logs", None), ("./logs/a\nb", b"x")], "control character"),
    ],
    ids=["dotdot", "absolute", "symlink", "long", "newline"],
)
def test_a_results_archive_that_escapes_is_refused_and_the_fetched_run_is_kept(
    host, hostile_sshd, members, named
):
    """The host packs the run's results; one whose archive holds a name outside the run's folder,
    a link, or a name no folder should hold is refused in one line naming it, and the copy
    fetched before stays as it was (it is replaced only by a whole, checked copy)."""
    root, machine, fab = host
    _plant_run(root)
    first = fab("fetch")
    assert first.returncode == 0, first.stdout + first.stderr
    assert (machine.project / "runs" / LAUNCH_ID / "metrics" / "train.tsv").is_file()
    machine.before = machine.state()
    members = [(n, str(machine.victim) if c == "->VICTIM" else c) for n, c in members]
    (hostile_sshd.fakebin / "archive.tgz").write_bytes(_archive(*members))
    refused(fab("fetch"), named, "nothing was written")
    machine.assert_untouched()


# -- a hostile store -----------------------------------------------------------------------------
@pytest.fixture
def store(project, tmp_path, s3_server):
    """A bucket holding one launch of one run (metrics and a log file), the machine watched, and
    `fab` with the store's credentials; `put` writes any key, as anyone who can write the bucket
    could."""
    import boto3

    remote = s3_server.new_bucket() + "/runs"
    bucket, prefix = remote.removeprefix("s3://").split("/", 1)
    client = boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint,
        aws_access_key_id=s3_server.env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=s3_server.env["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )

    def put(key: str, body: bytes | str) -> None:
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=body)

    def launch(**changes) -> None:
        record = {**run_record().to_dict(), "training_run": RUN_ID, "store": remote, **changes}
        put(f"launches/{LAUNCH_ID}.json", json.dumps(record))

    launch()
    put(f"{RUN_ID}/metrics/train.tsv", "run_id\tstep\n")
    put(f"{RUN_ID}/logs/train/events.out.tfevents.1", b"\0")
    fab = make_fab(project, tmp_path / "home", tmp_path / "remote")
    machine = Machine(project, tmp_path / "home")

    def run_fab(task: str, *args: str):
        argv = [task, "--from-store", "--store", remote, *args]
        if "--run" not in args:
            argv += ["--run", LAUNCH_ID]
        if task == "tensorboard":
            argv += ["--port", str(free_port())]
        return fab(*argv, env=s3_server.env, timeout=120)

    yield put, launch, machine, run_fab
    machine.close()


@pytest.mark.parametrize(
    "key, named",
    [
        (f"logs/../../../{EVIL}.txt", f"'../../../{EVIL}.txt'"),
        (f"logs/../../../../../../../../tmp/{EVIL}.txt", f"/tmp/{EVIL}.txt'"),
        (f"logs//tmp/{EVIL}-abs.txt", f"'/tmp/{EVIL}-abs.txt'"),
        (f"logs/train/{LONG}", "over 255 bytes"),
        ("logs/a\x1b[2Jb", "control character"),
    ],
    ids=["dotdot", "deep-dotdot", "absolute", "long", "escape"],
)
def test_store_keys_that_escape_are_refused_and_nothing_is_written(store, key, named):
    """A store whose listing names a file outside the folder it is downloaded into: `fab fetch`
    refuses in one line naming the key, before downloading anything."""
    put, _, machine, fab = store
    put(f"{RUN_ID}/{key}", "evil")
    refused(fab("fetch"), "the run store", named, "nothing was written")
    machine.assert_untouched()


def test_tensorboard_refuses_the_keys_fetch_refuses_and_status_writes_nothing(store):
    """`fab tensorboard --from-store` downloads the logs through the same check; `fab status`
    downloads nothing and writes nothing."""
    put, _, machine, fab = store
    put(f"{RUN_ID}/logs/../../../{EVIL}.txt", "evil")
    refused(fab("tensorboard"), "the run store", f"'../../../{EVIL}.txt'", "nothing was written")
    status = fab("status")
    assert status.returncode == 0, status.stdout + status.stderr
    machine.assert_untouched()


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"launch_id": "../../victim"}, "names the launch '../../victim'"),
        ({"launch_id": "20261201-120000-abcdef"}, "names the launch '20261201-120000-abcdef'"),
        ({"training_run": "../../victim"}, "training_run: not a run id: '../../victim'"),
        ({"training_run": f"{RUN_ID}/../.."}, "not a run id"),
    ],
    ids=["launch-dotdot", "launch-other", "run-dotdot", "run-suffix"],
)
def test_a_store_record_naming_another_folder_is_refused_and_nothing_is_written(
    store, changes, named
):
    """The store's launch record names the launch (a folder here) and the training run (a folder
    there): `fab fetch` refuses one that is not the launch asked for, or no run id, in one line."""
    _, launch, machine, fab = store
    launch(**changes)
    refused(fab("fetch"), f"launches/{LAUNCH_ID}.json", named)
    machine.assert_untouched()


def test_tensorboard_and_status_read_a_store_record_through_the_same_check(store):
    _, launch, machine, fab = store
    launch(launch_id="../../victim")
    for task in ("tensorboard", "status"):
        refused(fab(task), f"launches/{LAUNCH_ID}.json", "names the launch '../../victim'")
    machine.assert_untouched()


def test_a_run_argument_that_is_no_launch_id_is_refused_before_the_store_is_asked(store):
    _, _, machine, fab = store
    for task in ("fetch", "tensorboard", "status"):
        refused(fab(task, "--run", "../../victim"), "--launch", "not a launch id: '../../victim'")
    machine.assert_untouched()


def test_a_symbolic_link_in_the_download_folder_is_not_followed(store):
    """`runs/<launch>` made a link to another folder (by anyone): `fab tensorboard --from-store`
    refuses to download through it, naming it, and writes nothing there."""
    _, _, machine, fab = store
    runs = machine.project / "runs"
    runs.mkdir(exist_ok=True)
    (runs / LAUNCH_ID).symlink_to(machine.victim)
    try:
        machine.before = machine.state()
        refused(fab("tensorboard"), f"runs/{LAUNCH_ID} is a symbolic link", "nothing was written")
        machine.assert_untouched()
    finally:
        (runs / LAUNCH_ID).unlink()


def test_a_whole_store_is_fetched_and_served_as_before(store, tmp_path):
    """The same store without a hostile key: `fab fetch --from-store` brings its files home
    (the checks refuse names, not runs)."""
    _, _, machine, fab = store
    result = fab("fetch", "--to", str(tmp_path / "fetched"))
    assert result.returncode == 0, result.stdout + result.stderr
    fetched = tmp_path / "fetched" / LAUNCH_ID
    assert (fetched / "metrics" / "train.tsv").read_text() == "run_id\tstep\n"
    assert (fetched / "logs" / "train" / "events.out.tfevents.1").is_file()
