"""Train stage: open_clip on DeepSpeed, with cached contrastive accumulation and exact resume."""
