"""The disk-full line's free-bytes figure is the room there is once the failed save is gone: the
save's files are closed (their blocks freed) and removed before the disk is measured. A real
tmpfs that someone else fills during the save; a stand-in engine writes until the disk is full,
as torch's zip writer does, its file still open in the failed frame."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

from tests.conftest import subprocess_env
from tests.support.mounts import tmpfs

MB = 2**20
_SAVE = """
import shutil, sys
from pathlib import Path
import torch
import torch.distributed as dist
from clipforge.checkpoints.checkpointer import Checkpointer
from clipforge.errors import DiskFull

disk = Path(sys.argv[1])
dist.init_process_group(
    "gloo", init_method=f"file://{disk.parent}/group", rank=0, world_size=1
)

class Engine:
    device = "cpu"
    module = torch.nn.Linear(2 * 2**20 // 16, 1, bias=False)  # ~2 MB a checkpoint, estimated

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        (disk / "teammate.bin").write_bytes(b"x" * 3 * 2**20)  # someone else fills the disk
        folder = Path(save_dir) / tag
        folder.mkdir(parents=True)
        out = open(folder / "mp_rank_00_model_states.pt", "wb")
        while True:
            out.write(bytes(2**16))
            out.flush()

try:
    Checkpointer(disk / "run", 2, True).save(Engine(), 10, {}, "")
except DiskFull as exc:
    print(exc.step, shutil.disk_usage(disk).free, exc, sep="\\n")
"""


def test_the_free_bytes_figure_is_measured_after_the_partial_save_is_removed(tmp_path):
    with tmpfs(tmp_path / "disk", 4 * MB) as disk:
        done = subprocess.run(
            [sys.executable, "-c", _SAVE, str(disk)],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        step, free_after, line = done.stdout.splitlines()
        assert not (disk / "run" / "step-00000010").exists()
        assert shutil.disk_usage(disk).free == int(free_after)
    match = re.match(r"disk full at \S+: ([\d,]+) bytes free, a checkpoint needs ~([\d,]+)", line)
    assert match, line
    said = int(match.group(1).replace(",", ""))
    assert step == "10" and said == int(free_after) and 0.9 * MB < said < 2 * MB
