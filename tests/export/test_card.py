"""The model card of an export (clipforge.export.card): the facts it is given, in words."""

from __future__ import annotations

import dataclasses

from clipforge.export.card import NOT_EVALUATED, CardFacts, render, with_eval_metrics

FACTS = CardFacts(
    model="ViT-B-32 + hfl/chinese-roberta-wwm-ext",
    run_id="run-0123456789ab",
    steps=42000,
    samples_seen=172032000,
    data_manifest_sha256="ab" * 32,
    decontamination={
        "checked": True,
        "mode": "drop",
        "method": "pHash 64-bit, <= 4 bits; exact: decoded-pixel sha256",
        "found": {"exact": 3, "near": 2, "total": 5},
        "test_images_found": 4,
        "dropped": 5,
    },
    train_metrics={"loss": 1.25, "val_loss": 1.5, "logit_scale": 100.0},
    eval_metrics={"flickr30k-cn": {"t2i_r01": 62.7, "mean_recall": 80.1}},
)


def test_the_card_gives_model_data_decontamination_and_metrics_per_suite():
    card = render(FACTS, "ChineseCLIPModel", "")
    assert "# ViT-B-32 + hfl/chinese-roberta-wwm-ext\n" in card and "run-0123456789ab" in card
    assert "ab" * 32 in card
    assert "5 training images matched 4 test images, 5 dropped (mode drop)" in card
    assert "- flickr30k-cn: t2i_r01 62.7, mean_recall 80.1" in card
    assert "- train: loss 1.25, val_loss 1.5, logit_scale 100" in card


def test_the_card_says_how_to_load_it_both_ways():
    card = render(FACTS, "ChineseCLIPModel", "")
    assert 'open_clip.create_model_and_transforms("local-dir:PATH")' in card
    assert 'ChineseCLIPModel.from_pretrained("PATH/transformers")' in card
    assert 'ChineseCLIPProcessor.from_pretrained("PATH/transformers")' in card
    assert "model.text_projection(model.text_model(**text)" in card  # get_text_features fails


def test_without_a_transformers_export_the_card_says_why():
    facts = CardFacts(**{**vars(FACTS), "decontamination": None, "eval_metrics": {}})
    card = render(facts, None, "no transformers class computes this open_clip model: x=1")
    assert "No transformers export: no transformers class computes" in card
    assert "from_pretrained" not in card
    assert "decontamination: no record" in card
    assert "eval suites: not run at export time" in card


def test_eval_puts_every_suites_metrics_and_their_mean_in_place_of_the_not_evaluated_line():
    """Not the baseline's: the card is this model's."""
    card = render(dataclasses.replace(FACTS, eval_metrics={}), "ChineseCLIPModel", "")
    assert NOT_EVALUATED in card
    evaluated = with_eval_metrics(
        card,
        {
            "flickr30k-cn": {"t2i_r01": 62.7, "mean_recall": 80.1},
            "imagenet-cn": {"top1": 41.25, "top5": 70.5},
            "mean_over_suites": 60.675,
            "baseline": {"flickr30k-cn": {"t2i_r01": 50.0}},
        },
    )
    assert NOT_EVALUATED not in evaluated
    assert "- flickr30k-cn: t2i_r01 62.7, mean_recall 80.1" in evaluated
    assert "- imagenet-cn: top1 41.25, top5 70.5" in evaluated
    assert "- mean_over_suites: value 60.67" in evaluated
    assert "50" not in evaluated.split("## Load")[0].split("## Metrics")[1]  # no baseline
