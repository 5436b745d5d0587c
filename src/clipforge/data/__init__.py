"""Data stage: a source of image-caption pairs -> webdataset shards + a Chinese-CLIP test set."""
