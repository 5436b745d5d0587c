"""The model: its config, what its name decides, its files, text towers, configs/ and factory.

Its `model:` section (config), what its name alone decides (names: the open_clip
config it resolves to, its tokenizer and that tokenizer's fingerprint), the files a model is
loaded from (files), Hugging Face text towers (text_towers), the bundled architectures (configs/)
and the open_clip model built from them (factory). clipforge never forks open_clip's code.

Nothing is imported here: the data stage reads `config` and `names` without the model's code.
"""
