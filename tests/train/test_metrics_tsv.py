"""The metrics TSVs a run writes for `dvc plots` and `fab status`."""

from __future__ import annotations

from clipforge.train.reporting import COLUMNS, TsvLog, run_label


def _rows(path) -> list[tuple[str, str]]:
    lines = path.read_text().splitlines()
    header = lines[0].split("\t")
    return [
        (r[header.index("step")], r[header.index("run_id")])
        for r in (line.split("\t") for line in lines[1:])
    ]


def test_a_resumed_run_keeps_only_its_own_rows_up_to_its_checkpoint(tmp_path):
    """Resumed at step 4 over a file that also holds another run's rows (a checkout's committed
    results): the other run's rows go, this run's rows after step 4 go (they are redone)."""
    path = tmp_path / "train.tsv"
    mine = TsvLog(path, COLUMNS, "run-a", start_step=0)
    for step in (2, 4, 6):
        mine.append({"step": step, "loss": 1.0 / step})
    lines = path.read_text().splitlines()
    others = [line.replace("run-a", "run-b") for line in lines[1:]]
    path.write_text("\n".join(lines + others) + "\n")
    TsvLog(path, COLUMNS, "run-a", start_step=4)
    assert _rows(path) == [("2", "run-a"), ("4", "run-a")]


def test_a_new_run_starts_its_file_afresh(tmp_path):
    """Step 0: whatever the file held is replaced by this run's header."""
    path = tmp_path / "val.tsv"
    path.write_text("step\tloss\trun_id\n12\t0.5\trun-bbbbbbbbbbbb\n")
    TsvLog(path, ("step", "loss", "run_id"), "run-aaaaaaaaaaaa", start_step=0)
    assert path.read_text() == "step\tloss\trun_id\n"


def test_run_label_reads_model_batch_lr_and_zero_stage():
    """TensorBoard's run name: readable, one path component, ending with the run id."""
    assert (
        run_label("ViT-B-32", 4096, 5e-4, 3, "run-0123456789ab")
        == "ViT-B-32-b4096-lr0.0005-zero3-run-0123456789ab"
    )
    assert "/" not in run_label("hf/odd name", 8, 1e-3, 1, "run-x")
