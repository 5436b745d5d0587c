"""What the Fabric tasks (fabfile.py) call: launch, watch, stop and recover runs on GPU hosts.

Two sides:
- the laptop side builds commands and drives hosts over SSH (hosts, preflight, source, launch,
  watch, fetch); it holds no training logic, it runs `dvc exp run` / DeepSpeed's launcher;
- the host side is standard library only (plan, layout, supervisor, status, smoke), because on a
  docker-runtime host it runs under the host's own python3, outside the training image.
"""
