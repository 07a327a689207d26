"""Importance weights far below 1 (every log-ratio well under 0): the weight moments keep their digits.

The sums of u = w - 1 that keep 1 - ESS exact near on-policy hold no digit of w once u ~ -1 (a sequence
log-ratio of -20 nats is w = 2e-9); the ESS, the second moment, the weight mean / std, the top-1% mass and
the controller's per-group ESS then come from the raw sums of w and w^2. References: NumPy in float64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import opbc_metrics as om
from opbc_metrics import OPBCCollection
from opbc_metrics.controller import Action, OPBCController, Reason

C = 20.0


def _inputs(mu: float, sd: float, dtype: torch.dtype, b: int = 16, t: int = 256, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3 - 4.0  # room for trainer = rollout + r <= 0
    r = (mu + sd * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=3.0)
    return (rollout + r).to(dtype), rollout.to(dtype)


def _token_reference(trainer: torch.Tensor, rollout: torch.Tensor) -> dict[str, float]:
    r = (trainer.double() - rollout.double()).numpy().ravel()
    w = np.exp(np.clip(r, -C, C))
    return {
        "opbc/is/ess": w.sum() ** 2 / (w.size * (w**2).sum()),
        "opbc/is/second_moment": (w**2).mean(),
        "opbc/is/weight_mean": w.mean(),
        "opbc/is/weight_std": w.std(),
    }


def _seq_ess_reference(trainer: torch.Tensor, rollout: torch.Tensor) -> float:
    s = (trainer.double() - rollout.double()).sum(1).numpy()
    w = np.exp(np.clip(s, -C, C))
    return w.sum() ** 2 / (w.size * (w**2).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mu", [-6.0, -12.0, -18.0])
def test_token_weight_moments_match_the_reference_when_every_weight_is_small(mu, dtype):
    trainer, rollout = _inputs(mu, 1.0, dtype)
    out = om.host_floats(OPBCCollection(sections=["mismatch"])(trainer_logprobs=trainer, rollout_logprobs=rollout))
    for key, want in _token_reference(trainer, rollout).items():
        assert out[key] == pytest.approx(want, rel=1e-4), key  # before: ESS 1.0 or 0.63 for 0.36, E[w^2] < 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sequence_ess_of_long_drifting_responses(dtype):
    # 2048-token responses with a per-token drift of a few thousandths of a nat: sequence log-ratios of -13 to -20.
    g = torch.Generator().manual_seed(3)
    rollout = -torch.rand(8, 2048, generator=g, dtype=torch.float64) * 2 - 1.0
    drift = torch.linspace(-0.0065, -0.0095, 8, dtype=torch.float64).unsqueeze(1)
    trainer = rollout + drift + 0.05 * torch.randn(8, 2048, generator=g, dtype=torch.float64)
    trainer, rollout = trainer.to(dtype), rollout.to(dtype)
    want = _seq_ess_reference(trainer, rollout)
    assert 0.05 < want < 0.95
    got = om.SequenceESS()
    got.update(trainer_logprobs=trainer, rollout_logprobs=rollout)
    assert float(got.compute()) == pytest.approx(want, rel=1e-6)  # before: 1.0 (float32) or 0.0 (float64)
    assert float(om.functional.sequence_ess(trainer, rollout)) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("log_ratio", [-10.0, -19.0, -25.0])
def test_equal_small_weights_have_ess_one(log_ratio):
    rollout = torch.full((4, 64), -1.0, dtype=torch.float64)
    trainer = rollout + log_ratio / 64  # every token and every sequence the same weight
    out = om.host_floats(OPBCCollection(sections=["mismatch"])(trainer_logprobs=trainer, rollout_logprobs=rollout))
    assert out["opbc/is/ess"] == pytest.approx(1.0, abs=1e-12)
    assert out["opbc/is/seq_ess"] == pytest.approx(1.0, abs=1e-12)  # before: 0.0 at -19 nats
    assert out["opbc/is/second_moment"] == pytest.approx(np.exp(2 * log_ratio / 64), rel=1e-9)


def test_top_mass_of_small_weights_is_a_share_of_their_own_sum():
    trainer, rollout = _inputs(-12.0, 1.0, torch.float32)
    sketch, exact = om.TopGradientMass(), om.TopGradientMass(exact=True)
    for m in (sketch, exact):
        m.update(trainer_logprobs=trainer, rollout_logprobs=rollout)
    assert float(sketch.compute()) == pytest.approx(float(exact.compute()), rel=sketch.error_bound)


def test_controller_replays_a_group_whose_small_weights_are_uneven():
    trainer, rollout = _inputs(-12.0, 1.0, torch.float32, b=8, t=256)
    want = _token_reference(trainer, rollout)["opbc/is/ess"]
    assert want < 0.6  # the replay threshold
    out = OPBCController(track_budget=False).step(
        trainer_logprobs=trainer, rollout_logprobs=rollout, group_ids=torch.zeros(8, dtype=torch.int64)
    )
    (group,) = out.decisions
    assert group.report.ess == pytest.approx(want, rel=1e-4)  # before: 1.0, and `train`
    assert group.action == Action.REPLAY and group.reasons == (Reason.ESS_BELOW_REPLAY,)


@settings(max_examples=25, deadline=None)
@given(shift=st.floats(-15.0, 0.0), seed=st.integers(0, 2**16))
def test_ess_does_not_depend_on_the_scale_of_the_weights(shift, seed):
    # ESS(c w) = ESS(w): a common shift of every log-ratio (inside the clamp) leaves it unchanged.
    trainer, rollout = _inputs(0.0, 0.5, torch.float64, b=4, t=64, seed=seed)
    base = float(om.functional.importance_ess(trainer, rollout))
    shifted = float(om.functional.importance_ess(trainer + shift, rollout))
    assert shifted == pytest.approx(base, rel=1e-9)


@pytest.mark.parametrize("shift", [-0.2, -0.15, -0.08])  # mean weight 0.47, 0.498 (raw sums), 0.53 (centred)
def test_no_jump_where_the_moments_switch_sums(shift):
    # Half the tokens far off-policy (r ~ -10): the sum of u^2 from rc^2 + 2 rc k3 + k3^2 cancelled ~300x in float32.
    g = torch.Generator().manual_seed(5)
    rollout = -torch.rand(32, 2048, generator=g, dtype=torch.float64) * 3 - 12.0
    far = torch.rand(32, 2048, generator=g, dtype=torch.float64) < 0.45
    r = torch.where(far, -10.0, 0.3 * torch.randn(32, 2048, generator=g, dtype=torch.float64)) + shift
    trainer, rollout = (rollout + r).float(), rollout.float()
    out = om.host_floats(OPBCCollection(sections=["mismatch"])(trainer_logprobs=trainer, rollout_logprobs=rollout))
    for key, want in _token_reference(trainer, rollout).items():
        assert out[key] == pytest.approx(want, rel=2e-5), key


def _far_inputs(dtype: torch.dtype):
    """Every token 56-60 nats off (log-ratios ~ N(-58, 1)): weights ~e^-58, their squares below float32's range."""
    return _inputs(-58.0, 1.0, dtype, b=8, t=128)


def _far_reference(trainer: torch.Tensor, rollout: torch.Tensor, clamp: float) -> float:
    w = np.exp(np.clip((trainer.double() - rollout.double()).numpy().ravel(), -clamp, clamp))
    return float(w.sum() ** 2 / (w.size * (w**2).sum()))


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_clamp_above_40_with_float32_logprobs_is_refused(dtype, compiled):
    # C = 60 in float32: w^2 = e^-116 flushes to 0 and the ESS read 1.0 (the on-policy value) for a true ~0.4.
    trainer, rollout = _far_inputs(dtype)
    with pytest.raises(ValueError, match=r"clamp C = 60 nats needs float64 logprobs.*`trainer_logprobs`"):
        OPBCCollection(sections=["mismatch"], clamp=60.0, veto=80.0, compiled=compiled).update(
            trainer_logprobs=trainer, rollout_logprobs=rollout)
    with pytest.raises(ValueError, match="needs float64 logprobs"):
        om.mismatch.ImportanceSamplingESS(clamp=60.0).update(trainer_logprobs=trainer, rollout_logprobs=rollout)
    with pytest.raises(ValueError, match="needs float64 logprobs"):
        om.functional.importance_ess(trainer, rollout, clamp=60.0)
    with pytest.raises(ValueError, match="needs float64 logprobs"):
        OPBCController(om.OPBCPolicy(clamp=60.0, veto=80.0), track_budget=False).step(
            trainer_logprobs=trainer, rollout_logprobs=rollout, group_ids=torch.zeros(8, dtype=torch.int64))
    # at the limit float32 is taken, and its values hold
    trainer, rollout = _inputs(-38.0, 1.0, torch.float32, b=8, t=128)
    out = om.host_floats(OPBCCollection(sections=["mismatch"], clamp=40.0, veto=80.0, compiled=compiled)(
        trainer_logprobs=trainer, rollout_logprobs=rollout))
    assert out["opbc/is/ess"] == pytest.approx(_far_reference(trainer, rollout, 40.0), rel=1e-4)


def test_a_clamp_above_40_with_float64_logprobs_matches_the_reference():
    trainer, rollout = _far_inputs(torch.float64)
    want = _far_reference(trainer, rollout, 60.0)
    assert 0.1 < want < 0.9
    out = om.host_floats(OPBCCollection(sections=["mismatch"], clamp=60.0, veto=80.0)(
        trainer_logprobs=trainer, rollout_logprobs=rollout))
    assert out["opbc/is/ess"] == pytest.approx(want, rel=1e-9)
    decisions = OPBCController(om.OPBCPolicy(clamp=60.0, veto=80.0), track_budget=False).step(
        trainer_logprobs=trainer, rollout_logprobs=rollout, group_ids=torch.zeros(8, dtype=torch.int64)).decisions
    assert decisions[0].report.ess == pytest.approx(want, rel=1e-9)
