"""The `storage:` section of params.yaml: where a run is kept besides the disk it trains on.

Only the place, never a credential: each fsspec library reads its own from the environment or
its profile (s3fs: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL or ~/.aws; gcsfs:
GOOGLE_APPLICATION_CREDENTIALS; ...), so params.yaml, which is committed and saved next to every
output, holds none. Where a run is stored is not part of what it is: the run id ignores this
section (clipforge.checkpoints.checkpointer.run_id fingerprints data, model and train only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from clipforge.fields import ConfigError, Section, knob

# scheme://user:password@host, or a query string carrying a key: a credential in a URL.
_SECRET_IN_URL = re.compile(
    r"^[a-z0-9+.-]+://[^/@]*:[^/@]*@|[?&](key|secret|token|password|sig|signature)=", re.I
)


@dataclass(frozen=True, kw_only=True)
class StorageConfig(Section):
    SECTION = "storage"

    remote: str | None = knob(
        None,
        "Run store: an fsspec URL (s3://bucket/prefix, gs://..., oss://..., az://...) or a "
        "local path. While the run trains, its checkpoints, TensorBoard events, metrics and "
        "record are copied there, and the exported model at the end; a start whose local "
        "checkpoints are missing, damaged or older resumes from there, on any host. null: off. "
        "Credentials come from the library's environment or profile, never from here.",
        nonempty=True,
        path=True,
    )
    keep_checkpoints: int = knob(
        2, "Checkpoints kept in the store per run (older ones are deleted there).", ge=1
    )
    sync_logs_every_minutes: float = knob(
        5.0,
        "Interval of the upload of TensorBoard events, metrics and the run record (also after "
        "each checkpoint and at the end).",
        gt=0.0,
    )
    max_lag_seconds: float = knob(
        1800.0,
        "Alert (`store_sync_lag`) when a saved checkpoint has waited this long for its upload.",
        gt=0.0,
    )
    failures_before_alert: int = knob(
        3,
        "Failed upload attempts in a row before the `store_unreachable` alert (training goes "
        "on, and so do the attempts).",
        ge=1,
    )
    retry_backoff_seconds: float = knob(
        2.0, "Wait after a failed upload attempt; doubled after each next one...", ge=0.0
    )
    max_retry_backoff_seconds: float = knob(300.0, "...up to this.", ge=0.0)
    flush_timeout_seconds: float = knob(
        600.0,
        "How long the end of a run (or a stop) waits for its uploads; what is left stays on the "
        "local disk, and the next start of the stage uploads it.",
        ge=0.0,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.remote and _SECRET_IN_URL.search(self.remote):
            raise ConfigError(
                "storage.remote: holds a credential; give only the place (e.g. "
                "s3://bucket/prefix) and the credentials in the environment or the library's "
                "profile (AWS_ACCESS_KEY_ID, ~/.aws/credentials, ...)"
            )
        if self.max_retry_backoff_seconds < self.retry_backoff_seconds:
            raise ConfigError(
                f"storage.max_retry_backoff_seconds: got {self.max_retry_backoff_seconds}; must "
                f"be >= storage.retry_backoff_seconds ({self.retry_backoff_seconds})"
            )
