"""The declared state tables of OPBCMetric: registration, shapes from settings, the base update, and refusals."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor
from torchmetrics.utilities.data import dim_zero_cat, dim_zero_max, dim_zero_min, dim_zero_sum

from opbc_metrics.batch import BatchView
from opbc_metrics.functional.perf import TransformerFlops
from opbc_metrics.glossary import public_metrics
from opbc_metrics.integrations.wandb_logger import DistributionHistograms
from opbc_metrics.metric import MAX, MIN, SUM, BySettings, OPBCMetric, State, table
from opbc_metrics.mismatch import TopGradientMass
from opbc_metrics.per_round import PerRoundMismatch
from opbc_metrics.rollout import SampleMetricStats
from opbc_metrics.sync import packable, reduce_kind
from opbc_metrics.training import GlobalSeqlen, StageTiming


class _Toy(OPBCMetric):
    """Sum, max and min of ``x``, a histogram of ``bins`` x ``width + 1`` (no keys: not a registered metric)."""

    data_counts = ("count",)
    states = table("count", "total", hi=MAX, lo=MIN, hist=SUM.of("bins", lambda m: m.width + 1, "names"))

    def __init__(self, bins: int = 2, width: int = 0, names: tuple[str, ...] = ("a",), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bins, self.width, self.names = bins, width, names

    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        x = view.field("x").to(torch.float64)
        hist = torch.zeros(self.bins, self.width + 1, len(self.names), dtype=torch.float64)
        hist[0, 0, 0] = x.numel()
        return {"count": torch.tensor(float(x.numel())), "total": x.sum(), "hi": x.max(), "lo": x.min(), "hist": hist}

    def compute(self) -> dict[str, Tensor]:
        return self.state_values(exclude=("hist",))


class _Extra(_Toy):
    def statistics(self, view: BatchView) -> dict[str, Tensor]:
        return {**super().statistics(view), "sum_sq": torch.tensor(1.0)}


def test_states_are_registered_from_the_table_in_order_with_their_reductions_and_defaults():
    m = _Toy(bins=3, width=1)
    assert list(m._defaults) == ["count", "total", "hi", "lo", "hist"]
    assert [reduce_kind(m, n) for n in m._defaults] == ["sum", "sum", "max", "min", "sum"]
    assert float(m.count) == 0.0 and float(m.hi) == -math.inf and float(m.lo) == math.inf
    assert all(getattr(m, n).dtype == torch.float64 for n in m._defaults)
    assert set(m.state_dict()) == {"count", "total", "hi", "lo", "hist", "_extra_state"}
    assert packable(m)


def test_shapes_resolve_from_the_constructors_settings():
    assert _Toy(bins=3, width=1).hist.shape == (3, 2, 1)
    assert _Toy(bins=5, width=0, names=("a", "b")).hist.shape == (5, 1, 2)  # a sequence setting: its length
    assert SampleMetricStats(["a", "b", "c"]).count.shape == (3,)
    assert GlobalSeqlen(world_size=2, max_seqlen=7).hist.shape == (8,)
    assert StageTiming(stages=("gen", "step"), world_size=4).time.shape == (4, 2)


def test_the_base_update_folds_statistics_by_each_states_reduction():
    m = _Toy()
    m.update(x=torch.tensor([1.0, 5.0]))
    m.update(x=torch.tensor([-2.0, 3.0, 4.0]))
    out = m.compute()
    assert {k: float(v) for k, v in out.items()} == {"count": 5.0, "total": 11.0, "hi": 5.0, "lo": -2.0}
    assert float(m.hist[0, 0, 0]) == 5.0


def test_an_unknown_reduction_is_refused():
    with pytest.raises(ValueError, match="unknown state reduction 'mean'"):
        State("mean")
    with pytest.raises(ValueError, match="unknown state reduction"):
        State("avg", (2,))

    class _Bad(_Toy):
        states = {"count": "sum"}  # noqa: RUF012 (a plain string, not a State)

    with pytest.raises(TypeError, match=r"_Bad.states\['count'\] must be a State"):
        _Bad()


def test_a_statistic_that_is_not_in_the_table_is_refused_before_any_state_changes():
    m = _Extra()
    with pytest.raises(ValueError, match=r"_Extra: the batch statistics \['sum_sq'\] are not states of the metric"):
        m.update(x=torch.tensor([1.0]))
    assert all(torch.equal(getattr(m, n), default) for n, default in m._defaults.items())


def test_keys_and_fields_that_depend_on_settings_show_the_pattern_on_the_class():
    class _Named:  # a plain class: a metric class with keys would join the registry of every test session
        keys = BySettings(("toy/<name>",), lambda m: tuple(f"toy/{n}" for n in m.names))

        def __init__(self, names: tuple[str, ...]) -> None:
            self.names = names

    assert _Named.keys == ("toy/<name>",)
    assert _Named(("a", "b")).keys == ("toy/a", "toy/b")
    assert SampleMetricStats.keys[0] == "sample_metrics/<name>/mean"
    assert SampleMetricStats(["f"], group_gini=False).required_fields == ("sample_metrics",)
    assert SampleMetricStats(["f"]).required_fields == ("sample_metrics", "group_ids")
    assert "keys" not in SampleMetricStats(["f"]).config()["settings"]


# Settings for the registered classes that need some; the others are built with their defaults.
_SETTINGS: dict[str, dict[str, Any]] = {
    "SampleMetricStats": {"names": ["a", "b"]},
    "ValidationAccuracy": {"data_sources": ["a", "b"]},
    "ValidationReward": {"data_sources": ["a", "b"]},
    "ModelFlopsUtilization": {"flops": TransformerFlops(1e9, 1, 1), "peak_flops": 1e15},
}
# Settings that change a table (its names or its shapes).
_VARIANTS: list[Any] = [
    lambda: TopGradientMass(exact=True),
    lambda: PerRoundMismatch(capacity=3),
    lambda: DistributionHistograms(bins=4),
    lambda: DistributionHistograms(bins=4, num_layers=3),
]
_FX = {"sum": dim_zero_sum, "max": dim_zero_max, "min": dim_zero_min, "cat": dim_zero_cat}


@pytest.mark.parametrize(
    "build",
    [lambda cls=cls: cls(**_SETTINGS.get(cls.__name__, {})) for cls in public_metrics()] + _VARIANTS,
    ids=[cls.__name__ for cls in public_metrics()] + [f"variant{i}" for i in range(len(_VARIANTS))],
)
def test_every_metric_registers_exactly_the_states_of_its_table(build):
    metric = build()
    states = metric.state_table()
    assert states, f"{type(metric).__name__} declares no states"
    assert list(metric._defaults) == list(states)  # none registered outside the table, in the table's order
    for name, state in states.items():
        assert metric._reductions[name] is _FX[state.reduce], name
        default = metric._defaults[name]
        if state.reduce == "cat":
            assert default == []
        else:
            assert default.dtype == torch.float64 and tuple(default.shape) == state.resolve(metric), name


def test_a_cat_state_keeps_each_batchs_values_and_leaves_the_packed_sync():
    m = TopGradientMass(exact=True)
    m.update(trainer_logprobs=torch.zeros(1, 2), rollout_logprobs=torch.tensor([[0.0, -1.0]]))
    m.update(trainer_logprobs=torch.zeros(1, 1), rollout_logprobs=torch.zeros(1, 1))
    assert [w.tolist() for w in m.weights] == [[1.0, pytest.approx(math.e, rel=1e-6)], [1.0]]
    assert float(m.count) == 3.0
    assert not packable(m)
