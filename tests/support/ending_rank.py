"""Run by test_rank_exit.py as each rank of a two-rank gloo group on this machine: joins it on
the train stage's rendezvous (clipforge.train.dist.rendezvous_store), gathers a few times, and
ends as a rank of the train stage ends (clipforge.train.dist.exit_leaving_process_group), its
peer ending beside it. ENDING_CODE: raise SystemExit with it instead of returning 0 (a stop)."""

from __future__ import annotations

import datetime
import os


def main() -> int:
    import torch
    import torch.distributed as dist

    from clipforge.train.dist import rendezvous_store

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port, timeout = int(os.environ["MASTER_PORT"]), datetime.timedelta(seconds=120)
    store = rendezvous_store("127.0.0.1", port, rank, world, timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    mine = torch.full((1000,), float(rank))
    for _ in range(20):
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
    assert [int(t[0]) for t in gathered] == list(range(world))
    if "ENDING_CODE" in os.environ:
        raise SystemExit(int(os.environ["ENDING_CODE"]))
    return 0


if __name__ == "__main__":
    from clipforge.train.dist import exit_leaving_process_group

    exit_leaving_process_group(main)
