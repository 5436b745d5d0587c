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
from clipforge.fsutil import atomic_write_text

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
    """relevant[t, i]: text t describes image i. Features must be L2-normalised."""
    similarity = text_features @ image_features.T
    t2i = recall_at_k(similarity, relevant)
    i2t = recall_at_k(similarity.T, relevant.T)
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


def load_open_clip(spec: str, pretrained: str | None, device: str):
    """(model, preprocess, tokenizer) through plain open_clip, exactly as a user would. Weights
    that cannot be had (no network and not cached, an unknown tag) are a StageError in one line."""
    import open_clip

    from clipforge.model import register_bundled_configs

    register_bundled_configs()
    # The hub logs every retry of a failed download (twice: through its handler and the root
    # one), open_clip logs the failure again before raising it: the failure is reported once,
    # below.
    logging.disable(logging.ERROR)
    try:
        model, _, preprocess = open_clip.create_model_and_transforms(
            spec, pretrained=pretrained, device=device
        )
    except (RuntimeError, OSError) as exc:
        raise StageError(_weights_error(spec, pretrained, exc)) from None
    finally:
        logging.disable(logging.NOTSET)
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

    chunks = []
    with torch.no_grad():
        for start in range(0, len(images), batch_size):
            batch = torch.stack(
                [
                    preprocess(Image.open(io.BytesIO(b)).convert("RGB"))
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
    spec: str, pretrained: str | None, test_dir: Path, batch_size: int, device: str
) -> tuple[dict, dict]:
    """(recall metrics, test set counts)."""
    from clipforge.data import testset

    images = list(testset.read_images(test_dir))
    texts = testset.read_texts(test_dir)
    model, preprocess, tokenizer = load_open_clip(spec, pretrained, device)
    image_features = encode_images(model, preprocess, [b for _, b in images], batch_size, device)
    text_features = encode_texts(model, tokenizer, [t.text for t in texts], batch_size, device)
    metrics = retrieval_metrics(
        image_features, text_features, relevance_matrix([i for i, _ in images], texts)
    )
    return metrics, {"num_images": len(images), "num_texts": len(texts)}


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
    test_dir = Path(args.data)
    for name in ("test_imgs.tsv", "test_texts.jsonl"):
        if not (test_dir / name).is_file():
            raise StageError(
                f"{test_dir / name} not found: --data must be a test set in "
                f"Chinese-CLIP layout (test_imgs.tsv + test_texts.jsonl)"
            )
    if args.model.startswith("local-dir:") and not Path(args.model[10:]).is_dir():
        raise StageError(f"--model {args.model}: no such directory; run the train stage first")
    if not weights_included(args.model) and not args.pretrained:
        raise StageError(
            f"--model {args.model}: an open_clip architecture, whose weights would be random: "
            f"name them with --pretrained TAG or FILE ({_tags_text(args.model)})"
        )
    import torch

    cfg = config.eval
    device = (
        "cuda"
        if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        else "cpu"
    )
    try:
        metrics, counts = evaluate(args.model, args.pretrained, test_dir, cfg.batch_size, device)
        info = {"model": args.model, "pretrained": args.pretrained, "test_set": str(test_dir)}
        info.update(counts)
        if cfg.baseline_model:
            base, _ = evaluate(
                cfg.baseline_model, cfg.baseline_pretrained, test_dir, cfg.batch_size, device
            )
            metrics["baseline"] = base
            metrics["delta"] = {k: metrics[k] - base[k] for k in METRIC_KEYS}
            info["baseline"] = {"model": cfg.baseline_model, "pretrained": cfg.baseline_pretrained}
    except ValueError as exc:
        raise StageError(f"{test_dir}: {exc}") from None
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
