"""What the supervisor runs on one node: phases in order, and the restart policy.

Written by the launcher as <node>/plan.json, read by clipforge.launcher.host.supervisor on the
host. It never holds secrets: those reach the supervisor through its environment only (see the
supervisor's `launch`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from clipforge.errors import LauncherError
from clipforge.fields import Section, knob
from clipforge.util import backoff_seconds

# Environment variables passed from the laptop to the run when set there; values are never written
# to a file, a log or a command line. The alert webhooks are secrets; the faults
# (clipforge.train.faults) let a failure path be tried on a real host; the run store's
# credentials (storage.remote) are the usual variables of its fsspec library.
STORE_ENV = (
    # s3fs (S3 and S3-compatible stores: MinIO, OSS, COS...)
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    # gcsfs: the path of a service account key (the file must be on the host)
    "GOOGLE_APPLICATION_CREDENTIALS",
    # adlfs
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
)
PASSTHROUGH_ENV = ("CLIPFORGE_ALERT_WEBHOOKS", "CLIPFORGE_FAULTS", *STORE_ENV)
# Names a container reads from its stdin at start, one value per line (docker/entrypoint.sh):
# docker would keep a value given with `--env` in the container's config, for `docker inspect`.
ENV_FROM_STDIN = "CLIPFORGE_ENV_FROM_STDIN"


@dataclass
class Phase:
    """One command; restarted on abnormal exit when `restartable`."""

    name: str
    argv: list[str]
    cwd: str
    env: dict[str, str] = field(default_factory=dict)
    restartable: bool = True
    # How to ask the command to stop (checkpoint, then exit). None: SIGINT to its process group,
    # which DVC ignores while its stage runs and the train stage treats like SIGTERM. The docker
    # runtime signals the processes inside the container instead.
    stop_argv: list[str] | None = None
    # Run before each attempt and after an abnormal exit, e.g. remove a leftover container.
    cleanup_argv: list[str] | None = None
    # Environment variables whose values (from the supervisor's environment, "" when unset) the
    # command reads on its stdin, one per line, in this order: see ENV_FROM_STDIN.
    stdin_env: list[str] = field(default_factory=list)
    # Every node runs this phase together, as one process group (the multi-node train stage):
    # an attempt runs the ranks per node that the nodes agreed on (host.gpus, `agree`).
    spans_nodes: bool = False


@dataclass(frozen=True, kw_only=True)
class RestartTimings(Section):
    """How long the supervisor waits before a restart and for a stop: fabric.yaml settings
    (clipforge.launcher.session.Settings holds them), carried in every plan."""

    SECTION = "clipforge"
    ERROR = LauncherError

    backoff_seconds: float = knob(
        30.0, "the supervisor's wait before a phase's first restart; doubles per restart...", ge=0
    )
    backoff_max_seconds: float = knob(900.0, "...up to this", ge=0)
    stop_timeout_seconds: float = knob(
        900.0, "a graceful stop's time to checkpoint before SIGKILL", gt=0
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.backoff_max_seconds < self.backoff_seconds:
            raise self.ERROR(
                f"{self.key_of('backoff_seconds')}: got {self.backoff_seconds:g}; must be <= "
                f"{self.key_of('backoff_max_seconds')} ({self.backoff_max_seconds:g})"
            )


@dataclass(frozen=True, kw_only=True)
class RestartLimits(Section):
    """How many restarts, and on how few GPUs a run goes on: `fab train` options
    (clipforge.launcher.options.TrainOptions holds them), carried in every plan."""

    ERROR = LauncherError

    @classmethod
    def key_of(cls, name: str) -> str:
        return "--" + name.replace("_", "-")  # fab train's option

    max_restarts: int = knob(5, "restarts of a phase after an abnormal exit, then it fails", ge=0)
    # clipforge.launcher.host.gpus; below it the run stops with the reason.
    min_gpus: int | None = knob(
        None, "the fewest GPUs per node a run goes on with after losing some (none: half)", ge=1
    )


@dataclass(frozen=True, kw_only=True)
class RestartPolicy(RestartLimits, RestartTimings):
    """The supervisor's restart policy: the launch's limits and the launcher's timings."""

    @classmethod
    def key_of(cls, name: str) -> str:
        # Each key named as the user sets it: a `fab train` option or a fabric.yaml setting.
        owner = RestartLimits if name in RestartLimits.__dataclass_fields__ else RestartTimings
        return owner.key_of(name)

    def delay_before(self, restart: int) -> float:
        """Seconds to wait before restart number `restart` (1-based)."""
        return backoff_seconds(restart, self.backoff_seconds, self.backoff_max_seconds)


@dataclass
class PhasePlan:
    """A node's plan.json: the phases its supervisor runs, in order, and their restart policy
    (not the batch's BatchPlan)."""

    phases: list[Phase]
    policy: RestartPolicy

    def to_json(self) -> str:
        raw = asdict(self)
        for phase in raw["phases"]:
            # Only where it is set: a run moved from the store runs its own (older) commit's
            # supervisor, which knows no such field; a single node's plan reads as before.
            if not phase["spans_nodes"]:
                del phase["spans_nodes"]
        return json.dumps(raw, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> PhasePlan:
        raw = json.loads(text)
        return cls(
            phases=[Phase(**p) for p in raw["phases"]], policy=RestartPolicy(**raw["policy"])
        )
