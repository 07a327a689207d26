"""The Off-Policy Budget Controller: one call per batch turns logprobs into per-group decisions, a loss mask
and importance weights for the trainer, and budget metrics.

Device work (statistics, contract checks, rules, correction weights, budget statistics) never synchronises
host and device. The Python decisions (:attr:`BatchDecisions.decisions`) are built lazily from one transfer
of a packed ``[groups, columns]`` tensor, so a trainer that only needs the mask and the weights never waits
for the host, and one that needs the replay ids pays a single copy per batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from opbc_metrics.batch import (
    GROUP_IDS,
    PER_SEQUENCE_FIELDS,
    RESPONSE_MASK,
    ROLLOUT_LOGPROBS,
    ROLLOUT_TOKEN_IDS,
    TRAINER_LOGPROBS,
    TRAINER_TOKEN_IDS,
    BatchView,
    as_view,
    check_field_names,
)
from opbc_metrics.collection import OPBCCollection
from opbc_metrics.controller.budget import DECISIONS_FIELD, budget_metrics
from opbc_metrics.controller.decisions import GroupDecision, GroupReport, dump_decisions
from opbc_metrics.functional import controller as FC
from opbc_metrics.policy import Action, OPBCPolicy, Reason

POLICY_LAG = "policy_lag"
ROLLOUT_EXPERTS = "rollout_experts"
TRAINER_EXPERTS = "trainer_experts"
ROLLOUT_ROUTER_LOGITS = "rollout_router_logits"
TRAINER_ROUTER_LOGITS = "trainer_router_logits"


@dataclass(eq=False)
class BatchDecisions:
    """Everything the controller produced for one batch.

    Device tensors (no host sync to produce or read them):

    * ``loss_mask`` ``[B, T]`` bool and ``weights`` ``[B, T]``: what the trainer consumes. Tokens of groups
      decided ``replay``, ``quarantine`` or ``reject`` have mask 0 and weight 0.
    * ``row_action`` ``[B]``: each row's action code (index into ``ACTIONS``; :meth:`Action.from_code`).
    * ``values``: per-group statistics ``{name: [capacity] float64}``; ``action`` ``[capacity]`` (-1 on
      padding) and ``reasons`` ``[capacity, R]`` bool; ``index`` the dense group index (groups by ascending id).

    Host results (one device-to-host copy on first access, then cached): :attr:`decisions`, the id lists
    (:attr:`replay_group_ids`, ...), :meth:`rows` and :meth:`select`.
    """

    policy: OPBCPolicy
    index: FC.GroupIndex
    values: dict[str, Tensor]
    action: Tensor
    reasons: Tensor
    row_action: Tensor
    loss_mask: Tensor
    weights: Tensor
    counts: dict[str, Tensor]
    _decisions: list[GroupDecision] | None = field(default=None, repr=False)
    _budget: dict[str, Tensor] | None = field(default=None, repr=False)

    # -- device-side budget statistics ------------------------------------------------------------
    def budget_stats(self) -> dict[str, Tensor]:
        """Sufficient statistics of the decision budget of this batch (float64 device tensors)."""
        if self._budget is None:
            present = self.index.present
            n_actions = len(FC.ACTIONS)
            codes = torch.arange(n_actions, device=self.action.device)
            onehot = ((self.action[:, None] == codes[None, :]) & present[:, None]).to(torch.float64)
            tokens = self.values["num_response_tokens"]
            self._budget = {
                "groups": present.to(torch.float64).sum(),
                "group_count": onehot.sum(dim=0),
                "tokens": (tokens * present).sum(),
                "token_count": (onehot * tokens[:, None]).sum(dim=0),
                "reason_count": self.reasons.to(torch.float64).sum(dim=0),
                **{k: v.to(torch.float64) for k, v in self.counts.items()},
            }
        return self._budget

    # -- host-side decisions ----------------------------------------------------------------------
    def _pack(self) -> Tensor:
        """``[capacity, 2 + R + F]`` int64: group id, action code, reason bits, and the float64 statistics
        reinterpreted bit for bit as int64 (so ids and values survive the one transfer exactly)."""
        floats = torch.stack([self.values[name].to(torch.float64) for name in FC.STAT_NAMES], dim=1)
        return torch.cat(
            [
                self.index.group_ids[:, None],
                self.action[:, None],
                self.reasons.to(torch.int64),
                floats.contiguous().view(torch.int64),
            ],
            dim=1,
        )

    @property
    def decisions(self) -> list[GroupDecision]:
        """One :class:`GroupDecision` per group, by ascending group id (one device-to-host copy)."""
        if self._decisions is None:
            host = self._pack().cpu()  # the single device-to-host transfer of this batch
            n_reasons = len(FC.REASON_NAMES)
            ids = host[:, 0].tolist()
            actions = host[:, 1].tolist()
            bits = host[:, 2 : 2 + n_reasons].tolist()
            floats = host[:, 2 + n_reasons :].contiguous().view(torch.float64).tolist()
            reasons_all = [Reason(name) for name in FC.REASON_NAMES]
            out = []
            for gid, code, row_bits, row in zip(ids, actions, bits, floats):
                if code < 0:  # padding: groups are packed first, so the rest is padding too
                    break
                report = GroupReport.from_values(gid, dict(zip(FC.STAT_NAMES, row)))
                reasons = tuple(r for r, bit in zip(reasons_all, row_bits) if bit)
                out.append(GroupDecision(gid, Action.from_code(code), reasons, report))
            self._decisions = out
        return self._decisions

    def group_ids_for(self, *actions: Action | str) -> list[int]:
        """Ids of the groups decided any of ``actions``, ascending."""
        wanted = {Action(a) for a in actions}
        return [d.group_id for d in self.decisions if d.action in wanted]

    @property
    def replay_group_ids(self) -> list[int]:
        """Groups for the replay buffer: excluded from this step, to be re-scored and trained later."""
        return self.group_ids_for(Action.REPLAY)

    @property
    def quarantine_group_ids(self) -> list[int]:
        return self.group_ids_for(Action.QUARANTINE)

    @property
    def rejected_group_ids(self) -> list[int]:
        return self.group_ids_for(Action.REJECT)

    @property
    def trained_group_ids(self) -> list[int]:
        return self.group_ids_for(Action.TRAIN, Action.TRAIN_WITH_CORRECTION)

    def rows(self, *actions: Action | str) -> Tensor:
        """Row indices (``[n]`` long) of the sequences whose group was decided any of ``actions`` (host sync)."""
        codes = torch.tensor([Action(a).code for a in actions], dtype=torch.int64, device=self.row_action.device)
        return torch.nonzero(torch.isin(self.row_action, codes)).flatten()

    def select(self, batch: Any, *actions: Action | str) -> dict[str, Any]:
        """The rows of ``batch`` whose group was decided any of ``actions`` (e.g. to push to a replay buffer).

        Tensors and lists whose first dimension is the batch size are sliced; everything else is kept.
        """
        data = as_view(batch).data
        rows = self.rows(*actions)
        b = self.row_action.shape[0]
        out: dict[str, Any] = {}
        for k, v in data.items():
            if isinstance(v, Tensor) and v.ndim >= 1 and v.shape[0] == b:
                out[k] = v[rows.to(v.device)]
            elif isinstance(v, list) and len(v) == b:
                out[k] = [v[i] for i in rows.tolist()]
            else:
                out[k] = v
        return out

    def to_json(self, **extra: Any) -> str:
        """The decisions (with reports) and the policy as JSON; see :func:`~opbc_metrics.controller.load_decisions`."""
        return dump_decisions(self.decisions, policy=self.policy.to_dict(), **extra)


class OPBCController:
    """Per-group OPBC decisions, trainer inputs and budget metrics, for all groups of a batch at once.

    The batch holds ``trainer_logprobs``, ``rollout_logprobs`` ``[B, T]``, ``group_ids`` ``[B]`` (any
    integers), an optional ``response_mask``, and optionally ``policy_lag`` (``[B]`` tensor in trainer steps,
    a number for the whole batch, or a ``{group_id: lag}`` mapping, which reads the ids to the host),
    ``rollout_experts`` / ``trainer_experts`` ``[B, T, L, K]`` (router flip rate; a side without expert ids
    may give ``rollout_router_logits`` / ``trainer_router_logits`` ``[B, T, L, E]``, whose top-1 expert is the
    argmax over E) and ``rollout_token_ids`` / ``trainer_token_ids`` ``[B, T]``.

    A batch that breaks the contract as a whole (a logprob field absent, shapes that disagree) rejects
    every group with ``logprobs_missing`` / ``shape_mismatch`` instead of raising; inputs that cannot be
    data (``group_ids`` missing or not a 1-D integer tensor, a non-float logprob tensor, one of a pair of
    fields without the other, a framework's field name such as TRL's ``completion_mask`` without the
    schema's, see :func:`~opbc_metrics.batch.check_field_names`) raise a ``ValueError`` naming the field.

    Args:
        policy: an :class:`OPBCPolicy` or a preset name (``"default"``).
        track_budget: keep the budget metrics (:attr:`budget`) updated by :meth:`step`.
        metric_kwargs: torchmetrics arguments for the budget metrics (``process_group``, ...).

    Example:
        >>> import torch
        >>> controller = OPBCController("default")
        >>> t = torch.full((4, 3), -1.0)
        >>> r = t.clone(); r[2:] -= 40.0           # group 9 has tokens 40 nats off: vetoed
        >>> out = controller.step(trainer_logprobs=t, rollout_logprobs=r, group_ids=torch.tensor([5, 5, 9, 9]))
        >>> [(d.group_id, d.action.value, [x.value for x in d.reasons]) for d in out.decisions]
        [(5, 'train', []), (9, 'quarantine', ['veto', 'clipped_above_max'])]
        >>> out.loss_mask.sum(dim=1), out.quarantine_group_ids
        (tensor([3, 3, 0, 0]), [9])
        >>> controller.compute_budget()["opbc/decision/group_share/quarantine"]
        tensor(0.5000, dtype=torch.float64)
    """

    def __init__(self, policy: OPBCPolicy | str | None = None, *, track_budget: bool = True, **metric_kwargs: Any):
        if policy is None:
            policy = OPBCPolicy()
        elif isinstance(policy, str):
            policy = OPBCPolicy.preset(policy)
        elif not isinstance(policy, OPBCPolicy):
            raise TypeError(f"`policy` must be an OPBCPolicy or a preset name, got {type(policy).__name__}")
        self.policy: OPBCPolicy = policy
        self.budget: OPBCCollection | None = None
        if track_budget:
            self.budget = OPBCCollection(budget_metrics(optional=False, **metric_kwargs))

    def evaluate(self, batch: Any = None, **fields: Any) -> BatchDecisions:
        """Decide every group of a batch (no budget update, no host sync unless ``policy_lag`` is a mapping)."""
        with torch.no_grad():  # decisions, weights and statistics never carry the trainer's graph
            return self._evaluate(as_view(batch, **fields))

    def _evaluate(self, view: BatchView) -> BatchDecisions:
        view, index, batch_reasons, flips, lag_rows, token_ids = _prepare(view)
        policy = self.policy
        # A large batch is processed in chunks of rows (statistics, checks, then correction), so that the
        # per-token temporaries are those of one chunk; see FC.row_chunks.
        chunks = FC.row_chunks(view)
        fused = None
        if not batch_reasons and FC.fused_pass_applies(view, chunks):
            # The same values from one sweep over the tokens (see FC.fused_pass).
            fused = FC.fused_pass(view, index, policy.clamp, policy.veto, policy.alignment_gap, chunks, flips=flips,
                                  lag_rows=lag_rows, token_ids=token_ids,
                                  with_weights=FC.fused_correction_applies(policy))
            values = FC._group_compute(fused.stats)
        else:
            values = FC._group_compute(
                FC.group_update(view, index, policy.clamp, policy.veto, flips=flips, lag_rows=lag_rows, chunks=chunks)
            )
        negative_rows = view._cache.get("negative_expert_rows")
        if fused is not None:
            rows = fused.contract_rows if negative_rows is None else {**fused.contract_rows,
                                                                       "negative_expert_ids": negative_rows}
            contract = FC._contract_from_rows(rows, index, lag_rows, view.mask_other_rows)
        elif batch_reasons:
            declared = view._cache.get("declared_response_tokens")
            if declared is not None:
                values["num_response_tokens"] = FC._segment_sum(declared, index)
            none = torch.zeros(index.capacity, dtype=torch.bool, device=view.device)
            contract = {name: none for name in FC.CONTRACT_REASONS}
            contract.update({name: index.present for name in batch_reasons})
            contract["invalid_policy_lag"] = FC.invalid_lag_groups(lag_rows, index)
        else:
            parts = [
                FC._contract_rows(FC.chunk_view(view, i, j), policy.alignment_gap,
                                  None if token_ids is None else (token_ids[0][i:j], token_ids[1][i:j]))
                for i, j in chunks
            ]
            rows = FC.cat_rows(parts)
            if negative_rows is not None:
                rows["negative_expert_ids"] = negative_rows
            contract = FC._contract_from_rows(rows, index, lag_rows, view.mask_other_rows)
        action, reasons = FC.decide(values, contract, index.present, policy)
        row_action = action[index.row_group]
        if fused is not None and fused.weights is not None:
            loss_mask, weights, counts = FC.fused_correction(fused, row_action, policy, chunks, view.dtype)
        elif len(chunks) == 1:
            corr = FC._correction(view, row_action, policy)
            loss_mask, weights = corr["loss_mask"], corr["weights"]
            counts = {k: corr[k] for k in _CORRECTION_COUNTS}
        else:
            _, _, mask = view.token_inputs
            loss_mask = torch.empty(mask.shape, dtype=torch.bool, device=view.device)
            weights = torch.empty(mask.shape, dtype=view.dtype, device=view.device)
            counts = {k: torch.zeros((), dtype=view.dtype, device=view.device) for k in _CORRECTION_COUNTS}
            for i, j in chunks:
                corr = FC._correction(FC.chunk_view(view, i, j), row_action[i:j], policy)
                loss_mask[i:j] = corr["loss_mask"]
                weights[i:j] = corr["weights"]
                for k in _CORRECTION_COUNTS:
                    counts[k] += corr[k]
        return BatchDecisions(policy, index, values, action, reasons, row_action, loss_mask, weights, counts)

    def step(self, batch: Any = None, **fields: Any) -> BatchDecisions:
        """:meth:`evaluate` and fold the result into the budget metrics.

        Raises:
            ValueError: the batch is on another accelerator than the budget metrics' states (naming the batch's
                fields and ``controller.to(device)``); a batch on the CPU is folded into states anywhere.
        """
        view = as_view(batch, **fields)
        with torch.no_grad():
            out = self._evaluate(view)
        if self.budget is not None:
            self._check_budget_device(view, out.row_action.device)
            self.budget.update({DECISIONS_FIELD: out})
        return out

    __call__ = step

    def compute_budget(self) -> dict[str, Tensor]:
        """The budget metrics over everything stepped since the last reset (synced across ranks)."""
        if self.budget is None:
            raise RuntimeError("this controller was built with track_budget=False")
        return self.budget.compute()

    def reset_budget(self) -> None:
        if self.budget is not None:
            self.budget.reset()

    def _check_budget_device(self, view: BatchView, device: torch.device) -> None:
        """The budget metrics would refuse decisions on ``device`` (the batch's, which :meth:`_evaluate` checked is
        every field's) naming their own internal field: name the user's fields and the controller's remedy."""
        if self.budget is None:
            return
        states = self.budget.members()[0].device
        # The rule of OPBCMetric.checked_statistics: statistics on the CPU move to the states, others do not.
        if device == states or device.type == "cpu":
            return
        # dict.items: listing the fields is not a read by a metric (check_unread has run already).
        names = ", ".join(f"`{k}`" for k, v in dict.items(view.data) if isinstance(v, Tensor) and v.device == device)
        raise ValueError(
            f"batch field(s) {names} are on {device} but the states of the controller's budget metrics are on "
            f'{states}; move the controller to the batch\'s device: controller.to("{device}")'
        )

    def to(self, device: torch.device | str) -> OPBCController:
        """Move the budget metric states (they must live where the batches are)."""
        if self.budget is not None:
            self.budget.to(device)
        return self


_CORRECTION_COUNTS = ("trained_tokens", "corrected_tokens", "truncated_tokens", "masked_tokens")


# -- batch-level validation ---------------------------------------------------------------------------
def _require_tensor(name: str, value: Any) -> Tensor:
    if not isinstance(value, Tensor):
        raise ValueError(f"batch field `{name}` must be a torch.Tensor, got {type(value).__name__}")
    return value


def _pair(view: BatchView, first: str, second: str) -> tuple[Tensor, Tensor] | None:
    a, b = view.data.get(first), view.data.get(second)
    if a is None and b is None:
        return None
    if a is None or b is None:
        missing, given = (first, second) if a is None else (second, first)
        raise ValueError(f"batch field `{missing}` is required when `{given}` is given")
    return _require_tensor(first, a), _require_tensor(second, b)


_ROUTER_LOGITS = (ROLLOUT_ROUTER_LOGITS, TRAINER_ROUTER_LOGITS)


def _router_pair(view: BatchView) -> tuple[tuple[Tensor, Tensor] | None, tuple[str, str]]:
    """Each side's expert ids, or its router logits when the ids are absent (as the moe section reads them),
    and the fields they came from; ``None`` when neither side has any."""
    sides = []
    for ids_name, logits_name in ((ROLLOUT_EXPERTS, ROLLOUT_ROUTER_LOGITS), (TRAINER_EXPERTS, TRAINER_ROUTER_LOGITS)):
        name = ids_name if view.data.get(ids_name) is not None else logits_name
        sides.append((name, view.data.get(name)))
    (r_name, rollout), (t_name, trainer) = sides
    names = (r_name, t_name)
    if rollout is None and trainer is None:
        return None, names
    if rollout is None or trainer is None:
        missing, given = (ROLLOUT_EXPERTS, t_name) if rollout is None else (TRAINER_EXPERTS, r_name)
        also = ROLLOUT_ROUTER_LOGITS if rollout is None else TRAINER_ROUTER_LOGITS
        raise ValueError(f"batch field `{missing}` (or `{also}`) is required when `{given}` is given")
    for name, value in zip(names, (rollout, trainer)):
        _require_tensor(name, value)
        if name in _ROUTER_LOGITS and not value.is_floating_point():
            raise ValueError(f"batch field `{name}` must be floating-point router logits [B, T, L, E], "
                             f"got {value.dtype}")
        if name in _ROUTER_LOGITS and value.ndim == 4 and 0 in value.shape[2:]:
            # Before the sides' shapes are compared: no experts is no input, not a mismatch of the two sides' E.
            raise ValueError(f"batch field `{name}` must have at least one layer and one expert (L, E >= 1), "
                             f"got {tuple(value.shape)}")
    return (rollout, trainer), names


def _lag_rows(value: Any, group_ids: Tensor) -> Tensor | None:
    b, device = group_ids.shape[0], group_ids.device
    if value is None:
        return None
    if isinstance(value, Mapping):
        missing = sorted({g for g in group_ids.tolist() if g not in value})  # host read, documented
        if missing:
            raise ValueError(f"batch field `{POLICY_LAG}` has no lag for groups {missing}")
        lags = [float(value[g]) for g in group_ids.tolist()]
        return torch.tensor(lags, dtype=torch.float64, device=device)
    if isinstance(value, Tensor):
        if value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"batch field `{POLICY_LAG}` must be a real tensor, got {value.dtype}")
        if value.device != device:
            raise ValueError(f"batch field `{POLICY_LAG}` is on {value.device} but `{GROUP_IDS}` is on {device}")
        if value.ndim == 0:
            return value.to(device=device, dtype=torch.float64).expand(b)
        if value.shape != (b,):
            raise ValueError(f"batch field `{POLICY_LAG}` must have shape [B] = ({b},), got {tuple(value.shape)}")
        return value.to(device=device, dtype=torch.float64)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.full((b,), float(value), dtype=torch.float64, device=device)
    raise ValueError(
        f"batch field `{POLICY_LAG}` must be a [B] tensor, a number or a {{group_id: lag}} mapping, "
        f"got {type(value).__name__}"
    )


def _prepare(
    view: BatchView,
) -> tuple[BatchView, FC.GroupIndex, list[str], Tensor | None, Tensor | None, tuple[Tensor, Tensor] | None]:
    """Validate the batch as a whole; return the view to compute on, the group index, batch-wide contract
    failures (every group is rejected), router flips, per-row lags and the token-id pair."""
    # Framework names (TRL's `completion_mask`, verl's `old_log_probs` without the schema's) are refused as the
    # collection refuses them: read as absent, they would give an all-ones mask or reject every group. Rows that
    # disagree (`group_ids` vs the logprobs) are a contract failure here (shape_mismatch), not an error.
    check_field_names({k: v for k, v in view.data.items() if k not in PER_SEQUENCE_FIELDS})
    group_ids = view.tensor(GROUP_IDS)
    if group_ids.ndim != 1 or group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(
            f"batch field `{GROUP_IDS}` must be a 1-D integer tensor [B], got {group_ids.dtype} "
            f"of shape {tuple(group_ids.shape)}"
        )
    b, device = group_ids.shape[0], group_ids.device
    data = view.data
    reasons: list[str] = []
    shape: tuple[int, ...] | None = None
    for name in (TRAINER_LOGPROBS, ROLLOUT_LOGPROBS):
        value = data.get(name)
        if value is None:
            if "logprobs_missing" not in reasons:
                reasons.append("logprobs_missing")
            continue
        t = _require_tensor(name, value)
        if not t.is_floating_point():
            raise ValueError(f"batch field `{name}` must be a floating-point tensor, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"batch field `{name}` is on {t.device} but `{GROUP_IDS}` is on {device}")
        if t.ndim != 2 or t.shape[0] != b or (shape is not None and tuple(t.shape) != shape):
            reasons.append("shape_mismatch")
        shape = shape or (tuple(t.shape) if t.ndim == 2 and t.shape[0] == b else None)
    mask = data.get(RESPONSE_MASK)
    if mask is not None:
        mask = _require_tensor(RESPONSE_MASK, mask)
        if mask.device != device:
            raise ValueError(f"batch field `{RESPONSE_MASK}` is on {mask.device} but `{GROUP_IDS}` is on {device}")
        if mask.is_complex():
            raise ValueError(f"batch field `{RESPONSE_MASK}` must be bool, integer or float, got {mask.dtype}")
        if mask.ndim != 2 or mask.shape[0] != b or (shape is not None and tuple(mask.shape) != shape):
            reasons.append("shape_mismatch")
        shape = shape or (tuple(mask.shape) if mask.ndim == 2 and mask.shape[0] == b else None)
    experts, expert_names = _router_pair(view)
    token_ids = _pair(view, ROLLOUT_TOKEN_IDS, TRAINER_TOKEN_IDS)
    pairs = ((experts, expert_names), (token_ids, (ROLLOUT_TOKEN_IDS, TRAINER_TOKEN_IDS)))
    for pair, names in pairs:
        for name, t in zip(names, pair or ()):
            if t.device != device:
                raise ValueError(f"batch field `{name}` is on {t.device} but `{GROUP_IDS}` is on {device}")
    if shape is not None:
        # Expert ids [B, T, L, K] or router logits [B, T, L, E] per side: the same B, T, L; the same K for ids, the
        # same E for logits (argmaxes over different numbers of experts are not the same experts).
        if experts is not None and (
            any(x.ndim != 4 or tuple(x.shape[:2]) != shape for x in experts)
            or experts[0].shape[2] != experts[1].shape[2]
            or (expert_names in ((ROLLOUT_EXPERTS, TRAINER_EXPERTS), _ROUTER_LOGITS)
                and experts[0].shape != experts[1].shape)
        ):
            reasons.append("shape_mismatch")
        if token_ids is not None and any(tuple(x.shape) != shape for x in token_ids):
            reasons.append("shape_mismatch")
    lag_rows = _lag_rows(data.get(POLICY_LAG), group_ids)
    view.check_unread()  # every field the controller reads has been looked up
    index = FC.group_index(group_ids)
    reasons = list(dict.fromkeys(reasons))
    if reasons:
        # Nothing per token can be trusted: compute on an empty mask (the statistics read as empty groups),
        # but count the response tokens the mask declares, for the token shares of the budget.
        t = shape[1] if shape is not None else 0
        zeros = torch.zeros(b, t, device=device)
        fallback = BatchView(trainer_logprobs=zeros, rollout_logprobs=zeros, response_mask=zeros.bool())
        if mask is not None and tuple(mask.shape) == (b, t):
            fallback._cache["declared_response_tokens"] = (mask != 0).to(torch.float32).sum(dim=1)
        return fallback, index, reasons, None, lag_rows, None
    _, _, response = view.token_inputs  # (BatchView's own validation, cached for every later use)
    flips = None
    if experts is not None:
        from opbc_metrics.functional.moe import _check_pair, _side, top1_flips_and_negatives

        # Each side's top-1 expert as the moe section reads it: its ids' first column, or its logits' argmax (its
        # ids whole, for the check of every id).
        rollout, trainer = (_side(view, ids, logits, None if view.has(ids) else 1)[0]
                            for ids, logits in ((ROLLOUT_EXPERTS, ROLLOUT_ROUTER_LOGITS),
                                                (TRAINER_EXPERTS, TRAINER_ROUTER_LOGITS)))
        _check_pair(rollout[..., :1], trainer[..., :1])  # (the [B, T, L] of both; K may differ)
        flips, negative = top1_flips_and_negatives(rollout, trainer)
        # A negative expert id (a -1 placeholder: no expert) on a response token is a contract failure of its row
        # (FC._contract_from_rows reads it): the group is rejected, whatever its flip rate reads.
        view._cache["negative_expert_rows"] = (negative & response).sum(dim=1)
    return view, index, [], flips, lag_rows, token_ids
