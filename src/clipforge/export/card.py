"""The model card (README.md) of an export, written from the run's facts.

The model card (README.md) of an export: what the model is, what it was trained on, what it
scored, and how to load it with open_clip and with transformers. Pure: the facts in, text out."""

from __future__ import annotations

from dataclasses import dataclass, field

from clipforge.envrecord import card_lines

TRANSFORMERS_DIR = "transformers"  # the transformers folder, inside the open_clip export
CARD_FILE = "README.md"  # the card's name in each folder
# The export's card holds this line until eval has run; eval writes the card with its metrics.
NOT_EVALUATED = "- eval suites: not run at export time (see metrics/model-card.md)"


@dataclass(kw_only=True)
class CardFacts:
    model: str  # the open_clip architecture, with its text tower if swapped
    run_id: str
    steps: int
    samples_seen: int
    data_manifest_sha256: str | None  # of data/manifest.json, the training data's listing
    decontamination: dict | None  # the data stage's record (clipforge.data.decontam)
    train_metrics: dict  # metrics/train.json
    # suite name -> metrics (metrics/eval.json's layout), where eval has run
    eval_metrics: dict[str, dict] = field(default_factory=dict)
    environment: dict | None = None  # the train stage's record (clipforge.envrecord)
    launch_id: str | None = None  # the `fab train` launch, when there was one


def render(
    facts: CardFacts,
    transformers_class: str | None,
    transformers_skipped: str,
    in_transformers_folder: bool = False,
) -> str:
    """transformers_class: CLIPModel / ChineseCLIPModel, or None with the reason it was not
    written in transformers_skipped. in_transformers_folder: the card of that folder (PATH is
    then the folder itself, open_clip's export its parent)."""
    open_clip_path = "PATH/.." if in_transformers_folder else "PATH"
    transformers_path = "PATH" if in_transformers_folder else f"PATH/{TRANSFORMERS_DIR}"
    lines = [
        "---",
        "library_name: open_clip",
        "tags: [clip, zero-shot-image-classification, clipforge]",
        "---",
        f"# {facts.model}",
        "",
        f"Trained by clipforge: run `{facts.run_id}`, {facts.steps} steps, "
        f"{facts.samples_seen} samples seen.",
        "",
        "## Training data",
        f"- data manifest sha256: `{facts.data_manifest_sha256 or 'unknown'}`",
        f"- decontamination: {_decontamination(facts.decontamination)}",
        "",
        "## Metrics",
        *_metric_lines("train", facts.train_metrics),
        *(line for suite, m in facts.eval_metrics.items() for line in _metric_lines(suite, m)),
    ]
    if not facts.eval_metrics:
        lines.append(NOT_EVALUATED)
    lines += ["", "## Reproduce it", "", *_rerun_lines(facts)]
    lines += ["", "## Load it with open_clip", "", *_open_clip_usage(open_clip_path), ""]
    lines += ["## Load it with transformers", ""]
    if transformers_class:
        lines += _transformers_usage(transformers_class, transformers_path)
    else:
        lines.append(f"No transformers export: {transformers_skipped}")
    return "\n".join(lines) + "\n"


def with_eval_metrics(card: str, eval_metrics: dict) -> str:
    """The export's card with the eval stage's metrics (metrics/eval.json: each suite's and the
    mean over suites) in place of the line that says eval had not run."""
    lines = [
        line
        for name, value in eval_metrics.items()
        if name not in ("baseline", "delta")  # another model's, and ours against it
        for line in _metric_lines(name, value if isinstance(value, dict) else {"value": value})
    ]
    return card.replace(NOT_EVALUATED, "\n".join(lines))


def _rerun_lines(facts: CardFacts) -> list[str]:
    """The exact command that repeats the run (one `fab train` started), and the environment it
    ran in."""
    if facts.launch_id:
        lines = ["```sh", rerun_command(facts.launch_id), "```", ""]
    else:
        lines = [
            f"Run `{facts.run_id}` was not started by `fab train`, so `fab rerun` cannot repeat "
            "it: check out the commit below and run `dvc exp run` with the params of "
            "clipforge_config.yaml.",
            "",
        ]
    if facts.environment:
        lines += ["Environment:", *card_lines(facts.environment)]
    else:
        lines.append("Environment: not recorded")
    return lines


def rerun_command(launch_id: str) -> str:
    """`fab rerun`'s line for a launch: the card's and the published record's."""
    return f"fab rerun {launch_id}   # from the run store, or runs/{launch_id} as `fab fetch` brought it"


def _decontamination(record: dict | None) -> str:
    if not record:
        return "no record"
    if not record.get("checked"):
        return f"not checked ({record.get('reason', 'no reason given')})"
    found = record.get("found", {})
    return (
        f"checked against the test set ({record.get('method')}): {found.get('total', 0)} "
        f"training images matched {record.get('test_images_found', 0)} test images, "
        f"{record.get('dropped', 0)} dropped (mode {record.get('mode')})"
    )


def _metric_lines(name: str, metrics: dict) -> list[str]:
    flat = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and v is not None}
    text = ", ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in flat.items()
    )
    return [f"- {name}: {text or 'none'}"]


def _open_clip_usage(path: str) -> list[str]:
    return [
        "```python",
        "import open_clip",
        f'model, _, preprocess = open_clip.create_model_and_transforms("local-dir:{path}")',
        f'tokenizer = open_clip.get_tokenizer("local-dir:{path}")',
        "```",
    ]


def _transformers_usage(kind: str, path: str) -> list[str]:
    # Imported here: export.hf imports torch, and `fab` renders cards (rerun_command) without it.
    from clipforge.export.hf import CHINESE_CLIP

    chinese = kind == CHINESE_CLIP
    processor = "ChineseCLIPProcessor" if chinese else "CLIPProcessor"
    lines = [
        f"`{path}`: a `{kind}` with its `{processor}`.",
        "",
        "```python",
        f"from transformers import {kind}, {processor}",
        f'model = {kind}.from_pretrained("{path}").eval()',
        f'processor = {processor}.from_pretrained("{path}")',
        'inputs = processor(text=["..."], images=[image], padding="max_length", truncation=True, '
        'return_tensors="pt")',
        "outputs = model(**inputs)  # outputs.image_embeds, outputs.text_embeds: normalised",
    ]
    if chinese:  # its get_text_features reads a pooler the model lacks (transformers 4.57)
        lines += [
            "# text alone: the [CLS] state through the projection",
            'text = processor(text=["..."], padding="max_length", truncation=True, '
            'return_tensors="pt")',
            "text_embeds = model.text_projection(model.text_model(**text).last_hidden_state[:, 0])",
        ]
    return [
        *lines,
        "```",
        "",
        '`padding="max_length"` gives open_clip\'s token ids exactly (the same embeddings '
        "either way: padding is masked); the fast tokenizer (the default) applies the text "
        "clean-up open_clip applies (ftfy: full-width punctuation, curly quotes).",
    ]
