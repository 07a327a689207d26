"""Actor metrics (``actor/*``): trainer scalars, policy entropy, PPO KL and clip fractions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from opbc_metrics.batch import BatchView, check_positive
from opbc_metrics.functional.training import (
    ADVANTAGES,
    CLIPFRAC_KEYS,
    DEFAULT_CLIP_RATIO,
    DEFAULT_CLIP_RATIO_C,
    DEFAULT_RATIO_CLAMP,
    ENTROPIES,
    KL_ESTIMATORS,
    LOGITS,
    OLD_LOGPROBS,
    POLICY_LOGPROBS,
    POSITIVE_LOGPROBS,
    PPO_LOGPROB_FIELDS,
    _clipfrac_compute,
    _clipfrac_update,
    _entropy_update,
    _policy_kl_update,
    _scalar_compute,
    _scalar_update,
    _token_mean_compute,
    check_clip_range,
)
from opbc_metrics.metric import SUM, BySettings, State, table
from opbc_metrics.training._base import Scalar, _TrainerScalar, _TrainingMetric, diagnostic, trainer_scalars

_STEPS = "trainer observations (optimizer steps or micro-batches) over the window and all ranks"
_LOSS_UNIT = ("trainer observations over the window and all ranks, weighted by `loss_tokens` when given (the token "
              "mean of a token-mean loss), else equally")
_TOKENS = "response tokens (response_mask = 1) over the window and all ranks"


ActorLoss, PolicyGradientLoss, EntropyLoss, KLLoss, KLCoef, ActorGradNorm, ActorLR = trainer_scalars(
    __name__,
    Scalar("ActorLoss", "actor/loss", "actor_loss", "Total actor loss, as the trainer computed it,",
           ("actor_loss=0.5, loss_tokens=300", "actor_loss=[1.0, 2.0], loss_tokens=[100, 100]"),
           "tensor(0.9000, dtype=torch.float64)", weighted=True, higher_is_better=False, unit=_LOSS_UNIT,
           what="Total actor loss (often pg_loss + regularizers). Should trend down overall; sudden jumps point to "
           "too-large learning rates, abrupt distribution shifts or oscillating updates."),
    Scalar("PolicyGradientLoss", "actor/pg_loss", "pg_loss", "Core policy-gradient loss", ("pg_loss=[-0.1, 0.3]",),
           "tensor(0.1000, dtype=torch.float64)", weighted=True, unit=_LOSS_UNIT,
           what="Core policy-gradient loss. Noisy by nature; a sustained blow-up is a red flag."),
    Scalar("EntropyLoss", "actor/entropy_loss", "entropy_loss", "Entropy-regularisation loss", ("entropy_loss=0.25",),
           "tensor(0.2500, dtype=torch.float64)", weighted=True, unit=_LOSS_UNIT,
           what="Entropy regularization loss term (keeps the policy from over-confident collapse)."),
    Scalar("KLLoss", "actor/kl_loss", "kl_loss", "KL penalty loss, when a KL loss is enabled,",
           ("kl_loss=0.002, loss_tokens=10", "kl_loss=0.004, loss_tokens=30"), "tensor(0.0035, dtype=torch.float64)",
           weighted=True, higher_is_better=False, unit=_LOSS_UNIT,
           what="KL penalty loss term between the policy and the reference (when an explicit KL loss is enabled)."),
    Scalar("KLCoef", "actor/kl_coef", "kl_coef", "KL penalty coefficient", ("kl_coef=0.001",),
           "tensor(0.0010, dtype=torch.float64)", unit=_STEPS,
           what="Weight of the KL penalty (fixed or adaptive). Explains moves of kl_loss and ppo_kl."),
    Scalar("ActorGradNorm", "actor/grad_norm", "actor_grad_norm", "Actor gradient L2 norm",
           ("actor_grad_norm=1.0", "actor_grad_norm=3.0"), "tensor(2., dtype=torch.float64)", higher_is_better=False,
           unit=_STEPS, aliases=("grad_norm",),
           note="The norm is of the all-reduced gradient, the same on every rank, so the mean over steps and ranks "
           "is the mean over steps.",
           what="L2 norm of the actor gradients: how hard the parameters want to move. A spike to 10x its usual "
           "value suggests gradient explosion, bad batches or numerical issues."),
    Scalar("ActorLR", "actor/lr", "actor_lr", "Actor learning rate", ("actor_lr=1e-6",),
           "tensor(1.0000e-06, dtype=torch.float64)", unit=_STEPS,
           what="Actor learning rate. Not a performance metric, but it explains many others: when loss, KL and "
           "grad_norm spike together, check the schedule first."),
)


class PolicyEntropy(_TrainingMetric):
    r"""Mean policy entropy ``actor/entropy`` over response tokens (nats), token mean over the window and ranks.

    From per-token ``entropies`` [B, T] (default), or from ``logits`` [B, T, V] with ``from_logits=True``
    (``log_softmax`` based, ``0 log 0 = 0``, logits divided by ``temperature`` first as in the rollout).
    Non-finite entropies on response tokens are excluded and make ``compute()`` raise.

    Args:
        from_logits: read ``logits`` instead of ``entropies``.
        temperature: sampling temperature applied to the logits.

    Example:
        >>> import torch
        >>> metric = PolicyEntropy()
        >>> metric.update(entropies=torch.tensor([[1.0, 2.0, 9.0]]), response_mask=torch.tensor([[1, 1, 0]]))
        >>> metric.update(entropies=torch.tensor([[3.0]]))
        >>> metric.compute()
        tensor(2., dtype=torch.float64)
    """

    keys = ("actor/entropy",)
    required_fields = BySettings((ENTROPIES,), lambda m: (LOGITS,) if m.from_logits else (ENTROPIES,))
    states = table("sum", "count", "nonfinite")
    kernel = (_entropy_update, _token_mean_compute)
    update_args = ("from_logits", "temperature")
    glossary = diagnostic("actor/entropy", unit=_TOKENS, aliases=("entropy", "policy entropy"),
        what="Mean entropy of the policy over response tokens. High early (exploration), lower later (commitment); an "
        "early collapse often means premature convergence. A sudden drop is the first thing to check when reward "
        "crashes.")

    def __init__(self, from_logits: bool = False, temperature: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.from_logits = bool(from_logits)
        self.temperature = check_positive("temperature", temperature)

    @property
    def _deferred(self) -> tuple[tuple[str, str, str], ...]:
        return (("nonfinite", self.required_fields[0], "non-finite entropies on response tokens"),)


class _PolicyKL(_TrainingMetric):
    required_fields = (POLICY_LOGPROBS, OLD_LOGPROBS)
    higher_is_better = False
    default_estimator = "k1"
    states = table("sum", "count", "nonfinite", "positive")
    kernel = (_policy_kl_update, _token_mean_compute)
    update_args = ("estimator", "clamp")
    _deferred = (("nonfinite", PPO_LOGPROB_FIELDS, "non-finite logprobs on response tokens"),
                 ("positive", PPO_LOGPROB_FIELDS, POSITIVE_LOGPROBS))

    def __init__(self, estimator: str | None = None, clamp: float = DEFAULT_RATIO_CLAMP, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        estimator = self.default_estimator if estimator is None else estimator
        if estimator not in KL_ESTIMATORS:
            raise ValueError(f"`estimator` must be one of {KL_ESTIMATORS}, got {estimator!r}")
        self.estimator = estimator
        self.clamp = check_positive("clamp", clamp)


class PPOKL(_PolicyKL):
    r"""``actor/ppo_kl``: token-mean KL(pi_old || pi) during the PPO update, verl's k1 estimator by default.

    Reads ``policy_logprobs`` (the policy being updated) and ``old_logprobs`` (the policy the PPO ratio is
    taken against; verl's ``old_log_prob``), [B, T], under ``response_mask``. With
    :math:`r = \mathrm{clamp}(\log\pi - \log\pi_{old}, -20, 20)`: ``k1 = -r``, ``k2 = r^2/2``,
    ``k3 = e^r - 1 - r`` (see :func:`~opbc_metrics.functional.training.policy_kl`).

    Args:
        estimator: ``"k1"`` (default), ``"k2"`` or ``"k3"``.
        clamp: the log-ratio clamp (20, as verl).

    Example:
        >>> import torch
        >>> metric = PPOKL()
        >>> metric.update(policy_logprobs=torch.tensor([[-1.0, -2.0]]), old_logprobs=torch.tensor([[-1.5, -1.0]]))
        >>> metric.compute()
        tensor(0.2500, dtype=torch.float64)
    """

    keys = ("actor/ppo_kl",)
    glossary = diagnostic("actor/ppo_kl", unit=_TOKENS, aliases=("objective/kl",),
        what="Approximate KL divergence between the old policy and the policy being updated (k1 = mean of log pi_old "
        "- log pi by default). Spikes often precede reward collapse; near zero for long means the model may not be "
        "learning.")


class ApproxKL(_PolicyKL):
    r"""``actor/approx_kl``: the same token-mean KL(pi_old || pi) as :class:`PPOKL`, k3 by default.

    k3 = :math:`e^r - 1 - r` is the low-variance non-negative estimator CleanRL/Stable-Baselines log as
    ``approx_kl``; choose ``"k2"`` for TRL's ``approx_kl``.

    Example:
        >>> import torch
        >>> metric = ApproxKL()
        >>> metric.update(policy_logprobs=torch.tensor([[-1.0, -2.0]]), old_logprobs=torch.tensor([[-1.5, -1.0]]))
        >>> metric.compute().round(decimals=4)
        tensor(0.2583, dtype=torch.float64)
    """

    keys = ("actor/approx_kl",)
    default_estimator = "k3"
    glossary = diagnostic("actor/approx_kl", unit=_TOKENS, aliases=("approx_kl", "policy/approx_kl"),
        what="Approximate KL divergence between the old and the new policy (k3 estimator by default): how far an "
        "update moved the policy.")


class PolicyClipFraction(_TrainingMetric):
    r"""``actor/pg_clipfrac`` and ``actor/pg_clipfrac_lower``: share of response tokens where PPO's clip,
    and the dual-clip lower bound, are active.

    PPO (Schulman et al. 2017) with dual clip (Ye et al. 2020) as in verl's ``compute_policy_loss``: with
    :math:`\rho = e^{\mathrm{clamp}(\log\pi - \log\pi_{old}, -20, 20)}`, a token is clipped when
    :math:`-A\,\mathrm{clip}(\rho, 1-\epsilon_{low}, 1+\epsilon_{high}) > -A\rho`, and lower-clipped when
    :math:`A < 0` and :math:`\max(-A\rho, -A\,\mathrm{clip}(\rho)) > -A c`. Fractions of the valid response
    tokens of the window and all ranks. ``advantages`` may be [B] or [B, T].

    Args:
        clip_ratio: epsilon (0.2), for both sides unless ``clip_ratio_low`` / ``clip_ratio_high`` are given.
        clip_ratio_c: the dual-clip bound c (> 1; 3).

    Example:
        >>> import torch
        >>> metric = PolicyClipFraction()
        >>> metric.update(policy_logprobs=torch.log(torch.tensor([[0.3, 0.1, 0.2, 0.8]])),  # ratios 1.5, 0.5, 1, 4
        ...               old_logprobs=torch.log(torch.full((1, 4), 0.2)),
        ...               advantages=torch.tensor([[1.0, -1.0, 1.0, -1.0]]))
        >>> {k: v.item() for k, v in metric.compute().items()}
        {'actor/pg_clipfrac': 0.5, 'actor/pg_clipfrac_lower': 0.25}
    """

    keys = CLIPFRAC_KEYS
    required_fields = (POLICY_LOGPROBS, OLD_LOGPROBS, ADVANTAGES)
    higher_is_better = False
    plot_lower_bound = 0.0
    plot_upper_bound = 1.0
    states = table("clipped", "clipped_lower", "count", "nonfinite", "positive")
    kernel = (_clipfrac_update, _clipfrac_compute)
    update_args = ("low", "high", "c", "clamp")
    _deferred = (("nonfinite", required_fields, "non-finite logprobs or advantages on response tokens"),
                 ("positive", PPO_LOGPROB_FIELDS, POSITIVE_LOGPROBS))
    glossary = diagnostic("actor/pg_clipfrac", unit=_TOKENS,
        what="Clip fraction: how often PPO's ratio clipping is active (the update was speed-limited), and how often "
        "the dual-clip lower bound binds for negative advantages. Sustained high values suggest a learning rate too "
        "high or batches too small/noisy.",
        aliases=("pg_clipfrac", "clip fraction", "actor/pg_clipfrac_lower"))

    def __init__(self, clip_ratio: float = DEFAULT_CLIP_RATIO, clip_ratio_low: float | None = None,
                 clip_ratio_high: float | None = None, clip_ratio_c: float = DEFAULT_CLIP_RATIO_C,
                 clamp: float = DEFAULT_RATIO_CLAMP, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.low, self.high, self.c = check_clip_range(clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c)
        self.clamp = check_positive("clamp", clamp)


LR_SCHEDULER = "lr_scheduler"


class LRSchedulerState(_TrainingMetric):
    """Learning-rate scheduler state ``lr_scheduler/<name>``, if the framework logs it.

    Batch field ``lr_scheduler``: a mapping from a state name (``last_lr``, ``warmup_steps_left``, ...) to a
    number, a 0-d tensor or one value per observation. Names are fixed at construction (state size is
    fixed); a batch may carry any subset of them, and a name not declared raises a ``ValueError``. Each key
    is the mean of its observations over the window and all ranks (a per-step value such as the current
    learning rate reads as itself); no data in the window: no key.

    Args:
        names: the scheduler state names to report (``("last_lr",)``).

    Example:
        >>> metric = LRSchedulerState(names=("last_lr", "step"))
        >>> metric.update(lr_scheduler={"last_lr": 1e-6, "step": 10})
        >>> metric.update(lr_scheduler={"last_lr": 3e-6, "step": 11})
        >>> {k: round(v.item(), 9) for k, v in metric.compute().items()}
        {'lr_scheduler/last_lr': 2e-06, 'lr_scheduler/step': 10.5}
    """

    keys = BySettings(("lr_scheduler/<name>",), lambda m: tuple(f"lr_scheduler/{n}" for n in m.names))
    required_fields = (LR_SCHEDULER,)
    higher_is_better = None
    glossary = diagnostic("lr_scheduler", unit=_STEPS, aliases=("lr_scheduler/*",),
        what="Learning-rate scheduler state as the framework reports it (current learning rate, warmup or decay "
        "position): to check the schedule behaves as configured, e.g. warmup finished when expected.")

    def __init__(self, names: tuple[str, ...] | list[str] = ("last_lr",), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        names = tuple(names)
        if not names or any(not isinstance(n, str) or not n or "/" in n for n in names) or len(set(names)) < len(names):
            raise ValueError(f"`names` must be distinct non-empty strings without '/', got {names!r}")
        self.names = names

    def state_table(self) -> dict[str, State]:
        # One block of trainer-scalar states per name, suffixed by the name's index.
        return {f"{stat}_{i}": SUM for i in range(len(self.names)) for stat in _TrainerScalar.states}

    @property
    def _deferred(self) -> tuple[tuple[str, tuple[str, ...], str], ...]:
        return tuple((f"nonfinite_{i}", (LR_SCHEDULER,), f"non-finite `{n}` values") for i, n in enumerate(self.names))

    # Each name is a trainer scalar of its own: the window has data when any name has an observation (or a counted
    # bad value), and a name without observations in the window has no key (not a made-up 0).
    @property
    def data_counts(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(f"{stat}_{i}" for stat in _TrainerScalar.data_counts for i in range(len(self.names)))

    @property
    def key_counts(self) -> tuple[tuple[str, str], ...]:  # type: ignore[override]
        return tuple((key, f"sum_w_{i}") for i, key in enumerate(self.keys))

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        state = view.field(LR_SCHEDULER)
        if not isinstance(state, Mapping):
            raise ValueError(f"batch field `{LR_SCHEDULER}` must be a mapping of state names to values, "
                             f"got {type(state).__name__}")
        unknown = sorted(set(state) - set(self.names))
        if unknown:
            raise ValueError(f"batch field `{LR_SCHEDULER}` has names {unknown} not declared in `names` "
                             f"{list(self.names)}")
        inner = BatchView(dict(state))
        out: dict[str, Tensor] = {}
        for i, name in enumerate(self.names):
            if inner.has(name):
                try:
                    stats = _scalar_update(inner, name, None, self.device)
                except ValueError as err:
                    raise ValueError(f"batch field `{LR_SCHEDULER}`: {err}") from err
                out.update({f"{k}_{i}": v for k, v in stats.items()})
        return out

    def compute(self) -> dict[str, Tensor]:
        return {key: _scalar_compute(getattr(self, f"sum_wx_{i}"), getattr(self, f"sum_w_{i}"),
                                       getattr(self, f"count_{i}")) for i, key in enumerate(self.keys)}
