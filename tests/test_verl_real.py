"""The verl integration against verl itself: real ``DataProto`` batches (and the V1 trainer's jagged
TransferQueue form), values checked against verl's own metric functions on the same batch for every key
both define."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
verl = pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[integrations]')")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # verl warns that the megatron engines are unavailable
    from verl.protocol import DataProto
    from verl.trainer.ppo import metric_utils
    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode, compute_offpolicy_metrics
    from verl.utils.debug.metrics import calculate_debug_metrics
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions, log_seqlen_unbalance

from opbc_metrics import glossary  # noqa: E402
from opbc_metrics.integrations import verl as opbc_verl  # noqa: E402
from opbc_metrics.integrations._common import OPBCIntegrationWarning  # noqa: E402
from tests.support import load_module  # noqa: E402
from tests.verl_data import TIMING_RAW, make_dataproto, v1_transfer_queue_form  # noqa: E402

# verl's key -> the library's key for the same number, where the names differ.
VERL_TO_OPBC = {
    "kl": "opbc/kl/k1", "k3_kl": "opbc/kl/k3", "log_ppl_diff": "opbc/ppl/log_ppl_diff",
    "log_ppl_abs_diff": "opbc/ppl/log_ppl_abs_diff", "ppl_ratio": "opbc/ppl/ratio", "chi2_token": "opbc/kl/chi2_token",
    "chi2_seq": "opbc/kl/chi2_seq", "training/rollout_probs_diff_max": "opbc/prob/abs_diff_max",
    "training/rollout_probs_diff_mean": "opbc/prob/abs_diff_mean",
    "training/rollout_actor_probs_pearson_corr": "opbc/prob/pearson",
    **{verl_key: key for key, verl_key in opbc_verl.VERL_KEY_ALIASES.items()},
}


# verl keys with no OPBC key of the same quantity: its per-sequence perplexity extremes and perplexities, its
# non-aborted response lengths, and two debug statistics of its own
VERL_PPL = {"log_ppl_diff_max", "log_ppl_diff_min", "rollout_log_ppl", "rollout_ppl", "training_log_ppl",
            "training_ppl"}
VERL_NON_ABORTED = {f"response_length_non_aborted/{s}" for s in ("clip_ratio", "max", "mean", "min")}
VERL_DEBUG = {"training/rollout_probs_diff_std", "training/rollout_probs_diff_valid"}


def assert_equal_where_both_define(ours: dict, verls: dict, unpaired: set[str], rel: float = 1e-5,
                                   abs_: float = 1e-6) -> list[str]:
    """Every verl key but ``unpaired`` has its OPBC key (same name or an alias) with the same value: a key the
    integration stops producing, or produces under another name, fails here rather than leaving the comparison."""
    pairs = []
    for verl_key, value in verls.items():
        key = VERL_TO_OPBC.get(verl_key, verl_key)
        if key in ours:
            pairs.append(key)
            assert ours[key] == pytest.approx(float(value), rel=rel, abs=abs_), (verl_key, key, ours[key], value)
    assert {k for k in verls if VERL_TO_OPBC.get(k, k) not in ours} == unpaired, sorted(ours)
    return pairs


@pytest.mark.parametrize("seed", [0, 1])
def test_values_equal_verls_own_metric_functions(seed):
    data = make_dataproto(seed=seed)
    b = data.batch
    m = opbc_verl.VerlMetrics(training=True, max_response_length=b["responses"].shape[-1],
                              max_prompt_length=b["prompts"].shape[-1], n_gpus=8)
    m.observe_logprobs(data)
    m.observe_step(data, TIMING_RAW)
    ours = m.compute()
    verls = {}
    verls.update(metric_utils.compute_data_metrics(batch=data, use_critic=True))
    verls.update(metric_utils.compute_timing_metrics(batch=data, timing_raw=TIMING_RAW))
    verls.update(metric_utils.compute_throughout_metrics(batch=data, timing_raw=TIMING_RAW, n_gpus=8))
    verls.update(calculate_debug_metrics(data))
    verls.update(compute_offpolicy_metrics(b["old_log_probs"], b["rollout_log_probs"], b["response_mask"]))
    pairs = assert_equal_where_both_define(ours, verls, VERL_PPL | VERL_NON_ABORTED | VERL_DEBUG)
    for expected in ("critic/score/mean", "critic/value/mean", "num_turns/mean", "timing_s/start_profile",
                     "timing_per_token_ms/gen", "perf/throughput", "opbc/kl/chi2_seq", "opbc/prob/pearson",
                     "critic/vf_explained_var"):
        assert expected in pairs


@pytest.mark.parametrize("scale", [1.0, 1e-2, 3e-3])
def test_vf_explained_var_equals_verls_with_its_epsilon(scale):
    """verl: 1 - Var(R - V) / (Var(R) + 1e-5); the epsilon dominates once Var(R) is near 1e-5."""
    data = make_dataproto(seed=6)
    b = data.batch
    g = torch.Generator().manual_seed(7)
    b["returns"] = 1.0 + scale * torch.randn(b["returns"].shape, generator=g)
    b["values"] = b["returns"] + 0.5 * scale * torch.randn(b["returns"].shape, generator=g)
    m = opbc_verl.VerlMetrics(training=True)
    m.observe_step(data)
    verls = metric_utils.compute_data_metrics(batch=data, use_critic=True)
    # verl's variances are float32 (the tensors'): agreement to their rounding
    assert m.compute()["critic/vf_explained_var"] == pytest.approx(verls["critic/vf_explained_var"], abs=1e-4)


def test_timing_keys_are_the_stages_verl_timed():
    """A GRPO step (no critic, no reference model): verl's compute_timing_metrics reports the stages of
    timing_raw only; the integration adds none that verl did not time (a 0.0 there would be made up)."""
    data = make_dataproto(seed=2)
    timing_raw = {"gen": 2.0, "adv": 0.1, "update_actor": 1.0, "step": 4.0}
    m = opbc_verl.VerlMetrics(training=True)
    m.observe_step(data, timing_raw)
    ours = {k: v for k, v in m.compute().items() if k.startswith("timing")}
    verls = metric_utils.compute_timing_metrics(batch=data, timing_raw=timing_raw)
    assert ours.keys() == verls.keys()
    assert ours == pytest.approx(verls, rel=1e-6)


def test_global_seqlen_equals_verls_balance_on_the_workload():
    """verl balances on 24576*s + s^2, which re-partitions long sequences differently than their lengths."""
    from opbc_metrics.training import GlobalSeqlen

    differs_from_length_balance = 0
    for seed in range(6):
        rng = np.random.default_rng(seed)
        dp, n = 4, 24
        seqlens = torch.tensor(rng.integers(100, 30000, n))
        parts = get_seqlen_balanced_partitions(calculate_workload(seqlens), k_partitions=dp, equal_size=True)
        verls = log_seqlen_unbalance(seqlen_list=seqlens.tolist(), partitions=parts, prefix="global_seqlen")
        step = {"prompt_length": (seqlens // 4).float(), "response_length": (seqlens - seqlens // 4).float()}
        m = opbc_verl.VerlMetrics(training=True, dp_size=dp)
        m.observe_step(step)
        ours = m.compute()
        pairs = assert_equal_where_both_define(ours, verls, set(), rel=0, abs_=1e-9)
        assert len(pairs) == 6
        by_length = GlobalSeqlen(world_size=dp)
        by_length.update(prompt_lengths=step["prompt_length"], response_lengths=step["response_length"],
                         rank_ids=torch.arange(n) * dp // n)
        plain = by_length.compute()
        differs_from_length_balance += plain["global_seqlen/balanced_max"].item() != verls["global_seqlen/balanced_max"]
    assert differs_from_length_balance  # the workload matters on these batches


def test_verl_value_names_resolve_to_the_glossary_entries():
    for ours, verls in opbc_verl.VERL_KEY_ALIASES.items():
        assert glossary.lookup(verls) is glossary.lookup(ours)


def test_bypass_mode_is_reported_once_and_logs_no_mismatch():
    data = make_dataproto()
    from omegaconf import OmegaConf

    apply_bypass_mode(data, rollout_corr_config=OmegaConf.create({"bypass_mode": True}),
                      policy_loss_config=OmegaConf.create({}))
    assert data.batch["old_log_probs"] is data.batch["rollout_log_probs"] or opbc_verl.is_bypass(data)
    m = opbc_verl.VerlMetrics()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.observe_logprobs(data)
        m.observe_logprobs(data)
        # a copy with equal values (V1's bypass writes old_log_probs through TransferQueue)
        copy = DataProto.from_dict(tensors={**dict(data.batch.items()),
                                            "old_log_probs": data.batch["rollout_log_probs"].clone()})
        m.observe_logprobs(copy)
    ours = [w for w in caught if issubclass(w.category, OPBCIntegrationWarning)]
    assert len(ours) == 1 and "bypass" in str(ours[0].message)
    metrics = {}
    assert m.merge_into(metrics) == {} and metrics == {}


def test_v1_transfer_queue_batch_gives_the_values_of_the_padded_batch():
    data = make_dataproto(seed=3)
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]  # V1 without KL in reward
    v1 = opbc_verl.v1_dataproto(v1_transfer_queue_form(data))
    assert "attention_mask" not in v1.batch.keys()
    a, b = opbc_verl.VerlMetrics(training=True), opbc_verl.VerlMetrics(training=True)
    a.observe_logprobs(data)
    a.observe_step(data, TIMING_RAW)
    b.observe_logprobs(v1)
    b.observe_step(v1, TIMING_RAW)
    want, got = a.compute(), b.compute()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-9), k
    assert "critic/score/mean" in got and "num_turns/max" in got and "opbc/is/ess" in got


def test_with_opbc_picks_the_mixin_for_each_trainer_kind():
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.v1 import PPOTrainerSync

    v1 = opbc_verl.with_opbc(PPOTrainerSync, training=True)
    legacy = opbc_verl.with_opbc(RayPPOTrainer)
    assert issubclass(v1, opbc_verl.OPBCPPOTrainerMixin) and issubclass(v1, PPOTrainerSync)
    assert issubclass(legacy, opbc_verl.OPBCRayPPOTrainerMixin) and issubclass(legacy, RayPPOTrainer)
    assert v1.opbc_options == {"training": True}
    with pytest.raises(TypeError):
        opbc_verl.with_opbc(dict)


def test_legacy_fit_merges_the_step_into_verls_metrics(monkeypatch):
    """RayPPOTrainer.fit is one long loop; the integration reads the logprobs after _compute_old_log_prob and
    merges through verl's own compute_timing_metrics call. Both verl methods are replaced by stand-ins that
    do what fit does around those calls (no Ray cluster here)."""
    from verl.trainer.ppo import ray_trainer

    data = make_dataproto(seed=5)
    old = DataProto.from_dict(tensors={"old_log_probs": data.batch["old_log_probs"]})
    logged = {}

    def fake_old_log_prob(self, batch):
        return old, 0.0

    def fake_fit(self):
        self._compute_old_log_prob(data)
        metrics = {"critic/score/mean": -1.0}
        metrics.update(ray_trainer.compute_timing_metrics(batch=data, timing_raw=dict(TIMING_RAW)))
        logged.update(metrics)

    monkeypatch.setattr(ray_trainer.RayPPOTrainer, "_compute_old_log_prob", fake_old_log_prob)
    monkeypatch.setattr(ray_trainer.RayPPOTrainer, "fit", fake_fit)
    cls = opbc_verl.with_opbc(ray_trainer.RayPPOTrainer, training=True)
    trainer = cls.__new__(cls)
    trainer.config = None
    trainer.fit()
    assert ray_trainer.compute_timing_metrics is metric_utils.compute_timing_metrics  # restored after fit
    assert logged["critic/score/mean"] == -1.0  # verl's key keeps verl's value
    assert "opbc/is/ess" in logged and "critic/value/mean" in logged and "timing_s/gen" in logged
    b = data.batch
    verls = compute_offpolicy_metrics(b["old_log_probs"], b["rollout_log_probs"], b["response_mask"])
    assert_equal_where_both_define(logged, verls, VERL_PPL)


def test_legacy_fit_keeps_verls_global_seqlen_of_the_batch_before_balancing():
    """verl's _balance_batch logs global_seqlen/* of the batch as it arrived, then reorders it; the integration's
    figures (from the reordered final batch) must not overwrite them when fit() merges compute_timing_metrics."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo import ray_trainer

    dp = 4

    def make_batch():
        data = make_dataproto(seed=8)
        att = data.batch["attention_mask"]
        att[: att.shape[0] // 2] = 1  # long sequences first: contiguous chunks are unbalanced
        return data

    class FakeLegacy(ray_trainer.RayPPOTrainer):
        def __init__(self):  # what _balance_batch and the mixin read
            self.config = OmegaConf.create({"algorithm": {}, "actor_rollout_ref": {"actor": {}}})
            self.actor_rollout_wg = None

        def _get_dp_size(self, worker_group, role):
            return dp

        def fit(self):  # the order of RayPPOTrainer.fit's metric calls
            batch, metrics = make_batch(), {}
            self._balance_batch(batch, metrics=metrics)
            metrics.update(ray_trainer.compute_timing_metrics(batch=batch, timing_raw=dict(TIMING_RAW)))
            return metrics

    verls = FakeLegacy().fit()
    logged = opbc_verl.with_opbc(FakeLegacy, training=True, dp_size=dp)().fit()
    keys = [f"global_seqlen/{s}" for s in ("min", "max", "minmax_diff", "balanced_min", "balanced_max", "mean")]
    balanced_spread = verls["global_seqlen/balanced_max"] - verls["global_seqlen/balanced_min"]
    assert verls["global_seqlen/minmax_diff"] > balanced_spread  # an imbalance re-balancing removes
    assert {k: logged[k] for k in keys} == {k: verls[k] for k in keys}
    assert "critic/value/mean" in logged  # the integration's own keys still join


def test_readme_snippet_registers_the_v1_trainer_and_builds_the_legacy_one():
    from verl.trainer.ppo.v1 import get_trainer_cls

    module = load_module("readme_verl")
    v1 = get_trainer_cls("opbc_sync")
    assert issubclass(v1, opbc_verl.OPBCPPOTrainerMixin) and v1.opbc_options == {"training": True}
    assert issubclass(module.OPBCRayPPOTrainer, opbc_verl.OPBCRayPPOTrainerMixin)


def test_aborted_responses_are_left_out_of_scores_and_rewards_as_verl_does():
    data = make_dataproto(seed=4)
    b = data.batch
    width = b["prompts"].shape[1]
    for row in (1, 5):  # two aborted rollouts: empty response, score 0
        b["attention_mask"][row, width:] = 0
        b["response_mask"][row] = 0
        b["token_level_scores"][row] = 0.0
        b["token_level_rewards"][row] = 0.0
    m = opbc_verl.VerlMetrics(training=True, max_response_length=b["responses"].shape[-1])
    m.observe_step(data)
    ours = m.compute()
    verls = metric_utils.compute_data_metrics(batch=data, use_critic=True)
    verls.pop("critic/vf_explained_var")
    # (no max_prompt_length given: no prompt clip ratio)
    pairs = assert_equal_where_both_define(ours, verls, VERL_NON_ABORTED | {"prompt_length/clip_ratio"})
    assert "critic/score/mean" in pairs and "critic/rewards/min" in pairs and "response/aborted_ratio" in pairs


def test_routed_experts_leave_out_the_filler_slot_as_verls_load_metrics_do():
    """verl's router replay (R3) ``routed_experts`` spans prompt and response, with filler (zeros) in each sequence's
    last response slot. ``verl_routed_experts`` gives the response part and a mask without that slot: the per-layer
    expert counts it selects equal verl's own ``_compute_rollout_moe_load_counts`` on the same batch (agent-loop
    masks with holes, a row without response tokens). In a ``moe`` collection against the trainer's routing, the
    filler is no flip."""
    from opbc_metrics import OPBCCollection

    g = torch.Generator().manual_seed(4)
    b, prompt, width, layers, k, experts = 5, 3, 9, 2, 2, 8
    routed = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(b * (prompt + width) * layers)])
    routed = routed.view(b, prompt + width, layers, k)
    mask = (torch.rand(b, width, generator=g) < 0.7).long()
    mask[0, -1] = 1  # a full-length response
    mask[3] = 0  # no response token
    last = [max((j for j in range(width) if mask[i, j]), default=None) for i in range(b)]
    for i, j in enumerate(last):
        if j is not None:
            routed[i, prompt + j] = 0  # verl's filler in the last response slot
    batch = {"routed_experts": routed, "response_mask": mask}
    rollout, moe_mask = opbc_verl.verl_routed_experts(batch)
    want = metric_utils._compute_rollout_moe_load_counts(routed, mask, experts)
    got = torch.stack([torch.bincount(rollout[moe_mask][:, layer].flatten(), minlength=experts)
                       for layer in range(layers)])
    assert torch.equal(got, want)
    assert moe_mask.tolist() == [[bool(mask[i, j]) and j != last[i] for j in range(width)] for i in range(b)]
    # the trainer's top-K: the rollout's on every routed token, its own (not the filler) on the last one
    trainer = rollout.clone()
    for i, j in enumerate(last):
        if j is not None:
            trainer[i, j] = torch.arange(1, k + 1)
    moe = OPBCCollection(sections=["moe"])
    moe.update(rollout_experts=rollout, trainer_experts=trainer, response_mask=moe_mask)
    assert moe.compute()["moe/router/flip_rate"].item() == 0.0
    with pytest.raises(ValueError, match="verl batch has no `routed_experts`"):
        opbc_verl.verl_routed_experts({"response_mask": mask})
    with pytest.raises(ValueError, match=r"`routed_experts` has shape \(5, 4, 2, 2\)"):
        opbc_verl.verl_routed_experts({"routed_experts": routed[:, :4], "response_mask": mask})
