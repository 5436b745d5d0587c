"""Chinese-CLIP's own models through our eval (`--model chinese-clip:PATH`): the original
repository's .pt checkpoint and its transformers form (a ChineseCLIPModel folder), on a tiny
model of that architecture made here (random weights; no download)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from clipforge.data import builtin
from clipforge.eval.stage import main as eval_main
from clipforge.export.loading import load_model
from tests.conftest import eval_argv, write_params

pytestmark = pytest.mark.slow

CONTEXT = 52  # Chinese-CLIP's
SIDE = 32
TEXTS = ["左上角有一个红色的圆形", "图中只有一个蓝色的方形" * 8, "Red 圆形"]


def write_vocab(path: Path) -> Path:
    text = "".join(builtin.COLOURS) + "".join(builtin.SHAPES) + "".join(builtin.POSITIONS)
    chars = sorted(set(text + "有一个的，图中只位于redgbluthsqa"))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, "##e", "##d"]
    path.write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return path


def original_state_dict(model) -> dict[str, torch.Tensor]:
    """A ChineseCLIPModel's weights in Chinese-CLIP's own naming (cn_clip/clip/model.py: an
    OpenAI ViT under `visual.`, a BERT under `bert.` with its pooler, the projections as
    [in, out] matrices), as its training saves them: DistributedDataParallel's `module.`."""
    hf = model.state_dict()
    out = {
        "visual.conv1.weight": hf["vision_model.embeddings.patch_embedding.weight"],
        "visual.class_embedding": hf["vision_model.embeddings.class_embedding"],
        "visual.positional_embedding": hf["vision_model.embeddings.position_embedding.weight"],
        "visual.ln_pre.weight": hf["vision_model.pre_layrnorm.weight"],
        "visual.ln_pre.bias": hf["vision_model.pre_layrnorm.bias"],
        "visual.ln_post.weight": hf["vision_model.post_layernorm.weight"],
        "visual.ln_post.bias": hf["vision_model.post_layernorm.bias"],
        "visual.proj": hf["visual_projection.weight"].t(),
        "text_projection": hf["text_projection.weight"].t(),
        "logit_scale": hf["logit_scale"],
        "bert.pooler.dense.weight": torch.randn(128, 128),
        "bert.pooler.dense.bias": torch.randn(128),
    }
    for i in range(model.config.vision_config.num_hidden_layers):
        hf_layer, layer = f"vision_model.encoder.layers.{i}.", f"visual.transformer.resblocks.{i}."
        for kind in ("weight", "bias"):
            out[f"{layer}attn.in_proj_{kind}"] = torch.cat(
                [hf[f"{hf_layer}self_attn.{p}_proj.{kind}"] for p in ("q", "k", "v")]
            )
            for ours, theirs in [
                ("attn.out_proj", "self_attn.out_proj"),
                ("ln_1", "layer_norm1"),
                ("ln_2", "layer_norm2"),
                ("mlp.c_fc", "mlp.fc1"),
                ("mlp.c_proj", "mlp.fc2"),
            ]:
                out[f"{layer}{ours}.{kind}"] = hf[f"{hf_layer}{theirs}.{kind}"]
    for key, value in hf.items():
        if key.startswith("text_model."):
            out["bert." + key[len("text_model.") :]] = value
    return {f"module.{k}": v.clone() for k, v in out.items()}


@pytest.fixture(scope="module")
def tiny_chinese_clip(tmp_path_factory):
    """(reference model, its processor, .pt file, transformers folder) of one tiny model:
    2-head towers of width 128 (Chinese-CLIP's head width, 64), QuickGELU in the ViT."""
    from transformers import (
        BertTokenizer,
        ChineseCLIPConfig,
        ChineseCLIPImageProcessor,
        ChineseCLIPModel,
        ChineseCLIPProcessor,
    )

    root = tmp_path_factory.mktemp("chinese-clip")
    (root / "original").mkdir()
    vocab = write_vocab(root / "original" / "vocab.txt")
    config = ChineseCLIPConfig(
        text_config={
            "vocab_size": len(vocab.read_text(encoding="utf-8").split()),
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 256,
            "max_position_embeddings": 64,
        },
        vision_config={
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": SIDE,
            "patch_size": 8,
            "hidden_act": "quick_gelu",
        },
        projection_dim=48,
    )
    torch.manual_seed(0)
    model = ChineseCLIPModel(config).eval()
    processor = ChineseCLIPProcessor(
        image_processor=ChineseCLIPImageProcessor(
            size={"height": SIDE, "width": SIDE}, do_center_crop=False
        ),
        tokenizer=BertTokenizer(str(vocab)),
    )
    folder = root / "transformers"
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    checkpoint = root / "original" / "tiny-chinese-clip.pt"
    torch.save(
        {"epoch": 1, "step": 10, "name": "tiny", "state_dict": original_state_dict(model)},
        checkpoint,
    )
    return model, processor, checkpoint, folder


def chinese_clip_tokens(tokenizer, text: str) -> list[int]:
    """cn_clip.clip.tokenize: [CLS] + wordpieces (at most 50) + [SEP], zeros to 52."""
    ids = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(text))[: CONTEXT - 2]
    ids = [tokenizer.cls_token_id, *ids, tokenizer.sep_token_id]
    return ids + [0] * (CONTEXT - len(ids))


def images() -> list[Image.Image]:
    generator = torch.Generator().manual_seed(1)
    return [
        Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=generator).byte().numpy())
        for h, w in [(32, 32), (48, 40), (29, 61)]
    ]


@pytest.mark.parametrize("form", ["original", "transformers"])
def test_a_chinese_clip_model_is_evaluated_with_its_tokenizer_preprocessing_and_weights(
    tiny_chinese_clip, form
):
    """Both forms give Chinese-CLIP's token ids (context 52) and the model's own embeddings
    (cosine >= 0.9999 against ChineseCLIPModel's forward on its processor's inputs)."""
    reference, processor, checkpoint, folder = tiny_chinese_clip
    path = checkpoint if form == "original" else folder
    model, preprocess, tokenizer = load_model(f"chinese-clip:{path}", None, "cpu")
    ids = tokenizer(TEXTS)
    assert ids.tolist() == [chinese_clip_tokens(processor.tokenizer, t) for t in TEXTS]

    inputs = processor(
        text=TEXTS,
        images=images(),
        padding="max_length",
        max_length=CONTEXT,
        truncation=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        expected = reference(**inputs)
        image_features = model.encode_image(
            torch.stack([preprocess(i) for i in images()]), normalize=True
        )
        text_features = model.encode_text(ids, normalize=True)
    cosine = torch.nn.functional.cosine_similarity
    assert cosine(image_features, expected.image_embeds).min() >= 0.9999
    assert cosine(text_features, expected.text_embeds).min() >= 0.9999


def test_the_eval_stage_scores_a_chinese_clip_model_and_one_as_baseline(
    tiny_chinese_clip, small_data, tmp_path
):
    _, _, checkpoint, folder = tiny_chinese_clip
    params = write_params(
        tmp_path / "params.yaml", {"eval": {"baseline_model": f"chinese-clip:{checkpoint}"}}
    )
    out = tmp_path / "eval.json"
    model = f"chinese-clip:{folder}"
    assert eval_main(eval_argv(params, model, small_data / "test", out)) == 0
    assert json.loads(out.read_text())
    info = json.loads(out.with_suffix(".info.json").read_text())
    assert info["model"] == model


def test_a_chinese_clip_checkpoint_without_its_vocabulary_is_one_line(
    tiny_chinese_clip, small_data, tmp_path, capsys
):
    _, _, checkpoint, _ = tiny_chinese_clip
    alone = tmp_path / "alone.pt"
    alone.write_bytes(checkpoint.read_bytes())
    params = write_params(tmp_path / "params.yaml")
    argv = eval_argv(params, f"chinese-clip:{alone}", small_data / "test", tmp_path / "e.json")
    assert eval_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "vocab.txt not found" in err and len(err.splitlines()) == 1


def test_a_file_of_another_layout_is_not_taken_for_chinese_clip(tmp_path):
    from clipforge.model.files import ModelFilesError

    (tmp_path / "vocab.txt").write_text("[PAD]\n", encoding="utf-8")
    torch.save({"state_dict": {"module.conv1.weight": torch.zeros(1)}}, tmp_path / "rn.pt")
    with pytest.raises(ModelFilesError, match="not a Chinese-CLIP ViT checkpoint"):
        load_model(f"chinese-clip:{tmp_path / 'rn.pt'}", None, "cpu")
