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
from clipforge.metrics.sizes import DirectionSize

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
        counts = {"num_images": len(self.data.image_ids), "num_texts": len(self.data.texts)}
        for size in self.direction_sizes():
            if size.direction == "i2t":
                counts["num_i2t_queries"] = size.queries  # images some caption describes
        return counts

    def direction_sizes(self) -> list[DirectionSize]:
        """Each retrieval direction scored, with its queries and candidates; none for a
        classification suite."""
        if isinstance(self.data, testset.ClassificationSet):
            return []
        return self.data.direction_sizes(self.config.directions)

    def flags(self) -> dict[str, int]:
        """What eval.json records beside this suite's numbers: a direction with fewer than
        FEW_QUERIES queries or candidates (DirectionSize.flags)."""
        return {k: v for size in self.direction_sizes() for k, v in size.flags().items()}

    def warnings(self) -> list[str]:
        return [
            f"suite {self.name} ({self.config.path}): {w}"
            for w in (size.warning() for size in self.direction_sizes())
            if w
        ]


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
        suite = Suite(config, testset.load_test_set(Path(config.path)))
        problems = [p for p in (size.problem() for size in suite.direction_sizes()) if p]
        if problems:
            raise testset.TestSetError(
                [f"eval.suites {config.name} ({config.path}): {p}" for p in problems]
                + [_retrieval_remedy(config, suite)]
            )
        return suite
    classes = Path(config.classes) if config.classes else None
    data = testset.load_classification_set(Path(config.path), classes)
    return Suite(config, data, read_templates(Path(config.templates or DEFAULT_TEMPLATES)))


def _retrieval_remedy(config: SuiteConfig, suite: Suite) -> str:
    where = f"eval.suites {config.name}"
    usable = [size.direction for size in suite.direction_sizes() if not size.problem()]
    if usable == ["t2i"]:
        return (
            f"{where}: its captions describe too few images to rank captions by image: set "
            f"directions: t2i to score it text->image only, as MUGE is"
        )
    return (
        f"{where}: give it more images and captions ({testset.IMAGES_FILE}, {testset.TEXTS_FILE})"
    )


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
