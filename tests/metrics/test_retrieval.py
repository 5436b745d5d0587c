"""Recall@k with several captions per image, counted as Chinese-CLIP does."""

from __future__ import annotations

import pytest
import torch

from clipforge.data.testset import Caption
from clipforge.metrics.retrieval import recall_at_k, relevance_matrix, retrieval_metrics


def test_multi_caption_recall_on_a_hand_made_case():
    """Two images; image 10 has captions 0 and 1, image 20 has caption 2.

    Similarities (rows: texts) are set so that text 0 ranks image 20 first (a miss at R@1), text 1
    and text 2 rank their own image first. For image->text, image 10 ranks caption 2 first but
    caption 1 second: a hit at R@2 through its *second* caption, which a one-caption-per-image
    metric would miss.
    """
    image_ids = [10, 20]
    texts = [Caption(0, "a", (10,)), Caption(1, "b", (10,)), Caption(2, "c", (20,))]
    relevant = relevance_matrix(image_ids, texts)
    similarity = torch.tensor(
        [
            [0.1, 0.9],  # text 0: wrong image first
            [0.8, 0.2],  # text 1: right
            [0.3, 0.7],
        ]
    )  # text 2: right
    t2i = recall_at_k(similarity, relevant, ks=(1, 2))
    assert t2i == {1: pytest.approx(200 / 3), 2: 100.0}
    # image 10 vs texts: [0.1, 0.8, 0.3] -> best is text 1 (its own): hit at 1
    # image 20 vs texts: [0.9, 0.2, 0.7] -> best is text 0 (not its own), then text 2: hit at 2
    i2t = recall_at_k(similarity.T, relevant.T, ks=(1, 2))
    assert i2t == {1: 50.0, 2: 100.0}


def test_a_caption_describing_two_images_is_a_hit_for_either():
    texts = [Caption(0, "two cats", (1, 2))]
    relevant = relevance_matrix([1, 2, 3], texts)
    assert recall_at_k(torch.tensor([[0.1, 0.9, 0.5]]), relevant, ks=(1,)) == {1: 100.0}


def test_metrics_have_the_documented_keys_and_a_perfect_model_scores_100():
    features = torch.nn.functional.normalize(torch.randn(4, 8), dim=1)
    texts = [Caption(i, str(i), (i,)) for i in range(4)]
    metrics = retrieval_metrics(features, features, relevance_matrix(list(range(4)), texts))
    assert set(metrics) == {
        "t2i_r01",
        "t2i_r05",
        "t2i_r10",
        "i2t_r01",
        "i2t_r05",
        "i2t_r10",
        "mean_recall",
    }
    assert all(value == 100.0 for value in metrics.values())


def test_an_image_no_caption_describes_is_in_the_gallery_but_no_image_to_text_query():
    """MUGE's validation set has many images no query points to: they make text->image harder
    (the gallery is bigger) but have no right caption, so as image->text queries they could only
    lower the recall. A perfect model scores 100 both ways."""
    image_features = torch.nn.functional.normalize(torch.randn(5, 8), dim=1)
    texts = [Caption(i, str(i), (i,)) for i in range(3)]  # images 3 and 4: distractors
    relevant = relevance_matrix(list(range(5)), texts)
    metrics = retrieval_metrics(image_features, image_features[:3], relevant)
    assert metrics["i2t_r01"] == 100.0 and metrics["t2i_r01"] == 100.0
