"""Every section of params.yaml, each from the stage that owns it.

Every section of params.yaml, each from the stage that owns it: what `fab train` checks whole
before it ships a run, records in the run's record, and what params.yaml documents."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from clipforge.alerts.config import AlertsConfig
from clipforge.config import Params, load_params
from clipforge.data.config import DataConfig, DataParams
from clipforge.eval.config import EvalConfig, EvalParams
from clipforge.model.config import ModelConfig
from clipforge.store.config import StorageConfig
from clipforge.train.config import TrainConfig, TrainParams, check_tower_locks


@dataclass(kw_only=True)
class PipelineParams(Params):
    """Every section, in params.yaml's order (clipforge.config.SECTION_NAMES)."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)

    def __post_init__(self) -> None:
        check_tower_locks(self.model, self.train)


# What each pipeline stage reads (its `python -m clipforge.<stage>.config` writes it resolved).
STAGE_PARAMS: dict[str, type[Params]] = {
    "data": DataParams,
    "train": TrainParams,
    "eval": EvalParams,
}


def load_pipeline_params(
    params_path: str | Path | None = "params.yaml", overrides: Sequence[str] = ()
) -> PipelineParams:
    return load_params(PipelineParams, params_path, overrides)


def field_docs() -> dict[str, str]:
    """Dotted key -> documentation, for every knob (params.yaml's comments are these)."""
    docs = {}
    for name, section in PipelineParams.sections().items():
        docs.update({f"{name}.{f.name}": f.metadata["doc"] for f in section.knobs()})
    return docs
