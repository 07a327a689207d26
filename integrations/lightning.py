"""Lightning integration (the ``lightning`` extra): :class:`OPBCCallback`.

The callback feeds an :class:`~opbc_metrics.OPBCCollection` from each training batch and logs the flat
``section/group/metric`` keys every ``log_every_n_steps`` batches and at the end of each training epoch.

How it logs, and why:

* ``OPBCCollection.compute()`` already returns *global* values: it all-reduces the sufficient
  statistics of every rank (one collective per reduction kind) before computing. So the callback calls
  it on every rank at the same batch and never asks Lightning to reduce: nothing is logged with
  ``sync_dist=True`` (Lightning's default ``reduce_fx`` would average per-rank values, the wrong answer
  for ESS, maxima and ratios).
* One destination, chosen by ``sinks``: without sinks the values go to ``trainer.loggers``
  (``Logger.log_metrics``, Lightning's ``WandbLogger`` included) from global rank 0; with sinks (e.g. an
  :class:`~opbc_metrics.integrations.wandb_logger.OPBCWandbLogger`, which attaches to the run
  Lightning's ``WandbLogger`` started) they go only to the sinks, so no key is written twice. Either way
  at the step Lightning itself uses for the same batch (``fit_loop.epoch_loop._batches_that_stepped``),
  so the chosen interval is exact whatever ``Trainer(log_every_n_steps=...)`` says. Keys that are a
  fixed function of another key and counts of events that stayed zero are not written (``log_all=True``
  writes them; see :mod:`opbc_metrics.integrations.dashboard`). Window values are also logged, every
  key, with ``pl_module.log(..., on_step=True, on_epoch=False, sync_dist=False, logger=False)`` so that
  they appear in ``trainer.callback_metrics`` (for ``ModelCheckpoint``/``EarlyStopping`` monitors and
  the progress bar) with identical values on every rank. A key the window did not compute (a metric
  with no data in it) is taken out of ``callback_metrics`` and the progress bar, not left at an
  earlier window's value; keys you log yourself are never touched.
* Windows: after each interval log the window is folded into the epoch's accumulator
  (``Metric.merge_state``: sums add, maxima max) and reset. At the end of each training epoch the
  epoch's values (every batch of the epoch, all ranks) are kept in :attr:`OPBCCallback.epoch_values`;
  with ``log_epoch=True`` they are also logged as ``<key><epoch_suffix>`` (``opbc/is/ess_epoch``,
  Lightning's own suffix for epoch aggregates: one point per epoch, so off by default).

Where the batch comes from: ``source="outputs"`` (default) reads what ``training_step`` returned -- a
dict with the batch-schema fields, or the sub-dict under ``key`` -- and ``source="batch"`` reads the
dataloader batch. ``transform`` (e.g. :func:`opbc_metrics.integrations.verl.verl_to_batch`) maps a
framework's names first. Updates run under ``torch.no_grad()``; tensors need not be detached.

Pattern: holding the collection inside the LightningModule. Declared as a module attribute, the
collection moves with the module to its device, and its states (persistent) are saved in the
module's checkpoints. Give the callback the attribute name::

    class Policy(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.opbc = OPBCCollection()

        def training_step(self, batch, batch_idx):
            trainer_logprobs = self.logprobs(batch)          # [B, T], with grad
            loss = ...
            return {"loss": loss, "opbc": {"trainer_logprobs": trainer_logprobs,
                                           "rollout_logprobs": batch["rollout_logprobs"],
                                           "response_mask": batch["response_mask"]}}

    trainer = L.Trainer(callbacks=[OPBCCallback("opbc", key="opbc", log_every_n_steps=10)])

Without the callback, the same pattern logs by hand -- compute on every rank, no Lightning
reduction, reset yourself. ``self.log_dict(self.opbc)`` (the torchmetrics habit) cannot work: Lightning
would log each member metric, and each computes a dict of keys; the first such call raises a
``TypeError`` saying what to do.
By hand::

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if (batch_idx + 1) % 10 == 0:
                self.log_dict(self.opbc.compute(), on_step=True, on_epoch=False, sync_dist=False)
                self.opbc.reset()
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

try:  # the unified package first, the standalone one as a fallback
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:  # pragma: no cover - depends on the environment
    from pytorch_lightning import Callback, LightningModule, Trainer

from opbc_metrics.batch import host_floats
from opbc_metrics.collection import OPBCCollection
from opbc_metrics.integrations._common import OPBCIntegrationWarning
from opbc_metrics.integrations.dashboard import KeyFilter

__all__ = ["OPBCCallback"]

class OPBCCallback(Callback):
    """Update an :class:`~opbc_metrics.OPBCCollection` from training batches and log its global values.

    Args:
        metrics: the collection, the name of a ``LightningModule`` attribute holding one, or ``None``
            for a default ``OPBCCollection()`` owned by the callback.
        source: ``"outputs"`` (what ``training_step`` returned) or ``"batch"`` (the dataloader batch).
        key: read the batch fields from ``source[key]`` instead of ``source`` itself.
        transform: a callable mapping the selected object onto the batch schema (e.g. ``verl_to_batch``).
        log_every_n_steps: log the window every this many training batches (per rank); ``None`` uses
            ``Trainer(log_every_n_steps=...)``; ``0`` logs only the epoch aggregate, at epoch end.
        log_epoch: also log the epoch aggregate (``<key><epoch_suffix>``) at the end of each training epoch
            (it is computed and kept in :attr:`epoch_values` either way).
        epoch_suffix: appended to each key for the epoch aggregate.
        prog_bar: keys also shown in the progress bar.
        sinks: where to write instead of ``trainer.loggers``, e.g. an
            :class:`~opbc_metrics.integrations.wandb_logger.OPBCWandbLogger`: objects with
            ``log(values, step)`` and optionally ``update(batch)``. They are called on every rank (their own
            sync, if any, is collective) and write on rank 0. With sinks, ``trainer.loggers`` get nothing
            from the callback.
        log_all: write every key to ``trainer.loggers``, aliases and event counts that stayed zero included.
        skip_missing: skip batches where ``source`` (or ``source[key]``) is ``None`` or absent, instead
            of raising. A ``source`` that is there but lacks ``key`` (e.g. ``training_step`` returned the
            fields under another name, or only the loss) is most likely a wrong ``key``: the first such
            batch warns (:class:`~opbc_metrics.integrations._common.OPBCIntegrationWarning`), naming the
            key and the keys it had (once; the batches are still skipped).

    Example:
        >>> callback = OPBCCallback(key="opbc", log_every_n_steps=10)
        >>> callback.state_dict()
        {'batches_seen': 0, 'window_batches': 0}
    """

    def __init__(
        self,
        metrics: OPBCCollection | str | None = None,
        *,
        source: Literal["outputs", "batch"] = "outputs",
        key: str | None = None,
        transform: Callable[[Any], Any] | None = None,
        log_every_n_steps: int | None = None,
        log_epoch: bool = False,
        epoch_suffix: str = "_epoch",
        prog_bar: Iterable[str] = (),
        sinks: Sequence[Any] = (),
        log_all: bool = False,
        skip_missing: bool = True,
    ) -> None:
        super().__init__()
        if source not in ("outputs", "batch"):
            raise ValueError(f"`source` must be 'outputs' or 'batch', got {source!r}")
        if log_every_n_steps is not None and (not isinstance(log_every_n_steps, int) or log_every_n_steps < 0):
            raise ValueError(f"`log_every_n_steps` must be a non-negative integer or None, got {log_every_n_steps!r}")
        if metrics is not None and not isinstance(metrics, (OPBCCollection, str)):
            raise TypeError(f"`metrics` must be an OPBCCollection, an attribute name or None, got {type(metrics)}")
        self._metrics_arg = metrics
        self.metrics: OPBCCollection | None = metrics if isinstance(metrics, OPBCCollection) else None
        self._epoch_metrics: OPBCCollection | None = None
        self.source = source
        self.key = key
        self.transform = transform
        self.log_every_n_steps = log_every_n_steps
        self.log_epoch = log_epoch
        self.epoch_suffix = epoch_suffix
        self.prog_bar = set(prog_bar)
        self.sinks = list(sinks)
        self.key_filter = KeyFilter(log_all=log_all)
        self.skip_missing = skip_missing
        self.batches_seen = 0
        self.window_batches = 0
        self._warned_key = False
        self._reported: set[str] = set()  # names this callback put in trainer.callback_metrics
        self.last_values: dict[str, Tensor] = {}
        self.epoch_values: dict[str, Tensor] = {}
        self._pending_state: dict[str, Any] | None = None
        self._restored = False

    # -- setup -------------------------------------------------------------------------------------
    def _resolve(self, pl_module: LightningModule) -> OPBCCollection:
        if isinstance(self._metrics_arg, str):
            metrics = getattr(pl_module, self._metrics_arg, None)
            if not isinstance(metrics, OPBCCollection):
                raise AttributeError(
                    f"OPBCCallback: the LightningModule has no OPBCCollection attribute `{self._metrics_arg}`"
                )
            self.metrics = metrics
        elif self.metrics is None:
            self.metrics = OPBCCollection()
        return self.metrics

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        metrics = self._resolve(pl_module)
        metrics.to(pl_module.device)  # a no-op for a collection held by the module (already moved)
        self._epoch_metrics = copy.deepcopy(metrics)
        self._epoch_metrics.reset()

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._restored:  # resuming from a checkpoint: keep the restored window and epoch states
            self._restored = False
            return
        if self.metrics is not None:
            self.metrics.reset()
        if self._epoch_metrics is not None:
            self._epoch_metrics.reset()
        self.window_batches = 0

    # -- per batch ---------------------------------------------------------------------------------
    def _select(self, outputs: Any, batch: Any) -> Any:
        obj = outputs if self.source == "outputs" else batch
        lacks_key = None
        if obj is not None and self.key is not None:
            if isinstance(obj, Mapping) and self.key in obj:
                obj = obj[self.key]
            elif hasattr(obj, self.key) and not isinstance(obj, Mapping):
                obj = getattr(obj, self.key)
            else:
                lacks_key, obj = obj, None
        if obj is None:
            if self.skip_missing:
                if lacks_key is not None and not self._warned_key:
                    # silent skipping would log only zero input counts for the whole run
                    self._warned_key = True
                    had = (f"keys {sorted(map(str, lacks_key))}" if isinstance(lacks_key, Mapping)
                           else f"a {type(lacks_key).__name__}")
                    warnings.warn(
                        f"OPBCCallback: the training step's {self.source} has no `{self.key}` (it has {had}); "
                        f"skipping such batches. Pass `key=` the name your {self.source} holds the batch fields "
                        "under (`key=None` for the top level), or `skip_missing=False` to raise instead.",
                        OPBCIntegrationWarning,
                        stacklevel=2,
                    )
                return None
            where = f"{self.source}[{self.key!r}]" if self.key is not None else self.source
            raise ValueError(f"OPBCCallback: no batch fields in the training step's {where}")
        if self.key is None and self.source == "outputs" and isinstance(obj, Mapping) and "loss" in obj:
            # Lightning's own entry of a training step's output: not a batch field (it would warn as unread).
            obj = {k: v for k, v in obj.items() if k != "loss"}
        return self.transform(obj) if self.transform is not None else obj

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        metrics = self.metrics if self.metrics is not None else self._resolve(pl_module)
        fields = self._select(outputs, batch)
        if fields is not None:
            with torch.no_grad():
                metrics.update(fields)
                for sink in self.sinks:
                    update = getattr(sink, "update", None)
                    if callable(update):
                        update(fields)
        self.batches_seen += 1
        self.window_batches += 1
        interval = self._interval(trainer)
        if interval and self.window_batches >= interval:
            values = metrics.compute()  # global: a collective on every rank
            self.last_values = values
            self._emit(trainer, pl_module, values, suffix="", step_hook=True)
            self._fold_window()

    def _interval(self, trainer: Trainer) -> int:
        if self.log_every_n_steps is not None:
            return self.log_every_n_steps
        return int(getattr(trainer, "log_every_n_steps", 50) or 0)

    def _fold_window(self) -> None:
        """Merge the window's (local) states into the epoch accumulator and reset the window."""
        assert self.metrics is not None
        if self._epoch_metrics is not None and self.window_batches:
            for dst, src in zip(self._epoch_metrics.members(), self.metrics.members()):
                if src.update_called:
                    dst.merge_state(src)  # also drops dst's cached result; data presence is read from the states
        self.metrics.reset()
        self.window_batches = 0

    # -- epoch end ---------------------------------------------------------------------------------
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.metrics is None:
            return
        self._fold_window()
        if self._epoch_metrics is not None:
            values = self._epoch_metrics.compute()  # global over the epoch: a collective on every rank
            self.epoch_values = values
            if self.log_epoch or self._interval(trainer) == 0:
                self._emit(trainer, pl_module, values, suffix=self.epoch_suffix, step_hook=False)
            self._epoch_metrics.reset()

    # -- writing -----------------------------------------------------------------------------------
    def _emit(
        self, trainer: Trainer, pl_module: LightningModule, values: Mapping[str, Tensor], suffix: str, step_hook: bool
    ) -> None:
        step = _logger_step(trainer)
        scalars = {f"{k}{suffix}": v for k, v in values.items() if isinstance(v, Tensor) and v.numel() == 1}
        if step_hook:
            self._forget(trainer, pl_module, self._reported - scalars.keys())
            self._reported = set(scalars)
            for name, value in scalars.items():
                pl_module.log(
                    name,
                    value.detach().reshape(()),
                    on_step=True,
                    on_epoch=False,
                    sync_dist=False,
                    logger=False,
                    prog_bar=name in self.prog_bar,
                    batch_size=1,
                )
        if self.sinks:  # the sinks choose their keys
            for sink in self.sinks:
                sink.log({f"{k}{suffix}": v for k, v in values.items()}, step=step)
            return
        if trainer.is_global_zero and scalars:
            written = [f"{k}{suffix}" for k in self.key_filter(values)]
            floats = host_floats({name: scalars[name] for name in written if name in scalars})
            floats["epoch"] = float(trainer.current_epoch)  # as Lightning adds to its own records
            for logger in trainer.loggers:
                logger.log_metrics(floats, step=step)
                logger.save()

    def _forget(self, trainer: Trainer, pl_module: LightningModule, names: set[str]) -> None:
        """Take keys an earlier window put in ``trainer.callback_metrics`` and the progress bar, which this
        window did not compute, out of both: a monitor must not read an older window's value as this one's.

        Lightning keeps what ``log`` recorded (``trainer._results``, one entry per hook and name) and
        copies it into those dicts after each batch; both are cleared, for names this callback logged only.
        """
        if not names:
            return
        results = getattr(trainer, "_results", None)
        fx = getattr(pl_module, "_current_fx_name", None) or "on_train_batch_end"
        if results is not None:
            mine = [k for k, v in results.items() if getattr(v, "meta", None) is not None
                    and v.meta.name in names and v.meta.fx.split(".")[0] == fx]
            for k in mine:
                del results[k]
        for name in names:
            trainer.callback_metrics.pop(name, None)
            trainer.progress_bar_metrics.pop(name, None)

    # -- checkpointing -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"batches_seen": self.batches_seen, "window_batches": self.window_batches}
        if self.metrics is not None and not isinstance(self._metrics_arg, str):
            state["window"] = self.metrics.state_dict()
        if self._epoch_metrics is not None:
            state["epoch"] = self._epoch_metrics.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches_seen = int(state_dict.get("batches_seen", 0))
        self.window_batches = int(state_dict.get("window_batches", 0))
        self._pending_state = state_dict
        self._restored = True

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        pending = self._pending_state
        if pending is None:
            return
        self._pending_state = None
        if "window" in pending and self.metrics is not None:
            self.metrics.load_state_dict(pending["window"])
        if "epoch" in pending and self._epoch_metrics is not None:
            self._epoch_metrics.load_state_dict(pending["epoch"])


def _logger_step(trainer: Trainer) -> int:
    """The step Lightning's own logging uses for the current batch (falls back to ``global_step``)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    return int(step) if isinstance(step, int) else int(trainer.global_step)
