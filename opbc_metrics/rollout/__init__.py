"""Rollout-group metrics: the rollout-metrics UI's per-step statistics, as DDP-exact metrics.

Source: Telescope's rollout-metrics UI (its description of the per-step charts). Its flat names map onto this library's
``section/group/metric`` keys as below: W&B panel section ``rollout`` (or ``sample_metrics``), then the
quantity, then the statistic.

| Telescope | key |
|---|---|
| Reward: mean, std, min, max per step | ``rollout/reward/{mean,std,min,max}`` |
| Reward: Gini per prompt group, averaged | ``rollout/reward/group_gini_mean`` |
| Advantage: mean, std, min, max per step | ``rollout/advantage/{mean,std,min,max}`` |
| Tokens (Prompt): mean, std, min, max | ``rollout/tokens_prompt/{mean,std,min,max}`` |
| Tokens (Completion): mean, std, min, max | ``rollout/tokens_completion/{mean,std,min,max}`` |
| Tokens (Total): mean, std, min, max | ``rollout/tokens_total/{mean,std,min,max}`` |
| ``group_length_gini_mean`` | ``rollout/tokens_completion/group_gini_mean`` |
| ``group_length_max_median_ratio_mean`` | ``rollout/tokens_completion/group_max_median_ratio_mean`` |
| ``group_length_cv_mean`` | ``rollout/tokens_completion/group_cv_mean`` |
| off-policy steps (``policy_lag``): mean, std, min, max | ``rollout/off_policy_steps/{mean,std,min,max}`` |
| ``stop_reason_length_pct`` | ``rollout/stop_reason/length_pct`` |
| Discarded rollouts ``max_async``, ``zero_advantage`` | ``rollout/discarded/{max_async,zero_advantage}`` |
| (their sum, and share of all rollouts in %) | ``rollout/discarded/{total,pct}`` |
| discarded by reason, as shares of the discarded (%) | ``rollout/discarded/{max_async_pct,zero_advantage_pct}`` |
| zero-advantage split (all-zero, all-positive, mean reward) | ``rollout/discarded/zero_advantage_*`` |
| discarded rollouts' tokens, Gini, max/median | ``rollout/discarded/tokens_completion/*`` |
| discarded rollouts' stop_reason_length_pct | ``rollout/discarded/stop_reason/length_pct`` |
| ``sample_metrics``, per name: mean, std, min, max | ``sample_metrics/<name>/{mean,std,min,max}`` |
| ``sample_metrics``, per name: Gini per prompt group | ``sample_metrics/<name>/group_gini_mean`` |
| ``reward_min`` / ``reward_max``, ``metrics_ranges`` | no key: chart metadata, ``chart_ranges()`` |
| ``timing_step_total``, ``timing_step_active`` | ``timing_s/step``, ``timing_s/step_active`` (1) |
| ``timing_<stage>_total`` (forward, backward, ...) | ``timing_s/<stage>`` (1) |
| ``timing_waiting_for_data`` | ``timing_s/waiting_for_data`` (1) |
| ``timing_forward_microbatch_mean`` | ``timing_s/forward_microbatch`` (1) |
| step metric ``entropy`` | ``actor/entropy`` (1) |
| step metric ``kl_divergence_inference`` | ``opbc/kl/{k1,k2,k3}`` (mismatch section; a glossary alias) |
| step metrics ``grad_norm``, ``learning_rate`` | ``actor/grad_norm``, ``actor/lr`` (1) |

(1) Not in this package: the training section (:mod:`opbc_metrics.training`; its stage timer gives
``timing_s/<stage>`` for the stage names above: ``step``, ``step_active``, ``forward``, ``backward``,
``loss_computation``, ``compute_kl``, ``compute_entropy``, ``data_to_device``, ``prepare_tensors``,
``waiting_for_data``, ``weight_sync_trainer``, ``weight_sync_inference``).

Batch fields (the batch schema of :mod:`opbc_metrics.batch`, plus three of this section): ``rewards``,
``advantages`` ([B] or [B, T]; how a [B, T] field is reduced is in :mod:`opbc_metrics.functional.rollout`),
``prompt_lengths``, ``response_lengths`` ([B] token counts), ``group_ids`` ([B] int tensor of arbitrary
ids, or a list of hashable ids such as verl's ``uid`` strings), ``stop_reasons`` ([B] int codes 0 stop,
1 length, 2 abort; a [B] bool tensor; or a list of strings where ``"length"`` marks truncation),
``discard_reasons`` ([B] int codes 0 kept, 1 max_async, 2 zero_advantage, or a list of strings/None),
``sample_metrics`` (a mapping ``name -> [B]`` or a list of per-sample mappings), ``policy_lag`` ([B]
trainer steps behind, for the off-policy steps).

"Per step" is torchmetrics' window: ``update()`` every batch of the step, ``compute()``, ``reset()``.
How each statistic is kept exact over updates and ranks (sample std from mergeable sums; per-group values
merged as (sum over groups, number of groups), so **a prompt group must arrive whole in one update on one
rank**) is in :mod:`opbc_metrics.functional.rollout`.

In an :class:`~opbc_metrics.collection.OPBCCollection`, ask for ``sections=("mismatch", "rollout")`` (or
pass :func:`rollout_metrics`, which also takes the sample-metric names and the declared ranges). Every
member has ``optional_inputs = True``: a batch lacking a member's fields (say, no ``stop_reasons``)
skips that member instead of raising, and a member that never saw data is left out of the
collection's output. The section is opt-in (not in ``DEFAULT_SECTIONS``) because it checks the values
of fields that default users and adapters already pass for other sections (``rewards``,
``response_lengths``, ...): a NaN reward or a negative length raises at ``compute()``, which a default
collection should not start doing unasked. :class:`SampleMetricStats` is not in the ``"rollout"``
section factory, because its state size depends on the metric names: add it through
:func:`rollout_metrics` or explicitly.

Example:
    >>> import torch
    >>> from opbc_metrics import OPBCCollection
    >>> metrics = OPBCCollection(rollout_metrics(["tool_calls"], reward_min=0.0, reward_max=1.0))
    >>> metrics.update(rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]), group_ids=["a", "a", "b", "b"],
    ...                response_lengths=torch.tensor([100, 300, 50, 50]), prompt_lengths=torch.tensor([20, 20, 30, 30]),
    ...                stop_reasons=["stop", "length", "stop", "stop"],
    ...                sample_metrics={"tool_calls": torch.tensor([1.0, 3.0, 0.0, 0.0])})
    >>> out = metrics.compute()
    >>> [out[k].item() for k in ("rollout/reward/mean", "rollout/reward/group_gini_mean",
    ...                          "rollout/tokens_completion/group_max_median_ratio_mean",
    ...                          "rollout/stop_reason/length_pct", "sample_metrics/tool_calls/max")]
    [0.75, 0.25, 1.25, 25.0, 3.0]
"""

from opbc_metrics.rollout import metrics
from opbc_metrics.rollout.metrics import *  # noqa: F403

__all__ = metrics.__all__
