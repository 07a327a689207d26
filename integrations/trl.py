"""TRL integration: :class:`OPBCGRPOTrainer` and :func:`trl_to_batch` (TRL's batch -> the batch schema).

Importing this module does not import TRL: :func:`trl_to_batch` reads names only, and the trainer class
is built from TRL's ``GRPOTrainer`` on first access. Tested against TRL 1.16.

Targeted version: TRL 1.x ``GRPOTrainer`` with vLLM generation or a ``rollout_func``. The rollout
logprobs exist in TRL's batch since its vLLM truncated-importance-sampling correction (huggingface/trl
PR #3867, merged August 2025); older releases do not return them and cannot feed the mismatch metrics. The names
below were checked against ``trl/trainer/grpo_trainer.py`` (``_generate_and_score_completions``,
whose returned dict is what ``compute_loss`` later receives as ``inputs``) and
``trl/trainer/grpo_config.py``, as in the 1.6/1.7 sources quoted in unslothai/unsloth-zoo PR #870:

* ``completion_mask`` ``[B, T]``: 1 on completion tokens up to and including EOS, 0 after;
* ``tool_mask`` ``[B, T]`` (multi-turn tool calling only): 0 on tool-result tokens inserted into the
  completion; TRL's loss uses ``completion_mask * tool_mask``, and so does this adapter for
  ``response_mask``;
* ``old_per_token_logps`` ``[B, T]``: the training model's logprobs of the completion tokens,
  recomputed right after generation -> ``trainer_logprobs``;
* ``sampling_per_token_logps`` ``[B, T]``: the logprobs vLLM returned while sampling ->
  ``rollout_logprobs``. TRL computes and returns both when ``use_vllm=True`` and
  ``vllm_importance_sampling_correction=True`` (its default), and forms its own correction ratio as
  ``exp(old_per_token_logps - sampling_per_token_logps)`` under that mask: the same orientation as this
  library's ``r = trainer - rollout``;
* caveat (huggingface/trl issue #6789): with ``top_p < 1``, ``top_k`` or ``min_p``, vLLM's processed
  logprobs are renormalised over the tokens the truncation kept while the trainer's are over the full
  vocabulary, so every token's ``r`` is shifted by ``log(kept mass) <= 0``: the mismatch metrics then
  measure the truncation as well as the engines' numerical drift;
* ``advantages`` ``[B]``, ``prompt_mask`` ``[B, P]`` (-> ``prompt_lengths``), ``completion_mask``
  (-> ``response_lengths``);
* groups: TRL's ``RepeatSampler`` puts the ``num_generations`` completions of a prompt next to each
  other, and each process holds the slice ``[process_index * B, (process_index + 1) * B)`` of the
  globally ordered batch. So ``group_ids = (process_index * B + arange(B)) // num_generations``, a
  numbering shared by all processes. This holds for the dict *returned by*
  ``_generate_and_score_completions``; ``_prepare_inputs`` later shuffles and splits it, after which
  positions no longer identify groups.

Fields already named as in the batch schema (e.g. ``rewards`` in TRL variants that return it) pass
through.

**The trainer.** :class:`OPBCGRPOTrainer` (TRL imported on first use) is ``GRPOTrainer`` plus the
metrics; :func:`with_opbc` adds them to any ``GRPOTrainer`` subclass. One line changes::

    from opbc_metrics.integrations.trl import OPBCGRPOTrainer
    trainer = OPBCGRPOTrainer(model=model, args=GRPOConfig(...), reward_funcs=..., train_dataset=...)

Every generation batch that carries rollout logprobs (``sampling_per_token_logps``: vLLM, or a
``rollout_func`` that returns ``logprobs``) feeds the collection:

* when TRL computed ``old_per_token_logps`` (vLLM with importance-sampling correction, or generation
  misaligned with the optimizer steps), right after generation, with the groups of the generation order;
* otherwise (``steps_per_generation`` and ``num_iterations`` aligned with gradient accumulation, no IS
  correction) TRL uses the training forward's logprobs as the old ones: the trainer captures them in the
  first loss computation of each slice, at no extra forward pass, with group ids carried through TRL's
  shuffle in the ``opbc_group_ids`` field.

The values are added to TRL's own ``log()`` (every process computes, as the sync needs; the main process
writes). A window without a fed batch logs no key; a batch the trainer cannot read (no rollout logprobs,
bad fields) is reported once as an :class:`OPBCIntegrationWarning` and skipped, never stopping training.

With ``opbc_controller=`` an :class:`~opbc_metrics.controller.OPBCController` (or a preset name), the
controller decides every group of each generation batch: its per-token weights replace TRL's vLLM
importance-sampling ratio in the loss (``importance_sampling_ratio``, so TRL's path with
``use_vllm=True, vllm_importance_sampling_correction=True`` is required for the weights, not for the mask),
its loss mask removes replayed, quarantined and rejected groups from the loss (through ``tool_mask``), and
its budget keys (``opbc/decision/*``) are logged. Off by default.

**Tokens vLLM could not score differ from TRL's convention under the controller.** TRL maps a token
whose sampling logprob vLLM returned as ``None`` to NaN in ``sampling_per_token_logps`` and then sets its
log-ratio to 0 (``nan_to_num``): importance ratio exactly 1, and the row still trains. Without the
controller this adapter only measures: such tokens count in ``opbc/input/nonfinite_count`` and stay out
of the means, and TRL's loss is untouched. With ``opbc_controller=`` they are a contract failure (the
controller's first rule, non-finite logprobs): every group holding one is rejected (reason
``non_finite``, ``opbc/decision/reason_count/non_finite``) and leaves the loss, where TRL would have
trained it. To keep TRL's convention instead, fill them in a subclass before the metrics read the batch
(the non-finite count then no longer sees them)::

    class FillUnscored(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            rollout, trainer = out.get("sampling_per_token_logps"), out.get("old_per_token_logps")
            if rollout is not None and trainer is not None:  # r = 0 where vLLM gave no logprob, as TRL
                out["sampling_per_token_logps"] = torch.where(rollout.isnan(), trainer, rollout)
            return out

    trainer = with_opbc(FillUnscored)(..., opbc_controller="truncated_is")
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from opbc_metrics.integrations._common import (
    OPBCIntegrationWarning,
    ReportOnce,
    as_plain_mapping,
    ids_to_group_ids,
    loggable,
    logprob_fields,
    lookup,
    passthrough,
)

TRL_TRAINER_LOGPROBS = "old_per_token_logps"
TRL_ROLLOUT_LOGPROBS = "sampling_per_token_logps"
TRL_COMPLETION_MASK = "completion_mask"
TRL_TOOL_MASK = "tool_mask"
TRL_PROMPT_MASK = "prompt_mask"

__all__ = [  # noqa: F822 (OPBCGRPOTrainer is built on first access, see __getattr__)
    "OPBCGRPOTrainer", "OPBCIntegrationWarning",
    "OPBCTrainerMixin",
    "trl_to_batch",
    "with_opbc",
]

# Carries each row's group id through TRL's shuffle and split of the generation batch.
GROUP_FIELD = "opbc_group_ids"


def trl_to_batch(
    inputs: Any,
    *,
    num_generations: int | None = None,
    process_index: int = 0,
    group_ids: Any = None,
    trainer_key: str = TRL_TRAINER_LOGPROBS,
    rollout_key: str = TRL_ROLLOUT_LOGPROBS,
    require_logprobs: bool = True,
) -> dict[str, Any]:
    """Map a TRL ``GRPOTrainer`` generation batch onto the batch schema.

    Args:
        inputs: the dict returned by ``GRPOTrainer._generate_and_score_completions``.
        num_generations: completions per prompt (``GRPOConfig.num_generations``); gives ``group_ids``.
        process_index: this process's index (``trainer.accelerator.process_index``), so that group ids
            agree across processes.
        group_ids: explicit group identifiers (ints, or strings numbered by first appearance);
            overrides ``num_generations``.
        trainer_key: the trainer-logprob field (``old_per_token_logps``).
        rollout_key: the sampling-logprob field (``sampling_per_token_logps``).
        require_logprobs: raise a ``ValueError`` naming the TRL field when either logprob field is
            missing (default).

    Returns:
        A dict with the batch-schema names; no host sync.

    Example:
        >>> import torch
        >>> inputs = {
        ...     "prompt_mask": torch.tensor([[1, 1], [0, 1], [1, 1], [1, 1]]),
        ...     "completion_mask": torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]]),
        ...     "old_per_token_logps": torch.full((4, 3), -1.0),
        ...     "sampling_per_token_logps": torch.full((4, 3), -1.1),
        ...     "advantages": torch.tensor([0.5, -0.5, 1.0, -1.0]),
        ... }
        >>> out = trl_to_batch(inputs, num_generations=2, process_index=1)
        >>> out["group_ids"], out["prompt_lengths"], out["response_lengths"]
        (tensor([2, 2, 3, 3]), tensor([2, 1, 2, 2]), tensor([2, 3, 1, 3]))
    """
    inputs = as_plain_mapping(inputs, "TRL inputs")
    out = passthrough(inputs)

    how = "GRPOTrainer returns it with use_vllm=True and vllm_importance_sampling_correction=True"
    missing = (
        f"TRL inputs have no `{trainer_key}` (the training model's logprobs recomputed after generation); {how}",
        f"TRL inputs have no `{rollout_key}` (vLLM's sampling logprobs); {how}",
    )
    out.update(logprob_fields(inputs, (trainer_key, rollout_key), missing if require_logprobs else None))

    completion_mask = lookup(inputs, TRL_COMPLETION_MASK)
    if completion_mask is None:
        raise ValueError("TRL inputs have no `completion_mask` [B, T]")
    if not isinstance(completion_mask, Tensor) or completion_mask.ndim != 2:
        shape = tuple(completion_mask.shape) if isinstance(completion_mask, Tensor) else type(completion_mask).__name__
        raise ValueError(f"TRL field `completion_mask` must be a [B, T] tensor, got {shape}")
    tool_mask = lookup(inputs, TRL_TOOL_MASK)
    if tool_mask is not None:
        if not isinstance(tool_mask, Tensor) or tool_mask.shape != completion_mask.shape:
            shape = tuple(tool_mask.shape) if isinstance(tool_mask, Tensor) else type(tool_mask).__name__
            raise ValueError(
                f"TRL field `tool_mask` must match `completion_mask` {tuple(completion_mask.shape)}, got {shape}"
            )
        if tool_mask.device != completion_mask.device:
            raise ValueError(
                f"TRL field `tool_mask` is on {tool_mask.device} but `completion_mask` is on {completion_mask.device}"
            )
        out["response_mask"] = (completion_mask != 0) & (tool_mask != 0)
    else:
        out["response_mask"] = completion_mask
    out.setdefault("response_lengths", completion_mask.sum(dim=1))
    prompt_mask = lookup(inputs, TRL_PROMPT_MASK)
    if isinstance(prompt_mask, Tensor) and prompt_mask.ndim == 2:
        out.setdefault("prompt_lengths", prompt_mask.sum(dim=1))
    advantages = lookup(inputs, "advantages")
    if advantages is not None:
        out["advantages"] = advantages

    batch_size = completion_mask.shape[0]
    if group_ids is not None:
        try:
            out["group_ids"] = ids_to_group_ids(group_ids, device=completion_mask.device)
        except ValueError as err:
            raise ValueError(f"`group_ids`: {err}") from None
        if out["group_ids"].shape[0] != batch_size:
            raise ValueError(f"`group_ids` has {out['group_ids'].shape[0]} entries for a batch of {batch_size}")
    elif num_generations is not None:
        if not isinstance(num_generations, int) or num_generations < 1:
            raise ValueError(f"`num_generations` must be a positive integer, got {num_generations!r}")
        if not isinstance(process_index, int) or process_index < 0:
            raise ValueError(f"`process_index` must be a non-negative integer, got {process_index!r}")
        start = process_index * batch_size
        positions = torch.arange(start, start + batch_size, device=completion_mask.device)
        out["group_ids"] = torch.div(positions, num_generations, rounding_mode="floor")
    return out


def generation_group_ids(batch_size: int, num_generations: int, process_index: int, device: Any = None) -> Tensor:
    """Group id of each row of a process's generation batch: TRL's ``RepeatSampler`` keeps the
    ``num_generations`` completions of a prompt together in the globally ordered batch."""
    start = process_index * batch_size
    return torch.div(torch.arange(start, start + batch_size, device=device), num_generations, rounding_mode="floor")


class OPBCTrainerMixin:
    """Adds the OPBC metrics (and optionally the controller) to a TRL ``GRPOTrainer`` subclass.

    Put it first in the bases (``class T(OPBCTrainerMixin, GRPOTrainer)``), or use :func:`with_opbc`.

    Keyword arguments taken by ``__init__`` (the rest go to the trainer):
        opbc: the :class:`~opbc_metrics.OPBCCollection` to feed (default: ``OPBCCollection()``).
        opbc_controller: an :class:`~opbc_metrics.controller.OPBCController` or a policy preset name; its
            weights and loss mask then act on the loss (off by default).
    """

    def __init__(self, *args: Any, opbc: Any = None, opbc_controller: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from opbc_metrics import OPBCCollection
        from opbc_metrics.controller import OPBCController

        self.opbc = (opbc if opbc is not None else OPBCCollection()).to(self.accelerator.device)
        if isinstance(opbc_controller, str):
            opbc_controller = OPBCController(opbc_controller)
        self.opbc_controller = opbc_controller.to(self.accelerator.device) if opbc_controller is not None else None
        self._opbc_report = ReportOnce(f"{type(self).__name__} (opbc-metrics)")
        self._opbc_window = 0  # batches fed or attempted since the last log: the same count on every process
        self._opbc_generation_step = -1
        self._opbc_capture: list[Tensor] | None = None

    # -- feeding --------------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        out = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return out
        self._opbc_generation_step = self._step
        try:
            completion_mask = out["completion_mask"]
            groups = generation_group_ids(
                completion_mask.shape[0], self.num_generations, self.accelerator.process_index, completion_mask.device
            )
        except Exception as err:  # never break training
            self._opbc_window += 1
            self._opbc_report(err)
            return out
        if out.get(TRL_ROLLOUT_LOGPROBS) is None:
            self._opbc_window += 1
            self._opbc_report(
                f"the generation batch has no `{TRL_ROLLOUT_LOGPROBS}` (the rollout engine's logprobs): generate with "
                "vLLM (use_vllm=True) or a rollout_func that returns `logprobs`; there is no mismatch to measure"
            )
        elif out.get(TRL_TRAINER_LOGPROBS) is not None:
            self._opbc_window += 1
            try:
                batch = trl_to_batch(out, group_ids=groups)
                if self.opbc_controller is not None:
                    self._opbc_control(out, batch)
                self.opbc.update(batch)
            except Exception as err:
                self._opbc_report(err)
        else:
            # TRL will use the training forward's logprobs as the old ones: fed from _compute_loss.
            out[GROUP_FIELD] = groups
            if self.opbc_controller is not None:
                self._opbc_report(
                    "the controller needs the trainer's logprobs at generation time, which TRL computes only with "
                    "vLLM importance-sampling correction (or misaligned generation); it does not act on this run"
                )
        return out

    def _compute_loss(self, model: Any, inputs: Any) -> Any:
        capture = (
            self.model.training
            and GROUP_FIELD in inputs
            and inputs.get(TRL_TRAINER_LOGPROBS) is None
            and self._step - self._opbc_generation_step < self.args.steps_per_generation  # first pass over the slice
        )
        if not capture:
            return super()._compute_loss(model, inputs)
        self._opbc_window += 1
        self._opbc_capture = []
        try:
            loss = super()._compute_loss(model, inputs)
            captured = self._opbc_capture
        finally:
            self._opbc_capture = None
        try:
            if not captured:
                raise ValueError("the loss computed no per-token logprobs to read")
            self.opbc.update(trl_to_batch({**inputs, TRL_TRAINER_LOGPROBS: captured[0]}, group_ids=inputs[GROUP_FIELD]))
        except Exception as err:
            self._opbc_report(err)
        return loss

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._opbc_capture is not None and not self._opbc_capture:
            self._opbc_capture.append(out[0].detach())
        return out

    def _opbc_control(self, out: dict[str, Any], batch: dict[str, Any]) -> None:
        decisions = self.opbc_controller.step(batch)
        ratio = out.get("importance_sampling_ratio")
        if ratio is not None and getattr(self, "loss_type", None) != "vespo":
            out["importance_sampling_ratio"] = decisions.weights.to(ratio.dtype)
        else:
            self._opbc_report(
                "the controller's weights replace TRL's vLLM importance-sampling ratio, which this configuration "
                "does not apply (use_vllm=True, vllm_importance_sampling_correction=True, loss_type != 'vespo'); "
                "only its loss mask acts"
            )
        mask = decisions.loss_mask.to(out["completion_mask"].dtype)
        tool_mask = out.get(TRL_TOOL_MASK)
        out[TRL_TOOL_MASK] = mask if tool_mask is None else tool_mask * mask

    # -- logging --------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        training_log = self.model.training and not any(k.startswith("eval_") for k in logs)
        if training_log and self._opbc_window:
            self._opbc_window = 0
            try:  # compute() is collective: every process gets here at the same log
                values = loggable(self.opbc.compute(), logprob_window=True)
                if self.opbc_controller is not None and self.opbc_controller.budget is not None:
                    values.update(loggable(self.opbc_controller.compute_budget()))
            except Exception as err:
                self._opbc_report(err)
                values = {}
            finally:
                self.opbc.reset()
                if self.opbc_controller is not None:
                    self.opbc_controller.reset_budget()
            logs.update(values)
        super().log(logs, start_time)


def with_opbc(trainer_cls: type) -> type:
    """``trainer_cls`` (``GRPOTrainer`` or a subclass) with :class:`OPBCTrainerMixin` mixed in.

    Example:
        >>> from trl import GRPOTrainer  # doctest: +SKIP
        >>> MyTrainer = with_opbc(GRPOTrainer)  # doctest: +SKIP
    """
    if not isinstance(trainer_cls, type):
        raise TypeError(f"with_opbc expects a trainer class, got {type(trainer_cls).__name__}")
    if issubclass(trainer_cls, OPBCTrainerMixin):
        return trainer_cls
    return type(f"OPBC{trainer_cls.__name__}", (OPBCTrainerMixin, trainer_cls), {"__module__": __name__})


def __getattr__(name: str) -> Any:
    if name == "OPBCGRPOTrainer":  # built on first use, so importing this module does not import TRL
        from trl import GRPOTrainer

        cls = with_opbc(GRPOTrainer)
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
