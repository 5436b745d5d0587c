"""The second half of `fab train --smoke`: load the checkpoint just saved back, and check it.

The first half trained a few steps through DVC and saved checkpoints. This runs the train stage
again with the same params: it must resume from the final checkpoint (`resumed_from_step` equal
to the steps), train nothing more, and export weights identical to the ones exported before.
That is the round trip a multi-day run depends on, through the real stage, on the real host.
In a multi-node run every node runs the command again (the ranks meet across nodes); node 0,
whose rank 0 writes the metrics and the model, checks them.

  python -m clipforge.launcher.host.smoke --workspace CODE --result FILE [--node-rank N] -- <train command...>

Exit 0 when every check passed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from clipforge.fsutil import atomic_write_bytes, atomic_write_text

# The model cards of the export (clipforge.export.card's CARD_FILE, in the export and its
# transformers folder): each names the environment of the process that wrote it (the checkout's
# diff hash among them, which the eval phase's outputs change), so the reload's differs by design.
CARD_FILE = "README.md"


def tree_digests(root: Path) -> dict[str, str]:
    """Every file's sha256 but the model cards', by its path under root."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != CARD_FILE
    }


def run_smoke_check(workspace: Path, command: list[str], node_rank: int = 0) -> dict:
    if node_rank:
        code = subprocess.call(command, cwd=workspace)
        return {"passed": code == 0, "checks": {"resume command exited 0": code == 0}}
    summary_path = workspace / "metrics" / "train.info.json"
    model_dir = workspace / "models" / "clip"
    summary_bytes = summary_path.read_bytes()
    trained = json.loads(summary_bytes)
    before = tree_digests(model_dir)
    code = subprocess.call(command, cwd=workspace)
    checks = {"resume command exited 0": code == 0}
    if code == 0:
        resumed = json.loads(summary_path.read_text(encoding="utf-8"))
        checks["resumed from the final checkpoint"] = resumed.get(
            "resumed_from_step"
        ) == trained.get("steps") and bool(trained.get("steps"))
        checks["same run id after reload"] = resumed.get("run_id") == trained.get("run_id")
        after = tree_digests(model_dir)
        checks["exported weights identical after reload"] = bool(before) and after == before
        changed = sorted(n for n in set(before) | set(after) if before.get(n) != after.get(n))
        if changed:
            print(f"smoke: the reload's export differs in {', '.join(changed)}", flush=True)
    # The reload rewrote the run's record (resumed_from_step, wall time): keep the training's own.
    atomic_write_bytes(summary_path, summary_bytes)
    return {"passed": all(checks.values()), "checks": checks, "trained": trained}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="clipforge.launcher.host.smoke", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--workspace", required=True, type=Path)
    parser.add_argument("--result", required=True, type=Path)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    result = run_smoke_check(args.workspace, command, args.node_rank)
    atomic_write_text(args.result, json.dumps(result, indent=2) + "\n")
    for name, ok in result["checks"].items():
        print(f"smoke: {'ok  ' if ok else 'FAIL'} {name}", flush=True)
    print(f"smoke: {'PASSED' if result['passed'] else 'FAILED'}", flush=True)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
