"""A run that outlives its host through the run store (storage.remote: moto's S3 server on
127.0.0.1, s3fs as the client). Its first host dies mid-run (every process killed, its run
directory lost) once the store holds a checkpoint; `fab train --resume ID` on a host that never
saw the run finds the launch in the store, ships the run's commit there, and the train stage
resumes from the store's checkpoint to the weights of the uninterrupted run (the smoke run's
training). "Another host" is another run root behind the same sshd (nothing of the first one is
left to be found there), and, in the last test, another machine of the network-namespace
fixture; `fab status/fetch/tensorboard` then read the run from the store, and `fab clean` asks
it before removing a run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import urllib.request

import pytest

from tests.launcher.conftest import RUN_SETS, launch_run, make_fab, set_args, wait_for_end
from tests.support.hostprocs import files_containing, processes_under
from tests.support.netns import LAPTOP_ADDRESS, made_in_namespace
from tests.support.s3store import SECRET_KEY, S3Server
from tests.support.same_run import exported_weights
from tests.support.sshd import free_port
from tests.support.wait import still_running, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.tier2]
HELD_STEP = 5  # of the 8 of RUN_SETS: the first host holds there until it dies
STORED_STEP = 4  # the checkpoint (saved every 2 steps) the store has when the host dies


def _store_latest(fs, remote: str) -> str | None:
    fs.invalidate_cache()  # s3fs keeps listings: look at the store as it is now
    markers = fs.glob(remote.removeprefix("s3://") + "/*/checkpoints/latest")
    return fs.cat_file(markers[0]).decode().strip() if markers else None


def _die(run_root):
    """The box dies: every process of its runs killed (no stop, no last upload), its disk lost."""
    for pid in processes_under(run_root):
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(run_root)


@pytest.fixture(scope="module")
def moved_run(project, sshd, s3_server, tmp_path_factory):
    base = tmp_path_factory.mktemp("moved-run")
    remote = s3_server.new_bucket() + "/runs"
    fs = s3_server.filesystem()
    first_root = base / "host-a"
    first = make_fab(project, base / "home-a", first_root, sshd)
    run = launch_run(
        first,
        sshd,
        first_root,
        *set_args([*RUN_SETS, f"storage.remote={remote}"]),
        env={**s3_server.env, "CLIPFORGE_FAULTS": f"hold@{HELD_STEP}"},
    )
    run.wait_until(
        lambda: _store_latest(fs, remote) == f"step-{STORED_STEP:08d}", what="checkpoint stored"
    )
    _die(first_root)

    second_root = base / "host-b"
    run.second = make_fab(project, base / "home-b", second_root, sshd)
    run.second.env.update(s3_server.env)  # the user's shell holds the store's credentials
    run.remote = remote
    run.move = run.second(
        "train",
        "--resume",
        run.launch_id,
        "--store",
        remote,
        hosts=sshd.address,
        key=sshd.client_key,
    )
    assert run.move.returncode == 0, run.move.stdout + run.move.stderr
    run.moved_node = second_root / "runs" / run.launch_id / "node-0"
    run.final = wait_for_end(run.moved_node)
    return run


def test_a_run_moved_to_a_new_host_resumes_from_the_store_to_the_same_weights(moved_run, smoke_run):
    """On a host that never saw it, `fab train --resume ID` starts the run under its id from the
    store's checkpoint; it ends with the metrics and exported weights of the uninterrupted run."""
    assert (
        f"moving run {moved_run.launch_id} there from {moved_run.remote}" in moved_run.move.stdout
    )
    assert moved_run.final["state"] == "finished", (moved_run.moved_node / "train.log").read_text()[
        -3000:
    ]
    code = moved_run.moved_node / "code"
    info = json.loads((code / "metrics" / "train.info.json").read_text())
    assert info["resumed_from_step"] == STORED_STEP
    summary = json.loads((code / "metrics" / "train.json").read_text())
    assert summary == json.loads((smoke_run.code / "metrics" / "train.json").read_text())
    assert exported_weights(code / "models" / "clip") == exported_weights(
        smoke_run.code / "models" / "clip"
    )


def test_a_run_neither_on_the_host_nor_in_the_store_is_refused_in_one_line(moved_run, sshd):
    """`fab train --resume` of an id neither the host nor the store knows: one line naming the
    store; nothing is started."""
    result = moved_run.second(
        "train",
        "--resume",
        "20990101-000000-deadbeef",
        "--store",
        moved_run.remote,
        hosts=sshd.address,
        key=sshd.client_key,
    )
    assert result.returncode != 0
    assert f"the run store {moved_run.remote} has no run 20990101-000000-deadbeef" in result.stderr
    assert "Traceback" not in result.stderr


def test_status_without_a_host_reads_the_run_from_the_store(moved_run):
    """`fab status --run RUN` with no -H and no stack: the state, step and sync lag as the store
    last heard of them."""
    result = moved_run.second("status", "--run", moved_run.launch_id, "--store", moved_run.remote)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = dict(re.findall(r"^  (\w[\w ]*?)\s{2,}(.+)$", result.stdout, re.MULTILINE))
    assert rows["state"].startswith("finished") and rows["step"] == "8", result.stdout
    assert "step 8, behind by 0 steps" in rows["run store"], result.stdout


def test_status_on_the_host_shows_what_the_store_holds(moved_run, sshd):
    """`fab status` on the run's host: a `run store` row with the store's step and the lag."""
    result = moved_run.second("status", hosts=sshd.address, key=sshd.client_key)
    assert result.returncode == 0, result.stdout + result.stderr
    row = re.search(r"^  run store\s+(.+)$", result.stdout, re.MULTILINE)
    assert row and "step 8, behind by 0 steps" in row.group(1), result.stdout


def test_no_file_of_the_moved_run_nor_the_store_holds_its_secret(moved_run, s3_server):
    """The store's secret key reached the run through the environment only: not in run.json, the
    logs, the checkpoints or anything the run wrote on its host, nor in what went to the store."""
    assert files_containing(moved_run.moved_node.parent, SECRET_KEY) == []
    fs = s3_server.filesystem()
    stored = fs.find(moved_run.remote.removeprefix("s3://").split("/")[0])
    assert stored and not [path for path in stored if SECRET_KEY.encode() in fs.cat_file(path)]


def test_fetch_from_the_store_brings_the_results_of_the_moved_run(moved_run, tmp_path):
    """`fab fetch --from-store`: metrics, the exported model and the curves, as the run left them
    on its last host."""
    result = moved_run.second(
        "fetch", "--from-store", "--launch", moved_run.launch_id, "--store", moved_run.remote,
        "--to", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    fetched, code = tmp_path / moved_run.launch_id, moved_run.moved_node / "code"
    assert exported_weights(fetched / "models" / "clip") == exported_weights(
        code / "models" / "clip"
    )
    assert (fetched / "metrics" / "train.json").read_text() == (
        code / "metrics" / "train.json"
    ).read_text()
    assert list((fetched / "logs").rglob("events.out.tfevents.*"))


def test_tensorboard_from_the_store_serves_the_run_here(moved_run):
    """`fab tensorboard --from-store`: the run's events downloaded, a TensorBoard here serving them
    at the printed URL until interrupted."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "fabric", "tensorboard", "--from-store", "--launch", moved_run.launch_id,
         "--store", moved_run.remote, "--port", str(port)],
        cwd=moved_run.second.project, env=moved_run.second.env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_for(
            lambda: any(url in line for line in lines),
            what=f"tensorboard serving {url}",
            interval=0.2,
            check=still_running(process, lambda: "".join(lines)),
        )
        with urllib.request.urlopen(url + "data/runs", timeout=60) as response:
            assert any("-run-" in name for name in json.loads(response.read()))
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)
    assert (moved_run.second.project / "runs" / moved_run.launch_id / "logs").is_dir()


def test_clean_refuses_a_run_whose_newest_checkpoint_the_store_lacks(moved_run, sshd, s3_server):
    """`fab clean` of an ended run whose newest checkpoint is not in its store (here: taken out
    of it): refused, naming the checkpoint and the store, nothing removed; once the store holds it
    again, the run is removed."""
    fs = s3_server.filesystem()
    local = next((moved_run.moved_node / "code" / "checkpoints").glob("run-*"))
    tag = local.joinpath("latest").read_text().strip()
    store = moved_run.remote.removeprefix("s3://") + f"/{local.name}/checkpoints/{tag}"
    fs.rm(store, recursive=True)
    clean = ("clean", "--launch", moved_run.launch_id)
    refused = moved_run.second(*clean, hosts=sshd.address, key=sshd.client_key)
    assert refused.returncode != 0
    assert f"{local.name}/{tag} is not in the run store {moved_run.remote}" in refused.stderr
    assert moved_run.moved_node.is_dir()

    fs.put(str(local / tag), store, recursive=True)
    done = moved_run.second(*clean, hosts=sshd.address, key=sshd.client_key)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not moved_run.moved_node.exists()


# The moved run again between two network namespaces: make test-tier3. Tier2 keeps the run moved
# to a host that never saw it (above) and the spare host in a namespace (test_spare_host.py).
@pytest.mark.tier3
def test_a_run_moved_to_another_machine_ends_with_the_same_weights(
    netns_hosts, project, smoke_run, tmp_path_factory
):
    """The same between two machines of their own (tests/support/netns.py), `fab` on a third,
    the store on the laptop's network: host a dies once the store holds step 4 (`fab status`
    without a host says so), `fab -H b train --resume RUN` carries the run on to the weights of
    the uninterrupted run."""
    base = tmp_path_factory.mktemp("moved-between-machines")
    a, b = netns_hosts.hosts
    server = made_in_namespace(netns_hosts.laptop, lambda: S3Server(LAPTOP_ADDRESS).start())
    try:
        bucket = "runs-between-machines"
        made_in_namespace(netns_hosts.laptop, lambda: _client(server).create_bucket(Bucket=bucket))
        remote = f"s3://{bucket}/runs"
        fab_a = make_fab(project, base / "home", base / "host-a", a.sshd, b.sshd,
                         prefix=netns_hosts.on_laptop)  # fmt: skip
        fab_a.env.update(server.env)
        run = launch_run(
            fab_a, a.sshd, base / "host-a", *set_args([*RUN_SETS, f"storage.remote={remote}"]),
            env={"CLIPFORGE_FAULTS": f"hold@{HELD_STEP}"},
        )  # fmt: skip
        run.wait_until(
            lambda: (
                f"step {STORED_STEP},"
                in fab_a("status", "--launch", run.launch_id, "--store", remote).stdout
            ),
            what="checkpoint stored",
        )
        _die(base / "host-a")
        fab_b = make_fab(project, base / "home", base / "host-b", prefix=netns_hosts.on_laptop)
        fab_b.env.update(server.env)
        moved = fab_b(
            "train", "--resume", run.launch_id, "--store", remote,
            hosts=b.ssh_target, key=b.sshd.client_key,
        )  # fmt: skip
        assert moved.returncode == 0, moved.stdout + moved.stderr
        node = base / "host-b" / "runs" / run.launch_id / "node-0"
        assert wait_for_end(node)["state"] == "finished", (node / "train.log").read_text()[-3000:]
    finally:
        server.stop()
    info = json.loads((node / "code" / "metrics" / "train.info.json").read_text())
    assert info["resumed_from_step"] == STORED_STEP
    assert exported_weights(node / "code" / "models" / "clip") == exported_weights(
        smoke_run.code / "models" / "clip"
    )


def _client(server):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=server.env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=server.env["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )
