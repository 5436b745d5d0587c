"""The eval stage's params: the `eval:` section (EvalConfig) and its test sets.

The `eval:` section (EvalConfig) and its test sets (SuiteConfig), the
only section it reads.

`python -m clipforge.eval.config` writes resolved/eval.yaml (clipforge.resolve): the `params-eval`
stage of dvc.yaml.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Literal

from clipforge import util
from clipforge.config import Params
from clipforge.fields import REQUIRED, ConfigError, Entry, Section, knob
from clipforge.model.files import weights_included

SUITE_KINDS = ("retrieval", "zero-shot-classification")
# Keys of metrics/eval.json beside the suites' names (clipforge.eval.stage): no suite is called so.
RESERVED_SUITE_NAMES = ("baseline", "delta", "mean_over_suites")
_SUITE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


@dataclass(frozen=True, kw_only=True)
class SuiteConfig(Entry):
    """One test set of eval.suites (clipforge.eval.suites reads it)."""

    name: str = knob(
        REQUIRED,
        "the suite's key in metrics/eval.json: letters, digits, `-` and `_` (no dots: DVC "
        "joins nested keys with them)",
    )
    kind: Literal["retrieval", "zero-shot-classification"] = knob(
        REQUIRED, "`retrieval` or `zero-shot-classification`"
    )
    path: str = knob(
        REQUIRED,
        "retrieval: a folder in Chinese-CLIP layout (test_imgs.tsv + test_texts.jsonl); "
        "classification: a folder with a folder of images per class, or a .tsv of "
        "`image<TAB>label` lines (image paths relative to the .tsv)",
        nonempty=True,
        path=True,
    )
    required: bool = knob(
        True, "a missing path stops the stage before any model loads; false: skipped, one line"
    )
    directions: Literal["both", "t2i"] = knob(
        "both", "retrieval: `both`, or `t2i` for a text-to-image-only set such as MUGE's"
    )
    classes: str | None = knob(
        None,
        "classification: a file of class names, one per line; labels (folder names or the "
        ".tsv's) are then 0-based line numbers, as in Chinese-CLIP's `000/` folders and "
        "label_cn.txt; null: the labels are the class names",
        path=True,
    )
    templates: str | None = knob(
        None,
        "classification: a file of prompt templates, one per line, each with one `{}` for the "
        "class name (`#` lines are comments); null: clipforge's Chinese set "
        "(clipforge/eval/templates_zh.txt)",
        path=True,
    )

    def check(self, key: str) -> None:
        if not _SUITE_NAME.fullmatch(self.name) or self.name in RESERVED_SUITE_NAMES:
            raise ConfigError(
                f"{key}.name: got {util.short_repr(self.name)}; must be letters, digits, `-` and "
                f"`_`, and none "
                f"of {', '.join(RESERVED_SUITE_NAMES)}"
            )
        if self.kind == "retrieval":
            for name in ("classes", "templates"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{key}.{name}: only for kind zero-shot-classification")
        elif self.directions != "both":
            raise ConfigError(f"{key}.directions: only for kind retrieval")


# The demo's suites: the data stage's test split, and the builtin source's two generated suites
# (clipforge.data.builtin), optional since other sources do not make them.
# Keys left out take their defaults; params.yaml spells them out (a value equal to the embedded
# default is what lets a recipe's suites apply).
DEMO_SUITES = [
    {"name": "test", "kind": "retrieval", "path": "data/test"},
    {
        "name": "t2i-distractors",
        "kind": "retrieval",
        "path": "data/suites/t2i-distractors",
        "directions": "t2i",
        "required": False,
    },
    {
        "name": "colour-shape",
        "kind": "zero-shot-classification",
        "path": "data/suites/colour-shape/test",
        "classes": "data/suites/colour-shape/label_cn.txt",
        "required": False,
    },
]


@dataclass(kw_only=True)
class EvalConfig(Section):
    SECTION = "eval"

    suites: list[SuiteConfig] = knob(
        DEMO_SUITES,
        "The test sets, each scored under its name in metrics/eval.json, with one mean over "
        "them. Each entry: `name`, `kind` (`retrieval`: Chinese-CLIP layout; "
        "`zero-shot-classification`: a folder per class or an `image<TAB>label` .tsv), `path`, "
        "`required` (false: a missing path is skipped with one line), `directions` (retrieval: "
        "`both` or `t2i`), `classes` and `templates` (classification: files of class names and "
        "of prompts with `{}`; null templates: clipforge's Chinese set). Keys and layouts: "
        "docs/pipeline.md.",
    )
    batch_size: int = knob(256, "Images or texts per encoding batch.", ge=1)
    device: Literal["auto", "cpu", "cuda"] = knob("auto", "`auto`: CUDA when available, else CPU.")
    baseline_model: str | None = knob(
        None,
        "Also evaluate this model for comparison: `local-dir:PATH`, `hf-hub:ORG/REPO`, "
        "`chinese-clip:PATH` (a Chinese-CLIP .pt or ChineseCLIPModel folder) or an open_clip "
        "name (with baseline_pretrained).",
        path=True,
    )
    baseline_pretrained: str | None = knob(
        None, "open_clip pretrained tag or file for baseline_model.", path=True
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.suites:
            raise ConfigError("eval.suites: must list at least one test set")
        names = [suite.name for suite in self.suites]
        again = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if again:
            raise ConfigError(
                f"eval.suites: two suites are named {util.short_repr(again)}; names must be unique"
            )
        if self.baseline_pretrained and not self.baseline_model:
            raise ConfigError(
                "eval.baseline_pretrained: set only together with eval.baseline_model"
            )
        if (
            self.baseline_model
            and not weights_included(self.baseline_model)
            and not self.baseline_pretrained
        ):
            raise ConfigError(
                f"eval.baseline_pretrained: required with eval.baseline_model "
                f"{util.short_repr(self.baseline_model)}, an open_clip architecture whose "
                f"weights would "
                f"otherwise be random (a tag such as openai, or a weights file)"
            )


@dataclass(kw_only=True)
class EvalParams(Params):
    """What the eval stage reads of params.yaml."""

    eval: EvalConfig = field(default_factory=EvalConfig)


if __name__ == "__main__":
    from clipforge import resolve

    sys.exit(resolve.main("eval", EvalParams))
