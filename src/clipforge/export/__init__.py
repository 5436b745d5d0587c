"""The trained model as files others load: open_clip, Hugging Face, a model card.

open_clip's `local-dir:` layout with the train stage's export (local_dir), a Hugging Face
transformers folder (`CLIPModel` + `CLIPProcessor`, or `ChineseCLIPModel` + `ChineseCLIPProcessor`)
and the reverse for Chinese-CLIP's own checkpoints, which eval reads (hf), and the model card
written into both (card).
"""
