"""TRL adapter: the inputs dict of TRL's ``GRPOTrainer`` -> the opbc batch schema.

TRL is not imported: the adapter reads names only.

Targeted version: TRL 1.x ``GRPOTrainer`` with vLLM generation. The rollout logprobs exist in TRL's
batch since its vLLM truncated-importance-sampling correction (huggingface/trl PR #3867, merged
August 2025); older releases do not return them and cannot feed the mismatch metrics. The names
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

Recipe (``compute()`` is a collective: call it on every process; transformers' ``Trainer`` runs
``log()`` on all of them)::

    from trl import GRPOTrainer
    from opbc_metrics import OPBCCollection
    from opbc_metrics.integrations.trl import trl_to_batch

    class OPBCGRPOTrainer(GRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.opbc = OPBCCollection().to(self.accelerator.device)

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if self.model.training and out.get("sampling_per_token_logps") is not None:
                self.opbc.update(trl_to_batch(out, num_generations=self.num_generations,
                                              process_index=self.accelerator.process_index))
            return out

        def log(self, logs, start_time=None):
            if "loss" in logs:  # training logs, reached by every process at the same step
                logs.update({k: v.item() for k, v in self.opbc.compute().items()})
                self.opbc.reset()
            super().log(logs, start_time)

``_generate_and_score_completions`` is a private TRL method: if a TRL release renames it, call the
adapter wherever the generated batch dict is available.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from opbc_metrics.integrations._common import as_plain_mapping, ids_to_group_ids, lookup, passthrough

TRL_TRAINER_LOGPROBS = "old_per_token_logps"
TRL_ROLLOUT_LOGPROBS = "sampling_per_token_logps"
TRL_COMPLETION_MASK = "completion_mask"
TRL_TOOL_MASK = "tool_mask"
TRL_PROMPT_MASK = "prompt_mask"

__all__ = ["trl_to_batch"]


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

    trainer = lookup(inputs, trainer_key)
    rollout = lookup(inputs, rollout_key)
    if require_logprobs:
        if trainer is None:
            raise ValueError(
                f"TRL inputs have no `{trainer_key}` (the training model's logprobs recomputed after generation); "
                "GRPOTrainer returns it with use_vllm=True and vllm_importance_sampling_correction=True"
            )
        if rollout is None:
            raise ValueError(
                f"TRL inputs have no `{rollout_key}` (vLLM's sampling logprobs); GRPOTrainer returns it with "
                "use_vllm=True and vllm_importance_sampling_correction=True"
            )
    if trainer is not None:
        out["trainer_logprobs"] = trainer
    if rollout is not None:
        out["rollout_logprobs"] = rollout

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
