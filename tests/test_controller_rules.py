"""OPBC rules and policy: each rule alone and in combination, presets, validation, and the properties
(equal logprobs always train; loosening a threshold never makes an action stricter)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from opbc_metrics.controller import Action, CorrectionMode, OPBCController, OPBCPolicy, Reason, ess_floor
from opbc_metrics.functional import controller as FC
from opbc_metrics.policy import LOOSEN_DOWN, LOOSEN_UP

pytestmark = pytest.mark.filterwarnings("ignore:with clamp C")


# -- A plain-Python statement of DESIGN's rules: an if/elif chain, written apart from the implementation. ---
def reference_rules(s: dict, contract: set[str], p: OPBCPolicy) -> tuple[str, list[str]]:
    lag, flip, ess = s.get("policy_lag"), s.get("router_flip_rate"), s["ess"]
    fired = {  # reason -> whether it holds, in DESIGN's rule order
        "veto": s["veto_fraction"] > p.max_veto_fraction,
        "lag_above_max": lag is not None and lag > p.max_lag,
        "ess_below_min": ess < p.min_ess,
        "router_flip_above_max": flip is not None and flip > p.max_flip,
        "clipped_above_max": s["clipped_fraction"] > p.max_clipped,
        "lag_above_replay": lag is not None and lag > p.replay_lag,
        "ess_below_replay": ess < p.replay_ess,
    }
    reasons = [c for c in FC.CONTRACT_REASONS if c in contract] + [r for r, hold in fired.items() if hold]
    if contract:
        action = "reject"
    elif fired["veto"] or fired["lag_above_max"] or fired["ess_below_min"] or fired["router_flip_above_max"]:
        action = "quarantine"
    elif fired["clipped_above_max"]:
        action = "train_with_correction"
    elif fired["lag_above_replay"] or fired["ess_below_replay"]:
        action = "replay"
    else:
        action = "train"
    return action, reasons


def _decide_stats(stats: list[dict], contracts: list[set[str]], policy: OPBCPolicy) -> list[tuple[str, list[str]]]:
    values = {key: torch.tensor([float("nan") if s.get(key) is None else float(s[key]) for s in stats],
                                dtype=torch.float64)
              for key in ("ess", "veto_fraction", "clipped_fraction", "policy_lag", "router_flip_rate")}
    contract = {c: torch.tensor([c in x for x in contracts], dtype=torch.bool) for c in FC.CONTRACT_REASONS}
    action, reasons = FC.decide(values, contract, torch.ones(len(stats), dtype=torch.bool), policy)  # all present
    return [
        (FC.ACTIONS[a], [FC.REASON_NAMES[j] for j in range(len(FC.REASON_NAMES)) if reasons[i, j]])
        for i, a in enumerate(action.tolist())
    ]


CLEAN = {"ess": 0.95, "veto_fraction": 0.0, "clipped_fraction": 0.0, "policy_lag": 0.0, "router_flip_rate": 0.0}


# -- Each rule in isolation (boundaries included: caps are strict '>', floors strict '<') and combined ---------
@pytest.mark.parametrize(
    "change,contract,action,reasons",
    [
        ({}, set(), "train", []),
        ({}, {"non_finite"}, "reject", ["non_finite"]),
        ({}, {"shape_mismatch"}, "reject", ["shape_mismatch"]),
        ({"veto_fraction": 0.001}, set(), "quarantine", ["veto"]),
        ({"policy_lag": 9}, set(), "quarantine", ["lag_above_max", "lag_above_replay"]),
        ({"policy_lag": 8}, set(), "replay", ["lag_above_replay"]),  # 8 is not > max_lag 8
        ({"policy_lag": 4}, set(), "train", []),  # 4 is not > replay_lag 4
        ({"ess": 0.29}, set(), "quarantine", ["ess_below_min", "ess_below_replay"]),
        ({"ess": 0.30}, set(), "replay", ["ess_below_replay"]),
        ({"ess": 0.60}, set(), "train", []),
        ({"router_flip_rate": 0.16}, set(), "quarantine", ["router_flip_above_max"]),
        ({"router_flip_rate": 0.15}, set(), "train", []),
        ({"clipped_fraction": 0.11}, set(), "train_with_correction", ["clipped_above_max"]),
        ({"clipped_fraction": 0.10}, set(), "train", []),
        ({"policy_lag": None, "router_flip_rate": None}, set(), "train", []),  # not given: never fire
        # Combinations: which rule wins, and every reason is kept. Contract beats everything
        ({"veto_fraction": 0.5, "ess": 0.1, "policy_lag": 20, "clipped_fraction": 0.9}, {"logprobs_misaligned"},
         "reject",
         ["logprobs_misaligned", "veto", "lag_above_max", "ess_below_min", "clipped_above_max", "lag_above_replay",
          "ess_below_replay"]),
        # veto beats clipped and replay
        ({"veto_fraction": 0.05, "clipped_fraction": 0.5, "ess": 0.5}, set(), "quarantine",
         ["veto", "clipped_above_max", "ess_below_replay"]),
        # quarantine (flip) beats train_with_correction
        ({"router_flip_rate": 0.3, "clipped_fraction": 0.5}, set(), "quarantine",
         ["router_flip_above_max", "clipped_above_max"]),
        # train_with_correction beats replay (rule 4 before rule 5)
        ({"clipped_fraction": 0.2, "policy_lag": 6, "ess": 0.4}, set(), "train_with_correction",
         ["clipped_above_max", "lag_above_replay", "ess_below_replay"]),
        # replay by lag and ESS together
        ({"policy_lag": 5, "ess": 0.55}, set(), "replay", ["lag_above_replay", "ess_below_replay"]),
        # several contract failures, all reported, in rule order
        ({}, {"token_ids_mismatch", "logprobs_missing", "non_finite"}, "reject",
         ["logprobs_missing", "non_finite", "token_ids_mismatch"]),
    ],
)
def test_each_rule_alone_and_in_combination(change, contract, action, reasons):
    s = {**CLEAN, **change}
    assert _decide_stats([s], [contract], OPBCPolicy()) == [(action, reasons)]
    assert reference_rules(s, contract, OPBCPolicy()) == (action, reasons)


def test_decision_objects_carry_enum_reasons_and_primary_reason():
    t = torch.full((4, 10), -1.0, dtype=torch.float64)
    r = t.clone()
    r[0, 0] = t[0, 0] - 40.0  # vetoed (and clipped) token in group 1
    batch = {"trainer_logprobs": t, "rollout_logprobs": r, "group_ids": torch.tensor([1, 1, 2, 2]),
             "policy_lag": torch.tensor([0, 0, 6, 6])}
    d = {x.group_id: x for x in OPBCController(track_budget=False).step(batch).decisions}
    assert d[1].action is Action.QUARANTINE and d[1].primary_reason is Reason.VETO
    assert all(isinstance(x, Reason) for x in d[1].reasons)
    assert Reason.VETO.action is Action.QUARANTINE and Reason.NON_FINITE.is_contract
    assert d[2].action is Action.REPLAY and d[2].reasons == (Reason.LAG_ABOVE_REPLAY,)


# -- Policies and presets ---------------------------------------------------------------------------
def test_default_preset_is_design():
    p = OPBCPolicy.preset("default")
    assert p == OPBCPolicy()
    assert (p.clamp, p.veto, p.max_veto_fraction, p.max_lag, p.min_ess, p.max_flip, p.max_clipped, p.replay_lag,
            p.replay_ess) == (20.0, 30.0, 0.0, 8.0, 0.30, 0.15, 0.10, 4.0, 0.60)
    assert p.weight_bounds == (math.exp(-20.0), math.exp(20.0)) and not p.correct_train
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.min_ess = 0.1  # type: ignore[misc]


def test_truncated_is_preset_maps_the_weight_cap_and_keeps_design_thresholds():
    p = OPBCPolicy.preset("truncated_is")
    assert p.weight_cap == 2.0 and p.weight_floor == 0.0 and p.correct_train
    assert p.correction_mode is CorrectionMode.TRUNCATE
    default = OPBCPolicy()
    for name in ("clamp", "veto", "max_veto_fraction", "max_lag", "min_ess", "max_flip", "max_clipped", "replay_lag",
                 "replay_ess"):
        assert getattr(p, name) == getattr(default, name), name
    # The documented reason the cap is not the statistics' clamp: ESS would be floored at 0.64.
    assert ess_floor(math.log(2.0)) == pytest.approx(0.64)
    assert ess_floor(20.0) < 1e-16
    with pytest.warns(UserWarning, match="can never fire"):
        OPBCPolicy(clamp=math.log(2.0), veto=30.0)


def test_masked_is_preset_and_overrides():
    p = OPBCPolicy.preset("masked_is", max_lag=16)
    assert p.correction_mode is CorrectionMode.MASK and p.weight_bounds == (0.5, 2.0) and p.max_lag == 16
    assert set(OPBCPolicy.preset_names()) == {"default", "truncated_is", "masked_is"}
    with pytest.raises(ValueError, match="unknown OPBC preset"):
        OPBCPolicy.preset("aggressive")
    with pytest.raises(ValueError, match="replay_lag"):
        OPBCPolicy.preset("default", max_lag=2)


@pytest.mark.parametrize("name", ["default", "truncated_is", "masked_is"])
def test_policy_json_round_trip(name):
    p = OPBCPolicy.preset(name)
    assert OPBCPolicy.from_json(p.to_json()) == p
    q = p.replace(max_lag=math.inf, replay_lag=6.0, veto=math.inf)
    assert OPBCPolicy.from_json(q.to_json()) == q and '"inf"' in q.to_json()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"min_ess": -0.1}, "`min_ess` must be non-negative"),
        ({"max_lag": -1}, "`max_lag` must be non-negative"),
        ({"replay_lag": -1}, "`replay_lag` must be non-negative"),
        ({"max_clipped": -0.01}, "`max_clipped` must be non-negative"),
        ({"max_flip": -0.5}, "`max_flip` must be non-negative"),
        ({"max_veto_fraction": -1}, "`max_veto_fraction` must be non-negative"),
        ({"alignment_gap": -1}, "`alignment_gap` must be non-negative"),
        ({"veto": -30}, "`veto` must be non-negative"),
        ({"clamp": -1}, "`clamp` must be non-negative"),
        ({"clamp": 0}, "`clamp` must be a positive finite"),
        ({"clamp": math.inf}, "`clamp` must be a positive finite"),
        ({"min_ess": math.nan}, "`min_ess` must not be NaN"),
        ({"min_ess": 0.5, "replay_ess": 0.4}, "`replay_ess` \\(0.4\\) must be >= `min_ess` \\(0.5\\)"),
        ({"replay_lag": 10}, "`replay_lag` \\(10.0\\) must be <= `max_lag` \\(8.0\\)"),
        ({"max_clipped": 1.5}, "`max_clipped` is a fraction"),
        ({"replay_ess": 2.0}, "`replay_ess` is a fraction"),
        ({"veto": 10.0}, "`veto` \\(10.0\\) must be >= `clamp` \\(20.0\\)"),
        ({"veto": 0}, "`veto` must be positive"),
        ({"weight_cap": 1.0}, "`weight_cap` must be > 1"),
        ({"weight_floor": 1.0}, "`weight_floor` must be in \\[0, 1\\)"),
        ({"weight_floor": -0.5}, "`weight_floor` must be non-negative"),
        ({"correction_level": "segment"}, "`correction_level` must be one of"),
        ({"correction_mode": "clip"}, "`correction_mode` must be one of"),
        ({"max_lag": True}, "`max_lag` must be a number"),
        ({"min_ess": "0.3"}, "`min_ess` must be a number"),
        ({"correct_train": 1}, "`correct_train` must be a bool"),
    ],
)
def test_invalid_policies_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OPBCPolicy(**kwargs)


def test_from_dict_rejects_unknown_fields_and_controller_rejects_bad_policy():
    with pytest.raises(ValueError, match="unknown OPBC policy fields"):
        OPBCPolicy.from_dict({"min_ess": 0.2, "max_ess": 0.9})
    with pytest.raises(TypeError, match="policy"):
        OPBCController(policy=0.3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown OPBC preset"):
        OPBCController("nope")


# -- Properties -------------------------------------------------------------------------------------
@st.composite
def policies(draw):
    min_ess = draw(st.floats(0.0, 1.0))
    max_lag = draw(st.floats(0.0, 12.0))
    clamp = draw(st.sampled_from([0.5, 2.0, 5.0, 20.0]))
    level = draw(st.sampled_from(["token", "sequence", "geometric"]))
    mode = draw(st.sampled_from(["truncate", "mask"]))
    bounds = draw(st.sampled_from([(None, None), (2.0, 0.0), (2.0, 0.5), (5.0, 0.1)]))
    return OPBCPolicy(
        clamp=clamp,
        veto=draw(st.floats(clamp, 3 * clamp)),
        max_veto_fraction=draw(st.sampled_from([0.0, draw(st.floats(0.0, 1.0))])),
        max_lag=max_lag,
        min_ess=min_ess,
        max_flip=draw(st.floats(0.0, 1.0)),
        max_clipped=draw(st.floats(0.0, 1.0)),
        replay_lag=draw(st.floats(0.0, max_lag)),
        replay_ess=draw(st.floats(min_ess, 1.0)),
        alignment_gap=draw(st.floats(0.0, 3.0)),
        correction_level=level,
        correction_mode=mode,
        weight_cap=bounds[0],
        weight_floor=bounds[1],
        correct_train=draw(st.booleans()),
    )


group_stats = st.fixed_dictionaries({
    "ess": st.floats(0.0, 1.0), "veto_fraction": st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    "clipped_fraction": st.floats(0.0, 1.0), "policy_lag": st.one_of(st.none(), st.integers(0, 15)),
    "router_flip_rate": st.one_of(st.none(), st.floats(0.0, 1.0)),
})


@given(policies(), st.lists(st.tuples(group_stats, st.sets(st.sampled_from(FC.CONTRACT_REASONS), max_size=2)),
                            min_size=1, max_size=8))
def test_rules_match_the_plain_python_chain(policy, groups):
    stats, contracts = [g[0] for g in groups], [g[1] for g in groups]
    got = _decide_stats(stats, contracts, policy)
    assert got == [reference_rules(s, c, policy) for s, c in zip(stats, contracts)]


@st.composite
def batches(draw, max_b=8, max_t=6):
    b, t = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    logprob = st.one_of(st.just(0.0), st.floats(-25.0, 0.0, allow_nan=False, width=64))
    trainer = draw(st.lists(logprob, min_size=b * t, max_size=b * t))
    drift = draw(st.lists(st.one_of(st.just(0.0), st.floats(-40.0, 40.0)), min_size=b * t, max_size=b * t))
    mask = draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
    groups = draw(st.lists(st.integers(-3, 3), min_size=b, max_size=b))
    lag = draw(st.lists(st.integers(0, 12), min_size=b, max_size=b))
    experts = torch.tensor(draw(st.lists(st.integers(0, 3), min_size=b * t * 2, max_size=b * t * 2))).view(b, t, 2, 1)
    flip = torch.tensor(draw(st.lists(st.booleans(), min_size=b * t * 2, max_size=b * t * 2))).view(b, t, 2, 1)
    trainer_t = torch.tensor(trainer, dtype=torch.float64).view(b, t)
    return {
        "trainer_logprobs": trainer_t,
        "rollout_logprobs": trainer_t - torch.tensor(drift, dtype=torch.float64).view(b, t),
        "response_mask": torch.tensor(mask).view(b, t),
        "group_ids": torch.tensor(groups),
        "policy_lag": torch.tensor(lag),
        "rollout_experts": experts,
        "trainer_experts": torch.where(flip, (experts + 1) % 4, experts),
    }


@given(batches(), policies())
def test_equal_logprobs_always_train(batch, policy):
    """A group whose rollout logprobs equal its trainer logprobs (same routing, same token ids, lag within
    replay_lag, at least one response token) is trained, uncorrected: weight 1 on every response token."""
    batch = dict(batch, rollout_logprobs=batch["trainer_logprobs"].clone(),
                 trainer_experts=batch["rollout_experts"].clone())
    b, t = batch["trainer_logprobs"].shape
    batch["rollout_token_ids"] = batch["trainer_token_ids"] = torch.arange(b * t).view(b, t)
    batch["policy_lag"] = batch["policy_lag"].clamp(max=int(policy.replay_lag))
    ids, mask = batch["group_ids"], batch["response_mask"]
    has_tokens = {g: bool(mask[ids == g].any()) for g in set(ids.tolist())}
    out = OPBCController(policy, track_budget=False).step(batch)
    for d in out.decisions:
        if has_tokens[d.group_id]:
            assert d.action is Action.TRAIN, (d.reasons, d.report)
            assert d.reasons == ()
        else:
            assert d.action is Action.REJECT and d.reasons == (Reason.NO_RESPONSE_TOKENS,)
    trained_rows = torch.tensor([has_tokens[g] for g in ids.tolist()])
    expected_mask = mask & trained_rows[:, None]
    assert torch.equal(out.loss_mask, expected_mask)
    assert torch.equal(out.weights, expected_mask.to(out.weights.dtype))


def _loosen(policy: OPBCPolicy, name: str, fraction: float) -> OPBCPolicy:
    """Move ``name`` toward its loosest valid value by ``fraction`` of the way."""
    value = getattr(policy, name)
    if name in LOOSEN_DOWN:
        low = policy.min_ess if name == "replay_ess" else 0.0
        # max(): value - (value - low) can round below a tiny low (1.0 - 1e-38 == 1.0 in floats).
        return policy.replace(**{name: max(low, value - fraction * (value - low))})
    high = {"veto": 3 * value + 1, "max_lag": value + 10, "replay_lag": policy.max_lag, "alignment_gap": value + 5}
    return policy.replace(**{name: value + fraction * (high.get(name, 1.0) - value)})


@given(batches(), policies(), st.sampled_from(LOOSEN_UP + LOOSEN_DOWN), st.floats(0.0, 1.0))
def test_loosening_a_threshold_never_makes_an_action_stricter(batch, policy, name, fraction):
    looser = _loosen(policy, name, fraction)
    assume(looser != policy)
    before = OPBCController(policy, track_budget=False).step(batch).decisions
    after = OPBCController(looser, track_budget=False).step(batch).decisions
    for x, y in zip(before, after):
        assert x.group_id == y.group_id
        assert y.action.strictness <= x.action.strictness, (name, x, y)
        assert set(y.reasons) <= set(x.reasons)


def test_actions_and_reason_codes_are_ordered_by_strictness():
    """First match = the strictest action among the rules that hold, because rules are listed in action
    precedence order (each reason's code is >= the previous one's)."""
    order = sorted(Action, key=lambda a: a.strictness)
    assert order == [Action.TRAIN, Action.REPLAY, Action.TRAIN_WITH_CORRECTION, Action.QUARANTINE, Action.REJECT]
    assert [a.trains for a in order] == [True, False, True, False, False]
    codes = [a for _, a in FC.REASONS]
    assert codes == sorted(codes)
    assert [a for a, n in FC._REASON_RUNS for _ in range(n)] == codes
    assert [r.value for r in Reason] == list(FC.REASON_NAMES)
    assert [a.value for a in Action] == list(FC.ACTIONS)


def test_loosening_replay_ess_all_the_way_stays_valid_next_to_a_tiny_min_ess():
    """Regression (found by hypothesis): 1.0 - (1.0 - 1.2e-38) is 0.0 in floats, below min_ess."""
    policy = OPBCPolicy().replace(min_ess=1.175494351e-38, replay_ess=1.0)
    assert _loosen(policy, "replay_ess", 1.0).replay_ess == policy.min_ess
