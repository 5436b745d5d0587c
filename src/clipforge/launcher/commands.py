"""The commands a run is made of, as data: no I/O here, so each one is checked as a list.

What runs is always an existing engine: `dvc exp run -S ...` for a single node, DeepSpeed's own
launcher (no-SSH mode: one launcher per node with its node rank) for several, `docker run` around
either for the docker runtime. The supervisor runs these argv lists as they are (no shell).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field

from clipforge.envrecord import IMAGE_ENV
from clipforge.fault_record import FAULT_RECORD_ENV
from clipforge.launcher.host.gpus import hostfile_node
from clipforge.launcher.host.plan import (
    ENV_FROM_STDIN,
    PASSTHROUGH_ENV,
    Phase,
    PhasePlan,
    RestartPolicy,
)
from clipforge.launcher.host.run_dirs import NodeLayout
from clipforge.launcher.options import TrainOptions
from clipforge.store.remote import RUN_RECORD_ENV

# Inside the training image `python` is the image's interpreter (see docker/).
IMAGE_PYTHON = "python"


def dvc_train_argv(python: str, overrides: tuple[str, ...]) -> list[str]:
    """The train stage through DVC: `-S` applies each override to params.yaml, and `dvc exp run`
    reproduces what is out of date (the data stage too, with --data build) and records the
    experiment. Rerun after a crash, it trains on from the latest checkpoint (same params, same
    train run id)."""
    sets = [arg for item in overrides for arg in ("-S", item)]
    return [python, "-m", "dvc", "exp", "run", *sets, "train"]


def dvc_eval_argv(python: str, overrides: tuple[str, ...]) -> list[str]:
    """The eval stage through DVC, after train: the same `-S` leave train up to date, so this
    evaluates the exported model on the params' test sets and records the experiment again, now
    with every stage's results (the one `fab fetch` brings home)."""
    sets = [arg for item in overrides for arg in ("-S", item)]
    return [python, "-m", "dvc", "exp", "run", *sets, "eval"]


def direct_eval_argv(python: str, overrides: tuple[str, ...], data_dir: str) -> list[str]:
    """The eval stage without DVC: the model rank 0 exported (models/clip in the checkout) on
    every eval suite, those under data/ read from the run's data; metrics/eval.json and
    eval.info.json as the stage writes them."""
    sets = [arg for item in overrides for arg in ("--set", item)]
    return [python, "-m", "clipforge.eval", *sets, "--data-root", data_dir]


def dvc_pull_argv(python: str) -> list[str]:
    """The data stage's outputs recorded in the commit's dvc.lock, from the configured remote."""
    return [python, "-m", "dvc", "pull", "data"]


def dvc_data_argv(python: str, overrides: tuple[str, ...]) -> list[str]:
    sets = [arg for item in overrides for arg in ("-S", item)]
    return [python, "-m", "dvc", "exp", "run", *sets, "data"]


def stage_args(overrides: tuple[str, ...], data_dir: str, checkpoints_dir: str | None) -> list[str]:
    args = [arg for item in overrides for arg in ("--set", item)] + ["--data", data_dir]
    if checkpoints_dir:
        args += ["--checkpoints", checkpoints_dir]
    return args


def direct_train_argv(python: str, overrides: tuple[str, ...], data_dir: str) -> list[str]:
    """The train stage without DVC (data on a mounted volume). With ranks_per_node > 1 the stage
    re-executes itself under DeepSpeed's launcher."""
    return [python, "-m", "clipforge.train", *stage_args(overrides, data_dir, None)]


def hostfile_text(hosts: list[str], slots: int) -> str:
    """DeepSpeed's resource list: one line per node. In no-SSH mode nothing connects to these
    names; they only size the world and order the nodes."""
    return "".join(f"{hostfile_node(i)} slots={slots}\n" for i, _ in enumerate(hosts))


def multinode_train_argv(
    python: str,
    *,
    node_rank: int,
    num_nodes: int,
    ranks_per_node: int,
    master_addr: str,
    master_port: int,
    hostfile: str,
    overrides: tuple[str, ...],
    data_dir: str,
    checkpoints_dir: str,
) -> list[str]:
    """One node's DeepSpeed launcher in no-SSH mode: every node runs its own, with its rank; rank 0
    of node 0 (at master_addr:master_port) is where the process group meets."""
    return [
        python,
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        hostfile,
        "--no_ssh",
        "--node_rank",
        str(node_rank),
        "--num_nodes",
        str(num_nodes),
        "--num_gpus",
        str(ranks_per_node),
        "--master_addr",
        master_addr,
        "--master_port",
        str(master_port),
        "--no_local_rank",
        "--module",
        "clipforge.train",
        *stage_args(overrides, data_dir, checkpoints_dir),
    ]


def smoke_argv(python: str, layout: NodeLayout, resume: list[str]) -> list[str]:
    return [
        python,
        "-m",
        "clipforge.launcher.host.smoke",
        "--workspace",
        layout.code,
        "--result",
        layout.smoke_result,
        "--node-rank",
        str(layout.node_rank),
        "--",
        *resume,
    ]


@dataclass(frozen=True)
class DockerSpec:
    """How a command runs inside the pinned image."""

    image: str
    name: str  # container name: one per node and phase (run_container names them)
    user: str  # "uid:gid" of the SSH user, so files in the mounted run dir stay theirs
    run_dir: str  # mounted at the same path, so paths in the run record hold inside and out
    workdir: str
    home: str
    shm_size: str
    gpus: int = 0  # 0: no device request (CPU)
    data_dir: str | None = None  # a mounted dataset volume, read-only
    env: dict[str, str] = field(default_factory=dict)
    read_only: bool = False  # the run dir mounted read-only: the command only looks at the run
    detach: bool = False  # `docker run -d`: returns once the container has started
    # PASSTHROUGH_ENV (secrets) read from stdin by the entrypoint: the supervisor writes them
    secrets_on_stdin: bool = False


def container_prefix(launch_id: str) -> str:
    """Every container of a run is named with this prefix."""
    return f"clipforge-{launch_id}-"


def run_container(image: str, layout: NodeLayout, what: str, **spec) -> DockerSpec:
    """A container working on this node's run (`what`: its part, e.g. n0-train): the run dir at
    the same path, the checkout as working directory, the node's own HOME."""
    return DockerSpec(
        image=image,
        name=container_prefix(layout.launch_id) + what,
        run_dir=layout.run_dir,
        workdir=layout.code,
        home=layout.home,
        **spec,
    )


def docker_run_argv(spec: DockerSpec, inner: list[str]) -> list[str]:
    argv = [
        "docker",
        "run",
        "--rm",
        "--init",
        *(["--detach"] if spec.detach else []),
        "--name",
        spec.name,
        # NCCL between nodes and DeepSpeed's master port need the host's network.
        "--network",
        "host",
        "--shm-size",
        spec.shm_size,
        "--ulimit",
        "stack=67108864",
        "--user",
        spec.user,
        "--workdir",
        spec.workdir,
        "--volume",
        f"{spec.run_dir}:{spec.run_dir}" + (":ro" if spec.read_only else ""),
    ]
    if spec.gpus:
        # a device request for that many GPUs; unlimited locked memory for CUDA's pinned host
        # buffers and NCCL. Not asked for on the CPU: some engines (rootless, sandboxed) may not
        # raise it, and nothing there needs it.
        argv += ["--gpus", str(spec.gpus), "--ulimit", "memlock=-1"]
    if spec.data_dir:
        argv += ["--volume", f"{spec.data_dir}:{spec.data_dir}:ro"]
    env = {
        "HOME": spec.home,
        "PYTHONPATH": posixpath.join(spec.workdir, "src"),
        IMAGE_ENV: spec.image,  # for the environment record of each result
        **spec.env,
    }
    for name, value in sorted(env.items()):
        argv += ["--env", f"{name}={value}"]
    if spec.secrets_on_stdin:
        # Names only: the values go to the entrypoint's stdin, so no command line and no
        # `docker inspect` shows a secret.
        argv += ["--interactive", "--env", f"{ENV_FROM_STDIN}={','.join(PASSTHROUGH_ENV)}"]
    return argv + [spec.image, *inner]


def docker_stop_argv(name: str) -> list[str]:
    """SIGINT to every process in the container but its init: the train stage checkpoints and
    exits, DVC (which ignores SIGINT while its stage runs) then exits, and so does the container.
    The shell's own `kill`: a minimal image has no kill program (procps)."""
    return ["docker", "exec", name, "sh", "-c", "kill -INT -1"]


def docker_cleanup_argv(name: str) -> list[str]:
    return ["docker", "rm", "--force", name]


@dataclass(frozen=True)
class NodeContext:
    """Facts about one node that the phases depend on."""

    layout: NodeLayout
    hosts: list[str]
    master_addr: str
    host_python: str  # the python on the host (runs the supervisor; the stage too with `host`)
    user: str  # "uid:gid" on the host
    image: str
    shm_size: str
    env: dict[str, str] = field(default_factory=dict)  # this node's own, e.g. GLOO_SOCKET_IFNAME


def node_plan(
    options: TrainOptions, node: NodeContext, policy: RestartPolicy, init_dvc: bool = False
) -> PhasePlan:
    """Phases for one node: get the data, train, evaluate (node 0, which holds the exported
    model), and with --smoke reload the checkpoint last (after eval: a reload that trained on
    would then not change the numbers the run reports).
    `init_dvc`: the commit has no .dvc/, so the checkout is made a DVC repository first."""
    layout = node.layout
    docker = options.runtime == "docker"
    python = IMAGE_PYTHON if docker else node.host_python
    data_dir = options.data if options.mounted_data else layout.output("data")
    inner: list[tuple[str, list[str], bool]] = []  # (name, argv, restartable)
    if init_dvc and (options.through_dvc or options.data == "build"):
        # Idempotent, so that a supervisor started again (`fab train --resume`) may rerun it.
        inner.append(
            (
                "dvc-init",
                ["sh", "-c", 'test -d .dvc || exec "$0" -m dvc init --quiet', python],
                False,
            )
        )
    if options.data == "pull":
        inner.append(("data", dvc_pull_argv(python), True))
    elif options.data == "build" and not options.through_dvc:
        inner.append(("data", dvc_data_argv(python, options.overrides), True))
    if options.through_dvc:
        train = dvc_train_argv(python, options.overrides)
        resume = [python, "-m", "clipforge.train"]  # params.yaml as `dvc exp run -S` left it
    elif options.nodes > 1:
        train = multinode_train_argv(
            python,
            node_rank=layout.node_rank,
            num_nodes=options.nodes,
            ranks_per_node=max(options.gpus, 1),
            master_addr=node.master_addr,
            master_port=options.master_port,
            hostfile=layout.hostfile,
            overrides=options.overrides,
            data_dir=data_dir,
            checkpoints_dir=layout.shared_checkpoints,
        )
        resume = train
    else:
        train = direct_train_argv(python, options.overrides, data_dir)
        resume = train
    inner.append(("train", train, True))
    if options.through_dvc:
        inner.append(("eval", dvc_eval_argv(python, options.overrides), True))
    elif layout.node_rank == 0:
        inner.append(("eval", direct_eval_argv(python, options.overrides, data_dir), True))
    if options.smoke:
        inner.append(("smoke", smoke_argv(python, layout, resume), False))

    # The launch's record goes to the run store with the run (clipforge.store.uploader); a
    # stage's deterministic fault to its supervisor (clipforge.fault_record), from a container too.
    env = {
        **options.env,
        **node.env,
        RUN_RECORD_ENV: layout.record,
        FAULT_RECORD_ENV: layout.fault_record,
    }
    phases = []
    for name, argv, restartable in inner:
        spans_nodes = name == "train" and options.nodes > 1  # one process group of every node
        if docker:
            spec = run_container(
                node.image,
                layout,
                f"n{layout.node_rank}-{name}",
                gpus=options.gpus,
                user=node.user,
                shm_size=node.shm_size,
                env=env,
                data_dir=options.data if options.mounted_data else None,
                secrets_on_stdin=True,
            )
            phases.append(
                Phase(
                    name=name,
                    argv=docker_run_argv(spec, argv),
                    cwd=layout.code,
                    restartable=restartable,
                    stop_argv=docker_stop_argv(spec.name),
                    cleanup_argv=docker_cleanup_argv(spec.name),
                    stdin_env=list(PASSTHROUGH_ENV),
                    spans_nodes=spans_nodes,
                )
            )
        else:
            phases.append(
                Phase(
                    name=name,
                    argv=argv,
                    cwd=layout.code,
                    env=env,
                    restartable=restartable,
                    spans_nodes=spans_nodes,
                )
            )
    return PhasePlan(phases=phases, policy=policy)
