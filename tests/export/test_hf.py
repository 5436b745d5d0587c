"""The train stage's transformers export (clipforge.export.hf): the same model as open_clip's
export, checked by loading both and comparing what they compute on the same inputs."""

from __future__ import annotations

import io
import sys

import open_clip
import pytest
import torch
from PIL import Image

from clipforge.data import testset
from clipforge.eval.core import encode_images, encode_texts
from clipforge.export.hf import (
    CHINESE_CLIP,
    CLIP,
    NotRepresentable,
    clip_model,
    hf_class,
    open_clip_to_clip,
)
from clipforge.export.loading import load_open_clip
from clipforge.export.local_dir import export_model
from clipforge.fsutil import sha256_file
from clipforge.metrics.retrieval import relevance_matrix, retrieval_metrics
from clipforge.model.config import ModelConfig
from clipforge.model.factory import build_model
from tests.support.hf_tower import make_tiny_chinese_tower

pytestmark = pytest.mark.slow

MIN_COSINE = 0.9999
# Chinese punctuation and quotes (full-width, curly: ftfy rewrites them before open_clip's BPE),
# a ligature, odd spaces, and a text longer than the context.
TEXTS = [
    "左上角有一个红色的圆形，右边有“蓝色”的方形！",
    "A photo of a CAT, ok?  ﬁne\tＦｕｌｌ　ｗｉｄｔｈ ‘quoted’",
    "蓝色 的 方形 " * 30,
]


def images_of_several_shapes() -> list[Image.Image]:
    """Random pixels, square and not, so that the resize and crop are exercised."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(40, 40), (57, 33), (31, 64)]
    return [
        Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=generator).byte().numpy())
        for h, w in shapes
    ]


def hf_features(model, processor, images, texts):
    """transformers' embeddings as its documentation computes them: processor, then model."""
    inputs = processor(
        text=texts, images=images, padding="max_length", truncation=True, return_tensors="pt"
    )
    with torch.no_grad():
        out = model(**inputs)
    return inputs["input_ids"], out.image_embeds, out.text_embeds


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def test_the_trained_model_in_transformers_gives_open_clip_s_embeddings_tokens_and_recall(
    reference_run, small_data
):
    """The demo's run: models/clip/transformers is a CLIPModel + CLIPProcessor giving open_clip's
    input ids, embeddings (cosine >= 0.9999) and recall on the demo's test set."""
    from transformers import CLIPModel, CLIPProcessor

    model_dir = reference_run / "models" / "clip"
    model, preprocess, tokenizer = load_open_clip(f"local-dir:{model_dir}", None, "cpu")
    hf_model = CLIPModel.from_pretrained(model_dir / "transformers").eval()
    processor = CLIPProcessor.from_pretrained(model_dir / "transformers")
    test_set = testset.load_test_set(small_data / "test")
    texts = [t.text for t in test_set.texts]
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in test_set.images]

    ids, hf_images, hf_texts = hf_features(hf_model, processor, images, texts)
    assert torch.equal(ids, tokenizer(texts))
    open_clip_images = encode_images(model, preprocess, test_set.images, 8, "cpu")
    open_clip_texts = encode_texts(model, tokenizer, texts, 8, "cpu")
    assert cosines(open_clip_images, hf_images).min() >= MIN_COSINE
    assert cosines(open_clip_texts, hf_texts).min() >= MIN_COSINE

    relevant = relevance_matrix(test_set.image_ids, test_set.texts)
    ours = retrieval_metrics(open_clip_images, open_clip_texts, relevant)
    theirs = retrieval_metrics(hf_images, hf_texts, relevant)
    assert {k: round(v, 2) for k, v in theirs.items()} == {k: round(v, 2) for k, v in ours.items()}


def test_the_export_has_a_model_card_with_the_data_and_both_ways_to_load_it(
    reference_run, small_data
):
    model_dir = reference_run / "models" / "clip"
    card = (model_dir / "README.md").read_text(encoding="utf-8")
    assert sha256_file(small_data / "manifest.json") in card
    assert "# clipforge-tiny\n" in card
    assert "decontamination:" in card
    assert 'create_model_and_transforms("local-dir:PATH")' in card
    assert "CLIPModel.from_pretrained" in card and "CLIPProcessor.from_pretrained" in card
    inner = (model_dir / "transformers" / "README.md").read_text(encoding="utf-8")
    assert 'CLIPModel.from_pretrained("PATH")' in inner and "local-dir:PATH/.." in inner


def test_both_transformers_tokenizers_give_open_clip_s_ids(untrained_model_dir):
    """The fast tokenizer (what CLIPProcessor loads) and the slow one (which runs ftfy, as
    open_clip does) agree with open_clip's ids, Chinese punctuation and truncation included."""
    from transformers import CLIPProcessor, CLIPTokenizer

    folder = untrained_model_dir / "transformers"
    expected = open_clip.get_tokenizer(f"local-dir:{untrained_model_dir}")(TEXTS)
    fast = CLIPProcessor.from_pretrained(folder).tokenizer
    slow = CLIPTokenizer.from_pretrained(folder)
    assert type(fast).__name__ == "CLIPTokenizerFast"
    for tokenizer in (fast, slow):
        ids = tokenizer(TEXTS, padding="max_length", truncation=True, return_tensors="pt")
        assert torch.equal(ids["input_ids"], expected)


def test_a_chinese_roberta_model_exports_as_chinese_clip_with_its_tokenizer(tmp_path):
    """The production-zh-roberta architecture (ViT + BERT tower, [CLS] through one linear layer),
    in miniature: a ChineseCLIPModel + ChineseCLIPProcessor giving open_clip's input ids and
    embeddings. ChineseCLIPImageProcessor squashes to the square: square images here."""
    from transformers import ChineseCLIPModel, ChineseCLIPProcessor

    tower = make_tiny_chinese_tower(tmp_path / "tower")
    torch.manual_seed(0)
    bundle = build_model(ModelConfig(image_size=32, text_tower=str(tower)))
    model = bundle.model.eval()
    out = tmp_path / "clip"
    kind = export_model(
        model.state_dict(), bundle.model_cfg, bundle.preprocess_cfg, "", out, bundle.tokenizer
    )
    assert kind == CHINESE_CLIP
    hf_model = ChineseCLIPModel.from_pretrained(out / "transformers").eval()
    processor = ChineseCLIPProcessor.from_pretrained(out / "transformers")
    images = [image.resize((40, 40)) for image in images_of_several_shapes()]
    texts = TEXTS[:1] + ["红色的圆形位于图中"]

    ids, hf_images, hf_texts = hf_features(hf_model, processor, images, texts)
    assert torch.equal(ids, bundle.tokenizer(texts))
    with torch.no_grad():
        ours_images = model.encode_image(torch.stack([bundle.preprocess_val(i) for i in images]))
        ours_texts = model.encode_text(bundle.tokenizer(texts))
    assert cosines(ours_images, hf_images).min() >= MIN_COSINE
    assert cosines(ours_texts, hf_texts).min() >= MIN_COSINE


def test_vit_b_32_converts_to_a_clip_model_computing_the_same(tmp_path):
    """The production architecture, randomly initialised: the same embeddings through
    CLIPModel (in memory: the conversion is the one the export saves)."""
    model, _, preprocess = open_clip.create_model_and_transforms("ViT-B-32")
    model.eval()
    cfg = open_clip.get_model_config("ViT-B-32")
    assert hf_class(cfg) == CLIP
    hf_model = clip_model(cfg)
    hf_model.load_state_dict(open_clip_to_clip(model.state_dict()), strict=True)
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    pixels = torch.stack([preprocess(i) for i in images_of_several_shapes()])
    ids = tokenizer(TEXTS)
    with torch.no_grad():
        assert (
            cosines(
                model.encode_image(pixels), hf_model.get_image_features(pixel_values=pixels)
            ).min()
            >= MIN_COSINE
        )
        assert (
            cosines(
                model.encode_text(ids),
                hf_model.get_text_features(input_ids=ids, attention_mask=(ids != 0).long()),
            ).min()
            >= MIN_COSINE
        )


@pytest.mark.parametrize(
    ("name", "named"),
    [
        ("RN50", "vision_cfg.layers"),
        ("ViT-B-16-SigLIP", "init_logit_bias"),
        ("coca_ViT-B-32", "multimodal_cfg"),
        ("xlm-roberta-base-ViT-B-32", "text_cfg.hf_proj_type='mlp'"),
    ],
)
def test_an_architecture_transformers_cannot_hold_is_refused_naming_why(name, named):
    with pytest.raises(NotRepresentable, match="no transformers class") as refused:
        hf_class(open_clip.get_model_config(name))
    assert named in str(refused.value)


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("clipforge-tiny", "its towers are not open_clip's CLIP towers"),
        ("ViT-B-16-SigLIP", "open_clip's timm SigLIP towers are not converted"),
    ],
)
def test_a_model_of_siglips_loss_is_refused_with_siglips_reason(name, why):
    """train.loss: siglip: CLIPModel would drop the learned bias from the logits, and
    SiglipModel's towers are SigLIP's own: one line naming both."""
    from clipforge.model.factory import loss_init
    from clipforge.model.names import register_bundled_configs

    register_bundled_configs()
    cfg = {**open_clip.get_model_config(name), **loss_init(name, "siglip")}
    with pytest.raises(NotRepresentable, match="init_logit_bias=-10") as refused:
        hf_class(cfg)
    assert "CLIPModel and ChineseCLIPModel lack" in str(refused.value)
    assert f"SiglipModel has it, but {why}" in str(refused.value)


def test_a_model_without_a_transformers_form_still_exports_for_open_clip(tmp_path, caplog):
    """The refusal is one log line and a line in the card: the open_clip export is written."""
    torch.manual_seed(0)
    bundle = build_model(ModelConfig(image_size=32))
    cfg = {
        **bundle.model_cfg,
        "vision_cfg": {**bundle.model_cfg["vision_cfg"], "ls_init_value": 0.1},
    }
    out = tmp_path / "clip"
    from clipforge.export.card import CardFacts

    facts = CardFacts(
        model="clipforge-tiny",
        run_id="run-000000000000",
        steps=1,
        samples_seen=8,
        data_manifest_sha256=None,
        decontamination=None,
        train_metrics={"loss": 1.5},
    )
    state = bundle.model.state_dict()
    assert export_model(state, cfg, bundle.preprocess_cfg, "", out, card=facts) is None
    assert (out / "open_clip_model.safetensors").is_file()
    assert not (out / "transformers").exists()
    assert "vision_cfg.ls_init_value=0.1" in (out / "README.md").read_text(encoding="utf-8")
    assert [r.message for r in caplog.records if "no transformers export" in r.message]


def test_without_transformers_installed_the_export_is_skipped_in_one_line(
    tmp_path, caplog, monkeypatch
):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    torch.manual_seed(0)
    bundle = build_model(ModelConfig(image_size=32))
    out = tmp_path / "clip"
    state = bundle.model.state_dict()
    assert export_model(state, bundle.model_cfg, bundle.preprocess_cfg, "", out) is None
    assert (out / "open_clip_model.safetensors").is_file()
    assert not (out / "transformers").exists()
    (line,) = [r.message for r in caplog.records if "no transformers export" in r.message]
    assert "pip install 'clipforge[hf]'" in line
