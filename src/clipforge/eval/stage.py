"""`python -m clipforge.eval`: a CLIP model scored on every test suite of eval.suites.

Works on any open_clip model; a suite is a retrieval test set in Chinese-CLIP's layout or a
zero-shot classification set (clipforge.eval.suites):
    python -m clipforge.eval --model local-dir:models/clip --out metrics/eval.json
    python -m clipforge.eval --model local-dir:models/clip --data data/test   # one test set

metrics/eval.json holds what compares models, and nothing else (`dvc metrics show` lists every
key): each suite's metrics under its name (recall: clipforge.metrics.retrieval; accuracy:
clipforge.metrics.classification), with the counts of a direction too small to trust fully as
flags (Suite.flags), `mean_over_suites` (the mean of each suite's headline number: mean_recall,
or top1), and with eval.baseline_model the baseline's, in the same layout, and the deltas. What
was scored, on how many images, and which suites were skipped goes beside it (eval.info.json).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from clipforge import envrecord
from clipforge.cli import load_stage_config, path_argument, run_stage, stage_parser
from clipforge.data.decontam import eval_record, not_checked
from clipforge.errors import StageError
from clipforge.eval.config import EvalParams, SuiteConfig
from clipforge.eval.core import evaluate
from clipforge.eval.suites import Suite, load_suites
from clipforge.export.card import CARD_FILE, with_eval_metrics
from clipforge.export.loading import tags_text
from clipforge.fsutil import atomic_write_text
from clipforge.metrics import classification, retrieval
from clipforge.model.files import ModelFilesError, check_model_weights, weights_included
from clipforge.progress import ProgressFile

log = logging.getLogger("clipforge.eval")

# What this stage reads of params.yaml (dvc.yaml's params: its sections).
PARAMS = EvalParams
MEAN_KEY = "mean_over_suites"
MODEL_CARD = "model-card.md"  # beside eval.json: the export's card with these metrics
# The one number of each kind that the mean over suites averages.
HEADLINE = {"retrieval": "mean_recall", "zero-shot-classification": "top1"}
# Table columns, in this order: every key a suite can have.
COLUMNS = (*retrieval.METRIC_KEYS, *classification.METRIC_KEYS)


def metrics_record(scores: dict[str, dict], suites: list[Suite]) -> dict:
    """One model's part of eval.json: its suites' metrics under their names, each with its flags
    (a direction of few queries: Suite.flags), and the mean of their headline numbers."""
    record: dict = {suite.name: {**scores[suite.name], **suite.flags()} for suite in suites}
    headlines = [scores[s.name][HEADLINE[s.config.kind]] for s in suites]
    record[MEAN_KEY] = sum(headlines) / len(headlines)
    return record


def delta_record(model: dict, baseline: dict) -> dict:
    """model - baseline, metric by metric, in the same layout (flags are counts, not scores)."""
    return {
        name: (
            {k: value[k] - baseline[name][k] for k in value if k in COLUMNS}
            if isinstance(value, dict)
            else value - baseline[name]
        )
        for name, value in model.items()
    }


def format_table(metrics: dict, width: int = 80) -> str:
    """A row per suite and model (the model, its baseline, the delta), a column per metric; where
    that is wider than `width` (the terminal's), the metrics in blocks that fit, each block with
    the suite and model columns again."""
    parts = [("model", metrics, "{:.2f}")]
    if "baseline" in metrics:
        parts += [("baseline", metrics["baseline"], "{:.2f}")]
        parts += [("delta", metrics["delta"], "{:+.2f}")]
    names = [
        k for k, v in metrics.items() if isinstance(v, dict) and k not in ("baseline", "delta")
    ]
    rows = [("suite", "", *COLUMNS)]
    for name in names:
        for label, record, number in parts:
            values = [number.format(record[name][k]) if k in record[name] else "-" for k in COLUMNS]
            rows.append((name, label, *values))
    for label, record, number in parts:
        rows.append((MEAN_KEY, label, number.format(record[MEAN_KEY]), *[""] * (len(COLUMNS) - 1)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    blocks = _column_blocks(widths, width)
    lines: list[str] = []
    for block in blocks:
        if len(blocks) > 1 and lines:
            lines.append("")
        for row in rows:
            cells = [row[i].ljust(widths[i]) if i < 2 else row[i].rjust(widths[i]) for i in block]
            if any(row[i] for i in block[2:]):  # not the mean's row in a block without its number
                lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _column_blocks(widths: list[int], width: int) -> list[list[int]]:
    """The metric columns (from the third) in runs that fit `width` after the two key columns
    (at least one metric a block, however narrow the terminal)."""
    keys = widths[0] + 2 + widths[1]
    blocks: list[list[int]] = []
    used = width
    for i in range(2, len(widths)):
        if used + 2 + widths[i] > width:
            blocks.append([0, 1])
            used = keys
        blocks[-1].append(i)
        used += 2 + widths[i]
    return blocks


def _suite_configs(args, suites: list[SuiteConfig]) -> list[SuiteConfig]:
    if args.data:  # one retrieval test set, as the stage scored before eval.suites
        return [SuiteConfig(name="test", kind="retrieval", path=args.data)]
    if args.data_root:
        return [dataclasses.replace(s, path=under_root(s.path, args.data_root)) for s in suites]
    return suites


def under_root(path: str, data_root: str) -> str:
    """A suite path under the pipeline's `data/` read from `data_root` instead (the run's data on
    a mounted volume); any other path as given."""
    parts = PurePosixPath(path).parts
    if parts and parts[0] == "data":
        return str(PurePosixPath(data_root, *parts[1:]))
    return path


def _suite_manifests(suite: Suite) -> list[Path]:
    """Where the data stage's manifest of a suite's data is: beside the test set, or above the
    demo's data/suites/<name>."""
    path = Path(suite.config.path)
    return [p / "manifest.json" for p in (path.parent, path.parent.parent)]


def _data_manifest(suites: list[Suite]) -> Path | None:
    """The data manifest of the first suite that has one (the pipeline's data/manifest.json)."""
    return next((m for s in suites for m in _suite_manifests(s) if m.is_file()), None)


def _decontamination(suite: Suite) -> dict:
    if suite.config.kind != "retrieval":
        return not_checked("classification suites are not checked against the training data")
    # was the training data checked against it?
    manifests = _suite_manifests(suite)
    found = next((m for m in manifests if m.is_file()), manifests[0])
    return eval_record(found, Path(suite.config.path))


def _run(args) -> None:
    config = load_stage_config(args, PARAMS)
    cfg = config.eval
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
    suites, skipped, suite_problems = load_suites(_suite_configs(args, cfg.suites))
    problems += suite_problems
    if not suites and not problems:
        problems.append(f"eval.suites: none of {', '.join(skipped)} is there: nothing to score")
    if problems:
        raise StageError("\n".join(problems))
    for name, reason in skipped.items():
        log.warning("suite %s skipped (optional): %s", name, reason)
    for warning in (w for suite in suites for w in suite.warnings()):
        log.warning("%s (flagged in %s)", warning, args.out)
    # Under the supervisor, a stage silent for the run's stall timeout is a hang (it reads no
    # alerts: section; its beats name no timeout and the supervisor applies the run's).
    progress = ProgressFile.from_environment(0, None)
    beat = (lambda: progress.beat(None, "evaluating")) if progress else (lambda: None)
    if progress:
        progress.doing("loading the model to evaluate", None, "alerts.stall_timeout_seconds")
    import torch

    device = (
        "cuda"
        if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        else "cpu"
    )
    scores, *baseline = [
        evaluate(spec, pretrained, suites, cfg.batch_size, device, what, beat)
        for spec, pretrained, what, _ in models
    ]
    metrics = metrics_record(scores, suites)
    info: dict = {
        "model": args.model,
        "pretrained": args.pretrained,
        "suites": {
            s.name: {
                "kind": s.config.kind,
                "path": s.config.path,
                **s.counts(),
                "decontamination": _decontamination(s),
            }
            for s in suites
        },
        "skipped": skipped,
        envrecord.RESULT_KEY: envrecord.gather(
            "eval stage", params_text=config.to_yaml(), data_manifest=_data_manifest(suites)
        ).to_dict(),
    }
    if baseline:
        metrics["baseline"] = metrics_record(baseline[0], suites)
        metrics["delta"] = delta_record(
            {k: v for k, v in metrics.items() if k != "baseline"}, metrics["baseline"]
        )
        info["baseline"] = {"model": cfg.baseline_model, "pretrained": cfg.baseline_pretrained}
    out = Path(args.out)
    atomic_write_text(out, json.dumps(metrics, indent=2) + "\n")
    atomic_write_text(
        out.with_suffix(".info.json"), json.dumps(info, ensure_ascii=False, indent=2) + "\n"
    )
    atomic_write_text(out.with_suffix(".config.yaml"), config.to_yaml())
    write_model_card(args.model, metrics, out.with_name(MODEL_CARD))
    print(format_table(metrics, shutil.get_terminal_size((80, 24)).columns))


def write_model_card(model: str, metrics: dict, path: Path) -> None:
    """The card to publish with the model: the export's own (models/clip/README.md, written by
    the train stage before any eval) with this stage's metrics in it. Beside eval.json, not in
    the export, which is the train stage's output. Only for our own exports (local-dir: with a
    card)."""
    export = Path(model.removeprefix("local-dir:")) if model.startswith("local-dir:") else None
    card = export / CARD_FILE if export else None
    if card is None or not card.is_file():
        return
    atomic_write_text(path, with_eval_metrics(card.read_text(encoding="utf-8"), metrics))


def main(argv: Sequence[str] | None = None) -> int:
    parser = stage_parser(
        "clipforge.eval", "Retrieval recall and zero-shot accuracy on every suite of eval.suites."
    )
    parser.add_argument(
        "--model",
        type=path_argument,
        default="local-dir:models/clip",
        help="model: local-dir:PATH, hf-hub:ORG/REPO, chinese-clip:PATH (a Chinese-CLIP .pt or "
        "ChineseCLIPModel folder) or an open_clip name (default: local-dir:models/clip)",
    )
    parser.add_argument(
        "--pretrained",
        type=path_argument,
        metavar="TAG|FILE",
        help="weights of an open_clip --model NAME: a pretrained tag (e.g. openai) or a file",
    )
    parser.add_argument(
        "--data",
        type=path_argument,
        metavar="DIR",
        help="score only this retrieval test set (Chinese-CLIP layout), as suite `test`, instead "
        "of eval.suites",
    )
    parser.add_argument(
        "--data-root",
        type=path_argument,
        metavar="DIR",
        help="read eval.suites' files under data/ from DIR instead (the run's data elsewhere)",
    )
    parser.add_argument(
        "--out", type=path_argument, default="metrics/eval.json", help="default: metrics/eval.json"
    )
    return run_stage("clipforge.eval", _run, argv, parser, PARAMS)


if __name__ == "__main__":
    raise SystemExit(main())
