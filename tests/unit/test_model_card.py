"""The model card of an export (clipforge.export.card): the facts it is given, in words."""

from __future__ import annotations

from clipforge.export.card import CardFacts, render

FACTS = CardFacts(
    recipe="production-zh-roberta",
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


def test_the_card_gives_recipe_data_decontamination_and_metrics_per_suite():
    card = render(FACTS, "ChineseCLIPModel", "")
    assert "recipe `production-zh-roberta`" in card and "run-0123456789ab" in card
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
