"""Process groups, joined and left: one code path for a laptop CPU (world size 1) and N GPUs.

DeepSpeed's launcher sets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_*; a plain `python -m clipforge.train`
gets the same variables for a world of one, so the rest of the code never branches on it.

The process group listens only where it must. torch's env:// rendezvous makes rank 0's TCPStore
listen on every interface whatever MASTER_ADDR says (torch 2.1 to 2.14), and that store takes
anyone who connects: rank 0 here binds the store's socket to MASTER_ADDR itself and hands it to
torch (`rendezvous_store`). gloo and NCCL listen on GLOO/NCCL_SOCKET_IFNAME's interface, which the
launcher sets for several nodes (clipforge.launcher.network); a world on one machine (MASTER_ADDR
a loopback address) gets the loopback interface, where they would otherwise take the address
the host name resolves to (a public one, on some boxes).
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from clipforge.errors import StageError

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: str  # "cpu" or "cuda"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def under_launcher() -> bool:
    return all(v in os.environ for v in LAUNCHER_VARS)


def resolve_device(requested: str) -> str:
    """`auto` means CUDA when a GPU is visible. Decided before DeepSpeed is imported."""
    import torch

    has_cuda = torch.cuda.is_available()
    if requested == "cuda" and not has_cuda:
        raise StageError(
            "train.device: cuda requested but no GPU is visible "
            "(set train.device: cpu or auto to train on the CPU)"
        )
    return "cuda" if requested == "cuda" or (requested == "auto" and has_cuda) else "cpu"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    device: str,
    timeout_seconds: float = 1800.0,
    stop_requested: Callable[[], bool] = lambda: False,
) -> DistInfo:
    """Initialise torch.distributed through DeepSpeed (gloo on CPU, NCCL on GPUs).

    `stop_requested`: whether SIGTERM/SIGINT arrived (the train stage's StopFlag); a stop that
    interrupts the CPU op's compilation ends the run in one line, see `build_cpu_ops`."""
    if device == "cpu":
        # DeepSpeed picks its accelerator at import time; without this it probes for CUDA/XPU/...
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        build_cpu_ops(stop_requested)  # DeepSpeed's init below then only loads it
    use_environment_extension_cache()
    if not under_launcher():
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    use_loopback_for_one_machine(os.environ)
    import deepspeed
    import torch
    import torch.distributed as torch_dist

    local_rank = int(os.environ["LOCAL_RANK"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    timeout = datetime.timedelta(seconds=timeout_seconds)
    backend = "gloo" if device == "cpu" else "nccl"
    if not torch_dist.is_initialized():  # (a stage run again in one process keeps its group)
        store = rendezvous_store(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world_size, timeout
        )
        torch_dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)  # adopts the group
    if device == "cpu":
        use_list_collectives_where_gloo_lacks_tensor_ones()
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def exit_leaving_process_group(main: Callable[[], int | None]) -> NoReturn:
    """Run a rank's process (`main`) and exit with its code, having left its process group.

    Left to interpreter shutdown, the group's gloo threads can be destroyed while joinable: a
    rank whose work is done aborts (SIGABRT, "terminate called without an active exception"), and
    DeepSpeed's launcher reports the finished run as failed (exit 250). With torch 2.14, 1 pair of
    ranks in 7 ending side by side did. Only on a return or a SystemExit (a stop, a user error):
    a bug keeps its traceback, and a rank that failed mid-step may have collectives in flight.
    Only where the process ends: a second in-process run (tests) needs DeepSpeed's groups, which
    outlive a destroyed process group."""
    code: int | str | None
    try:
        code = main()
    except SystemExit as exit_:
        code = exit_.code
    leave_process_group()
    raise SystemExit(code)


def leave_process_group() -> None:
    """Destroy this process's group, if it has one (see `exit_leaving_process_group`)."""
    torch_dist = sys.modules.get("torch.distributed")  # not imported: no group to leave
    if torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def rendezvous_store(
    master_addr: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta
):
    """The process group's TCPStore: on rank 0 the server, listening on `master_addr` alone (a
    socket bound here, handed over as `master_listen_fd`, which torch 2.1 and 2.14 both take);
    on the others a client of it."""
    from torch.distributed import TCPStore

    if rank != 0:
        return TCPStore(master_addr, port, world_size, False, timeout)
    listener = _listener_on(master_addr, port, timeout.total_seconds())
    return TCPStore(
        master_addr, port, world_size, True, timeout, master_listen_fd=listener.detach()
    )


def device_has_bf16(device: str) -> bool:
    """Whether a run can train in bf16 here (after `init_distributed`; every rank calls it).
    A GPU from Ampere on: torch's `is_bf16_supported` also says yes for older GPUs that only
    emulate bf16 (slowly), so emulation is left out where torch tells the two apart. A CPU
    computes bf16 (torch, and DeepSpeed's CPU accelerator), but DeepSpeed also broadcasts and
    gathers the bf16 weights through the process group: gloo carries bf16 in recent torch, while
    torch 2.1's refuses it ("Invalid scalar type"); one tiny broadcast tells."""
    import inspect

    import torch
    import torch.distributed as dist

    if device == "cuda":
        check = torch.cuda.is_bf16_supported
        if "including_emulation" in inspect.signature(check).parameters:
            return check(including_emulation=False)
        return check()
    try:
        dist.broadcast(torch.zeros(1, dtype=torch.bfloat16), src=0)
    except RuntimeError:
        return False
    return True


def _listener_on(address: str, port: int, seconds: float) -> socket.socket:
    """A TCP socket listening on `address`:`port`. A name that does not resolve yet, or still to
    another address (a pod's own DNS name, published as the pod starts), is tried again for up to
    `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return _listening(address, port)
        except OSError as exc:
            not_yet = isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL
            if not not_yet or time.monotonic() > deadline:
                raise StageError(
                    f"the rendezvous cannot listen on MASTER_ADDR {address} port {port} on rank "
                    f"0's host ({exc.strerror}): it must be an address of this host, the port free"
                ) from None
            time.sleep(1)


def _listening(address: str, port: int) -> socket.socket:
    family, kind, proto, _, where = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(where)
        listener.listen()
    except OSError:
        listener.close()
        raise
    return listener


def use_loopback_for_one_machine(environ) -> None:
    """GLOO/NCCL_SOCKET_IFNAME, when not set: the loopback interface for a world on one machine
    (MASTER_ADDR a loopback address), so its ranks listen nowhere else."""
    if any(var in environ for var in SOCKET_IFNAME_VARS):
        return
    try:
        on_one_machine = ipaddress.ip_address(environ.get("MASTER_ADDR", "")).is_loopback
    except ValueError:  # a name: the launcher chose the interface (several nodes)
        return
    names = [name for _, name in socket.if_nameindex()]
    loopback = "lo" if "lo" in names else next((n for n in names if n.startswith("lo")), None)
    if on_one_machine and loopback:
        environ.update(dict.fromkeys(SOCKET_IFNAME_VARS, loopback))


def use_list_collectives_where_gloo_lacks_tensor_ones() -> None:
    """DeepSpeed picks `all_gather_into_tensor` / `reduce_scatter_tensor` when torch has the
    functions, not when the backend implements them: torch 2.1's gloo (the image's pinned stack)
    raises "no support for _allgather_base" on ZeRO's first multi-rank step. There, tell
    DeepSpeed's backend it lacks them, so it takes its own fallbacks (all_gather/reduce_scatter
    of tensor lists), the same data in the same order. The probe fails locally on every rank
    alike (no communication) or is one tiny all-gather, once."""
    import deepspeed.comm.comm as ds_comm
    import torch
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return  # ZeRO skips the gathers at one rank
    out = torch.empty(dist.get_world_size())
    try:
        dist.all_gather_into_tensor(out, torch.zeros(1))
    except RuntimeError:
        backend = ds_comm.cdb
        backend.all_gather_function = None
        backend.reduce_scatter_function = None


def use_environment_extension_cache() -> None:
    """Keep DeepSpeed's JIT-built ops inside the running Python environment (a venv) when it is
    writable, built by its own ninja: two environments with different DeepSpeed versions sharing
    ~/.cache/torch_extensions rebuild each other's ops (minutes each), while a venv builds once."""
    cache = os.path.join(sys.prefix, "torch_extensions")
    if "TORCH_EXTENSIONS_DIR" not in os.environ and os.access(sys.prefix, os.W_OK):
        os.environ["TORCH_EXTENSIONS_DIR"] = cache
    # torch runs the first `ninja` on PATH. The environment's own (a DeepSpeed dependency) and a
    # system one of another version hash build commands differently, so processes with different
    # PATHs would each find the op stale and rebuild it (a minute each): always use the former.
    bindir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if os.path.isfile(os.path.join(bindir, "ninja")) and path.split(os.pathsep)[0] != bindir:
        os.environ["PATH"] = os.pathsep.join([bindir, path]) if path else bindir


def build_cpu_ops(stop_requested: Callable[[], bool]) -> None:
    """prebuild_cpu_ops, in a run that can be stopped meanwhile. The supervisor's stop (SIGINT to
    the process group) reaches the compiler too: ninja exits 130 and torch raises "Error
    building extension"; once a stop was asked for, that is the stop itself, not a failure to
    show with a traceback. The half-built op is finished by the next run."""
    try:
        prebuild_cpu_ops()
    except Exception:
        if not stop_requested():
            raise  # a real build failure keeps its traceback
        from clipforge.train.loop import StopRequested  # (loop imports torch: not at start-up)

        raise StopRequested(0, during="the compilation of DeepSpeed's CPU op") from None


def prebuild_cpu_ops() -> None:
    """Compile DeepSpeed's shared-memory collective op for CPU ranks into the torch extensions
    cache; otherwise the first CPU run spends about a minute compiling it."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    use_environment_extension_cache()
    try:
        from deepspeed.comm.torch import build_shm_op
    except ImportError:  # a DeepSpeed without the op has nothing to build
        return
    build_shm_op()
