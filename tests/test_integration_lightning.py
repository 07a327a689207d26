"""OPBCCallback under a real lightning.Trainer on CPU: interval and epoch logging, global values under a
2-process DDP run (gloo), the LightningModule-held collection pattern, and a transform (verl names)."""

from __future__ import annotations

import copy
import math
import os
import warnings
from typing import Any

import numpy as np
import pytest
import torch

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.loggers import Logger  # noqa: E402
from lightning.pytorch.utilities import rank_zero_only  # noqa: E402

from opbc_metrics import OPBCCollection  # noqa: E402
from opbc_metrics.integrations._common import OPBCIntegrationWarning  # noqa: E402
from opbc_metrics.integrations.lightning import OPBCCallback  # noqa: E402
from opbc_metrics.integrations.verl import verl_to_batch  # noqa: E402
from tests.data import make_batch  # noqa: E402
from tests.ddp import run_distributed  # noqa: E402
from tests.support import collection_values, load_module  # noqa: E402
from tests.wandb_run import assert_logged as assert_close  # noqa: E402

SEQ = 12
QUIET = ("does not have many workers", "GPU available but not used", "log_every_n_steps")
pytestmark = [pytest.mark.filterwarnings(f"ignore:.*{m}") for m in QUIET]


# -- A tiny model, a per-sample dataset, and a logger that records what it receives --------------
def make_samples(n: int, seed: int, empty_every: int = 0) -> list[dict[str, torch.Tensor]]:
    """Per-sample dicts (the default collate stacks them into a batch-schema dict)."""
    b = make_batch(batch=n, seq=SEQ, seed=seed, drift=0.4, dtype=torch.float64, heavy_tail=True)
    samples = []
    for i in range(n):
        mask = b["response_mask"][i].clone()
        if empty_every and i % empty_every == 0:
            mask.zero_()  # sequences with no valid token: uneven work across ranks
        samples.append({"trainer_logprobs": b["trainer_logprobs"][i], "rollout_logprobs": b["rollout_logprobs"][i],
                        "response_mask": mask, "group_ids": torch.tensor(i // 2)})
    return samples


def reference(samples: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Values of a fresh single-process collection on exactly these samples (one update)."""
    return collection_values([{k: torch.stack([s[k] for s in samples]) for k in samples[0]}])


class TinyModule(L.LightningModule):
    """Returns the batch fields under "opbc" from training_step; the trainer logprobs carry grad."""

    def __init__(self, hold_collection: bool = False, return_fields: bool = True) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
        self.return_fields = return_fields
        if hold_collection:
            self.opbc = OPBCCollection()

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        if not self.return_fields:
            return (self.scale - 1.0) ** 2
        trainer_logprobs = batch["trainer_logprobs"] * self.scale  # == the batch values, requires grad
        loss = (trainer_logprobs * batch["response_mask"]).sum() * 0.0 + (self.scale - 1.0) ** 2
        fields = {"trainer_logprobs": trainer_logprobs, "rollout_logprobs": batch["rollout_logprobs"],
                  "response_mask": batch["response_mask"]}
        return {"loss": loss, "opbc": fields}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class MemoryLogger(Logger):
    """Records every ``log_metrics`` call as ``(step, metrics)``."""

    name, version = "memory", 0

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, dict[str, float]]] = []

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((int(step) if step is not None else -1, dict(metrics)))

    def opbc_records(self, suffix: str = "") -> list[tuple[int, dict[str, float]]]:
        """The records written by the callback: windows (``suffix=""``) or epoch aggregates."""
        return [(step, m) for step, m in self.records if f"opbc/is/ess{suffix}" in m]


def assert_windows(rows: list[tuple[int, dict[str, float]]], steps: list[int], samples: list, size: int = 4) -> None:
    """``(step, values)`` rows logged at ``steps``; row i equals a fresh collection on samples [size i, size (i+1))."""
    assert [step for step, _ in rows] == steps
    for i, (_, logged) in enumerate(rows):
        assert_close(logged, reference(samples[size * i : size * (i + 1)]))


def make_trainer(callbacks: OPBCCallback | list, logger: Logger, epochs: int = 1, **kwargs: Any) -> Any:
    callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
    return L.Trainer(**{"accelerator": "cpu", "devices": 1, "max_epochs": epochs, "logger": logger,
                        "callbacks": callbacks, "enable_checkpointing": False, "enable_progress_bar": False,
                        "enable_model_summary": False, "num_sanity_val_steps": 0, **kwargs})


def loader(samples: list[dict[str, Any]], batch_size: int = 2) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(samples, batch_size=batch_size, shuffle=False)


# -- Single process ------------------------------------------------------------------------------
def test_interval_and_epoch_values_equal_an_independent_collection_on_the_same_batches():
    samples = make_samples(12, seed=3, empty_every=5)  # 6 batches of 2 per epoch
    logger = MemoryLogger()
    callback = OPBCCallback(key="opbc", log_every_n_steps=2, prog_bar=["opbc/is/ess"], log_epoch=True)
    trainer = make_trainer(callback, logger, epochs=2, log_every_n_steps=50)
    trainer.fit(TinyModule(), loader(samples))

    # Logged every 2 batches, at the step Lightning uses for the batch (batches_that_stepped before
    # the increment): steps 1, 3, 5 in epoch 0 and 7, 9, 11 in epoch 1 (the same samples again).
    assert_windows(logger.opbc_records(), [1, 3, 5, 7, 9, 11], samples * 2)

    epochs = logger.opbc_records(suffix="_epoch")
    assert [step for step, _ in epochs] == [6, 12]
    for _, logged in epochs:
        assert_close(logged, reference(samples), suffix="_epoch")
    assert {m["epoch"] for _, m in logger.records if "opbc/is/ess_epoch" in m} == {0.0, 1.0}

    # callback_metrics holds the last window (for monitors / progress bar), unreduced.
    last = reference(samples[8:12])
    assert math.isclose(trainer.callback_metrics["opbc/is/ess"].item(), last["opbc/is/ess"], rel_tol=1e-9)
    assert math.isclose(trainer.progress_bar_metrics["opbc/is/ess"], last["opbc/is/ess"], rel_tol=1e-6)
    assert_close({k: v.item() for k, v in callback.epoch_values.items()}, reference(samples))


def test_module_held_collection_source_batch_and_trainer_interval():
    samples = make_samples(8, seed=4)
    module = TinyModule(hold_collection=True, return_fields=False)
    callback = OPBCCallback("opbc", source="batch")  # interval from Trainer(log_every_n_steps=2)
    logger = MemoryLogger()
    trainer = make_trainer(callback, logger, log_every_n_steps=2)
    trainer.fit(module, loader(samples))

    assert callback.metrics is module.opbc
    assert_windows(logger.opbc_records(), [1, 3], samples)
    # The window was reset after logging, as Lightning resets logged torchmetrics objects.
    assert all(m._update_count == 0 for m in module.opbc.members())
    # The collection is part of the module: its (persistent) states travel in the module's checkpoint.
    assert any(k.startswith("opbc.") for k in module.state_dict())


def test_transform_maps_a_frameworks_names_and_epoch_only_logging():
    samples = make_samples(6, seed=5)
    verl_samples = [{"old_log_probs": s["trainer_logprobs"], "rollout_log_probs": s["rollout_logprobs"],
                     "response_mask": s["response_mask"], "uid": f"prompt-{i // 3}"} for i, s in enumerate(samples)]
    logger = MemoryLogger()
    callback = OPBCCallback(source="batch", transform=verl_to_batch, log_every_n_steps=0, log_epoch=True,
                            epoch_suffix="")
    trainer = make_trainer(callback, logger, log_every_n_steps=50)
    trainer.fit(TinyModule(return_fields=False), loader(verl_samples, batch_size=3))
    records = [m for _, m in logger.records if "opbc/is/ess" in m]
    assert len(records) == 1  # epoch end only
    assert_close(records[0], reference(samples))


def test_skip_missing_and_clear_errors():
    samples = make_samples(4, seed=6)
    logger = MemoryLogger()
    # training_step returns a bare loss: nothing to read, the batches are skipped, and the key is reported once.
    callback = OPBCCallback(key="opbc", log_every_n_steps=1)
    with pytest.warns(OPBCIntegrationWarning, match=r"outputs has no `opbc` \(it has keys \['loss'\]\)") as seen:
        make_trainer(callback, logger).fit(TinyModule(return_fields=False), loader(samples))
    assert callback.batches_seen == 2 and sum(isinstance(w.message, OPBCIntegrationWarning) for w in seen) == 1
    assert all(m._update_count == 0 for m in callback.metrics.members())

    strict = OPBCCallback(key="opbc", log_every_n_steps=1, skip_missing=False)
    with pytest.raises(ValueError, match="no batch fields"):
        make_trainer(strict, MemoryLogger()).fit(TinyModule(return_fields=False), loader(samples))
    with pytest.raises(AttributeError, match="no OPBCCollection attribute `nope`"):
        make_trainer(OPBCCallback("nope"), MemoryLogger()).fit(TinyModule(), loader(samples))
    with pytest.raises(ValueError, match="source"):
        OPBCCallback(source="outputs_and_batch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="log_every_n_steps"):
        OPBCCallback(log_every_n_steps=-1)


class _RenamedFields(TinyModule):
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        return {"loss": out["loss"], "fields": out["opbc"]}


class _TopLevelFields(TinyModule):
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        return {"loss": out["loss"], **out["opbc"]}


def test_key_none_reads_the_top_level_without_lightnings_loss():
    """With `key=None` the fields sit beside Lightning's `loss`, which is not a batch field: no unread-field
    warning for it, and the values are those of the fields alone."""
    samples = make_samples(4, seed=6)
    callback = OPBCCallback(key=None, log_every_n_steps=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r".*not read by opbc-metrics")
        make_trainer(callback, MemoryLogger()).fit(_TopLevelFields(), loader(samples))
    assert callback.batches_seen == 2 and "opbc/is/ess" in callback.last_values


def test_a_wrong_key_is_reported_once_naming_the_keys_the_output_had():
    callback = OPBCCallback(key="opbc", log_every_n_steps=2)
    with pytest.warns(OPBCIntegrationWarning, match=r"no `opbc` \(it has keys \['fields', 'loss'\]\).*`key=`") as seen:
        make_trainer(callback, MemoryLogger()).fit(_RenamedFields(), loader(make_samples(8, seed=6)))
    assert sum(isinstance(w.message, OPBCIntegrationWarning) for w in seen) == 1
    right = OPBCCallback(key="fields", log_every_n_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OPBCIntegrationWarning)
        make_trainer(right, MemoryLogger()).fit(_RenamedFields(), loader(make_samples(8, seed=6)))
    assert right.last_values["opbc/input/num_tokens"] > 0


class _UserLogs(TinyModule):
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        self.log("user/value", float(batch_idx), on_step=True, on_epoch=False, prog_bar=True)
        return super().training_step(batch, batch_idx)


class _CallbackMetrics(L.Callback):
    """``trainer.callback_metrics`` and the progress bar after each batch's hooks and Lightning's own update."""

    def __init__(self) -> None:
        self.seen: list[tuple[set[str], set[str]]] = []

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:  # what the previous batch left
        self.seen.append((set(trainer.callback_metrics), set(trainer.progress_bar_metrics)))


def test_callback_metrics_hold_only_the_keys_the_last_window_computed():
    samples = make_samples(12, seed=7)
    for s in samples[4:8]:
        s["response_mask"] = torch.zeros_like(s["response_mask"])  # window 2 (batches 2, 3): no valid token
    callback = OPBCCallback(key="opbc", log_every_n_steps=2, prog_bar=["opbc/is/ess", "opbc/input/num_tokens"])
    spy = _CallbackMetrics()
    trainer = make_trainer([callback, spy], MemoryLogger())
    trainer.fit(_UserLogs(), loader(samples))
    after = [*spy.seen[1:], (set(trainer.callback_metrics), set(trainer.progress_bar_metrics))]  # after batch i
    computed_1, computed_3 = after[1][0], after[3][0]
    assert "opbc/is/ess" in computed_1 and "opbc/is/ess" in after[2][0]  # window 1's values until window 2
    assert not any(k.startswith(("opbc/is/", "opbc/kl/")) for k in computed_3)  # window 2 had no data for them
    assert {"opbc/input/num_tokens", "user/value"} <= computed_3 and "opbc/is/ess" not in after[3][1]
    assert after[3][1] >= {"opbc/input/num_tokens", "user/value"}
    assert "opbc/is/ess" in after[5][0] and "opbc/is/ess" in after[5][1]  # window 3 has data again


class _Snapshot(L.Callback):
    """A copy of the OPBC callback's state after training batch ``at``, as a mid-epoch checkpoint holds it."""

    def __init__(self, opbc: OPBCCallback, at: int) -> None:
        self.opbc, self.at, self.state = opbc, at, None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.at:
            self.state = copy.deepcopy(self.opbc.state_dict())


def test_callback_state_round_trip():
    """A checkpoint taken mid-window and mid-epoch: a callback restored from it (load_state_dict, then a new fit's
    hooks) goes on with that window and that epoch. Its first window equals a fresh collection on the window's
    batches from before and after the checkpoint, its epoch value one on every batch of both runs."""
    samples = make_samples(16, seed=7)  # batches of 2
    callback = OPBCCallback(key="opbc", log_every_n_steps=4, log_epoch=True)
    snapshot = _Snapshot(callback, at=4)  # after 5 batches: a window of 4 logged and folded, 1 batch open
    make_trainer([callback, snapshot], MemoryLogger()).fit(TinyModule(), loader(samples[:10]))
    state = snapshot.state
    assert state["batches_seen"] == 5 and state["window_batches"] == 1 and "window" in state and "epoch" in state
    fresh, logger = OPBCCallback(key="opbc", log_every_n_steps=4, log_epoch=True), MemoryLogger()
    fresh.load_state_dict(state)
    make_trainer(fresh, logger).fit(TinyModule(), loader(samples[10:]))  # 3 batches: the open window fills
    assert fresh.batches_seen == 8
    assert_windows(logger.opbc_records(), [2], samples[8:], size=8)
    epochs = logger.opbc_records(suffix="_epoch")
    assert len(epochs) == 1
    assert_close(epochs[0][1], reference(samples), suffix="_epoch")


# -- Two processes (gloo): the logged values are global, on every rank, with no Lightning reduction ---
DDP_SAMPLES = dict(n=16, seed=11, empty_every=3)  # rank r trains on samples r, r+2, ... (explicit shards)


def _ddp_worker(rank: int, world_size: int) -> dict[str, Any]:
    # The process group already exists (tests/ddp.py); LOCAL_RANK tells Lightning that processes were
    # launched externally, so it neither spawns nor re-initialises.
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size), NODE_RANK="0")
    from lightning.pytorch.strategies import DDPStrategy

    warnings.filterwarnings("ignore")
    samples = make_samples(**DDP_SAMPLES)
    logger = MemoryLogger()
    callback = OPBCCallback(key="opbc", log_every_n_steps=2, log_epoch=True)
    trainer = make_trainer(callback, logger, devices=world_size, strategy=DDPStrategy(process_group_backend="gloo"),
                           log_every_n_steps=50, use_distributed_sampler=False)
    trainer.fit(TinyModule(), loader(samples[rank::world_size]))  # this rank's shard, in order
    return {
        "records": logger.records,
        "epoch": {k: v.item() for k, v in callback.epoch_values.items()},
        "callback_ess": trainer.callback_metrics["opbc/is/ess"].item(),
        "world_size": trainer.world_size,
    }


def test_ddp_two_processes_log_global_values():
    results = run_distributed(_ddp_worker, world_size=2, timeout=120)
    assert [r["world_size"] for r in results] == [2, 2]
    samples = make_samples(**DDP_SAMPLES)
    per_rank = [samples[r::2] for r in range(2)]
    # Batch b on rank r holds per_rank[r][2b : 2b + 2]; the window after batches 2w, 2w+1 holds both
    # ranks' batches.
    windows = [[s for r in range(2) for s in per_rank[r][4 * w : 4 * w + 4]] for w in range(2)]
    rank0 = MemoryLogger()
    rank0.records = results[0]["records"]
    logged = rank0.opbc_records()
    assert [step for step, _ in logged] == [1, 3]
    for w, ((_, values), window) in enumerate(zip(logged, windows)):
        expected = reference(window)
        assert_close(values, expected)
        # The mean of per-rank values (what sync_dist averaging would log) is a different number.
        naive = np.mean([reference(per_rank[r][4 * w : 4 * w + 4])["opbc/is/ess"] for r in range(2)])
        assert not math.isclose(naive, expected["opbc/is/ess"], rel_tol=1e-6)
    epoch = [v for _, v in MemoryLogger.opbc_records(rank0, suffix="_epoch")]
    assert len(epoch) == 1
    assert_close(epoch[0], reference(samples), suffix="_epoch")
    # Every rank computed the same global values; only rank 0 wrote to its logger.
    assert_close(results[1]["epoch"], reference(samples))
    assert results[1]["records"] == []
    assert math.isclose(results[0]["callback_ess"], results[1]["callback_ess"], rel_tol=1e-12)


# -- The callback with a W&B sink (offline run, read back) ---------------------------------------
def test_callback_with_wandb_sink_writes_windows_epoch_and_histograms(tmp_path):
    pytest.importorskip("wandb")
    from opbc_metrics.integrations.wandb_logger import DistributionHistograms, OPBCWandbLogger
    from tests.wandb_run import read_offline_run

    samples = make_samples(10, seed=8)  # 5 batches: windows after batches 2 and 4, a 1-batch tail
    sink = OPBCWandbLogger(distributions=DistributionHistograms(bins=16), mode="offline", dir=str(tmp_path),
                           log_glossary=False)
    callback = OPBCCallback(key="opbc", log_every_n_steps=2, sinks=[sink], log_epoch=True)
    trainer_logger = MemoryLogger()
    make_trainer(callback, trainer_logger, log_every_n_steps=50).fit(TinyModule(), loader(samples))
    sink.finish()
    assert trainer_logger.opbc_records() == [] and trainer_logger.opbc_records("_epoch") == []  # one destination

    history = read_offline_run(tmp_path)["history"]
    windows = [r for r in history if "opbc/is/ess" in r]
    assert_windows([(r["opbc/step"], r) for r in windows], [1, 3], samples)
    epoch = [r for r in history if "opbc/is/ess_epoch" in r]
    assert [r["opbc/step"] for r in epoch] == [5]
    assert_close(epoch[0], reference(samples), suffix="_epoch")
    # Window histograms count that window's valid tokens; the tail batch's histogram rides with the
    # epoch row.
    for row, part in ((windows[0], samples[:4]), (windows[1], samples[4:8]), (epoch[0], samples[8:])):
        tokens = int(sum(s["response_mask"].sum() for s in part))
        assert sum(row["opbc/dist/log_ratio"]["values"]) == tokens


def test_lightning_example_runs_and_measures_a_real_bf16_mismatch(tmp_path, monkeypatch):
    example = load_module("lightning_example")
    monkeypatch.chdir(tmp_path)
    out = example.main(["--batches", "4", "--epochs", "1", "--log-every", "2"])
    assert 0.99 < out["opbc/is/ess"] <= 1.0
    assert 0.0 < out["opbc/logprob/abs_diff_mean"] < 0.05  # bf16 rounding of the same weights
    assert out["opbc/input/num_sequences"] == 32
    assert (tmp_path / "lightning_logs").exists()

    pytest.importorskip("wandb")
    from tests.wandb_run import read_offline_run

    example.main(["--batches", "4", "--epochs", "1", "--log-every", "2", "--wandb-dir", str(tmp_path / "wb")])
    history = read_offline_run(tmp_path / "wb")["history"]
    assert [r["opbc/step"] for r in history if "opbc/is/ess" in r] == [1, 3]  # the sink, in Lightning's run
    assert any("train/loss" in r for r in history) and any("opbc/glossary" in r for r in history)


# -- One destination, one key per quantity, and the torchmetrics habit ---------------------------
def test_each_quantity_is_written_once_and_epoch_copies_are_opt_in():
    samples = make_samples(8, seed=12)
    logger = MemoryLogger()
    callback = OPBCCallback(key="opbc", log_every_n_steps=2)
    make_trainer(callback, logger, log_every_n_steps=50).fit(TinyModule(), loader(samples))
    windows = logger.opbc_records()
    assert_windows(windows, [1, 3], samples)
    for _, record in windows:
        assert not any(k.endswith("_epoch") for k in record)
        assert "opbc/log_ratio/max_abs" not in record and "opbc/ppl/log_ppl_diff" not in record
        assert "opbc/logprob/abs_diff_max" in record
    assert_close({k: v.item() for k, v in callback.epoch_values.items()}, reference(samples))  # still computed

    everything = MemoryLogger()
    make_trainer(OPBCCallback(key="opbc", log_every_n_steps=2, log_all=True), everything,
                 log_every_n_steps=50).fit(TinyModule(), loader(samples))
    record = everything.opbc_records()[0][1]
    assert set(reference(samples[:4])) <= set(record)


class LogsTheCollection(TinyModule):
    """The torchmetrics habit: ``self.log_dict(self.opbc)`` after updating it."""

    def __init__(self) -> None:
        super().__init__(hold_collection=True)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        self.opbc.update(out["opbc"])
        self.log_dict(self.opbc)
        self.batches_run = batch_idx + 1
        return out


@pytest.mark.parametrize("with_callback", [True, False])
def test_log_dict_of_the_collection_fails_at_the_first_call_with_advice(with_callback: bool):
    """Without the callback Lightning would log nothing on step (and fail at epoch end): the first
    ``self.log_dict(self.opbc)`` raises, before the first step finishes."""
    module = LogsTheCollection()
    trainer = make_trainer([OPBCCallback("opbc", key="opbc")] if with_callback else [], MemoryLogger())
    with pytest.raises(TypeError, match=r"self\.log_dict\(self\.opbc\.compute\(\), sync_dist=False\)"):
        trainer.fit(module, loader(make_samples(8, seed=13)))
    assert getattr(module, "batches_run", 0) == 0


def test_lightning_wandb_logger_owns_the_run_and_the_sink_keeps_every_row(tmp_path):
    pytest.importorskip("wandb")
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    from opbc_metrics.integrations.wandb_logger import OPBCWandbLogger
    from tests.wandb_run import read_offline_run

    class LogsLoss(TinyModule):
        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            self.log("train/loss", float(batch_idx), on_step=True, batch_size=2)
            return out

    samples = make_samples(12, seed=14)  # 6 batches
    lightning_logger = WandbLogger(project="lightning-owns", save_dir=str(tmp_path), offline=True)
    sink = OPBCWandbLogger(log_glossary=False)
    callback = OPBCCallback(key="opbc", log_every_n_steps=1, sinks=[sink])
    trainer = make_trainer(callback, lightning_logger, log_every_n_steps=1)
    trainer.fit(LogsLoss(), loader(samples))
    assert sink.run is lightning_logger.experiment and not sink.owns_run
    sink.finish()
    lightning_logger.experiment.log({"after": 1.0})  # still open: the sink did not finish it
    wandb.finish()

    history = read_offline_run(tmp_path)["history"]
    assert_windows([(r["opbc/step"], r) for r in history if "opbc/is/ess" in r], list(range(6)), samples, size=2)
    assert [r["train/loss"] for r in history if "train/loss" in r] == [float(b) for b in range(6)]
    assert any("after" in r for r in history)
