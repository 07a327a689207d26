"""Stateful MoE router-drift metrics (section ``moe``, group ``router``), thin classes over
:mod:`opbc_metrics.functional.moe`."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from opbc_metrics.batch import BatchView, check_count
from opbc_metrics.functional.moe import (
    DEFAULT_MOE_LAYERS,
    EXPERT_FIELDS,
    LOGIT_FIELDS,
    PAIR_SETS,
    TOPK_DISAGREEMENT_KEY,
    _flip_rate_compute,
    _flip_rate_update,
    _set_disagreement_compute,
    _set_disagreement_update,
    check_top_k,
    flip_rate_keys,
)
from opbc_metrics.metric import SUM, BySettings, GlossaryEntry, OPBCMetric, table

_PAIRS = (
    "valid (token, layer) pairs: response tokens (response_mask = 1) times MoE layers, over the window and all ranks"
)
_TOKENS = "valid response tokens (response_mask = 1), over the window and all ranks"


class _RouterMetric(OPBCMetric):
    """Base of the router metrics: reads expert ids (or router logits) of both engines and the mask.

    ``optional_inputs``: inside an :class:`~opbc_metrics.collection.OPBCCollection` the member skips
    batches that carry none of the four routing fields (dense models, logprob-only batches); a batch with
    any of them updates it, so one side without the other, or router logits without ``top_k``, raise a
    ``ValueError`` naming the missing field or option (:meth:`accepts`). ``required_fields`` are the
    expert-id fields, or the router-logit fields when ``top_k`` is given. The metric reads each side from
    its expert ids if present, else from its router logits, so mixed batches (replayed rollout ids,
    trainer logits) work.
    """

    higher_is_better = False  # rates of disagreement, in [0, 1]
    plot_lower_bound = 0.0
    plot_upper_bound = 1.0
    optional_inputs = True
    trigger_fields = (*EXPERT_FIELDS, *LOGIT_FIELDS)  # any routing field: a lone side or logits without top_k raise
    data_counts = ("layer_pairs", "tokens")
    required_fields = BySettings(EXPERT_FIELDS, lambda m: EXPERT_FIELDS if m.top_k is None else LOGIT_FIELDS)

    def __init__(self, top_k: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.top_k = check_top_k(top_k)

    def update(self, batch: Any = None, **fields: Any) -> None:
        """Accumulate a batch with ``rollout_experts`` / ``trainer_experts`` ``[B, T, L, K]`` (or
        ``rollout_router_logits`` / ``trainer_router_logits`` ``[B, T, L, E]`` with ``top_k`` set) and an
        optional ``response_mask`` ``[B, T]``."""
        super().update(batch, **fields)


class RouterFlipRate(_RouterMetric):
    r"""Top-1 router flip rate ``moe/router/flip_rate``, per layer, and the worst layer.

    .. math:: \mathrm{flip\_rate} = \frac{\#\{(t, l): m_t = 1,\ e^{roll}_{t,l,1} \ne e^{train}_{t,l,1}\}}
              {\#\{(t, l): m_t = 1\}}

    over valid tokens ``t`` and MoE layers ``l``. The state is two fixed vectors of ``num_layers + 1``
    counts (flips and (token, layer) pairs per layer, the last entry pooling layers ``>= num_layers``),
    so DDP sync is exact and the size does not depend on the model. Keys:

    * ``moe/router/flip_rate``: over all layers (the overflow included).
    * ``moe/router/layer_{l}/flip_rate`` for the layers that saw a valid token in the window (a 48-layer
      model gets 48 keys; a layer without data has no key, on the synced counts). Without ``num_layers``,
      layers ``>= 64`` are pooled into ``moe/router/layer_overflow/flip_rate``, only when such layers were
      seen.
    * ``moe/router/worst_layer``: the layer with the highest rate among the layers that saw a valid
      token, the first one on ties; 64 stands for the pooled overflow bucket ("some layer >= 64").
      ``moe/router/worst_layer_flip_rate``: its rate.

    No valid token in the window: no keys. A negative expert id in a valid token (a -1 placeholder for a token
    the engine did not route or record: no expert, which would read as a flip) makes :meth:`compute` raise, naming
    the fields; set ``response_mask`` to 0 on such tokens.

    Args:
        num_layers: the model's number of MoE layers (the per-layer capacity): a batch with more layers
            raises a ``ValueError`` in ``update``. ``None`` (the default): a capacity of 64, deeper layers
            pooled.
        top_k: the number of routed experts, needed to read router logits (top-1 uses the first).
        kwargs: torchmetrics ``Metric`` arguments.

    Example:
        >>> import torch
        >>> metric = RouterFlipRate(num_layers=2)
        >>> r = torch.tensor([[[[1, 2], [3, 4]], [[5, 6], [7, 0]]]])  # B=1, T=2, L=2, K=2
        >>> t = torch.tensor([[[[2, 1], [3, 4]], [[5, 6], [0, 7]]]])  # flips: (0, 0) and (1, 1)
        >>> metric.update(rollout_experts=r, trainer_experts=t, response_mask=torch.tensor([[1, 1]]))
        >>> metric.update(rollout_experts=r, trainer_experts=t, response_mask=torch.tensor([[0, 1]]))
        >>> for key, value in metric.compute().items():  # layer 0: 1 flip in 3 tokens; layer 1: 2 in 3
        ...     print(key, round(value.item(), 4))
        moe/router/flip_rate 0.5
        moe/router/worst_layer 1.0
        moe/router/worst_layer_flip_rate 0.6667
        moe/router/layer_0/flip_rate 0.3333
        moe/router/layer_1/flip_rate 0.6667
    """

    keys = BySettings(flip_rate_keys(DEFAULT_MOE_LAYERS), lambda m: flip_rate_keys(m.num_layers))
    glossary = GlossaryEntry(
        name="router_flip_rate",
        what="Fraction of (token, layer) pairs where the MoE top-1 routed expert differs between rollout and "
        "trainer: top-1 stability under quantization or precision changes. Low values (< 5%) suggest the "
        "dominant expert is robust. Also per MoE layer (layer_{l}/flip_rate, layers beyond the capacity "
        "pooled in layer_overflow without num_layers) and the worst layer with its rate. Expert ids must be >= 0 "
        "(a -1 placeholder is no expert): compute raises otherwise.",
        unit=_PAIRS,
        cap="flip_rate > max_flip (0.15)",
        action="the OPBC quarantines the group: its routing no longer matches the trainer's, so the trainer's "
        "gradient is not the gradient of the policy that sampled it",
        aliases=("top-1 flip rate", "top1_flip_rate"),
    )
    states = table("negative_ids", layer_flips=SUM.of(lambda m: m.num_layers + 1),
                   layer_pairs=SUM.of(lambda m: m.num_layers + 1))

    def __init__(self, num_layers: int | None = None, top_k: int | None = None, **kwargs: Any) -> None:
        super().__init__(top_k, **kwargs)
        self.configured_layers = 0 if num_layers is None else check_count("num_layers", num_layers, optional=False)
        self.num_layers = self.configured_layers or DEFAULT_MOE_LAYERS

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        return _flip_rate_update(view, self.num_layers, self.top_k, configured=bool(self.configured_layers))

    def compute(self) -> dict[str, Tensor]:
        return _flip_rate_compute(**self.state_values())


class RouterSetDisagreement(_RouterMetric):
    r"""Top-K set disagreement ``moe/router/topk_disagreement_rate``.

    .. math:: \frac{\#\{t: m_t = 1,\ \exists l: S^{roll}_{t,l} \ne S^{train}_{t,l}\}}{\#\{t: m_t = 1\}}

    where :math:`S_{t,l}` is the set of the top-K experts of token ``t`` in layer ``l``: the order within
    the top-K does not matter. No valid token in the window: no key.

    Args:
        top_k: the number of routed experts, needed to read router logits; with expert ids it compares
            the first ``top_k`` of each side.
        num_experts: the model's number of experts E, when known: ids compared in the narrowest dtype
            holding ``[0, E)`` (uint8 for E <= 256, cheaper than int16); ids outside ``[0, E)`` in valid
            tokens make :meth:`compute` raise. ``None``: with K > 2 the ids are compared as int16, so ids
            outside ``[0, 2**15)`` in valid tokens make :meth:`compute` raise (pass ``num_experts``); with
            K <= 2 any ids compare exactly, and a negative one (a -1 placeholder: no expert) raises.
        compiled: compare the sets in one ``torch.compile`` loop (CPU, K > 2; a collection's ``compiled`` option
            does it for all): ~2-2.5x faster at K = 8 after a compilation of a few seconds on first use, the same
            value. Elsewhere the eager comparison runs.
        kwargs: torchmetrics ``Metric`` arguments.

    Example:
        >>> import torch
        >>> metric = RouterSetDisagreement(num_experts=8)
        >>> r = torch.tensor([[[[1, 2], [3, 4]], [[5, 6], [7, 0]]]])
        >>> t = torch.tensor([[[[2, 1], [3, 4]], [[5, 6], [7, 1]]]])  # token 0: a swap; token 1: a new expert
        >>> metric.update(rollout_experts=r, trainer_experts=t)
        >>> metric.compute()
        tensor(0.5000, dtype=torch.float64)
    """

    keys = (TOPK_DISAGREEMENT_KEY,)
    glossary = GlossaryEntry(
        name="token_expert_disagreement_rate",
        what="Fraction of tokens with at least one MoE layer where the top-k *set* of routed experts differs "
        "between rollout and trainer. More sensitive than the top-1 flip: quantization noise often shuffles "
        "the lower-ranked experts even when the dominant one is stable; the gap between the two shows it. "
        "Expert ids must lie in [0, num_experts) (without num_experts: in [0, 32768) for top-k > 2, >= 0 "
        "otherwise): "
        "compute raises otherwise.",
        unit=_TOKENS,
        cap="none (diagnostic)",
        action="no OPBC action; read it against router_flip_rate, which carries the cap (max_flip)",
        aliases=("top-k set disagreement", "topk_disagreement_rate"),
    )
    states = table("disagreements", "tokens", "out_of_range")

    def __init__(
        self, top_k: int | None = None, num_experts: int | None = None, compiled: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(top_k, **kwargs)
        self.num_experts = check_count("num_experts", num_experts)
        self.compiled = bool(compiled)

    def request_shared(self, view: BatchView) -> None:
        """Without ``num_experts``, ask for the shared K = 2 loop, which gives the flip rate its flips too."""
        if self.num_experts is None:
            view.request(PAIR_SETS, self.top_k)

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        return _set_disagreement_update(view, self.top_k, self.num_experts, self.compiled)

    def compute(self) -> Tensor:
        return _set_disagreement_compute(**self.state_values(), num_experts=self.num_experts)


MOE_METRICS: tuple[type[_RouterMetric], ...] = (RouterFlipRate, RouterSetDisagreement)


def moe_section(num_layers: int | None = None, top_k: int | None = None, num_experts: int | None = None,
                **kwargs: Any) -> list[OPBCMetric]:
    """The ``moe`` section of :class:`~opbc_metrics.collection.OPBCCollection`: both router metrics.

    ``num_layers``, ``top_k`` and ``num_experts`` come from ``OPBCCollection(section_options={"moe": {...}})``.
    """
    return [
        RouterFlipRate(num_layers=num_layers, top_k=top_k, **kwargs),
        RouterSetDisagreement(top_k=top_k, num_experts=num_experts, **kwargs),
    ]
