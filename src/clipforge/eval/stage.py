"""`python -m clipforge.eval`: retrieval recall of a CLIP model on a Chinese-CLIP-layout test set.

Works on any open_clip model and any test set in that layout:
    python -m clipforge.eval --model local-dir:models/clip --data data/test --out metrics/eval.json

How recall is counted: clipforge.metrics.retrieval.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from clipforge.cli import StageError, load_stage_config, run_stage, stage_parser
from clipforge.config import STAGE_SECTIONS, weights_included
from clipforge.data import testset
from clipforge.data.decontam import eval_record
from clipforge.eval.core import evaluate
from clipforge.eval.loading import tags_text
from clipforge.fsutil import atomic_write_text
from clipforge.metrics.retrieval import METRIC_KEYS
from clipforge.model_files import ModelFilesError, check_model_weights

log = logging.getLogger("clipforge.eval")

# The params sections this stage reads (dvc.yaml's params: recipe plus these).
PARAM_SECTIONS = STAGE_SECTIONS["eval"]


def format_table(metrics: dict, info: dict) -> str:
    rows = [("model", *METRIC_KEYS), (info["model"], *(f"{metrics[k]:.2f}" for k in METRIC_KEYS))]
    if "baseline" in metrics:
        base = metrics["baseline"]
        rows.append((info["baseline"]["model"], *(f"{base[k]:.2f}" for k in METRIC_KEYS)))
        rows.append(("delta", *(f"{metrics['delta'][k]:+.2f}" for k in METRIC_KEYS)))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(r, widths)) for r in rows)


def _run(args) -> None:
    config = load_stage_config(args, PARAM_SECTIONS)
    cfg = config.eval
    assert cfg is not None  # PARAM_SECTIONS holds eval: it is loaded
    models = [(args.model, args.pretrained, "--model", "--pretrained")]
    if cfg.baseline_model:
        models.append(
            (
                cfg.baseline_model,
                cfg.baseline_pretrained,
                "eval.baseline_model",
                "eval.baseline_pretrained",
            )
        )
    problems = []  # every input is checked, and every problem named, before a model loads
    for spec, pretrained, what, weights_option in models:
        if not weights_included(spec) and not pretrained:
            problems.append(
                f"{what} {spec}: an open_clip architecture, whose weights would be random: "
                f"name them with {weights_option} TAG or FILE ({tags_text(spec)})"
            )
            continue
        try:
            check_model_weights(spec, pretrained, what)
        except ModelFilesError as exc:
            problems.append(str(exc))
    try:
        test_set = testset.load_test_set(Path(args.data))
    except testset.TestSetError as exc:
        problems.append(str(exc))
    if problems:
        raise StageError("\n".join(problems))
    import torch

    device = (
        "cuda"
        if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        else "cpu"
    )
    (metrics, counts), *baseline = [
        evaluate(spec, pretrained, test_set, cfg.batch_size, device, what)
        for spec, pretrained, what, _ in models
    ]
    info = {"model": args.model, "pretrained": args.pretrained, "test_set": args.data, **counts}
    # was the training data (the data stage's manifest beside the test set) checked against it?
    info["decontamination"] = eval_record(Path(args.data).parent / "manifest.json", args.data)
    if baseline:
        base = baseline[0][0]
        metrics["baseline"] = base
        metrics["delta"] = {k: metrics[k] - base[k] for k in METRIC_KEYS}
        info["baseline"] = {"model": cfg.baseline_model, "pretrained": cfg.baseline_pretrained}
    out = Path(args.out)
    # The metrics file holds only what compares models (dvc metrics show lists every key of
    # it); what was evaluated, on how many images and texts, goes beside it.
    atomic_write_text(out, json.dumps(metrics, indent=2) + "\n")
    atomic_write_text(
        out.with_suffix(".info.json"), json.dumps(info, ensure_ascii=False, indent=2) + "\n"
    )
    atomic_write_text(out.with_suffix(".config.yaml"), config.to_yaml())
    print(format_table(metrics, info))


def main(argv: Sequence[str] | None = None) -> int:
    parser = stage_parser("clipforge.eval", "Retrieval recall (R@1/5/10, both directions).")
    parser.add_argument(
        "--model",
        default="local-dir:models/clip",
        help="open_clip model: local-dir:PATH, hf-hub:ORG/REPO or a name "
        "(default: local-dir:models/clip)",
    )
    parser.add_argument(
        "--pretrained",
        metavar="TAG|FILE",
        help="weights of an open_clip --model NAME: a pretrained tag (e.g. openai) or a file",
    )
    parser.add_argument("--data", default="data/test", help="test set dir (default: data/test)")
    parser.add_argument("--out", default="metrics/eval.json", help="default: metrics/eval.json")
    return run_stage("clipforge.eval", _run, argv, parser, PARAM_SECTIONS)


if __name__ == "__main__":
    raise SystemExit(main())
