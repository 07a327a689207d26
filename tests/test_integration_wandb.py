"""OPBCWandbLogger against a real wandb run in offline mode, read back from the run's ``.wandb`` file
(:mod:`tests.wandb_run`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

wandb = pytest.importorskip("wandb")

from opbc_metrics import OPBCCollection  # noqa: E402
from opbc_metrics.integrations.dashboard import KeyFilter, resolve_alias  # noqa: E402
from opbc_metrics.integrations.wandb_logger import (  # noqa: E402
    GLOSSARY_KEY,
    MAX_HISTOGRAM_BINS,
    DistributionHistograms,
    OPBCWandbLogger,
    batch_histograms,
    summaries_for,
    vector_histogram,
)
from opbc_metrics.testing import assert_no_host_sync  # noqa: E402
from tests.data import concat_batches, make_batch  # noqa: E402
from tests.ddp import run_distributed  # noqa: E402
from tests.reference import router_reference  # noqa: E402
from tests.support import collection_values  # noqa: E402
from tests.wandb_run import assert_logged, read_back, read_offline_run  # noqa: E402

LAYERS, TOP_K = 4, 2


# -- Data with real router disagreement ----------------------------------------------------------
def expert_batch(seed: int, batch: int = 6, seq: int = 10, flip_p: float = 0.2) -> dict[str, torch.Tensor]:
    b = make_batch(batch=batch, seq=seq, seed=seed, drift=0.3, dtype=torch.float64)
    g = torch.Generator().manual_seed(1000 + seed)
    rollout = torch.stack([torch.randperm(8, generator=g)[:TOP_K] for _ in range(batch * seq * LAYERS)])
    rollout = rollout.reshape(batch, seq, LAYERS, TOP_K)
    trainer = rollout.clone()
    flip = torch.rand(batch, seq, LAYERS, generator=g) < flip_p * (1 + torch.arange(LAYERS)) / LAYERS
    trainer[..., 0] = torch.where(flip, (rollout[..., 0] + 1) % 8, rollout[..., 0])
    return {**b, "rollout_experts": rollout, "trainer_experts": trainer}


def np_layer_flip_rate(batches: list[dict[str, torch.Tensor]]) -> np.ndarray:
    cat = concat_batches(batches)
    ref = router_reference(*(cat[k].numpy() for k in ("rollout_experts", "trainer_experts", "response_mask")),
                           num_layers=LAYERS)
    return np.array([ref[f"moe/router/layer_{k}/flip_rate"] for k in range(LAYERS)])


def np_valid_log_ratios(batches: list[dict[str, torch.Tensor]]) -> tuple[np.ndarray, np.ndarray]:
    tokens, seqs = [], []
    for b in batches:
        r = (b["trainer_logprobs"] - b["rollout_logprobs"]).numpy()
        mask = b["response_mask"].numpy().astype(bool)
        tokens.extend(r[mask].tolist())
        seqs.extend(r[i][mask[i]].sum() for i in range(r.shape[0]) if mask[i].any())
    return np.array(tokens), np.array(seqs)


def np_hist(values: np.ndarray, bins: int, half_width: float) -> np.ndarray:
    """Counts in equal bins over [-R, R], the end bins open (values beyond are clipped into them)."""
    edges = np.linspace(-half_width, half_width, bins + 1)
    counts, _ = np.histogram(np.clip(values, -half_width, half_width), bins=edges)
    return counts.astype(float)


# -- The logger against an offline run -----------------------------------------------------------
def test_offline_run_history_summaries_config_and_histograms(tmp_path: Path):
    batches = [[expert_batch(3 * s + k) for k in range(2)] for s in range(3)]  # 3 windows of 2 batches
    metrics = OPBCCollection()
    hist = DistributionHistograms(bins=32, log_ratio_range=1.5, seq_log_ratio_range=6.0, num_layers=LAYERS)
    logger = OPBCWandbLogger(collection=metrics, distributions=hist, num_layers=LAYERS, layer_bars=True,
                             ranges={"rollout/reward/mean": (0.0, 2.0)}, project="opbc-test", mode="offline",
                             dir=str(tmp_path))
    logged: list[dict[str, float]] = []
    for step, window in enumerate(batches):
        for b in window:
            metrics.update(b)
            logger.update(b)
        values = metrics.compute()
        logged.append({k: v.item() for k, v in values.items() if v.numel() == 1})
        logger.log(values, step=10 * step)
        metrics.reset()
    logger.finish()

    run = read_offline_run(tmp_path)
    assert "offline-run-" in run["path"]
    rows = [r for r in run["history"] if "opbc/is/ess" in r]
    assert [r["opbc/step"] for r in rows] == [0, 10, 20], (run["kinds"], os.path.getsize(run["path"]))

    for row, window in zip(rows, batches):
        # Scalars: exactly what a fresh collection computes on the window (independent recomputation);
        # an alias left out of the row equals its canonical key there.
        assert_logged(row, collection_values(window), rel=0.0, abs_=1e-15)
        assert "opbc/log_ratio/max_abs" not in row and "opbc/ppl/log_ppl_diff" not in row
        # Distribution histograms (fixed bins, end bins open) against numpy on the window's tokens.
        tokens, seqs = np_valid_log_ratios(window)
        h = row["opbc/dist/log_ratio"]
        assert h["_type"] == "histogram" and len(h["bins"]) == len(h["values"]) + 1 <= MAX_HISTOGRAM_BINS + 1
        np.testing.assert_allclose(h["values"], np_hist(tokens, 32, 1.5))
        np.testing.assert_allclose(h["bins"], np.linspace(-1.5, 1.5, 33))
        np.testing.assert_allclose(row["opbc/dist/seq_log_ratio"]["values"], np_hist(seqs, 32, 6.0))
        flips = np_layer_flip_rate(window)
        np.testing.assert_allclose(row["moe/dist/layer_flip_rate"]["values"], flips, rtol=1e-12)
        # Per-layer bars built from the collection's moe/router/layer_<i>/flip_rate scalars.
        bars = row["moe/router/flip_rate_by_layer"]
        np.testing.assert_allclose(bars["values"], flips, rtol=1e-12)
        assert bars["bins"] == [0, 1, 2, 3, 4]

    # define_metric: every key keeps its last value and, with a direction, its worst over the run;
    # signed keys nothing more; all charted against the logger's step metric.
    defined = run["metrics"]
    summaries = {"opbc/is/ess": {"min", "last"}, "opbc/is/veto_fraction": {"max", "last"},
                 "opbc/logprob/abs_diff_mean": {"max", "last"}, "opbc/is/weight_mean": {"last"},
                 "opbc/logprob/diff_mean": {"last"}, "moe/router/flip_rate": {"max", "last"},
                 "moe/router/worst_layer": {"last"}}
    assert {k: defined[k]["summary"] for k in summaries} == summaries
    assert {m["step_metric"] for k, m in defined.items() if k != "opbc/step"} == {"opbc/step"}
    # ... and W&B's own summary holds those aggregates of what was logged.
    summary = run["summary"]
    assert summary["opbc/is/ess"]["min"] == pytest.approx(min(v["opbc/is/ess"] for v in logged), rel=1e-12)
    assert summary["opbc/is/ess"]["last"] == pytest.approx(logged[-1]["opbc/is/ess"], rel=1e-12)
    assert summary["opbc/kl/k3"]["max"] == pytest.approx(max(v["opbc/kl/k3"] for v in logged), rel=1e-12)
    assert summary["moe/router/flip_rate"]["max"] == pytest.approx(max(v["moe/router/flip_rate"] for v in logged),
                                                                   rel=1e-12)
    assert summary["opbc/logprob/diff_mean"]["last"] == pytest.approx(logged[-1]["opbc/logprob/diff_mean"])

    # Config: chart ranges (class bounds + declared) and histogram bins; no glossary text.
    opbc = run["config"]["opbc"]
    assert set(opbc) == {"chart_ranges", "histograms"}
    assert opbc["chart_ranges"]["opbc/is/ess"] == [0.0, 1.0]
    assert opbc["chart_ranges"]["rollout/reward/mean"] == [0.0, 2.0]
    assert opbc["histograms"]["opbc/dist/log_ratio"] == {"bins": 32, "edges": [-1.5, 1.5]}
    # The glossary: one table, logged once, with the identities of the keys not written.
    table = read_table(run, GLOSSARY_KEY)
    ess = next(r for r in table if r["entry"] == "ESS")
    assert ess["keys"] == "opbc/is/ess" and ess["cap"]
    identities = next(r for r in table if r["entry"] == "log_ratio")["identities"]
    assert "opbc/log_ratio/max_abs = opbc/logprob/abs_diff_max" in identities
    assert sum(GLOSSARY_KEY in r for r in run["history"]) == 1


def read_table(run: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """The rows of a ``wandb.Table`` logged under ``key``, from the run's files."""
    ref = next(r[key] for r in run["history"] if key in r)
    assert ref["_type"] == "table-file"
    data = json.loads((Path(run["path"]).parent / "files" / ref["path"]).read_text())
    return [dict(zip(data["columns"], row)) for row in data["data"]]


def test_summaries_keep_the_last_value_and_the_objectives_best(tmp_path: Path):
    logger = OPBCWandbLogger(mode="offline", dir=str(tmp_path), log_glossary=False)
    rewards = [0.05, 0.4, 0.3]
    for step, reward in enumerate(rewards):
        logger.log({"rollout/reward/mean": reward, "rollout/reward/max": reward + 0.1, "opbc/kl/k1": -reward,
                    "opbc/is/ess": 1.0 - reward}, step=step)
    logger.finish()
    run = read_offline_run(tmp_path)
    summary = run["summary"]
    assert summary["rollout/reward/mean"] == {"max": 0.4, "last": 0.3}
    assert summary["rollout/reward/max"]["max"] == pytest.approx(0.5)
    assert summary["opbc/kl/k1"] == {"last": -0.3}
    assert summary["opbc/is/ess"]["min"] == pytest.approx(0.6) and summary["opbc/is/ess"]["last"] == pytest.approx(0.7)


def test_chart_ranges_follow_what_the_run_observes(tmp_path: Path):
    metrics = OPBCCollection(sections=("rollout",))
    logger = OPBCWandbLogger(collection=metrics, mode="offline", dir=str(tmp_path), log_glossary=False)
    for step, rewards in enumerate(([0.0, 0.1], [0.2, 0.9], [0.5, 0.6])):
        metrics.update(rewards=torch.tensor(rewards, dtype=torch.float64))
        logger.log(metrics.compute(), step=step)
        metrics.reset()
    logger.finish()
    config = read_offline_run(tmp_path)["config"]["opbc"]
    assert config["chart_ranges"]["rollout/reward/mean"] == [0.0, 0.9]


def test_one_key_per_quantity_missing_keys_stay_missing_and_log_all(tmp_path: Path):
    metrics = OPBCCollection(sections=("mismatch", "moe", "per_round"), section_options={"moe": {"num_layers": LAYERS}})
    metrics.update(expert_batch(4))
    values = metrics.compute()
    assert {"opbc/log_ratio/max_abs", "opbc/kl/k1", "opbc/ppl/log_ppl_diff"} <= set(values)  # compute() keeps all
    for log_all in (False, True):
        root = tmp_path / str(log_all)
        logger = OPBCWandbLogger(mode="offline", dir=str(root), log_glossary=False, log_all=log_all)
        logger.log(values, step=0)
        partial = {k: v for k, v in values.items() if k.startswith("opbc/is/")}
        logger.log(partial, step=1)  # a dict lacking keys: nothing is filled in
        logger.finish()
        rows = [r for r in read_offline_run(root)["history"] if "opbc/is/ess" in r]
        written = {k for k in rows[0] if not k.startswith("_") and k != "opbc/step"}
        dropped = set(values) - written
        if log_all:
            assert dropped == set()
        else:
            # the aliases (the log-ratio extreme that is max |r| here), event counts that are zero, and the
            # per-round keys: every sequence of these batches has one round, so they repeat the whole-sequence keys
            assert values["per_round/total_rounds"] == 1.0 and "moe/router/layer_overflow/flip_rate" not in values
            top = values["opbc/logprob/abs_diff_max"]
            extreme = "opbc/log_ratio/max" if values["opbc/log_ratio/max"] == top else "opbc/log_ratio/min"
            assert dropped == {
                "opbc/log_ratio/max_abs", "opbc/kl/k1", "opbc/ppl/log_ppl_diff", "opbc/kl/chi2_token", extreme,
                "opbc/is/clipped_fraction", "opbc/is/veto_fraction", "opbc/input/nonfinite_count",
                *(k for k in values if k.startswith("per_round/")),
            }, dropped
            # the zero counts are in the summary, not charted
            summary = read_offline_run(root)["summary"]
            assert summary["opbc/is/veto_fraction"] == 0.0 and summary["opbc/input/nonfinite_count"] == 0.0
        assert {k for k in rows[1] if not k.startswith("_") and k != "opbc/step"} == set(partial) - dropped


def test_a_quiet_count_keeps_its_worst_value_in_the_summary(tmp_path: Path):
    # 0 in the summary while it stays zero; once a window vetoes a token, W&B's max survives later clean windows
    metrics = OPBCCollection(sections=("mismatch",))
    logger = OPBCWandbLogger(collection=metrics, mode="offline", dir=str(tmp_path), log_glossary=False)
    keys = ("opbc/is/veto_fraction", "opbc/is/clipped_fraction", "opbc/input/nonfinite_count")
    computed = []
    for step in range(4):
        b = make_batch(batch=4, seq=10, seed=step, dtype=torch.float64)
        if step == 1:
            b["rollout_logprobs"][1, 0] = b["trainer_logprobs"][1, 0] - 40.0  # vetoed (and clipped)
            b["trainer_logprobs"][0, 0] = float("nan")
        metrics.update(b)
        values = metrics.compute()
        computed.append({k: float(values[k]) for k in keys})
        logger.log(values, step=step)
        metrics.reset()
    logger.finish()
    summary = read_offline_run(tmp_path)["summary"]
    assert all(computed[1][k] > 0 for k in keys) and all(computed[-1][k] == 0 for k in keys), computed
    for k in keys:
        assert summary[k] == {"max": max(c[k] for c in computed), "last": computed[-1][k]}, (k, summary[k])


def test_an_alias_is_written_from_the_first_step_it_differs_and_overflow_from_its_first_nonzero_value():
    f = KeyFilter()
    same = {"opbc/logprob/diff_mean": -0.5, "opbc/kl/k1": 0.5}
    clamped = {"opbc/logprob/diff_mean": -25.0, "opbc/kl/k1": 20.0, "opbc/is/clipped_fraction": 1.0}
    assert [("opbc/kl/k1" in f(v)) for v in (same, clamped, same)] == [False, True, True]  # no gap once written
    assert "opbc/kl/k1" in f({"opbc/kl/k1": 0.5})  # no canonical key to read it from
    key = "per_round/overflow_token_count"
    assert [key in f({key: v}) for v in (0.0, 0.0, 3.0, 0.0)] == [False, False, True, True]
    prefixed = {"bf16/opbc/log_ratio/max_abs": 1.0, "bf16/opbc/logprob/abs_diff_max": 1.0}
    assert list(KeyFilter()(prefixed)) == ["bf16/opbc/logprob/abs_diff_max"]


def test_linear_identities_and_quiet_event_counts():
    f = KeyFilter()
    # chi2 = E[w^2] - 1; total tokens = completion + the one prompt length; the discard shares add to 100
    step = {"opbc/is/second_moment": 1.25, "opbc/kl/chi2_token": 0.25,
            "rollout/tokens_prompt/mean": 3.0, "rollout/tokens_prompt/max": 3.0, "rollout/tokens_prompt/min": 3.0,
            "rollout/tokens_prompt/std": 0.0,
            "rollout/tokens_completion/mean": 7.5, "rollout/tokens_total/mean": 10.5,
            "rollout/tokens_completion/max": 12.0, "rollout/tokens_total/max": 15.0,
            "rollout/discarded/max_async_pct": 25.0, "rollout/discarded/zero_advantage_pct": 75.0,
            "opbc/decision/group_share/train": 1.0, "opbc/decision/group_share/reject": 0.0,
            "opbc/decision/reason_count/veto": 0.0, "opbc/decision/reason_count/lag_above_max": 2.0}
    assert sorted(f(step)) == sorted([
        "opbc/is/second_moment", "rollout/tokens_prompt/mean", "rollout/tokens_completion/mean",
        "rollout/tokens_completion/max", "rollout/discarded/max_async_pct", "opbc/decision/group_share/train",
        "opbc/decision/reason_count/lag_above_max",
    ])
    assert f.zero_so_far == {"opbc/decision/group_share/reject", "opbc/decision/reason_count/veto",
                             "rollout/tokens_prompt/std"}
    # a second prompt length: the prompt spread and the total's extremes are their own quantities from then on
    varied = {**step, "rollout/tokens_prompt/max": 5.0, "rollout/tokens_prompt/std": 1.0,
              "rollout/tokens_total/max": 16.0, "opbc/decision/reason_count/veto": 1.0}
    written = f(varied)
    assert {"rollout/tokens_prompt/max", "rollout/tokens_prompt/std", "rollout/tokens_total/max",
            "opbc/decision/reason_count/veto"} <= set(written)
    assert "rollout/tokens_total/mean" not in written and "opbc/kl/chi2_token" not in written
    assert f.zero_so_far == {"opbc/decision/group_share/reject"}
    assert "rollout/tokens_prompt/std" in f(step)  # written from its first nonzero value on
    # the most specific alias names a key; a prefix renames every source
    assert resolve_alias("rollout/discarded/zero_advantage_pct").describe() == (
        "rollout/discarded/zero_advantage_pct = -rollout/discarded/max_async_pct + 100")
    assert resolve_alias("bf16/rollout/tokens_total/max").describe() == (
        "bf16/rollout/tokens_total/max = bf16/rollout/tokens_completion/max + bf16/rollout/tokens_prompt/mean"
        " when every prompt has one length")
    first_row = KeyFilter()(step)  # every key left out of it reads back from the ones written
    assert {key: read_back(first_row, key)[0] for key in step} == step


def test_per_round_keys_start_with_the_first_multi_round_window():
    f = KeyFilter()
    single = {"per_round/total_rounds": 1.0, "per_round/round_0_abs_diff_mean": 0.2, "opbc/logprob/abs_diff_mean": 0.2}
    multi = {"per_round/total_rounds": 2.0, "per_round/round_1_abs_diff_mean": 0.4, "opbc/logprob/abs_diff_mean": 0.3}
    assert [sorted(f(v)) for v in (single, multi, single)] == [["opbc/logprob/abs_diff_mean"], sorted(multi),
                                                                sorted(single)]
    alone = {"per_round/total_rounds": 1.0, "per_round/round_0_abs_diff_mean": 0.2}  # nothing it repeats
    assert KeyFilter()(alone) == alone


def test_a_single_round_key_that_differs_from_the_whole_response_is_written():
    # non-finite tokens count in round 0's tokens, not in opbc/input/num_tokens: the rule cannot give that count
    metrics = OPBCCollection(sections=("mismatch", "per_round"))
    b = make_batch(batch=4, seq=10, seed=1, dtype=torch.float64)
    b["response_mask"][:] = 1
    b["trainer_logprobs"][0, :3] = float("nan")
    metrics.update(b)
    values = {k: float(v) for k, v in metrics.compute().items()}
    assert values["per_round/total_rounds"] == 1.0
    assert values["per_round/round_0_token_count"] != values["opbc/input/num_tokens"]
    f = KeyFilter()
    row = f(values)
    assert row["per_round/round_0_token_count"] == values["per_round/round_0_token_count"]
    assert "per_round/round_0_abs_diff_mean" not in row  # still the whole response's mean
    assert_logged(row, values)  # every key left out reads back as computed
    clean = {**values, "per_round/round_0_token_count": values["opbc/input/num_tokens"]}
    assert "per_round/round_0_token_count" in f(clean)  # written from then on, like an alias


def test_step_metric_and_batch_distributions(tmp_path: Path):
    logger = OPBCWandbLogger(step_metric="trainer/global_step", mode="offline", dir=str(tmp_path), log_glossary=False)
    b = make_batch(batch=5, seq=9, seed=2)
    logger.log({"opbc/is/ess": torch.tensor(0.75), "opbc/is/veto_fraction": 0.0, "custom/loss": 1.5}, step=7)
    logger.log_batch_distributions(b, step=8, bins=16)
    logger.finish()
    run = read_offline_run(tmp_path)
    assert run["metrics"]["opbc/is/ess"]["step_metric"] == "trainer/global_step"
    assert run["metrics"]["custom/loss"]["summary"] == {"last"}  # unknown direction: the last value
    row = next(r for r in run["history"] if "opbc/is/ess" in r)
    assert row["trainer/global_step"] == 7 and row["opbc/is/ess"] == 0.75 and row["custom/loss"] == 1.5
    hist_row = next(r for r in run["history"] if "opbc/dist/log_ratio" in r)
    tokens, seqs = np_valid_log_ratios([b])
    counts, edges = np.histogram(tokens, bins=16)
    assert hist_row["trainer/global_step"] == 8
    np.testing.assert_allclose(hist_row["opbc/dist/log_ratio"]["values"], counts)
    np.testing.assert_allclose(hist_row["opbc/dist/log_ratio"]["bins"], edges, rtol=1e-12)
    assert sum(hist_row["opbc/dist/seq_log_ratio"]["values"]) == len(seqs)


def test_only_rank_zero_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RANK", "1")
    hist = DistributionHistograms(bins=8)
    logger = OPBCWandbLogger(distributions=hist, mode="offline", dir=str(tmp_path))
    logger.update(make_batch(seed=1))
    logger.log({"opbc/is/ess": 0.5}, step=0)
    logger.finish()
    assert logger.run is None
    assert not (tmp_path / "wandb").exists()
    assert float(hist.token_counts.sum()) == 0.0  # the window was consumed (and reset) all the same


# -- Histograms: bin limit, reference, no host sync, chunking ------------------------------------
def test_histograms_respect_wandbs_bin_limit():
    assert MAX_HISTOGRAM_BINS == wandb.Histogram.MAX_LENGTH == 512
    with pytest.raises(ValueError, match="512"):
        DistributionHistograms(bins=513)
    with pytest.raises(ValueError, match="512"):
        batch_histograms(make_batch(), bins=1000)
    heights, edges = vector_histogram(np.arange(1500.0))
    assert len(heights) <= 512 and len(edges) == len(heights) + 1
    assert heights.sum() * 3 == pytest.approx(np.arange(1500.0).sum())  # means over runs of 3
    wandb.Histogram(np_histogram=(heights, edges))  # accepted by wandb itself
    with pytest.raises(ValueError, match="log_ratio_range"):
        DistributionHistograms(log_ratio_range=0.0)
    with pytest.raises(ValueError, match="num_layers"):
        DistributionHistograms(num_layers=0)


@pytest.mark.filterwarnings("ignore:The ``compute`` method of metric DistributionHistograms")
def test_distribution_histograms_reference_chunking_and_no_host_sync():
    batches = [expert_batch(s) for s in range(3)]
    one = DistributionHistograms(bins=20, num_layers=LAYERS)
    chunked = DistributionHistograms(bins=20, num_layers=LAYERS)
    with assert_no_host_sync():
        for b in batches:
            chunked.update(b)
    one.update(concat_batches(batches))
    tokens, seqs = np_valid_log_ratios(batches)
    for metric in (one, chunked):
        out = metric.histograms()
        np.testing.assert_allclose(out["opbc/dist/log_ratio"][0], np_hist(tokens, 20, 1.0))
        np.testing.assert_allclose(out["opbc/dist/seq_log_ratio"][0], np_hist(seqs, 20, 10.0))
        np.testing.assert_allclose(out["moe/dist/layer_flip_rate"][0], np_layer_flip_rate(batches), rtol=1e-12)
    bad = dict(batches[0], trainer_experts=batches[0]["trainer_experts"][:, :, :2])
    with pytest.raises(ValueError, match="`trainer_experts`"):
        DistributionHistograms(num_layers=LAYERS).update(bad)
    empty = DistributionHistograms(bins=4, num_layers=LAYERS)
    assert empty.histograms(skip_empty=True) == {}
    assert all(not v.any() for v in empty.compute().values())


def test_summaries_follow_the_worst_case_direction():
    directions = {"a/b/good": True, "a/b/bad": False, "a/b/neutral": None, "rollout/reward/mean": True}
    got = summaries_for([*directions, "a/b/unknown", "a/b/good_epoch", "pre/a/b/bad"], directions,
                        overrides={"a/b/bad": "max,mean"})
    assert got == {
        "a/b/good": "min,last",
        "a/b/bad": "max,mean",
        "a/b/neutral": "last",
        "rollout/reward/mean": "max,last",  # the objective keeps its best
        "a/b/unknown": "last",
        "a/b/good_epoch": "min,last",
        "pre/a/b/bad": "max,last",  # a collection prefix
    }


@pytest.mark.filterwarnings("ignore:The ``compute`` method of metric DistributionHistograms")
@given(
    sizes=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 9)), min_size=1, max_size=4),
    seed=st.integers(0, 10_000),
    drift=st.floats(0.01, 3.0),
)
def test_distribution_histograms_properties(sizes, seed, drift):
    batches = [make_batch(batch=b, seq=t, seed=seed + i, drift=drift, dtype=torch.float64, empty_rows=i % 2)
               for i, (b, t) in enumerate(sizes)]
    chunked, one, permuted = (DistributionHistograms(bins=24, log_ratio_range=0.7) for _ in range(3))
    for b in batches:
        chunked.update(b)
    whole = concat_batches(batches)
    one.update(whole)
    perm = torch.randperm(whole["trainer_logprobs"].shape[0], generator=torch.Generator().manual_seed(seed))
    permuted.update({k: v[perm] for k, v in whole.items()})
    a, b, c = chunked.compute(), one.compute(), permuted.compute()
    for key in a:
        assert torch.equal(a[key], b[key]) and torch.equal(a[key], c[key])
    valid_tokens = sum(int(x["response_mask"].sum()) for x in batches)
    valid_seqs = sum(int((x["response_mask"].sum(1) > 0).sum()) for x in batches)
    assert float(a["opbc/dist/log_ratio"].sum()) == valid_tokens  # nothing dropped: end bins are open
    assert float(a["opbc/dist/seq_log_ratio"].sum()) == valid_seqs
    restored = DistributionHistograms(bins=24, log_ratio_range=0.7)
    restored.load_state_dict(chunked.state_dict())
    assert torch.equal(restored.compute()["opbc/dist/log_ratio"], a["opbc/dist/log_ratio"])


# -- Two processes: every rank calls log(), rank 0 writes the global values ----------------------
SHARDS = [[dict(seed=21), dict(seed=22, batch=3)], [dict(seed=23, flip_p=0.6)]]


def _wandb_worker(rank: int, world_size: int, root: str) -> bool:
    os.environ["RANK"] = str(rank)
    metrics = OPBCCollection()
    logger = OPBCWandbLogger(collection=metrics, distributions=DistributionHistograms(bins=16, num_layers=LAYERS),
                             num_layers=LAYERS, mode="offline", dir=root, log_glossary=False)
    for spec in SHARDS[rank]:
        b = expert_batch(**spec)
        metrics.update(b)
        logger.update(b)
    logger.log(metrics.compute(), step=1)
    wrote = logger.run is not None
    logger.finish()
    return wrote


def test_ddp_rank_zero_writes_global_values(tmp_path: Path):
    assert run_distributed(_wandb_worker, world_size=2, args=(str(tmp_path),)) == [True, False]
    everything = [expert_batch(**spec) for shard in SHARDS for spec in shard]
    row = next(r for r in read_offline_run(tmp_path)["history"] if "opbc/is/ess" in r)
    assert_logged(row, collection_values(everything))
    tokens, _ = np_valid_log_ratios(everything)
    np.testing.assert_allclose(row["opbc/dist/log_ratio"]["values"], np_hist(tokens, 16, 1.0))
    np.testing.assert_allclose(row["moe/dist/layer_flip_rate"]["values"], np_layer_flip_rate(everything), rtol=1e-9)


# -- The dashboard of a full run: one key per quantity -------------------------------------------
def full_window_batch(seed: int) -> dict[str, Any]:
    """Every field the demo's collection reads: logprobs, experts, groups, lags, rewards, lengths, stop reasons
    and the controller's decisions; single-turn responses, one prompt length (as in the demo)."""
    from opbc_metrics.functional.rollout import discard_reasons

    b = expert_batch(seed, batch=8, seq=10)
    g = torch.Generator().manual_seed(seed)
    b["group_ids"] = torch.arange(8) // 4 + 10 * seed
    b["policy_lag"] = torch.randint(0, 6, (8,), generator=g)
    rewards = torch.rand(8, generator=g, dtype=torch.float64).round(decimals=1)
    lengths = b["response_mask"].sum(1)
    return {
        **b,
        "rewards": rewards,
        "advantages": (rewards - rewards.mean()) / (rewards.std() + 1e-6),
        "prompt_lengths": torch.full_like(lengths, 3),
        "response_lengths": lengths,
        "stop_reasons": ["length" if int(n) == 10 else "stop" for n in lengths],
        "discard_reasons": discard_reasons(rewards, b["group_ids"]),
    }


def test_a_full_run_has_no_two_keys_equal_on_every_step(tmp_path: Path):
    from opbc_metrics.controller import OPBCController, budget_metrics
    from tests.wandb_run import chart_report

    base = OPBCCollection(sections=("mismatch", "moe", "per_round", "rollout"),
                          section_options={"moe": {"num_layers": LAYERS}, "per_round": {"capacity": 2}})
    metrics = OPBCCollection([*base.members(), *budget_metrics(optional=True)])
    controller = OPBCController("truncated_is")
    computed: list[dict[str, Tensor]] = []
    for log_all in (True, False):
        logger = OPBCWandbLogger(collection=metrics, log_all=log_all, mode="offline", dir=str(tmp_path / str(log_all)))
        for step in range(6):
            batch = full_window_batch(step)
            metrics.update({**batch, "opbc_decisions": controller.step(batch)})
            values = metrics.compute()
            computed.append(values)
            logger.log(values, step=step)
            metrics.reset()
        logger.finish()
    everything = chart_report(read_offline_run(tmp_path / "True"))
    report = chart_report(read_offline_run(tmp_path / "False"))
    pairs = {(a, b) for a, b, _ in everything["pairs"]}
    # what compute() returns holds duplicates (the contract); the default dashboard has none
    duplicates = {("opbc/log_ratio/max_abs", "opbc/logprob/abs_diff_max"), ("opbc/kl/k1", "opbc/logprob/diff_mean")}
    assert duplicates <= pairs, pairs
    assert report["pairs"] == []
    assert report["scalar_charts"] < everything["scalar_charts"] and report["tables"] == 1
    rows = [r for r in read_offline_run(tmp_path / "False")["history"] if "opbc/is/ess" in r]
    for row, values in zip(rows, computed[6:]):
        assert_logged(row, {k: v.item() for k, v in values.items() if v.numel() == 1})
