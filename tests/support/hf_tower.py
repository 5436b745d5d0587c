"""A tiny Chinese BERT-style text tower made here, in the layout of the hub's
hfl/chinese-roberta-wwm-ext: no download, no weights from elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from clipforge.data import builtin


def make_tiny_chinese_tower(directory: Path) -> Path:
    """vocab.txt + tokenizer_config.json + a 2-layer BertModel: the hub layout, in miniature."""
    from transformers import BertConfig, BertModel

    text = "".join(builtin.COLOURS) + "".join(builtin.SHAPES) + "".join(builtin.POSITIONS)
    chars = sorted(set(text + "有一个的，图中只位于"))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars
    directory.mkdir(parents=True)
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "BertTokenizer",
                "do_lower_case": True,
                "tokenize_chinese_chars": True,
            }
        )
    )
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=80,
    )
    BertModel(config, add_pooling_layer=False).save_pretrained(directory)
    return directory
