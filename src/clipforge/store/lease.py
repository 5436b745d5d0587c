"""One run, one writer in the run store: the lease and its heartbeat.

The lease `<remote>/<run id>/lease.json`, its holder and
a heartbeat the uploader refreshes (the run directory's lock, its counterpart on the disk, is
clipforge.checkpoints.lock).

Object stores have no lock, so the lease is a fence, not a gate: a trainer that starts takes it
(a run moved to another host must be able to go on at once, and a dead host cannot give it back),
and a trainer that finds, at its next heartbeat or before an upload, that the lease is no longer
its own stops writing the store and stops training, so that two hosts never interleave
checkpoints there.
"""

from __future__ import annotations

import logging
import time

from clipforge.checkpoints.layout import STORE_LEASE
from clipforge.checkpoints.lock import Holder
from clipforge.errors import StageError
from clipforge.store.remote import RunStore

log = logging.getLogger(__name__)

LEASE_HEARTBEAT_SECONDS = 60.0  # how often the uploader refreshes the store's lease


class LeaseLost(StageError):
    """Another trainer took the run store's lease: this one must stop writing the run."""


def take_lease(store: RunStore, holder: Holder) -> None:
    """Write this trainer's lease in the store (saying whose it replaces, if still beating)."""
    previous = lease_holder(store)
    if previous and previous.token != holder.token:
        log.warning(
            "run store %s: taking the run over from %s; if that trainer still runs, it stops at "
            "its next heartbeat",
            store.url,
            previous.describe(),
        )
    renew_lease(store, holder)


def renew_lease(store: RunStore, holder: Holder) -> None:
    store.fs.pipe_file(store.path(STORE_LEASE), holder.to_json(heartbeat_at=time.time()).encode())


def lease_holder(store: RunStore) -> Holder | None:
    try:
        return Holder.parse(store.fs.cat_file(store.path(STORE_LEASE)))
    except FileNotFoundError:
        return None


def check_lease(store: RunStore, holder: Holder) -> None:
    """LeaseLost when the store's lease names another trainer (one that started after this)."""
    current = lease_holder(store)
    if current is not None and current.token != holder.token:
        raise LeaseLost(
            f"the run store {store.url} is now written by {current.describe()}: this trainer "
            f"({holder.describe()}) stops, so that one writer keeps the run; its checkpoints "
            f"stay on this disk"
        )


def release_lease(store: RunStore, holder: Holder) -> None:
    """Remove the lease if it is still this trainer's."""
    if (current := lease_holder(store)) is not None and current.token == holder.token:
        store.fs.rm_file(store.path(STORE_LEASE))
