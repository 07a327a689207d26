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
  their sum over the response, in float64 (verl's ``critic/rewards``); ``token_level_scores`` (V1:
  ``rm_scores``) -> ``scores`` (``critic/score/*``); ``advantages``, ``returns``, ``values`` ``[B, T_resp]``
  unchanged; ``non_tensor_batch["__num_turns__"]`` (V1: ``num_turns``) -> ``num_turns`` (``num_turns/*``);
  V1's ``prompt_length`` / ``response_length`` ``[B]`` -> ``prompt_lengths`` / ``response_lengths``.

Fields already named as in the batch schema (``rollout_experts``, ``stop_reasons``, ...) pass through.
verl's own ``routed_experts`` (router replay, R3) is the rollout side of the router only, over prompt and
response, with filler in each sequence's last response slot: :func:`verl_routed_experts` gives its response part
and the mask of the tokens that carry a routing record, for a ``moe`` collection of its own beside the trainer's
top-K recorded on the same tokens. :func:`verl_to_batch` does not map it (a rollout side without the trainer's
would make the ``moe`` section raise).

**The trainers.** :func:`with_opbc` adds the metrics to verl 0.9's default V1 trainers
(``verl.trainer.ppo.v1``: ``PPOTrainerSync`` and the async ones) and to the legacy ``RayPPOTrainer``::

    from verl.trainer.ppo.v1 import PPOTrainerSync, register_trainer
    from opbc_metrics.integrations.verl import with_opbc
    register_trainer("opbc_sync")(with_opbc(PPOTrainerSync))   # then trainer.v1.trainer_mode=opbc_sync

Each step, the batch is read where it holds both logprob tensors and *before* verl's rollout correction
rewrites ``response_mask`` (V1: at the start of ``_compute_advantage``, from TransferQueue; legacy: right
after ``_compute_old_log_prob``), and with ``training=True`` the step's final batch and ``timing_raw``
feed the training section (``critic/*``, lengths, ``num_turns/*``, ``global_seqlen/*`` with verl's
workload, ``timing_s/*``, ``perf/*``). The values are merged into verl's own ``metrics`` dict, so verl's
tracker logs them; a key verl already set keeps verl's value (the glossary's ``critic/value/*`` is logged
under its own name next to verl's ``critic/values/*``, see :data:`VERL_KEY_ALIASES`).

**Where the values differ from verl's own rollout-vs-trainer metrics** (``compute_offpolicy_metrics`` in
``rollout_corr_helper.py``), by design (the library's formulas, DESIGN.md):

* ``log_ppl_diff``, ``log_ppl_abs_diff``, ``ppl_ratio`` and ``chi2_seq``: verl averages the per-sequence
  values over all ``B`` rows, so an empty or aborted response (no valid token) counts as ``d = 0``
  (ratio 1) and ``rho^2 = 1``; ``opbc/ppl/*`` and ``opbc/kl/chi2_seq`` average over the sequences with at
  least one valid token (with two aborted rows of twelve: ``ppl_ratio`` 0.973 in verl, 0.967 here);
* ``kl`` and ``k3_kl``: verl uses the raw log-ratio ``r``; ``opbc/kl/k1`` and ``opbc/kl/k3`` clamp it to
  ``[-C, C]`` (``C = 20``) as the importance weights are, so a single token with ``|r| > 20`` moves verl's
  ``k3_kl`` by orders of magnitude more (``exp(25)`` against ``exp(20)``).

Every other key both compute agrees with verl's function on the same batch (``tests/test_verl_real.py``).
Timing keys exist only for the stages of ``timing_raw``; ``timing_per_token_ms/*`` is left out of a step
without tokens, where verl reports 0.0.

**Bypass mode** (``algorithm.rollout_correction.bypass_mode=True``) uses the rollout's logprobs as
``old_log_probs``: the two tensors are the same (or equal), so the mismatch cannot be measured. The
integration says so once and logs no mismatch keys, instead of a perfect on-policy 0 drift.

Note: a ``response_mask`` read after verl's rollout rejection sampling has the rejected tokens removed;
read the batch before that step to measure the rollout as sampled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from opbc_metrics.functional.perf import DEFAULT_STAGES
from opbc_metrics.integrations._common import (
    OPBCIntegrationWarning,
    ReportOnce,
    as_plain_mapping,
    hashable_key,
    ids_to_group_ids,
    loggable,
    logprob_fields,
    lookup,
    passthrough,
)

VERL_TRAINER_LOGPROBS = "old_log_probs"
VERL_ROLLOUT_LOGPROBS = "rollout_log_probs"
VERL_RESPONSE_MASK = "response_mask"
VERL_RESPONSES = "responses"
VERL_ATTENTION_MASK = "attention_mask"
VERL_UID = "uid"
VERL_NUM_TURNS = ("__num_turns__", "num_turns")  # legacy non_tensor_batch, V1 TransferQueue field
VERL_ROUTED_EXPERTS = "routed_experts"  # router replay (R3): the rollout engine's top-K per token and MoE layer

# verl's names for the glossary's keys, where they differ. The glossary key is what the integration
# logs; verl's name resolves to the same glossary entry (``opbc_metrics.glossary.lookup``).
VERL_KEY_ALIASES: dict[str, str] = {
    "critic/value/mean": "critic/values/mean",
    "critic/value/max": "critic/values/max",
    "critic/value/min": "critic/values/min",
}

# The stage names verl's trainers put in ``timing_raw`` (V1 and legacy, verl 0.9), profiler bookkeeping
# included: the training section's timing members are built with these.
VERL_TIMING_STAGES: tuple[str, ...] = (
    *DEFAULT_STAGES,
    "start_profile",
    "stop_profile",
    "save_checkpoint",
    "testing",
    "dump_rollout_generations",
)

__all__ = [
    "VERL_KEY_ALIASES",
    "VERL_TIMING_STAGES",
    "OPBCIntegrationWarning",
    "VerlMetrics",
    "is_bypass",
    "split_dataproto",
    "verl_routed_experts",
    "verl_to_batch",
    "verl_workload",
    "with_opbc",
]


def verl_workload(seqlens: Tensor) -> Tensor:
    """The cost verl balances data-parallel ranks on: ``24576 * s + s ** 2`` for a sequence of ``s`` tokens
    (``verl.utils.seqlen_balancing.calculate_workload``: dense-transformer FLOPs of a 7B model, up to scale).

    Example:
        >>> verl_workload(torch.tensor([1.0, 100.0])).tolist()
        [24577.0, 2467600.0]
    """
    return 24576 * seqlens + seqlens**2


def is_bypass(data: Any, *, trainer_key: str = VERL_TRAINER_LOGPROBS, rollout_key: str = VERL_ROLLOUT_LOGPROBS) -> bool:
    """True when the batch's trainer logprobs *are* the rollout logprobs (verl's bypass mode): the same
    tensor, or equal values. Reads the tensors on the host when they are distinct objects.

    Example:
        >>> t = torch.tensor([[-1.0, -2.0]])
        >>> is_bypass({"old_log_probs": t, "rollout_log_probs": t}), is_bypass({"old_log_probs": t,
        ...     "rollout_log_probs": t - 0.1})
        (True, False)
    """
    tensors, _ = split_dataproto(data)
    trainer, rollout = lookup(tensors, trainer_key), lookup(tensors, rollout_key)
    if not isinstance(trainer, Tensor) or not isinstance(rollout, Tensor):
        return False
    if trainer is rollout:
        return True
    return trainer.shape == rollout.shape and bool(torch.equal(trainer, rollout.to(trainer.device, trainer.dtype)))


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

    missing = (
        f"verl batch has no `{trainer_key}` (the actor's recomputed logprobs of the response tokens); call the "
        "adapter after `batch = batch.union(old_log_prob)`",
        f"verl batch has no `{rollout_key}` (the rollout engine's logprobs); enable "
        "`actor_rollout_ref.rollout.calculate_log_probs=True`",
    )
    out.update(logprob_fields(tensors, (trainer_key, rollout_key), missing if require_logprobs else None))
    trainer, rollout = out.get("trainer_logprobs"), out.get("rollout_logprobs")

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

    scores_name = "token_level_scores"
    scores = lookup(tensors, scores_name)
    if scores is None:
        scores_name, scores = "rm_scores", lookup(tensors, "rm_scores")  # V1's name for the same tensor
    token_rewards = lookup(tensors, "token_level_rewards")
    for name, value in ((scores_name, scores), ("token_level_rewards", token_rewards)):
        _check_token_width(name, value, width if width is not None else _response_width(None, mask))
    if "rewards" not in out and (token_rewards is not None or scores is not None):
        out["rewards"] = _per_sequence(token_rewards if token_rewards is not None else scores)
    if "scores" not in out and scores is not None:
        out["scores"] = _per_sequence(scores)

    if "num_turns" not in out:
        for name in VERL_NUM_TURNS:
            turns = lookup(non_tensors, name)
            if turns is None:
                turns = lookup(tensors, name)
            if turns is not None:
                out["num_turns"] = turns if isinstance(turns, Tensor) else torch.as_tensor(np.asarray(turns))
                break
    # V1 batches carry the lengths themselves (no attention_mask / responses)
    for verl_name, name in (("prompt_length", "prompt_lengths"), ("response_length", "response_lengths")):
        value = lookup(tensors, verl_name)
        if name not in out and isinstance(value, Tensor):
            out[name] = value
    return out


def verl_routed_experts(data: Any) -> tuple[Tensor, Tensor]:
    """The rollout's routed experts of verl's router replay (R3) on the response tokens:
    ``(rollout_experts [B, T_resp, L, K], moe_mask [B, T_resp])``.

    verl keeps ``routed_experts`` ``[B, T_prompt + T_resp, L, K]`` over the whole sequence; the response is its
    last ``T_resp`` positions. Each sequence's last response token is sampled but never fed back through the model,
    so its slot holds filler from batch assembly (zeros), not a routing record: ``moe_mask`` is the response mask
    (``response_mask``, else derived from ``attention_mask`` as :func:`verl_to_batch` does) without that token, as
    verl's own rollout MoE load metrics drop it. Compared against the trainer's routing, the filler would read as
    expert 0 in every layer: a made-up flip. No host sync; views of verl's tensor.

    Use the pair with the trainer's top-K of the same tokens (``trainer_experts``) in a collection of the ``moe``
    section fed ``moe_mask`` as its ``response_mask``. (verl's R2 mode records the trainer's own routes under the same
    name in the actor's forward: that batch's ``routed_experts`` go in as ``trainer_experts``.)

    Example:
        >>> import torch
        >>> routed = torch.arange(2 * 5 * 1 * 2).view(2, 5, 1, 2)  # B = 2, T_prompt + T_resp = 5, L = 1, K = 2
        >>> experts, moe_mask = verl_routed_experts({"routed_experts": routed,
        ...                                          "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])})
        >>> experts.shape, moe_mask.tolist()
        (torch.Size([2, 3, 1, 2]), [[True, False, False], [True, True, False]])
    """
    tensors, _ = split_dataproto(data)
    routed = lookup(tensors, VERL_ROUTED_EXPERTS)
    if not isinstance(routed, Tensor):
        raise ValueError(f"verl batch has no `{VERL_ROUTED_EXPERTS}` tensor: enable router replay (R3) in the rollout, "
                         "which returns the routed experts")
    mask = verl_to_batch(data, require_logprobs=False).get("response_mask")
    if not isinstance(mask, Tensor) or mask.ndim != 2:
        raise ValueError(f"verl batch needs `{VERL_RESPONSE_MASK}` [B, T_resp] (or `{VERL_RESPONSES}` and "
                         f"`{VERL_ATTENTION_MASK}`) to find the response part of `{VERL_ROUTED_EXPERTS}`")
    b, width = mask.shape
    if routed.ndim != 4 or routed.shape[0] != b or routed.shape[1] < width:
        raise ValueError(f"verl field `{VERL_ROUTED_EXPERTS}` has shape {tuple(routed.shape)}: expected "
                         f"[B = {b}, T >= {width}, L, K] (the prompt and response positions of every sequence)")
    response = mask.to(device=routed.device) != 0
    positions = torch.arange(width, device=routed.device)
    last = torch.where(response, positions, -1).amax(dim=-1, keepdim=True) if width else positions.view(1, 0)
    return routed[:, routed.shape[1] - width :], response & (positions != last)


def _per_sequence(token_values: Any) -> Any:
    if isinstance(token_values, Tensor) and token_values.ndim == 2:
        # Floating rewards are summed in float64: a float32 sum of huge token rewards overflows to inf.
        dtype = torch.float64 if token_values.is_floating_point() else None
        return token_values.sum(dim=-1, dtype=dtype)
    return token_values


def _check_token_width(name: str, value: Any, width: int | None) -> None:
    """A per-token reward tensor is summed over its columns: they must be the response's, one per token."""
    if isinstance(value, Tensor) and value.ndim == 2 and width is not None and value.shape[1] != width:
        raise ValueError(
            f"verl field `{name}` has {value.shape[1]} columns but the response width is {width} (`responses`, "
            f"or the logprobs): pass it as [B, T_resp], one column per response token"
        )


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


# ---------------------------------------------------------------------------------------------
# The integration: one object per trainer (the driver holds the whole step's batch: no DDP sync)
# ---------------------------------------------------------------------------------------------
class VerlMetrics:
    """The OPBC metrics of a verl run, fed by the driver and merged into verl's ``metrics`` dict.

    Args:
        collection: the collection fed with the logprob batches (default: ``OPBCCollection()``).
        training: also compute the training section (``critic/*``, lengths, turns, ``global_seqlen/*``,
            ``timing_s/*``, ``perf/*``) from each step's final batch; verl logs most of these itself, and a
            key verl set keeps verl's value.
        dp_size: the actor's data-parallel size, for ``global_seqlen/*`` (sequences dealt to ranks in
            contiguous chunks, as verl's dispatch does, and re-balanced on :func:`verl_workload`).
        n_gpus: GPUs of the run, for ``perf/throughput``.
        max_response_length, max_prompt_length: for the ``clip_ratio`` keys.

    Example:
        >>> import numpy as np
        >>> m = VerlMetrics()
        >>> t = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]])
        >>> m.observe_logprobs({"old_log_probs": t, "rollout_log_probs": t - 0.1, "response_mask": torch.ones(2, 2),
        ...                     "uid": np.array(["a", "a"], dtype=object)})
        >>> metrics = {"critic/score/mean": 1.0}
        >>> _ = m.merge_into(metrics)
        >>> round(metrics["opbc/logprob/diff_mean"], 6), metrics["critic/score/mean"]
        (0.1, 1.0)
    """

    def __init__(
        self,
        collection: Any = None,
        *,
        training: bool = False,
        dp_size: int | None = None,
        n_gpus: int | None = None,
        max_response_length: int | None = None,
        max_prompt_length: int | None = None,
    ) -> None:
        from opbc_metrics import OPBCCollection

        self.collection = collection if collection is not None else OPBCCollection()
        self.training = None
        self.dp_size = dp_size
        if training:
            self.training = OPBCCollection(metrics=verl_training_metrics(
                dp_size=dp_size, n_gpus=n_gpus, max_response_length=max_response_length,
                max_prompt_length=max_prompt_length))
        self.report = ReportOnce("opbc-metrics verl integration")
        self._fed = 0
        self._steps = 0
        self._group_offset = 0

    def observe_logprobs(self, data: Any) -> None:
        """Feed a batch holding ``old_log_probs`` and ``rollout_log_probs`` (before rollout correction)."""
        try:
            if is_bypass(data):
                self.report(
                    "bypass mode: `old_log_probs` is the rollout's `rollout_log_probs`, so the train/rollout "
                    "mismatch cannot be measured; no mismatch keys are logged (turn bypass_mode off to measure it)"
                )
                return
            batch = verl_to_batch(data, group_offset=self._group_offset)
            self.collection.update(batch)
            if "group_ids" in batch:
                _, non_tensors = split_dataproto(data)
                uids = lookup(non_tensors, VERL_UID)
                self._group_offset += len({hashable_key(u) for u in uids}) if uids is not None else 0
            self._fed += 1
        except Exception as err:  # never break training
            self.report(err)

    def observe_step(self, data: Any, timing_raw: Mapping[str, float] | None = None) -> None:
        """Feed the step's final batch (and ``timing_raw``) to the training section, if enabled."""
        if self.training is None:
            return
        try:
            batch = verl_to_batch(data, require_logprobs=False)
            fields = {k: v for k, v in batch.items() if k in _TRAINING_FIELDS}
            if self.dp_size and "prompt_lengths" in fields:
                n = int(fields["prompt_lengths"].shape[0])
                fields["rank_ids"] = torch.arange(n) * self.dp_size // max(n, 1)
            if timing_raw is not None:
                fields["timing_s"] = {k: float(v) for k, v in timing_raw.items()}
            self.training.update(fields)
            self._steps += 1
        except Exception as err:
            self.report(err)

    def compute(self) -> dict[str, float]:
        """The window's values as floats (nothing for a part that saw no data), then reset."""
        out: dict[str, float] = {}
        try:
            if self._fed:
                out.update(loggable(self.collection.compute(), logprob_window=True))
            if self.training is not None and self._steps:
                out.update(loggable(self.training.compute()))
        except Exception as err:
            self.report(err)
        finally:
            self.collection.reset()
            if self.training is not None:
                self.training.reset()
            self._fed = self._steps = self._group_offset = 0
        return out

    def merge_into(self, metrics: dict[str, Any]) -> dict[str, float]:
        """Add the window's values to verl's ``metrics`` dict (verl's own keys keep their values)."""
        values = self.compute()
        for key, value in values.items():
            metrics.setdefault(key, value)
        return values


# Batch-schema fields the training section reads from verl's final batch.
_TRAINING_FIELDS = (
    "response_mask",
    "rewards",
    "scores",
    "advantages",
    "returns",
    "values",
    "prompt_lengths",
    "response_lengths",
    "num_turns",
)


def verl_training_metrics(
    *,
    dp_size: int | None = None,
    n_gpus: int | None = None,
    max_response_length: int | None = None,
    max_prompt_length: int | None = None,
) -> list[Any]:
    """The training members that verl's batches feed, configured as verl computes them: timing stages of
    verl's ``timing_raw`` (other stages ignored), ``global_seqlen`` balanced on :func:`verl_workload` over
    ``dp_size`` ranks."""
    from opbc_metrics.training import (
        AbortedRatio,
        AdvantageStats,
        ExplainedVariance,
        GlobalSeqlen,
        NumTurns,
        PromptLength,
        ResponseLength,
        ReturnStats,
        RewardStats,
        ScoreStats,
        StageTiming,
        Throughput,
        ValueStats,
    )

    members = [
        ScoreStats(),
        RewardStats(),
        AdvantageStats(),
        ReturnStats(),
        ValueStats(),
        ExplainedVariance(),
        ResponseLength(max_response_length),
        PromptLength(max_prompt_length),
        AbortedRatio(),
        NumTurns(),
        StageTiming(VERL_TIMING_STAGES, strict=False, world_size=1),
        Throughput(num_gpus=n_gpus, world_size=1),
    ]
    if dp_size:
        members.append(GlobalSeqlen(world_size=dp_size, workload=verl_workload))
    return members


# ---------------------------------------------------------------------------------------------
# Trainer mixins
# ---------------------------------------------------------------------------------------------
class _OPBCTrainer:
    opbc_options: ClassVar[dict[str, Any]] = {}

    @property
    def opbc(self) -> VerlMetrics:
        metrics = self.__dict__.get("_opbc_metrics")
        if metrics is None:
            metrics = self.__dict__["_opbc_metrics"] = VerlMetrics(**self.opbc_options)
            if _config_bypass(getattr(self, "config", None)):
                metrics.report(
                    "bypass mode (algorithm.rollout_correction.bypass_mode=True): `old_log_probs` is the rollout's "
                    "`rollout_log_probs`, so the train/rollout mismatch cannot be measured; no mismatch keys are logged"
                )
        return metrics


def _config_bypass(config: Any) -> bool:
    try:
        corr = config.algorithm.get("rollout_correction", None)
        return bool(corr and corr.get("bypass_mode", False))
    except Exception:
        return False


class OPBCPPOTrainerMixin(_OPBCTrainer):
    """For verl's V1 trainers (``verl.trainer.ppo.v1.PPOTrainer`` subclasses): the batch lives in
    TransferQueue; it is read at the start of ``_compute_advantage`` (both logprobs present, rollout
    correction not yet applied) and the step's values are merged in ``_compute_metrics``."""

    _LOGPROB_FIELDS = ("uid", "response_mask", "old_log_probs", "rollout_log_probs")
    _STEP_FIELDS = ("prompts", "responses", "response_mask", "advantages", "returns", "rm_scores", "num_turns")

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        if not _config_bypass(self.config):
            try:
                data = _tq_get(batch, self._LOGPROB_FIELDS)
                self.opbc.observe_logprobs(v1_dataproto(data))
            except Exception as err:
                self.opbc.report(err)
        else:
            _ = self.opbc  # says once that bypass mode cannot be measured
        return super()._compute_advantage(batch, metrics)

    def _compute_metrics(self, batch: Any, metrics: dict, timing_raw: dict, global_steps: int, epoch: int) -> None:
        if self.opbc.training is not None:
            try:
                fields = list(self._STEP_FIELDS)
                if getattr(self, "use_critic", False):
                    fields.append("values")
                if self.config.algorithm.get("use_kl_in_reward", False):
                    fields.append("token_level_rewards")
                data = _tq_get(batch, fields, padding_mask=True)
                self.opbc.observe_step(v1_dataproto(data), timing_raw)
            except Exception as err:
                self.opbc.report(err)
        super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        self.opbc.merge_into(metrics)


def _tq_get(batch: Any, fields: Sequence[str], padding_mask: bool = False) -> Any:
    import transfer_queue as tq

    stored = getattr(batch, "fields", None)  # the fields TransferQueue holds for these keys, when known
    wanted = [f for f in fields if stored is None or f in stored]
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=wanted)
    if padding_mask:
        keep = [not tag.get("is_padding", False) for tag in batch.tags]
        if not all(keep) and any(keep):
            data = data[torch.tensor(keep)]
    return data


def v1_dataproto(data: Any) -> Any:
    """A V1 TransferQueue batch (a ``TensorDict`` of jagged tensors and non-tensor ``uid``) -> the
    ``DataProto`` verl's V1 trainer builds from it (padded tensors, ``uid`` and ``num_turns`` as numpy),
    with ``prompt_length`` / ``response_length`` from the jagged offsets as in ``_compute_metrics``."""
    from verl.protocol import DataProto

    extra: dict[str, Tensor] = {}
    for name, out_name in (("prompts", "prompt_length"), ("responses", "response_length")):
        if name in data.keys() and getattr(data[name], "is_nested", False):
            extra[out_name] = data[name].offsets().diff().float()
    non_tensor: dict[str, np.ndarray] = {}
    for name in ("uid", "num_turns"):
        if name in data.keys():
            values = data.pop(name)
            values = values.tolist() if hasattr(values, "tolist") else list(values)
            non_tensor[name] = np.array(values, dtype=object if name == "uid" else None)
    padded = data.to_padded_tensor() if any(getattr(v, "is_nested", False) for v in data.values()) else data
    for name, value in extra.items():
        padded[name] = value
    return DataProto(batch=padded, non_tensor_batch=non_tensor)


class OPBCRayPPOTrainerMixin(_OPBCTrainer):
    """For verl's legacy ``RayPPOTrainer``: the logprobs are read right after ``_compute_old_log_prob``
    (before rollout correction); the final batch, ``timing_raw`` and the merge go through verl's own
    ``compute_timing_metrics`` call, whose result ``fit()`` adds to its ``metrics`` (wrapped for the
    duration of ``fit()`` only). That result leaves out verl's data keys and every key verl's
    ``_balance_batch`` step had set by then (``global_seqlen/*``, from the batch before it was re-balanced),
    so they keep verl's values."""

    def _compute_old_log_prob(self, batch: Any) -> Any:
        out = super()._compute_old_log_prob(batch)
        try:
            old = out[0] if isinstance(out, tuple) else out
            tensors = {**dict(batch.batch.items()), VERL_TRAINER_LOGPROBS: old.batch[VERL_TRAINER_LOGPROBS]}
            self.opbc.observe_logprobs({**tensors, VERL_UID: batch.non_tensor_batch.get(VERL_UID)})
        except Exception as err:
            self.opbc.report(err)
        return out

    def _balance_batch(self, batch: Any, metrics: dict, *args: Any, **kwargs: Any) -> Any:
        # verl logs global_seqlen/* here, from the batch as dispatched before it reorders it; fit() adds the
        # compute_timing_metrics result to `metrics` later, so the keys verl set by then are remembered and
        # left out of ours (ours would describe the reordered batch).
        out = super()._balance_batch(batch, metrics, *args, **kwargs)
        self.__dict__["_opbc_step_metrics"] = metrics
        return out

    def fit(self) -> Any:
        from verl.trainer.ppo import ray_trainer

        original = ray_trainer.compute_timing_metrics

        def timing_metrics(batch: Any, timing_raw: dict) -> dict:
            out = original(batch=batch, timing_raw=timing_raw)
            self.opbc.observe_step(batch, timing_raw)
            ours = self.opbc.compute()
            verl_set = self.__dict__.pop("_opbc_step_metrics", None) or {}
            return {**{k: v for k, v in ours.items() if k not in _VERL_DATA_KEYS and k not in verl_set}, **out}

        with _patched(ray_trainer, "compute_timing_metrics", timing_metrics):
            _ = self.opbc
            return super().fit()


# The keys verl's compute_data_metrics sets itself (legacy fit merges our keys after it: verl's stay).
_VERL_DATA_KEYS = frozenset(
    [f"critic/{g}/{s}" for g in ("score", "rewards", "advantages", "returns", "values") for s in ("mean", "max", "min")]
    + ["critic/vf_explained_var", "response/aborted_ratio"]
    + [f"{g}/{s}" for g in ("response_length", "prompt_length") for s in ("mean", "max", "min", "clip_ratio")]
    + [f"num_turns/{s}" for s in ("mean", "max", "min")]
)


@contextlib.contextmanager
def _patched(module: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def with_opbc(trainer_cls: type, **options: Any) -> type:
    """``trainer_cls`` (a verl V1 ``PPOTrainer`` subclass or ``RayPPOTrainer``) with the OPBC metrics;
    ``options`` go to :class:`VerlMetrics` (``training=True``, ``dp_size=...``, ...).

    Example:
        >>> from verl.trainer.ppo.v1 import PPOTrainerSync  # doctest: +SKIP
        >>> trainer = with_opbc(PPOTrainerSync)(config)  # doctest: +SKIP
    """
    if not isinstance(trainer_cls, type):
        raise TypeError(f"with_opbc expects a trainer class, got {type(trainer_cls).__name__}")
    if hasattr(trainer_cls, "_compute_metrics") and hasattr(trainer_cls, "_compute_advantage"):
        mixin: type = OPBCPPOTrainerMixin
    elif hasattr(trainer_cls, "_compute_old_log_prob") and hasattr(trainer_cls, "fit"):
        mixin = OPBCRayPPOTrainerMixin
    else:
        raise TypeError(f"{trainer_cls.__name__} is neither a verl V1 PPOTrainer nor a RayPPOTrainer")
    return type(f"OPBC{trainer_cls.__name__}", (mixin, trainer_cls),
                {"__module__": __name__, "opbc_options": dict(options)})
