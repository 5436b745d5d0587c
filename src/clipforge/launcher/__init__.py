"""What the Fabric tasks (fabfile.py) call: launch, watch, stop and recover runs on GPU hosts.

Two sides:
- the laptop side builds commands and drives hosts over SSH (connection, session, preflight,
  source, launch, watch, fetch), and reads a run where it lives, its hosts or its run store
  (run_source); it holds no training logic, it runs `dvc exp run` / DeepSpeed's launcher;
- clipforge.launcher.host is what runs on the GPU host (plan, run directories, supervisor, status,
  smoke, stored checkpoints), standard library only.

Standard library only here too: importing the host side imports this package first.
"""
