"""`train.micro_batch_size: auto`: the search over micro batches, with an injected oracle, and for
real under an address-space cap (a CPU process whose allocations fail past a limit, as a GPU's do)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from clipforge.train.microbatch import (
    candidates,
    engine_reserve_bytes,
    largest_fitting,
    plan_record,
    probe_micro_batch,
    saved_micro_batch,
)
from tests.conftest import REPO, subprocess_env


def test_candidates_divide_the_ranks_share_so_the_accumulation_is_whole():
    assert candidates(1024) == [2**i for i in range(11)]
    assert candidates(96) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]


@pytest.mark.parametrize("limit", [1, 2, 5, 47, 48, 95, 96, 10_000])
def test_binary_search_finds_the_largest_fitting_in_logarithmic_tries(limit):
    options = candidates(96)
    tried = []

    def fits(m: int) -> bool:
        tried.append(m)
        return m <= limit

    assert largest_fitting(options, fits) == max(m for m in options if m <= limit)
    assert len(tried) <= math.ceil(math.log2(len(options) + 1))


def test_nothing_fits_is_a_clear_error_naming_the_remedies():
    assert largest_fitting([1, 2, 4], lambda m: False) is None
    with pytest.raises(ValueError, match="grad_checkpointing: true, a higher train.zero_stage"):
        probe_micro_batch(4096, lambda m: False)


def test_engine_reserve_counts_optimizer_states_accumulation_buffer_and_margin():
    params, gpu = 151_000_000, 80 * 2**30
    deepspeed_bf16 = engine_reserve_bytes(params, 4, True, gpu)
    autocast = engine_reserve_bytes(params, 4, False, gpu)
    assert deepspeed_bf16 - autocast == 4 * params  # the fp32 accumulation buffer
    assert autocast == 12 * params // 4 + int(0.10 * gpu)


def test_the_choice_is_kept_for_resume(tmp_path):
    assert saved_micro_batch(tmp_path) is None
    (tmp_path / "batch_plan.json").write_text(plan_record(256, 4, 4, "memory probe"))
    assert saved_micro_batch(tmp_path) == 256


# A process that caps its own address space just above what it holds after a warm-up, then
# probes the real model's forward + backward: allocations past the cap fail as on a full GPU.
CAPPED_PROBE = r"""
import json, resource, sys
import torch
from clipforge.model.config import ModelConfig
from clipforge.model.factory import build_model
from clipforge.train.microbatch import forward_backward_fits, probe_micro_batch
from contextlib import nullcontext

torch.set_num_threads(1)
model = build_model(ModelConfig(image_size=64)).model
fits = forward_backward_fits(model, torch.device("cpu"), torch.float32, 64, 72, 0, nullcontext)
assert fits(2)  # warm-up: thread pools, allocator arenas and lazy imports exist before the cap
size = lambda: int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
results = {}
for headroom_mb in map(int, sys.argv[1:]):
    cap = size() + headroom_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.RLIM_INFINITY))
    chosen = probe_micro_batch(4096, fits)
    results[headroom_mb] = {"chosen": chosen, "again": fits(chosen),
                            "twice": fits(2 * chosen) if chosen < 4096 else None}
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print(json.dumps(results))
"""


# Probes under a real memory cap (half a minute): in make test-tier2; make test keeps
# the search, the reserve and the kept choice above.
def _capped(script: str, *args: str) -> dict:
    """Run a probe script (one allocator arena, one thread, so the cap is what decides) and
    return the JSON its last line prints. glibc's mmap threshold is fixed: left dynamic, it
    rises after each large free, later tensors of that size then come from the heap, which is
    not given back, and whether a micro batch fit depended on what was tried before it (the
    teacher's probe failed 2 runs in 3: its chosen size's double fitted afterwards)."""
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        env={
            **subprocess_env(),
            "MALLOC_ARENA_MAX": "1",
            "MALLOC_MMAP_THRESHOLD_": "65536",
            "OMP_NUM_THREADS": "1",
        },
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.tier2
def test_probe_under_a_real_memory_cap_picks_what_fits_and_more_with_more_memory():
    small, large = _capped(CAPPED_PROBE, "300", "1200").values()
    for probe in (small, large):
        assert probe["again"] is True  # what was chosen fits when tried again
        assert probe["twice"] is False  # and the next candidate does not: the cap decided
    assert 1 <= small["chosen"] < large["chosen"] < 4096


# The same cap, probing a small student (clipforge-micro) alone and with a distillation teacher
# whose no-grad forward needs more memory than the student's forward + backward: a wide two-layer
# model (argv[1] holds its open_clip config). oneDNN's kernels fail under the cap with their own
# error instead of an allocation failure: off, so every failure is the allocator's.
CAPPED_TEACHER_PROBE = r"""
import json, resource, sys
import open_clip, torch
from clipforge.model.config import ModelConfig
from clipforge.model.factory import build_model
from clipforge.train.microbatch import forward_backward_fits, probe_micro_batch
from clipforge.train.teacher import Teacher
from contextlib import nullcontext

torch.set_num_threads(1)
torch.backends.mkldnn.enabled = False
open_clip.add_model_config(sys.argv[1])
student = build_model(ModelConfig(name="clipforge-micro", image_size=64)).model
teacher = Teacher(open_clip.create_model("wide-teacher"), torch.float32)
cpu = torch.device("cpu")
alone = forward_backward_fits(student, cpu, torch.float32, 64, 72, 0, nullcontext)
taught = forward_backward_fits(student, cpu, torch.float32, 64, 72, 0, nullcontext, teacher)
assert alone(2) and taught(2)  # warm-up, the teacher's weights allocated: before the cap
size = lambda: int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size() + 60 * 2**20, resource.RLIM_INFINITY))
chosen = {"alone": probe_micro_batch(4096, alone), "taught": probe_micro_batch(4096, taught)}
chosen["taught_twice"] = taught(2 * chosen["taught"])
print(json.dumps(chosen))
"""
WIDE_TEACHER = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 64, "layers": 2, "width": 768, "head_width": 64, "patch_size": 8},
    "text_cfg": {"context_length": 72, "vocab_size": 49408, "width": 768, "heads": 12, "layers": 2},
}


@pytest.mark.slow
@pytest.mark.tier2
def test_a_distillation_teachers_forward_is_measured_by_the_probe(tmp_path):
    """The probe runs the teacher's forward of every micro batch it tries (as the step does,
    before the student's): under the same memory, a teacher whose activations outgrow the
    student's leaves a smaller micro batch, one that fits with it and whose double does not."""
    (tmp_path / "wide-teacher.json").write_text(json.dumps(WIDE_TEACHER), encoding="utf-8")
    chosen = _capped(CAPPED_TEACHER_PROBE, str(tmp_path))
    assert 1 <= chosen["taught"] < chosen["alone"]
    assert chosen["taught_twice"] is False
