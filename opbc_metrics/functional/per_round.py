r"""Per-round (multi-turn) logprob mismatch: pure functions over one batch.

The keys and their meaning follow verl's per-round debug metrics (verl PR #5229,
``per_round/*`` of ``calculate_debug_metrics``), made exact over a window and all ranks:

* a *round* is a contiguous run of 1s in ``response_mask`` (one turn of model generation; the 0s
  between rounds are environment/tool tokens, the 0s after the last round padding). Round ``i`` is
  the ``i``-th run of a sequence, counted from 0.
* ``per_round/round_{i}_abs_diff_mean``: mean of :math:`|r_t| = |\log p_{train} - \log p_{roll}|`
  over the tokens of round ``i`` of every sequence, pooled (a token-weighted mean, as verl
  concatenates the round's tokens over the batch before averaging).
* ``per_round/round_{i}_token_count``: response tokens in round ``i`` over all sequences. Summed over
  the rounds (and the overflow) it is the number of response tokens, ``response_mask.sum()``.
* ``per_round/total_rounds``: the largest number of rounds of any one sequence (verl: "max number of
  rounds across batch"), over the window and all ranks; 0 when no sequence has a round. It is the
  value a verl user reads as "how many turns the longest trajectory had", and the number of
  ``round_{i}`` entries that carry data.
* ``per_round/max_round_diff``: the round ``i`` with the largest ``round_{i}_abs_diff_mean`` among the
  rounds with at least one valid token, the first one on ties (as verl's strict ``>`` scan).
  ``per_round/max_diff_value``: that mean. Both are left out when no round has a valid token (as verl
  leaves them out).

Rounds are found in the mismatch kernel's sweep over the tokens (:func:`opbc_metrics.functional.mismatch.
_round_sums`): a round starts where the mask is 1 and the previous token's is 0; its sums are differences of
prefix sums at round starts, from per-chunk sums the kernel takes while the tokens are in cache. Statistics
go into a fixed ``capacity + 1`` buffer: rounds ``0 .. capacity - 1`` each get a bucket, rounds ``>= capacity``
share the last one (``per_round/overflow_abs_diff_mean``,
``per_round/overflow_token_count``). The overflow bucket competes in ``max_round_diff`` as index
``capacity``, read "a round >= capacity": raise ``capacity`` to resolve it. No Python loop over tokens,
no host sync, a fixed state size.

Round boundaries come from ``response_mask`` alone. A response token whose trainer or rollout logprob
is non-finite stays in its round (it neither splits nor ends it) and in ``token_count``, but is left
out of the mean, as everywhere in this library (see :mod:`opbc_metrics.batch`); a round whose tokens
are all non-finite has no ``abs_diff_mean`` key (no value; its ``token_count`` stays) and does not compete
for ``max_round_diff``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from opbc_metrics.batch import BatchView, as_bool_mask, check_count, raise_if_bad_inputs
from opbc_metrics.functional import mismatch as M
from opbc_metrics.functional.statistics import Stats
from opbc_metrics.functional.statistics import safe_div as _safe_div

# 16 rounds cover the 8-turn GUI-agent trajectories verl's PR was tested on with room to spare; longer
# agents pool into the overflow bucket (or raise ``capacity``).
DEFAULT_ROUND_CAPACITY = 16

TOTAL_ROUNDS_KEY = "per_round/total_rounds"
MAX_ROUND_KEY = "per_round/max_round_diff"
MAX_VALUE_KEY = "per_round/max_diff_value"
OVERFLOW_MEAN_KEY = "per_round/overflow_abs_diff_mean"
OVERFLOW_COUNT_KEY = "per_round/overflow_token_count"



def round_mean_key(i: int) -> str:
    """``per_round/round_{i}_abs_diff_mean``."""
    return f"per_round/round_{i}_abs_diff_mean"


def round_count_key(i: int) -> str:
    """``per_round/round_{i}_token_count``."""
    return f"per_round/round_{i}_token_count"


def per_round_keys(capacity: int) -> tuple[str, ...]:
    """Keys of the per-round metric with ``capacity`` tracked rounds, in order.

    Example:
        >>> per_round_keys(1)
        ('per_round/total_rounds', 'per_round/round_0_abs_diff_mean', 'per_round/round_0_token_count', \
'per_round/overflow_abs_diff_mean', 'per_round/overflow_token_count', 'per_round/max_round_diff', \
'per_round/max_diff_value')
    """
    rounds = [k for i in range(capacity) for k in (round_mean_key(i), round_count_key(i))]
    return (TOTAL_ROUNDS_KEY, *rounds, OVERFLOW_MEAN_KEY, OVERFLOW_COUNT_KEY, MAX_ROUND_KEY, MAX_VALUE_KEY)


def round_index(response_mask: Tensor) -> Tensor:
    """``[B, T]`` int64: the 0-based round of each response token, -1 outside rounds.

    A round is a contiguous run of nonzero mask values: starts where the mask is on and the previous
    token's is off, then a cumulative sum (the per-round statistics themselves never form this index).

    Example:
        >>> import torch
        >>> round_index(torch.tensor([[1, 1, 0, 0, 1, 0, 1, 1], [0, 1, 1, 1, 1, 1, 0, 0]]))
        tensor([[ 0,  0, -1, -1,  1, -1,  2,  2],
                [-1,  0,  0,  0,  0,  0, -1, -1]])
    """
    if not isinstance(response_mask, Tensor) or response_mask.ndim != 2:
        shape = tuple(response_mask.shape) if isinstance(response_mask, Tensor) else type(response_mask).__name__
        raise ValueError(f"batch field `response_mask` must be a [B, T] tensor, got {shape}")
    on = as_bool_mask(response_mask)
    before = torch.nn.functional.pad(on[:, :-1], (1, 0))
    return torch.cumsum(on & ~before, dim=1).sub_(1).masked_fill_(~on, -1)


def request_rounds(view: BatchView, capacity: int) -> None:
    """Ask the view's shared mismatch kernel for the per-round sums of ``capacity`` rounds."""
    view.request(M.TOKEN_STATISTICS, M.rounds_need(capacity))


def round_kernel_statistics(view: BatchView, capacity: int, compiled: bool = False) -> Stats:
    """The shared mismatch kernel's statistics of the view with the per-round sums of ``capacity`` rounds (cached on
    the view: one call per batch)."""
    clamp, veto, bins = M.shared_settings(view)
    return M.batch_statistics(view, clamp, veto, bins, compiled, frozenset({M.rounds_need(capacity)}))


def _per_round_update(view: BatchView, capacity: int, compiled: bool = False) -> Stats:
    """The per-round sums of one batch, from the mismatch kernel's shared call (:func:`M._round_sums`).

    The kernel finds the rounds in the same sweep as the mismatch statistics; a collection asks for both
    before its members update, so one call serves them. With a larger capacity requested by another
    reader, rounds ``>= capacity`` are folded into this capacity's overflow bucket.
    """
    stats = round_kernel_statistics(view, capacity, compiled)

    def fold(sums: Tensor) -> Tensor:
        if sums.shape[0] == capacity + 1:  # the kernel's own capacity (the usual case): nothing to fold
            return sums
        return torch.cat([sums[:capacity], sums[capacity:].sum(0, keepdim=True)])

    return {
        "sum_abs": fold(stats["round_sum_abs"]),
        "valid_count": fold(stats["round_valid"]),
        "token_count": fold(stats["round_tokens"]),
        "max_rounds": stats["max_rounds"],
    }


def _per_round_compute(
    sum_abs: Tensor, valid_count: Tensor, token_count: Tensor, max_rounds: Tensor
) -> dict[str, Tensor]:
    capacity = sum_abs.shape[0] - 1
    means = _safe_div(sum_abs, valid_count, 0.0)
    observed = valid_count > 0
    worst = torch.argmax(torch.where(observed, means, torch.full_like(means, -1.0)))  # first max on ties
    any_observed = observed.any()
    out = {TOTAL_ROUNDS_KEY: max_rounds.clamp_min(0.0)}
    for i in range(capacity):
        out[round_mean_key(i)] = means[i]
        out[round_count_key(i)] = token_count[i]
    out[OVERFLOW_MEAN_KEY] = means[capacity]
    out[OVERFLOW_COUNT_KEY] = token_count[capacity]
    out[MAX_ROUND_KEY] = torch.where(any_observed, worst.to(means.dtype), torch.full_like(means[0], -1.0))
    out[MAX_VALUE_KEY] = torch.where(any_observed, means[worst], torch.zeros_like(means[0]))
    return out


def _occurred(out: dict[str, Tensor], capacity: int, valid_count: Tensor) -> dict[str, Tensor]:
    """``out`` without the keys of rounds that no sequence reached, and without the overflow keys unless
    a sequence had more than ``capacity`` rounds (single-turn data gets round 0 only); without the mean of a
    round that had no finite token (``valid_count`` 0: no mean, not a made-up 0; its token count stays), and
    without ``max_round_diff`` / ``max_diff_value`` when no round had one. Which keys exist depends on the
    data, so this reads the counts on the host: for ``compute``, never ``update``."""
    read = torch.cat([out[TOTAL_ROUNDS_KEY].reshape(1), (valid_count > 0).to(valid_count.dtype)]).tolist()  # one read
    rounds, has_mean = int(read[0]), [bool(x) for x in read[1:]]
    absent = {k for i in range(min(rounds, capacity), capacity) for k in (round_mean_key(i), round_count_key(i))}
    if rounds <= capacity:
        absent |= {OVERFLOW_MEAN_KEY, OVERFLOW_COUNT_KEY}
    absent |= {round_mean_key(i) for i in range(capacity) if not has_mean[i]}
    if not has_mean[capacity]:
        absent.add(OVERFLOW_MEAN_KEY)
    if not any(has_mean):
        absent |= {MAX_ROUND_KEY, MAX_VALUE_KEY}
    return {k: v for k, v in out.items() if k not in absent}


def per_round_mismatch(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor | None = None,
    capacity: int = DEFAULT_ROUND_CAPACITY,
) -> dict[str, Tensor]:
    r"""``per_round/*`` for one batch: per-round mean :math:`|r_t|`, token counts, rounds, worst round.

    .. math:: \mathrm{round}_i\_\mathrm{abs\_diff\_mean} = \frac{\sum_{b} \sum_{t \in R_{b,i}} |r_{b,t}|}
              {\sum_{b} |R_{b,i}|}

    where :math:`R_{b,i}` is the ``i``-th run of 1s of sequence ``b``'s response mask (finite tokens).

    Args:
        trainer_logprobs: ``[B, T]``.
        rollout_logprobs: ``[B, T]``.
        response_mask: ``[B, T]``; all ones (one round per sequence) when absent.
        capacity: rounds with their own keys; rounds ``>= capacity`` pool into ``overflow``.

    Example:
        >>> import torch
        >>> mask = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0]])
        >>> trainer = torch.tensor([[-1.0, -1.0, -5.0, -2.0], [-1.0, 0.0, 0.0, 0.0]])
        >>> rollout = torch.tensor([[-1.5, -1.0, -1.0, -1.0], [-1.1, 0.0, 0.0, 0.0]])
        >>> out = per_round_mismatch(trainer, rollout, mask, capacity=3)
        >>> {k.removeprefix("per_round/"): round(v.item(), 4) for k, v in out.items()}  # doctest: +NORMALIZE_WHITESPACE
        {'total_rounds': 2.0, 'round_0_abs_diff_mean': 0.2, 'round_0_token_count': 3.0,
         'round_1_abs_diff_mean': 1.0, 'round_1_token_count': 1.0, 'max_round_diff': 1.0, 'max_diff_value': 1.0}
    """
    view = BatchView(trainer_logprobs=trainer_logprobs, rollout_logprobs=rollout_logprobs, response_mask=response_mask)
    capacity = check_count("capacity", capacity, optional=False)
    stats = _per_round_update(view, capacity)
    raise_if_bad_inputs(*view.logprob_range, view.mask_other_values)  # probabilities, logits, a -100 label mask
    return _occurred(_per_round_compute(**stats), capacity, stats["valid_count"])
