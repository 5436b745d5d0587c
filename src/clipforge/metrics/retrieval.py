"""Retrieval recall@k, both directions, as the eval stage reports it and validation logs it.

A text->image query is a hit at k when any of its ground-truth images is among the k most
similar; an image->text query when any caption of the image is. This is how Chinese-CLIP counts
on Flickr30K-CN, where each image has five captions (open_clip's `get_clip_metrics` assumes one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

KS = (1, 5, 10)
# R@k named with two digits (t2i_r01, t2i_r05, t2i_r10) so that tools listing keys in sorted
# order (dvc metrics show, TensorBoard's tag list) show them as R@1, R@5, R@10.
METRIC_KEYS = tuple(f"{d}_r{k:02d}" for d in ("t2i", "i2t") for k in KS) + ("mean_recall",)
# A text-to-image-only set (MUGE's): its mean recall is over these three, as Chinese-CLIP's is.
T2I_KEYS = tuple(f"t2i_r{k:02d}" for k in KS) + ("mean_recall",)


# A recall over fewer than MIN_QUERIES queries, or ranking fewer than MIN_QUERIES candidates,
# measures nothing: one query scores 0 or 100, one candidate is always ranked first. Under
# FEW_QUERIES, one query moves a recall by more than 10 points, and recall@10 ranking fewer
# candidates is 100 whatever the model. One rule for the data stage's held-out splits and test
# sets and the eval stage's retrieval suites.
MIN_QUERIES = 2
FEW_QUERIES = 10
_NAMES = {"t2i": "text->image", "i2t": "image->text"}
_QUERIES = {"t2i": "captions", "i2t": "images some caption describes"}
_CANDIDATES = {"t2i": ("image", "images"), "i2t": ("caption", "captions")}


@dataclass(frozen=True)
class DirectionSize:
    """One direction of a retrieval set: its queries, and the candidates each query ranks."""

    direction: str  # t2i or i2t
    queries: int
    candidates: int

    def problem(self) -> str | None:
        """Why this direction measures nothing, or None."""
        if self.queries < MIN_QUERIES:
            return (
                f"{self._queries_text()}: a recall over fewer than {MIN_QUERIES} is 0 or 100 "
                f"whatever the model"
            )
        if self.candidates < MIN_QUERIES:
            return (
                f"{self._candidates_text()}: fewer than {MIN_QUERIES}, every recall is 100 "
                f"whatever the model"
            )
        return None

    def warning(self) -> str | None:
        """What makes this direction's recalls coarse, or None."""
        if self.candidates < FEW_QUERIES:
            return (
                f"{self._candidates_text()}: recall@10 over fewer than {FEW_QUERIES} is 100 "
                f"whatever the model"
            )
        if self.queries < FEW_QUERIES:
            return (
                f"{self._queries_text()}: under {FEW_QUERIES}, one query moves each recall by "
                f"over 10 points"
            )
        return None

    def _queries_text(self) -> str:
        word = "query" if self.queries == 1 else "queries"
        return f"{_NAMES[self.direction]} has {self.queries} {word} ({_QUERIES[self.direction]})"

    def _candidates_text(self) -> str:
        one, many = _CANDIDATES[self.direction]
        word = one if self.candidates == 1 else many
        return f"{_NAMES[self.direction]} ranks {self.candidates} {word}"

    def flags(self) -> dict[str, int]:
        """What eval.json records beside the recalls of a direction with few queries or
        candidates: `<direction>_few_queries`, `<direction>_few_candidates` (their counts)."""
        flags = {}
        if self.queries < FEW_QUERIES:
            flags[f"{self.direction}_few_queries"] = self.queries
        if self.candidates < FEW_QUERIES:
            flags[f"{self.direction}_few_candidates"] = self.candidates
        return flags


def direction_sizes(
    num_images: int, num_texts: int, num_described: int, directions: str = "both"
) -> list[DirectionSize]:
    """t2i: each caption ranks every image; i2t (`both`): each image some caption describes
    ranks every caption (retrieval_metrics' queries)."""
    sizes = [DirectionSize("t2i", num_texts, num_images)]
    if directions == "both":
        sizes.append(DirectionSize("i2t", num_described, num_texts))
    return sizes


def recall_at_k(similarity, relevant, ks: Sequence[int] = KS) -> dict[int, float]:
    """Percent of query rows with a relevant column among their top k (rows: queries). Fewer than
    MIN_QUERIES queries or candidates measure nothing: a ValueError, since every caller checks
    its sets first (DirectionSize.problem)."""
    if min(relevant.shape) < MIN_QUERIES:
        raise ValueError(f"recall over {tuple(relevant.shape)} queries x candidates")
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
    t2i = recall_at_k(similarity, relevant)
    metrics = {f"t2i_r{k:02d}": t2i[k] for k in KS}
    if directions == "both":
        described = relevant.any(dim=0)
        i2t = recall_at_k(similarity.T[described], relevant.T[described])
        metrics |= {f"i2t_r{k:02d}": i2t[k] for k in KS}
    metrics["mean_recall"] = sum(metrics.values()) / len(metrics)
    return metrics


def relevance_matrix(image_ids: Sequence[int], texts):
    """Boolean [texts, images]: does text t describe image i (`texts`: each with `image_ids`)."""
    import torch

    column = {image_id: i for i, image_id in enumerate(image_ids)}
    relevant = torch.zeros(len(texts), len(image_ids), dtype=torch.bool)
    for row, text in enumerate(texts):
        for image_id in text.image_ids:
            relevant[row, column[image_id]] = True
    return relevant
