"""`python -m clipforge.eval`: retrieval recall of a CLIP model on a Chinese-CLIP-layout test set.

Works on any open_clip model and any test set in that layout:
    python -m clipforge.eval --model local-dir:models/clip --data data/test --out metrics/eval.json

A text->image query is a hit at k when any of its ground-truth images is among the k most
similar; an image->text query when any caption of the image is. This is how Chinese-CLIP counts
on Flickr30K-CN, where each image has five captions (open_clip's `get_clip_metrics` assumes one).
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from clipforge.cli import StageError, load_stage_config, run_stage, stage_parser
from clipforge.config import STAGE_SECTIONS, weights_included
from clipforge.data import testset
from clipforge.data.decontam import eval_record
from clipforge.data.testset import TestSet
from clipforge.fsutil import atomic_write_text
from clipforge.model_files import (
    LOCAL_DIR,
    ModelFilesError,
    check_model_weights,
    local_dir_weights,
    looks_like_a_file,
)

log = logging.getLogger("clipforge.eval")

# The params sections this stage reads (dvc.yaml's params: recipe plus these).
PARAM_SECTIONS = STAGE_SECTIONS["eval"]
KS = (1, 5, 10)
# R@k named with two digits (t2i_r01, t2i_r05, t2i_r10) so that tools listing keys in sorted
# order (dvc metrics show, TensorBoard's tag list) show them as R@1, R@5, R@10.
METRIC_KEYS = tuple(f"{d}_r{k:02d}" for d in ("t2i", "i2t") for k in KS) + ("mean_recall",)


def recall_at_k(similarity, relevant, ks: Sequence[int] = KS) -> dict[int, float]:
    """Percent of query rows with a relevant column among their top k (rows: queries)."""
    top = similarity.topk(min(max(ks), similarity.shape[1]), dim=1).indices
    hits = relevant.gather(1, top)  # [queries, k]: is the i-th best a relevant item?
    return {k: 100.0 * hits[:, :k].any(dim=1).float().mean().item() for k in ks}


def retrieval_metrics(image_features, text_features, relevant) -> dict[str, float]:
    """relevant[t, i]: text t describes image i. Features must be L2-normalised.

    An image that no caption describes stays in the gallery of text->image queries but is no
    image->text query: it has no right answer, so counting it would only lower the recall
    (MUGE's validation set has thousands of such images)."""
    similarity = text_features @ image_features.T
    t2i = recall_at_k(similarity, relevant)
    described = relevant.any(dim=0)
    i2t = recall_at_k(similarity.T[described], relevant.T[described])
    metrics = {f"t2i_r{k:02d}": t2i[k] for k in KS} | {f"i2t_r{k:02d}": i2t[k] for k in KS}
    metrics["mean_recall"] = sum(metrics.values()) / len(metrics)
    return metrics


def relevance_matrix(image_ids: list[int], texts):
    """Boolean [texts, images]: does text t describe image i."""
    import torch

    column = {image_id: i for i, image_id in enumerate(image_ids)}
    relevant = torch.zeros(len(texts), len(image_ids), dtype=torch.bool)
    for row, text in enumerate(texts):
        for image_id in text.image_ids:
            relevant[row, column[image_id]] = True
    return relevant


def load_open_clip(spec: str, pretrained: str | None, device: str, what: str | None = None):
    """(model, preprocess, tokenizer) through plain open_clip, as a user would, except that the
    weights must fill the whole model (clipforge.model.load_weights): open_clip alone would
    evaluate a randomly initialised model when a folder has no weights file. Weights that cannot
    be had (no network and not cached, an unknown tag) are a StageError in one line."""
    import open_clip

    from clipforge.model import load_weights, register_bundled_configs

    register_bundled_configs()
    what = what or spec
    if spec.startswith(LOCAL_DIR):
        weights = local_dir_weights(Path(spec[len(LOCAL_DIR) :]), what)
    elif pretrained and looks_like_a_file(pretrained):
        weights = Path(pretrained)
    else:  # hf-hub:, or an open_clip tag open_clip downloads: a failed download is an error
        weights = None
    # The hub logs every retry of a failed download (twice: through its handler and the root
    # one), open_clip logs the failure again before raising it: the failure is reported once,
    # below.
    logging.disable(logging.ERROR)
    try:
        model, _, preprocess = open_clip.create_model_and_transforms(
            spec,
            pretrained=None if weights else pretrained,
            load_weights=weights is None,
            pretrained_text=weights is None,  # an HF text tower's own weights: replaced anyway
            require_pretrained=weights is None,
            device=device,
        )
    except (RuntimeError, OSError) as exc:
        raise StageError(_weights_error(spec, pretrained, exc)) from None
    finally:
        logging.disable(logging.NOTSET)
    if weights:
        load_weights(model, weights, what)
    model.eval()
    return model, preprocess, open_clip.get_tokenizer(spec)


def _weights_error(spec: str, pretrained: str | None, exc: Exception) -> str:
    what = f"{spec}" + (f" with pretrained {pretrained}" if pretrained else "")
    reason = " ".join(str(exc).split())
    if "download" in reason.lower() or "offline" in reason.lower():
        return (
            f"{what}: the weights are not in the local cache (HF_HOME) and could not be "
            f"downloaded (no network?): run once where the Hugging Face hub is reachable, or "
            f"give a weights file as pretrained"
        )
    return f"{what}: cannot load the weights: {reason[:300]}"


def encode_images(model, preprocess: Callable, images: list[bytes], batch_size: int, device: str):
    import torch
    from PIL import Image

    from clipforge.data.samples import to_rgb

    chunks = []
    with torch.no_grad():
        for start in range(0, len(images), batch_size):
            batch = torch.stack(
                [
                    preprocess(to_rgb(Image.open(io.BytesIO(b))))
                    for b in images[start : start + batch_size]
                ]
            ).to(device)
            chunks.append(model.encode_image(batch, normalize=True).float().cpu())
    return torch.cat(chunks)


def encode_texts(model, tokenizer: Callable, texts: list[str], batch_size: int, device: str):
    import torch

    chunks = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            tokens = tokenizer(texts[start : start + batch_size]).to(device)
            chunks.append(model.encode_text(tokens, normalize=True).float().cpu())
    return torch.cat(chunks)


def evaluate(
    spec: str, pretrained: str | None, test_set: TestSet, batch_size: int, device: str, what: str
) -> tuple[dict, dict]:
    """(recall metrics, test set counts) of one model; `what` names it in errors (--model,
    eval.baseline_model)."""
    model, preprocess, tokenizer = load_open_clip(spec, pretrained, device, what)
    image_features = encode_images(model, preprocess, test_set.images, batch_size, device)
    text_features = encode_texts(
        model, tokenizer, [t.text for t in test_set.texts], batch_size, device
    )
    relevant = relevance_matrix(test_set.image_ids, test_set.texts)
    counts = {
        "num_images": len(test_set.image_ids),
        "num_texts": len(test_set.texts),
        "num_i2t_queries": int(relevant.any(dim=0).sum()),  # images some caption describes
    }
    return retrieval_metrics(image_features, text_features, relevant), counts


def _tags_text(name: str) -> str:
    import open_clip

    tags = open_clip.list_pretrained_tags_by_model(name)
    return f"tags for {name}: {', '.join(tags)}" if tags else f"open_clip has no tags for {name}"


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
                f"name them with {weights_option} TAG or FILE ({_tags_text(spec)})"
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
    try:
        (metrics, counts), *baseline = [
            evaluate(spec, pretrained, test_set, cfg.batch_size, device, what)
            for spec, pretrained, what, _ in models
        ]
    except ModelFilesError as exc:
        raise StageError(str(exc)) from None
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
