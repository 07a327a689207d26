"""verl adapter: a verl ``DataProto`` (or a plain dict shaped like one) -> the opbc batch schema.

verl is not imported: the adapter reads names only, so it works with any verl version that uses them
and costs nothing when verl is absent.

What it relies on (verl's PPO/GRPO driver, ``verl/trainer/ppo/ray_trainer.py`` and
``verl/trainer/ppo/rollout_corr_helper.py``, and ``verl/protocol.py`` for ``DataProto``):

* a ``DataProto`` has ``.batch``, a ``TensorDict`` of ``[B, ...]`` tensors, and ``.non_tensor_batch``,
  a ``dict`` of numpy arrays of length ``B`` (object dtype for strings);
* ``batch["old_log_probs"]`` ``[B, T_resp]``: the trainer's logprobs of the sampled response tokens,
  recomputed by the actor (``compute_log_prob``) -> ``trainer_logprobs``;
* ``batch["rollout_log_probs"]`` ``[B, T_resp]``: the rollout engine's (vLLM/SGLang) logprobs, present
  when ``actor_rollout_ref.rollout.calculate_log_probs=True`` -> ``rollout_logprobs``. verl's rollout
  correction compares exactly these two (``log_ratio = old_log_prob - rollout_log_prob`` under
  ``response_mask``), the same orientation as this library's ``r = trainer - rollout``;
* ``batch["response_mask"]`` ``[B, T_resp]``: 1 on tokens the policy generated, 0 on padding and (in
  agent loops) on tool/environment tokens -> ``response_mask``. When it is absent the adapter derives it
  as verl's ``compute_response_mask`` does: ``attention_mask[:, -responses.size(1):]``;
* ``batch["responses"]`` ``[B, T_resp]`` and ``batch["attention_mask"]`` ``[B, T_prompt + T_resp]``: the
  response width, and ``prompt_lengths`` / ``response_lengths`` as in verl's ``_compute_response_info``
  (sums of the prompt and response parts of ``attention_mask``);
* ``non_tensor_batch["uid"]``: one id string per prompt, repeated over the ``n`` rollouts of that prompt
  (the GRPO group verl's ``compute_grpo_outcome_advantage`` normalises within) -> ``group_ids``, numbered
  ``0..G-1`` in order of first appearance within the batch (plus ``group_offset``);
* optional ``token_level_rewards`` (else ``token_level_scores``) ``[B, T_resp]`` -> ``rewards`` ``[B]`` as
  their sum over the response, in float64 (verl's ``critic/rewards``), and ``advantages``, ``returns``, ``values``
  ``[B, T_resp]`` unchanged.

Fields already named as in the batch schema (``rollout_experts``, ``stop_reasons``, ...) pass through.

Recipe (verl's single-controller driver holds the whole step's batch, so no DDP sync is involved)::

    from opbc_metrics import OPBCCollection
    from opbc_metrics.integrations.verl import verl_to_batch

    opbc = OPBCCollection()              # in RayPPOTrainer.__init__ (CPU on the driver is fine)

    # in RayPPOTrainer.fit, right after `batch = batch.union(old_log_prob)` and *before* rollout
    # correction / rejection sampling rewrites batch.batch["response_mask"]:
    opbc.update(verl_to_batch(batch))

    # where fit() assembles `metrics` for the tracker, once per step (or every k steps):
    metrics.update({k: v.item() for k, v in opbc.compute().items()})
    opbc.reset()

Note: a ``response_mask`` read after verl's rollout rejection sampling has the rejected tokens removed;
call the adapter before that step to measure the rollout as sampled.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from opbc_metrics.integrations._common import as_plain_mapping, ids_to_group_ids, lookup, passthrough

VERL_TRAINER_LOGPROBS = "old_log_probs"
VERL_ROLLOUT_LOGPROBS = "rollout_log_probs"
VERL_RESPONSE_MASK = "response_mask"
VERL_RESPONSES = "responses"
VERL_ATTENTION_MASK = "attention_mask"
VERL_UID = "uid"

__all__ = ["split_dataproto", "verl_to_batch"]


def split_dataproto(data: Any) -> tuple[Any, Any]:
    """``(tensors, non_tensors)`` of a ``DataProto``-like object, or ``(d, d)`` for a flat dict."""
    if hasattr(data, "batch") and hasattr(data, "non_tensor_batch"):
        tensors = data.batch
        non_tensors = data.non_tensor_batch if data.non_tensor_batch is not None else {}
        return as_plain_mapping(tensors, "DataProto.batch"), non_tensors
    return as_plain_mapping(data, "a verl batch"), data


def verl_to_batch(
    data: Any,
    *,
    trainer_key: str = VERL_TRAINER_LOGPROBS,
    rollout_key: str = VERL_ROLLOUT_LOGPROBS,
    group_key: str = VERL_UID,
    group_offset: int = 0,
    require_logprobs: bool = True,
) -> dict[str, Any]:
    """Map a verl ``DataProto`` (or a dict with verl's names) onto the batch schema.

    Args:
        data: a ``DataProto`` (``.batch`` TensorDict + ``.non_tensor_batch`` dict) or a flat dict.
        trainer_key: the trainer-logprob field (``old_log_probs``; e.g. ``actor_old_log_probs`` in
            verl's bypass mode).
        rollout_key: the rollout-logprob field (``rollout_log_probs``).
        group_key: the per-sequence prompt id in ``non_tensor_batch`` (``uid``).
        group_offset: added to the dense group numbers (to keep groups of different batches apart
            within one accumulation window).
        require_logprobs: raise a ``ValueError`` naming the verl field when either logprob field is
            missing (default); with ``False`` the other fields are still mapped.

    Returns:
        A dict with the batch-schema names; tensors are not copied (no host sync).

    Example:
        >>> import numpy as np, torch
        >>> batch = {
        ...     "old_log_probs": torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.1, -0.3]]),
        ...     "rollout_log_probs": torch.tensor([[-1.1, -2.0, 0.0], [-0.5, -0.2, -0.3]]),
        ...     "responses": torch.tensor([[11, 12, 0], [13, 14, 15]]),
        ...     "attention_mask": torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
        ...     "uid": np.array(["p-7", "p-7"], dtype=object),
        ... }
        >>> out = verl_to_batch(batch)
        >>> out["response_mask"], out["group_ids"], out["prompt_lengths"], out["response_lengths"]
        (tensor([[1, 1, 0],
                [1, 1, 1]]), tensor([0, 0]), tensor([1, 2]), tensor([2, 3]))
    """
    tensors, non_tensors = split_dataproto(data)
    out = passthrough(tensors, non_tensors)

    trainer = lookup(tensors, trainer_key)
    rollout = lookup(tensors, rollout_key)
    if require_logprobs:
        if trainer is None:
            raise ValueError(
                f"verl batch has no `{trainer_key}` (the actor's recomputed logprobs of the response tokens); "
                "call the adapter after `batch = batch.union(old_log_prob)`"
            )
        if rollout is None:
            raise ValueError(
                f"verl batch has no `{rollout_key}` (the rollout engine's logprobs); enable "
                "`actor_rollout_ref.rollout.calculate_log_probs=True`"
            )
    if trainer is not None:
        out["trainer_logprobs"] = trainer
    if rollout is not None:
        out["rollout_logprobs"] = rollout

    responses = lookup(tensors, VERL_RESPONSES)
    attention = lookup(tensors, VERL_ATTENTION_MASK)
    width = _response_width(responses, trainer, rollout)
    mask = lookup(tensors, VERL_RESPONSE_MASK)
    if mask is None and attention is not None and width is not None:
        mask = _response_part(attention, width)  # verl's compute_response_mask
    if mask is not None:
        out["response_mask"] = mask
    if attention is not None and width is not None:
        _check_attention(attention, width)
        if "prompt_lengths" not in out:
            out["prompt_lengths"] = attention[:, : attention.shape[1] - width].sum(dim=-1)
        if "response_lengths" not in out:
            out["response_lengths"] = _response_part(attention, width).sum(dim=-1)

    uids = lookup(non_tensors, group_key)
    if uids is None:
        uids = lookup(tensors, group_key)
    if uids is not None and "group_ids" not in out:
        device = trainer.device if isinstance(trainer, Tensor) else None
        try:
            out["group_ids"] = ids_to_group_ids(uids, offset=group_offset, device=device)
        except ValueError as err:
            raise ValueError(f"verl field `{group_key}`: {err}") from None

    if "rewards" not in out:
        token_rewards = lookup(tensors, "token_level_rewards")
        if token_rewards is None:
            token_rewards = lookup(tensors, "token_level_scores")
        if isinstance(token_rewards, Tensor):
            if token_rewards.ndim == 2:
                # Floating rewards are summed in float64: a float32 sum of huge token rewards overflows to inf.
                dtype = torch.float64 if token_rewards.is_floating_point() else None
                out["rewards"] = token_rewards.sum(dim=-1, dtype=dtype)
            else:
                out["rewards"] = token_rewards
    return out


def _response_width(responses: Any, *candidates: Any) -> int | None:
    if isinstance(responses, Tensor):
        if responses.ndim != 2:
            raise ValueError(f"verl field `responses` must have shape [B, T_resp], got {tuple(responses.shape)}")
        return int(responses.shape[1])
    for t in candidates:
        if isinstance(t, Tensor) and t.ndim == 2:
            return int(t.shape[1])
    return None


def _check_attention(attention: Any, width: int) -> None:
    if not isinstance(attention, Tensor) or attention.ndim != 2:
        shape = tuple(attention.shape) if isinstance(attention, Tensor) else type(attention).__name__
        raise ValueError(f"verl field `attention_mask` must be a [B, T_prompt + T_resp] tensor, got {shape}")
    if attention.shape[1] < width:
        raise ValueError(
            f"verl field `attention_mask` has {attention.shape[1]} columns, fewer than the response width {width} "
            "(`responses`)"
        )


def _response_part(attention: Tensor, width: int) -> Tensor:
    _check_attention(attention, width)
    return attention[:, attention.shape[1] - width :]
