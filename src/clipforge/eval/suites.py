"""eval.suites read and checked, every suite's files before any model is loaded.

eval.suites read and checked: every suite's files loaded before any model is, a missing
optional suite skipped with one line, a missing required one (or a broken one of either kind)
refused with every problem named.

A retrieval suite is a Chinese-CLIP-layout test set (clipforge.data.testset); a zero-shot
classification suite is labelled images, class names and prompt templates: the suite's own
`templates` file, or clipforge's Chinese set (templates_zh.txt beside this module, documented in
its header). Nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from clipforge.data import testset
from clipforge.eval.config import SuiteConfig

DEFAULT_TEMPLATES = Path(__file__).with_name("templates_zh.txt")


@dataclass(frozen=True)
class Suite:
    config: SuiteConfig
    data: testset.TestSet | testset.ClassificationSet
    templates: tuple[str, ...] = ()  # classification: prompts with one `{}`

    @property
    def name(self) -> str:
        return self.config.name

    def counts(self) -> dict:
        """What was scored, for eval.info.json."""
        if isinstance(self.data, testset.ClassificationSet):
            return {
                "num_images": len(self.data.images),
                "num_classes": len(self.data.class_names),
                "num_templates": len(self.templates),
            }
        described = {i for text in self.data.texts for i in text.image_ids}
        counts = {"num_images": len(self.data.image_ids), "num_texts": len(self.data.texts)}
        if self.config.directions == "both":
            counts["num_i2t_queries"] = len(described)  # images some caption describes
        return counts


def load_suites(configs: list[SuiteConfig]) -> tuple[list[Suite], dict[str, str], list[str]]:
    """(the suites to score, {name: why skipped}, problems): a problem is one line, prefixed by
    nothing when the file it names says enough, by the suite when the suite is missing."""
    suites, skipped, problems = [], {}, []
    for config in configs:
        if not Path(config.path).exists():
            if config.required:
                problems.append(
                    f"eval.suites {config.name}: {config.path} not found, and the suite is "
                    f"required (give its files there, or set required: false)"
                )
            else:
                skipped[config.name] = f"{config.path} not found"
            continue
        try:
            suites.append(load_suite(config))
        except testset.TestSetError as exc:
            problems.extend(str(exc).splitlines())  # at most MAX_PROBLEMS_SHOWN a suite
    return suites, skipped, problems


def load_suite(config: SuiteConfig) -> Suite:
    if config.kind == "retrieval":
        return Suite(config, testset.load_test_set(Path(config.path)))
    classes = Path(config.classes) if config.classes else None
    data = testset.load_classification_set(Path(config.path), classes)
    return Suite(config, data, read_templates(Path(config.templates or DEFAULT_TEMPLATES)))


def read_templates(path: Path) -> tuple[str, ...]:
    """Prompt templates, one per line with exactly one `{}`; `#` lines and blank lines skipped."""
    problems: list[str] = []
    templates = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise testset.TestSetError([f"{path} not found: the prompt templates file"]) from None
    except UnicodeDecodeError as exc:
        raise testset.TestSetError([f"{path}: not UTF-8 text (byte offset {exc.start})"]) from None
    for n, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        rest = text.replace("{}", "", 1)
        if "{}" not in text or "{" in rest or "}" in rest:
            problems.append(f"{path}:{n}: a template needs exactly one `{{}}` (the class name)")
            continue
        templates.append(text)
    if not templates and not problems:
        problems.append(f"{path}: no templates")
    if problems:
        raise testset.TestSetError(problems)
    return tuple(templates)
