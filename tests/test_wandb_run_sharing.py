"""OPBCWandbLogger sharing a W&B run with other writers, read back from the offline run file.

Every combination of: who started the run (the logger, the user's script, verl's tracker), whether the
other writer logs with ``step=`` or without, and whether ``logger.log`` gets a step. In each, every opbc
row and every row of the other writer must be in the run file with its values, and the logger must not
finish a run it did not start.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

wandb = pytest.importorskip("wandb")

from opbc_metrics.integrations.wandb_logger import OPBCWandbLogger  # noqa: E402
from tests.wandb_run import read_offline_run  # noqa: E402

STEPS = 6


def verl_tracker_init(root: Path) -> Any:
    """What verl's ``Tracking(default_backend=["wandb"])`` does: ``wandb.init``, then ``wandb.log(data, step=step)``."""
    return wandb.init(project="verl-like", mode="offline", dir=str(root), config={"trainer": {"total_steps": STEPS}})


def run_scenario(root: Path, owner: str, user_step: bool, opbc_step: bool) -> tuple[list[dict], list[tuple]]:
    """The other writer logs ``train/loss`` once per step; the logger logs ESS once per step (before the
    other writer on even steps, after it on odd ones), and when the other writer leaves W&B's step to
    W&B, a second time on every third step (a writer that sets ``step=`` has one row per step: more
    rows than its steps cannot fit)."""
    if owner == "verl":
        verl_tracker_init(root)
    elif owner == "user":
        wandb.init(project="user-script", mode="offline", dir=str(root))
    logger = OPBCWandbLogger(project="opbc-owner", mode="offline", dir=str(root), log_glossary=False)
    assert logger.run is wandb.run and logger.owns_run == (owner == "logger")
    first = 1 if owner == "verl" else 0  # verl's global_steps start at 1
    opbc: list[tuple] = []

    def opbc_log(step: int, value: float) -> None:
        given = step if opbc_step else None
        logger.log({"opbc/is/ess": value}, step=given)
        opbc.append((given if given is not None else len(opbc), value))

    for i in range(STEPS):
        step = first + i
        if i % 2 == 0:
            opbc_log(10 * step, 0.5 + i / 100)
        wandb.log({"train/loss": float(i)}, **({"step": step} if user_step else {}))
        if i % 2 == 1:
            opbc_log(10 * step, 0.5 + i / 100)
        if i % 3 == 2 and not user_step:
            opbc_log(10 * step + 5, 0.9 + i / 100)
    logger.finish()
    if owner != "logger":
        wandb.log({"after": 1.0})  # the user's run is still open
        wandb.finish()
    else:
        assert wandb.run is None or wandb.run._is_finished
    history = read_offline_run(root)["history"]
    return history, opbc


@pytest.mark.parametrize("owner", ["logger", "user", "verl"])
@pytest.mark.parametrize("user_step", [False, True], ids=["user-no-step", "user-step"])
@pytest.mark.parametrize("opbc_step", [False, True], ids=["opbc-no-step", "opbc-step"])
def test_every_row_of_every_writer_is_kept(tmp_path: Path, owner: str, user_step: bool, opbc_step: bool):
    history, opbc = run_scenario(tmp_path, owner, user_step, opbc_step)
    opbc_rows = [(r["opbc/step"], r["opbc/is/ess"]) for r in history if "opbc/is/ess" in r]
    assert opbc_rows == opbc
    assert len(opbc) == STEPS + (0 if user_step else STEPS // 3)
    losses = [r["train/loss"] for r in history if "train/loss" in r]
    assert losses == [float(i) for i in range(STEPS)]
    assert sum("after" in r for r in history) == (owner != "logger")
    if user_step:  # the other writer's steps are W&B's steps, as it asked
        first = 1 if owner == "verl" else 0
        assert [r["_step"] for r in history if "train/loss" in r][:STEPS] == list(range(first, first + STEPS))


def test_attaching_says_so_once_and_never_finishes_the_run(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    run = wandb.init(project="mine", mode="offline", dir=str(tmp_path))
    with caplog.at_level(logging.WARNING):
        logger = OPBCWandbLogger(project="ignored", mode="offline", log_glossary=False)
        for step in range(3):
            logger.log({"opbc/is/ess": 0.9}, step=step)
    notes = [r.getMessage() for r in caplog.records if "active W&B run" in r.getMessage()]
    assert len(notes) == 1 and run.id in notes[0] and "ignoring" in notes[0]
    logger.finish()
    assert logger.run is run  # attaches again: the run is still the active one
    wandb.log({"after": 1.0})  # would raise if the logger had finished the run
    run.finish()
    history = read_offline_run(tmp_path)["history"]
    assert sum("opbc/is/ess" in r for r in history) == 3 and any("after" in r for r in history)


def test_an_explicit_run_is_used_and_left_open(tmp_path: Path):
    run = wandb.init(project="mine", mode="offline", dir=str(tmp_path))
    logger = OPBCWandbLogger(run=run, log_glossary=False)
    logger.log({"opbc/is/ess": 0.7}, step=3)
    logger.finish()
    run.log({"after": 1.0})
    run.finish()
    rows = read_offline_run(tmp_path)["history"]
    assert [r["opbc/step"] for r in rows if "opbc/is/ess" in r] == [3]
