"""Retrieval recall@k, both directions, as the eval stage reports it and validation logs it.

A text->image query is a hit at k when any of its ground-truth images is among the k most
similar; an image->text query when any caption of the image is. This is how Chinese-CLIP counts
on Flickr30K-CN, where each image has five captions (open_clip's `get_clip_metrics` assumes one).
"""

from __future__ import annotations

from collections.abc import Sequence

from clipforge.metrics.sizes import MIN_QUERIES

KS = (1, 5, 10)
# R@k named with two digits (t2i_r01, t2i_r05, t2i_r10) so that tools listing keys in sorted
# order (dvc metrics show, TensorBoard's tag list) show them as R@1, R@5, R@10.
METRIC_KEYS = tuple(f"{d}_r{k:02d}" for d in ("t2i", "i2t") for k in KS) + ("mean_recall",)
# A text-to-image-only set (MUGE's): its mean recall is over these three, as Chinese-CLIP's is.
T2I_KEYS = tuple(f"t2i_r{k:02d}" for k in KS) + ("mean_recall",)


def recall_at_k(similarity, relevant, ks: Sequence[int] = KS) -> dict[int, float]:
    """Percent of query rows with a relevant column among their top k (rows: queries)."""
    top = similarity.topk(min(max(ks), similarity.shape[1]), dim=1).indices
    hits = relevant.gather(1, top)  # [queries, k]: is the i-th best a relevant item?
    return {k: 100.0 * hits[:, :k].any(dim=1).float().mean().item() for k in ks}


def retrieval_metrics(
    image_features, text_features, relevant, directions: str = "both"
) -> dict[str, float]:
    """relevant[t, i]: text t describes image i. Features must be L2-normalised. `directions`:
    `both`, or `t2i` for text-to-image only (T2I_KEYS).

    An image that no caption describes stays in the gallery of text->image queries but is no
    image->text query: it has no right answer, so counting it would only lower the recall
    (MUGE's validation set has thousands of such images)."""
    similarity = text_features @ image_features.T
    t2i = recall_at_k(similarity, _measurable(relevant))
    metrics = {f"t2i_r{k:02d}": t2i[k] for k in KS}
    if directions == "both":
        described = relevant.any(dim=0)
        i2t = recall_at_k(similarity.T[described], _measurable(relevant.T[described]))
        metrics |= {f"i2t_r{k:02d}": i2t[k] for k in KS}
    metrics["mean_recall"] = sum(metrics.values()) / len(metrics)
    return metrics


def _measurable(relevant):
    """`relevant` [queries, candidates], when a recall over it measures something: fewer than
    MIN_QUERIES of either is a ValueError, never a recall of 100 (every caller holds its sets to
    clipforge.metrics.sizes first)."""
    if min(relevant.shape) < MIN_QUERIES:
        raise ValueError(f"a recall over {tuple(relevant.shape)} queries x candidates")
    return relevant


def relevance_matrix(image_ids: Sequence[int], texts):
    """Boolean [texts, images]: does text t describe image i (`texts`: each with `image_ids`)."""
    import torch

    column = {image_id: i for i, image_id in enumerate(image_ids)}
    relevant = torch.zeros(len(texts), len(image_ids), dtype=torch.bool)
    for row, text in enumerate(texts):
        for image_id in text.image_ids:
            relevant[row, column[image_id]] = True
    return relevant
