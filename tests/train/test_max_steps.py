"""training.max_steps as in the Hugging Face Trainer: it overrides epochs, the data cycles, and
the LR schedule ends at it; a checkpoint resumes only on the schedule it was written on.
A packed run of max_steps past one epoch is in test_packing.py; a refused resume in test_resume.py."""

from __future__ import annotations

import pytest

from jobgen.job.models import Training
from jobgen.errors import UserError
from jobgen.train.schedule import LRFactor, check_schedule_total, total_steps_of


def _training(**fields) -> Training:
    return Training(model="m", data="d.json", **fields)


def test_max_steps_overrides_epochs_both_ways():
    # 5 optimizer steps per epoch.
    assert total_steps_of(_training(epochs=12, max_steps=60), 5) == 60  # not 5 x 12
    assert total_steps_of(_training(epochs=1, max_steps=8), 5) == 8  # past one epoch
    assert total_steps_of(_training(epochs=3), 5) == 15


def _saved_state(schedule: str, total: int) -> dict:
    """What a checkpoint's trainer_state.json holds of the LR scheduler (LambdaLR.state_dict())."""
    import torch

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, LRFactor(schedule, 0, total))
    return {"lr_scheduler": scheduler.state_dict()}


def test_a_checkpoint_resumes_only_with_its_schedules_total():
    check_schedule_total(_saved_state("cosine", 60), LRFactor("cosine", 0, 60), "step-000020")
    with pytest.raises(UserError) as refused:
        check_schedule_total(_saved_state("cosine", 60), LRFactor("cosine", 0, 80), "step-000020")
    assert str(refused.value) == (
        "training.max_steps: checkpoint step-000020 belongs to a run of 60 steps on a cosine schedule, this job has "
        "80 (from max_steps, or epochs when max_steps is unset), which would change the learning rate from the "
        "resume point on: set max_steps: 60 to resume, or use a new training.output_dir to start a run of the new length"
    )
    # A constant schedule has no total to change; a checkpoint from before totals were saved is not judged.
    check_schedule_total(_saved_state("constant", 60), LRFactor("constant", 0, 80), "step-000020")
    check_schedule_total({"lr_scheduler": {"lr_lambdas": [None]}}, LRFactor("cosine", 0, 80), "step-000020")
