"""How many queries, candidates and classes a metric needs to measure anything.

How many queries, candidates and classes a metric needs to measure anything: one rule for the
data stage's held-out splits and test sets and the eval stage's suites. A leaf of its own, so
that the data stage, which holds its test sets to it, does not depend on how recall is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

# Over one class, top-1 is 100% whatever the model: a classification suite needs at least this many.
MIN_CLASSES = 2

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
