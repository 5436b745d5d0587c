"""The trained model in other libraries' layouts, beside open_clip's own (clipforge.train.export):

- hf: a Hugging Face transformers folder (`CLIPModel` + `CLIPProcessor`, or `ChineseCLIPModel` +
  `ChineseCLIPProcessor`), and the reverse for Chinese-CLIP's own checkpoints, which eval reads;
- card: the model card (README.md) written into the exports.
"""
