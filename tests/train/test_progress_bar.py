"""The interactive progress bar and the log: a log line written while the bar is drawn starts a
line of its own, and the bar is drawn again below it."""

from __future__ import annotations

import logging
import sys

from clipforge.train.reporting import TrainReport


def _shown(raw: str) -> list[str]:
    """What a terminal shows of each line: the text after its last carriage return."""
    return [line.rsplit("\r", 1)[-1] for line in raw.split("\n")]


def test_a_log_line_during_the_bar_is_a_line_of_its_own(tmp_path, capsys):
    handler = logging.StreamHandler(sys.stderr)  # the console handler a stage configures
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logging.root.addHandler(handler)
    log = logging.getLogger("clipforge.train")
    try:
        report = TrainReport(tmp_path / "logs", tmp_path, "run-x", 0, 4, interactive=True)
        report.step(1, {"loss": 2.5, "lr": 1e-4})
        log.warning("validation starts")
        report.step(2, {"loss": 2.25, "lr": 1e-4})
        report.close()
        log.warning("after the bar")
    finally:
        logging.root.removeHandler(handler)
    lines = _shown(capsys.readouterr().err)
    assert "clipforge.train: validation starts" in lines, lines
    assert "clipforge.train: after the bar" in lines, lines
    # the bar went on below the log line, at step 2
    after = lines[lines.index("clipforge.train: validation starts") + 1 :]
    assert any("2/4" in line for line in after), lines
