"""MoE router drift against an independent NumPy reference on crafted inputs, the logits path, the wide-expert
bitmask path, properties and bad input (the shared contracts are in test_contracts.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opbc_metrics import OPBCCollection, RouterFlipRate, RouterSetDisagreement
from opbc_metrics import functional as F
from opbc_metrics.batch import BatchView
from opbc_metrics.collection import DEFAULT_SECTIONS
from opbc_metrics.functional import moe as FM
from opbc_metrics.functional.moe import DEFAULT_MOE_LAYERS, flip_rate_keys, layer_key
from opbc_metrics.testing import assert_no_host_sync
from tests.data import concat_batches, make_batch, make_router_batch, metric_values, router_batches
from tests.reference import FLIP, SET, WORST, WORST_RATE, router_reference


def _numpy(batch):
    return batch["rollout_experts"].numpy(), batch["trainer_experts"].numpy(), batch["response_mask"].numpy()


def _numpy_free(batch):
    return batch["rollout_experts"], batch["trainer_experts"], batch["response_mask"]


def _router_metrics(num_layers, top_k=None):
    return [RouterFlipRate(num_layers=num_layers, top_k=top_k), RouterSetDisagreement(top_k=top_k)]


def _values(metrics, *batches):
    return {k: v for m in metrics for k, v in metric_values(m, *batches).items()}


def _assert_close(got, want, tol=1e-12):
    assert set(want) <= set(got), set(want) - set(got)
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=tol, abs_tol=tol), (key, got[key], value)


# --- reference comparisons --------------------------------------------------------------------------
@pytest.mark.parametrize("layers,num_layers", [(3, 3), (3, 8), (66, None)])  # 66 > the default capacity: pooled
@pytest.mark.parametrize("k", [1, 2, 4])
def test_matches_reference(layers, num_layers, k):
    batches = [make_router_batch(batch=2, seq=5, layers=layers, k=k, seed=s, swap=0.3, replace=0.2 + 0.1 * s)
               for s in range(3)]
    got = _values(_router_metrics(num_layers), *batches)
    capacity = num_layers or DEFAULT_MOE_LAYERS
    want = router_reference(*_numpy(concat_batches(batches)), num_layers=capacity)
    assert want[FLIP] > 0 and want[SET] > 0
    _assert_close(got, want)
    # keys of the layers that saw data only: none for configured layers the batches lack (3 of 8)
    seen = {layer_key(i) for i in range(min(layers, capacity))}
    overflow = {"moe/router/layer_overflow/flip_rate"} if layers > capacity else set()
    assert set(got) == {FLIP, WORST, WORST_RATE, SET, *seen, *overflow}


def test_per_layer_keys_only_for_layers_that_exist():
    b = make_router_batch(layers=48, k=2, seed=2)
    default = RouterFlipRate()  # capacity 64, not configured: the 48 observed layers
    default.update(b)
    layers = [k for k in default.compute_dict() if k.startswith("moe/router/layer_")]
    assert layers == [f"moe/router/layer_{i}/flip_rate" for i in range(48)]  # nothing overflowed
    configured = RouterFlipRate(num_layers=50)  # layers 48, 49 saw no token: no keys (not a made-up 0)
    configured.update(b)
    assert [k for k in configured.compute_dict() if k.startswith("moe/router/layer_")] == layers
    small = RouterFlipRate(num_layers=40)  # the model has more layers than configured: an error, not a pool
    with pytest.raises(ValueError, match=r"L = 48 .*num_layers = 40"):
        small.update(b)


def test_layer_keys_decided_on_the_window_counts():
    """A layer's key is there once any batch of the window gave it a valid token, and gone after a reset."""
    m = RouterFlipRate(num_layers=8)
    m.update(make_router_batch(layers=3, seed=3))
    assert sorted(k for k in m.compute_dict() if k.startswith("moe/router/layer_")) == [layer_key(i) for i in range(3)]
    m.update(make_router_batch(layers=5, seed=4))
    assert sorted(k for k in m.compute_dict() if k.startswith("moe/router/layer_")) == [layer_key(i) for i in range(5)]
    out = F.router_flip_rate(*_numpy_free(make_router_batch(layers=2, seed=5)), num_layers=8)
    assert sorted(k for k in out if k.startswith("moe/router/layer_")) == [layer_key(0), layer_key(1)]
    with pytest.raises(ValueError, match="num_layers"):
        F.router_flip_rate(*_numpy_free(make_router_batch(layers=3, seed=5)), num_layers=2)


def test_repeated_ids_in_a_row_count_once():
    r = torch.tensor([[[[1, 1, 2]], [[3, 4, 5]]]])  # B=1, T=2, L=1, K=3
    t = torch.tensor([[[[2, 1, 2]], [[3, 4, 4]]]])  # token 0: {1, 2} both sides; token 1: {3, 4, 5} vs {3, 4}
    want = router_reference(r.numpy(), t.numpy())[SET]
    assert want == 0.5
    assert F.router_topk_disagreement_rate(r, t).item() == want


def test_overflow_layers_pool_and_can_be_the_worst():
    b = make_router_batch(batch=2, seq=4, layers=DEFAULT_MOE_LAYERS + 2, k=2, seed=1, swap=0.0, replace=0.0)
    b["trainer_experts"][:, :, -1, 0] += 100  # every valid token flips in the last layer, pooled with layer 64
    got = _values(_router_metrics(None), b)  # the default capacity pools the layers >= 64
    want = router_reference(*_numpy(b), num_layers=DEFAULT_MOE_LAYERS)
    _assert_close(got, want)
    assert got[WORST] == DEFAULT_MOE_LAYERS and got["moe/router/layer_overflow/flip_rate"] == 0.5


def test_worst_layer_is_the_first_on_ties_and_minus_one_when_empty():
    b = make_router_batch(layers=3, k=2, seed=2, swap=0.0, replace=0.0)
    b["trainer_experts"][:, :, 1, 0] += 100
    b["trainer_experts"][:, :, 2, 0] += 100
    assert _values([RouterFlipRate(num_layers=3)], b)[WORST] == 1.0
    empty = dict(b, response_mask=torch.zeros_like(b["response_mask"]))
    assert _values(_router_metrics(3), empty) == {}  # no valid (token, layer) pair: no keys


def test_router_logits_are_read_through_top_k():
    rng = np.random.default_rng(5)
    b, t, layers, experts, k = 3, 7, 4, 8, 2
    r_logits = rng.normal(size=(b, t, layers, experts)).astype(np.float32)
    t_logits = (r_logits + rng.normal(scale=0.3, size=r_logits.shape)).astype(np.float32)
    mask = (rng.random((b, t)) < 0.7).astype(np.int64)
    ref_r = np.argsort(-r_logits, axis=-1)[..., :k]
    ref_t = np.argsort(-t_logits, axis=-1)[..., :k]
    want = router_reference(ref_r, ref_t, mask, num_layers=layers)
    assert want[FLIP] > 0 and want[SET] > 0
    logits = {
        "rollout_router_logits": torch.from_numpy(r_logits),
        "trainer_router_logits": torch.from_numpy(t_logits),
        "response_mask": torch.from_numpy(mask),
    }
    _assert_close(_values(_router_metrics(layers, top_k=k), logits), want)
    # Mixed: replayed rollout ids against trainer logits.
    mixed = {"rollout_experts": torch.from_numpy(ref_r), "trainer_router_logits": logits["trainer_router_logits"],
             "response_mask": logits["response_mask"]}
    _assert_close(_values(_router_metrics(layers, top_k=k), mixed), want)
    # Functional: integer tensors are expert ids, floating ones router logits.
    out = F.router_flip_rate(logits["rollout_router_logits"], torch.from_numpy(ref_t), logits["response_mask"], top_k=k)
    _assert_close({key: v.item() for key, v in out.items()}, {key: v for key, v in want.items() if key != SET})
    assert F.router_topk_disagreement_rate(
        logits["rollout_router_logits"], logits["trainer_router_logits"], logits["response_mask"], top_k=k
    ).item() == pytest.approx(want[SET], abs=1e-15)
    assert torch.equal(F.router_topk(logits["rollout_router_logits"], k), torch.from_numpy(ref_r))


def test_top_k_cuts_expert_ids_to_the_highest_weights():
    b = make_router_batch(layers=3, k=4, seed=3, swap=0.0, replace=0.4)
    cut = {key: (v[..., :2] if key.endswith("experts") else v) for key, v in b.items()}
    want = router_reference(*_numpy(cut), num_layers=3)
    _assert_close(_values([RouterSetDisagreement(top_k=2), RouterFlipRate(num_layers=3, top_k=2)], b), want)
    assert want[SET] != router_reference(*_numpy(b))[SET]


def test_functional_equals_class_after_one_update():
    b = make_router_batch(layers=5, k=3, seed=4)
    args = (b["rollout_experts"], b["trainer_experts"], b["response_mask"])
    got = _values(_router_metrics(5), b)
    func = F.router_flip_rate(*args)  # num_layers defaults to L
    assert set(func) == set(flip_rate_keys(5)) - {"moe/router/layer_overflow/flip_rate"}
    for key, v in func.items():
        assert v.item() == got[key], key
    assert F.router_topk_disagreement_rate(*args).item() == got[SET]
    assert set(F.router_flip_rate(*args, num_layers=7)) == set(func)  # layers 5, 6 saw nothing: no keys


def test_public_token_helpers():
    b = make_router_batch(batch=3, seq=5, layers=4, k=3, seed=6, swap=0.4, replace=0.3)
    r, t = b["rollout_experts"], b["trainer_experts"]
    flips = F.router_top1_flips(r, t)
    sets = F.router_set_disagreement(r, t)
    assert flips.shape == (3, 5, 4) and flips.dtype == torch.bool
    assert sets.shape == (3, 5) and sets.dtype == torch.bool
    rn, tn = r.numpy(), t.numpy()
    for i in range(3):
        for j in range(5):
            any_set = False
            for layer in range(4):
                assert flips[i, j, layer].item() == (rn[i, j, layer, 0] != tn[i, j, layer, 0])
                any_set |= set(rn[i, j, layer]) != set(tn[i, j, layer])
            assert sets[i, j].item() == any_set
    with assert_no_host_sync():
        F.router_top1_flips(r, t)
        F.router_set_disagreement(r, t)


# --- collection ------------------------------------------------------------------------------------
def test_default_collection_includes_router_members_with_optional_inputs():
    # skipping batches without expert ids: tests/test_contracts.py; here the default layer count
    assert "moe" in DEFAULT_SECTIONS
    logprobs_only = make_batch(seed=1)
    router = make_router_batch(batch=6, seq=20, layers=5, seed=7)
    both = dict(logprobs_only, rollout_experts=router["rollout_experts"], trainer_experts=router["trainer_experts"])
    metrics = OPBCCollection()
    metrics.update(both)
    metrics.update(logprobs_only)
    want = router_reference(router["rollout_experts"].numpy(), router["trainer_experts"].numpy(),
                            logprobs_only["response_mask"].numpy(), num_layers=DEFAULT_MOE_LAYERS)
    _assert_close({k: v.item() for k, v in metrics.compute().items()}, want)


def test_custom_collection_with_logits_member():
    rng = np.random.default_rng(8)
    logits = torch.from_numpy(rng.normal(size=(2, 6, 3, 5)))
    batch = {"rollout_router_logits": logits, "trainer_router_logits": logits.flip(-1)}
    metrics = OPBCCollection([RouterFlipRate(num_layers=3, top_k=2), RouterSetDisagreement(top_k=2)])
    metrics.update(batch)
    want = router_reference(torch.topk(logits, 2).indices.numpy(), torch.topk(logits.flip(-1), 2).indices.numpy())
    _assert_close({k: v.item() for k, v in metrics.compute().items()}, want)
    assert RouterFlipRate(top_k=2).accepts(BatchView(rollout_experts=1, trainer_router_logits=2))
    assert not RouterFlipRate().accepts(BatchView(trainer_logprobs=1))  # a dense model's batch: skipped


def test_collection_raises_on_a_partial_routing_batch():
    """A batch with some routing fields is never skipped silently: one side missing, or router logits without
    ``top_k``, raise naming the field or the option (as the standalone metric does)."""
    lp = make_batch(batch=2, seq=4, seed=1)
    ids = make_router_batch(batch=2, seq=4, layers=3, seed=1)
    logits = {"rollout_router_logits": torch.randn(2, 4, 3, 5), "trainer_router_logits": torch.randn(2, 4, 3, 5)}
    for batch, match in [
        (dict(lp, rollout_experts=ids["rollout_experts"]), "trainer_experts"),
        (dict(lp, trainer_experts=ids["trainer_experts"]), "rollout_experts"),
        (dict(lp, **logits), "top_k"),
        (dict(lp, rollout_experts=ids["rollout_experts"], trainer_router_logits=logits["trainer_router_logits"]),
         "top_k"),
    ]:
        with pytest.raises(ValueError, match=match):
            OPBCCollection().update(batch)
    with pytest.raises(ValueError, match="trainer_experts"):
        OPBCCollection([RouterFlipRate(num_layers=3, top_k=2)]).update(rollout_experts=ids["rollout_experts"])


def test_expert_shapes_checked_against_the_logprobs_without_a_mask():
    lp = {k: v for k, v in make_batch(batch=4, seq=8, seed=2).items() if k != "response_mask"}
    ids = make_router_batch(batch=3, seq=6, layers=2, seed=2)
    batch = dict(lp, rollout_experts=ids["rollout_experts"], trainer_experts=ids["trainer_experts"])
    for metric in (OPBCCollection(), RouterFlipRate(), RouterSetDisagreement()):
        with pytest.raises(ValueError, match=r"rollout_experts.*trainer_logprobs"):
            metric.update(batch)


def test_out_of_range_message_names_the_given_num_experts():
    ids = make_router_batch(batch=2, seq=4, layers=2, seed=3)
    bad = ids["rollout_experts"].clone()
    bad[0, 0, 0, 0] = 100
    m = RouterSetDisagreement(num_experts=8)
    m.update(rollout_experts=bad, trainer_experts=ids["trainer_experts"], response_mask=ids["response_mask"])
    with pytest.raises(ValueError, match=r"out of range for num_experts=8") as info:
        m.compute()
    assert "pass the model's number of experts" not in str(info.value)  # it was passed


# --- properties -------------------------------------------------------------------------------------


@given(router_batches())
def test_property_matches_reference_bounded_and_side_symmetric(batch):
    got = _values(_router_metrics(3), batch)
    swapped = dict(batch, rollout_experts=batch["trainer_experts"], trainer_experts=batch["rollout_experts"])
    assert _values(_router_metrics(3), swapped) == got
    same = _values(_router_metrics(3), dict(batch, trainer_experts=batch["rollout_experts"].clone()))
    assert all(v == 0.0 for k, v in same.items() if k != WORST)  # identical routing: zero flips
    assert same.get(WORST) == (0.0 if batch["response_mask"].any() else None)
    if not batch["response_mask"].any():  # no valid token: no keys
        assert got == {}
        return
    _assert_close(got, router_reference(*_numpy(batch), num_layers=3))
    for key, value in got.items():
        if key != WORST:
            assert 0.0 <= value <= 1.0, key
    assert -1.0 <= got[WORST] <= 2.0


@given(router_batches(), st.randoms(use_true_random=False))
def test_permuting_within_top_k_flips_top1_but_keeps_the_set(batch, rnd):
    r = batch["rollout_experts"]
    k = r.shape[-1]
    perms = torch.tensor([rnd.sample(range(k), k) for _ in range(r[..., 0].numel())]).view(*r.shape[:3], k)
    permuted = torch.gather(r, -1, perms)
    got = _values(_router_metrics(3), dict(batch, trainer_experts=permuted))
    if not batch["response_mask"].any():
        assert got == {}
        return
    assert got[SET] == 0.0
    mask = batch["response_mask"].numpy()
    moved = perms[..., 0].numpy() != 0  # distinct ids: top-1 changes iff another position moves first
    want_flip = (moved & mask[..., None]).sum() / (mask.sum() * r.shape[2]) if mask.sum() else 0.0
    assert got[FLIP] == pytest.approx(want_flip, abs=1e-15)
    assert (got[FLIP] > 0) == bool((moved & mask[..., None]).any())


@given(router_batches(max_k=1))
def test_with_k1_set_disagreement_is_any_layer_flip(batch):
    """K = 1: a token's set differs exactly when its one expert differs in some layer (at least as often as the
    per-layer flip rate)."""
    got = _values(_router_metrics(3), batch)
    mask = batch["response_mask"].numpy().astype(bool)
    if not mask.any():
        assert SET not in got
        return
    any_layer = (batch["rollout_experts"][..., 0] != batch["trainer_experts"][..., 0]).any(-1).numpy()
    assert got[SET] == pytest.approx((any_layer & mask).sum() / mask.sum(), abs=1e-15)
    assert got[SET] >= got[FLIP] - 1e-15


# --- contracts --------------------------------------------------------------------------------------
def test_update_never_syncs_host_and_device():
    router = make_router_batch(batch=6, seq=20, layers=3, seed=9)
    full = {**make_batch(seed=9), **router}
    logits = {"rollout_router_logits": torch.randn(2, 5, 3, 6), "trainer_router_logits": torch.randn(2, 5, 3, 6),
              "rollout_experts": None, "trainer_experts": None}
    mixed = {"rollout_experts": router["rollout_experts"][:2, :5],
             "trainer_router_logits": torch.randn(2, 5, 3, 6)}
    for metric, batch in [
        (OPBCCollection(), full),
        (OPBCCollection(), make_batch(seed=9)),
        (RouterFlipRate(num_layers=3, top_k=2), logits),
        (RouterSetDisagreement(top_k=2), mixed),
    ]:
        with assert_no_host_sync():
            metric.update(batch)


def _bad(**changes):
    b = make_router_batch(batch=2, seq=4, layers=3, k=2, seed=0)
    b.update(changes)
    return b


@pytest.mark.parametrize(
    "batch,top_k,field",
    [
        (_bad(rollout_experts=torch.zeros(2, 4, 3, dtype=torch.long)), None, "rollout_experts"),  # rank 3
        (_bad(trainer_experts=torch.zeros(2, 4, 3, 2)), None, "trainer_experts"),  # float ids
        (_bad(trainer_experts=torch.zeros(2, 4, 3, 2, dtype=torch.bool)), None, "trainer_experts"),
        (_bad(trainer_experts=torch.zeros(2, 4, 2, 2, dtype=torch.long)), None, "trainer_experts"),  # L differs
        (_bad(trainer_experts=torch.zeros(2, 5, 3, 2, dtype=torch.long)), None, "trainer_experts"),  # T differs
        (_bad(trainer_experts=torch.zeros(2, 4, 3, 3, dtype=torch.long)), None, "trainer_experts"),  # K differs
        (_bad(rollout_experts=torch.zeros(2, 4, 0, 2, dtype=torch.long)), None, "rollout_experts"),
        (_bad(rollout_experts=[[1, 2]]), None, "rollout_experts"),
        (_bad(response_mask=torch.ones(2, 5)), None, "response_mask"),
        (_bad(response_mask=torch.ones(2, 4, 1)), None, "response_mask"),
        (_bad(trainer_experts=None), None, "trainer_experts"),  # missing
        (_bad(trainer_experts=None, trainer_router_logits=torch.randn(2, 4, 3, 5)), None, "trainer_router_logits"),
        (_bad(trainer_experts=None, trainer_router_logits=torch.ones(2, 4, 3, 5, dtype=torch.long)), 2,
         "trainer_router_logits"),  # logits must be floating point
        (_bad(trainer_experts=None, trainer_router_logits=torch.randn(2, 4, 3)), 2, "trainer_router_logits"),
        (_bad(trainer_experts=None, trainer_router_logits=torch.randn(2, 4, 3, 1)), 2, "trainer_router_logits"),
        (_bad(trainer_experts=None, trainer_router_logits=torch.randn(2, 4, 4, 5)), 2, "trainer_router_logits"),
        (_bad(), 3, "rollout_experts"),  # K = 2 ids < top_k
    ],
)
def test_bad_input_names_the_field(batch, top_k, field):
    for metric in _router_metrics(4, top_k=top_k):
        with pytest.raises(ValueError, match=field):
            metric.update(batch)


def test_bad_helper_and_constructor_arguments():
    r = torch.zeros(2, 3, 4, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="trainer_experts"):
        F.router_top1_flips(r, r[:, :2])
    with pytest.raises(ValueError, match="rollout_experts"):
        F.router_set_disagreement(r.float(), r)
    with pytest.raises(ValueError, match="rollout_experts"):
        F.router_set_disagreement(r[0], r[0])
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_layers"):
            RouterFlipRate(num_layers=bad)
        with pytest.raises(ValueError, match="top_k"):
            RouterSetDisagreement(top_k=bad)


# --- the bitmask path (num_experts known) ------------------------------------------------------------
def _python_set_rate(rollout, trainer, mask):
    return router_reference(rollout.numpy(), trainer.numpy(), mask.numpy())[SET]


def _wide_batch(num_experts, k, seed, b=3, t=40, layers=2):
    """Ids over the whole [0, num_experts), 63/64/127/128 boundaries included; the trainer's rows are
    the rollout's permuted, with a repeated id (same set or one id lost), or with a new id."""
    g = torch.Generator().manual_seed(seed)
    edges = torch.tensor([0, 63, 64, 127, 128, 191, 192, 255, 256, num_experts - 1])
    edges = edges[edges < num_experts]
    rollout = torch.randint(0, num_experts, (b, t, layers, k), generator=g)
    pick = torch.rand(b, t, layers, k, generator=g) < 0.3
    rollout = torch.where(pick, edges[torch.randint(0, len(edges), (b, t, layers, k), generator=g)], rollout)
    trainer = torch.gather(rollout, -1, torch.argsort(torch.rand(b, t, layers, k, generator=g), dim=-1))
    kind = torch.randint(0, 8, (b, t, layers, 1), generator=g)  # 0 and 4..7: only permuted
    col = torch.randint(0, k, (b, t, layers, 1), generator=g)
    repeated = torch.gather(trainer, -1, (col + 1) % k)  # a copy of another column of the row
    fresh = torch.randint(0, num_experts, (b, t, layers, 1), generator=g)
    trainer = trainer.scatter(-1, col, torch.where(kind == 1, repeated, torch.where(kind == 2, fresh,
                                                                                   trainer.gather(-1, col))))
    rollout[..., 0] = torch.where(kind[..., 0] == 3, rollout[..., -1], rollout[..., 0])  # a repeat in the rollout
    mask = torch.rand(b, t, generator=g) < 0.8
    return rollout, trainer, mask


@pytest.mark.parametrize("num_experts", [8, 64, 65, 128, 200, 256, 300])
@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_bitmask_path_matches_python_sets_for_wide_and_repeated_ids(num_experts, k):
    rollout, trainer, mask = _wide_batch(num_experts, k, seed=num_experts * 10 + k)
    want = _python_set_rate(rollout, trainer, mask)
    assert 0.0 < want < 1.0 or k == 1
    got = F.router_topk_disagreement_rate(rollout, trainer, mask, num_experts=num_experts).item()
    assert got == want
    assert F.router_topk_disagreement_rate(rollout, trainer, mask).item() == want  # the K x K path agrees
    metric = RouterSetDisagreement(num_experts=num_experts)
    metric.update(rollout_experts=rollout.int(), trainer_experts=trainer.int(), response_mask=mask)
    assert metric.compute().item() == want


def test_bitmask_path_on_an_empty_batch_reports_no_key():
    metric = RouterSetDisagreement(num_experts=64)
    metric.update(rollout_experts=torch.zeros(0, 3, 2, 2, dtype=torch.long),
                  trainer_experts=torch.zeros(0, 3, 2, 2, dtype=torch.long))
    assert metric.compute_dict() == {}


def test_bitmask_path_in_cpu_chunks_equals_one_pass(monkeypatch):
    rollout, trainer, _ = _wide_batch(128, 8, seed=3, b=5, t=7)
    whole = FM._set_differs_tokens(rollout, trainer, 128)
    monkeypatch.setattr(FM, "_CPU_CHUNK_IDS", 3 * 2 * 8)  # 3 tokens of 2 layers x 8 ids per chunk
    chunked = FM._set_differs_tokens(rollout, trainer, 128)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


def test_bitmask_path_raises_at_compute_on_ids_outside_the_experts():
    rollout, trainer, mask = _wide_batch(64, 2, seed=5)
    for bad in (-1, 64, 2**40):
        r = rollout.clone()
        r[0, 0, 1, 1] = bad
        metric = RouterSetDisagreement(num_experts=64)
        with assert_no_host_sync():
            metric.update(rollout_experts=r, trainer_experts=trainer, response_mask=torch.ones_like(mask))
        with pytest.raises(ValueError, match=r"num_experts=64 \(outside \[0, 64\)\) in 1 valid tokens"):
            metric.compute()
        with pytest.raises(ValueError, match="num_experts"):
            F.router_topk_disagreement_rate(r, trainer, num_experts=64)
        masked = mask.clone()
        masked[0, 0] = False  # a padding token may hold anything
        assert F.router_topk_disagreement_rate(r, trainer, masked, num_experts=64).item() == \
            _python_set_rate(r, trainer, masked)


@given(router_batches(max_k=4), st.integers(0, 200), st.integers(0, 3))
def test_property_bitmask_path_equals_k_by_k_path(batch, offset, extra):
    r, t = batch["rollout_experts"] + offset, batch["trainer_experts"] + offset
    num_experts = int(max(r.max(), t.max())) + 1 + extra
    fast = RouterSetDisagreement(num_experts=num_experts)
    plain = RouterSetDisagreement()
    for m in (fast, plain):
        m.update(rollout_experts=r, trainer_experts=t, response_mask=batch["response_mask"])
    assert fast.compute_dict() == plain.compute_dict()


def test_num_experts_reaches_the_collection_and_is_validated():
    collection = OPBCCollection(sections=("moe",), section_options={"moe": {"num_experts": 128}})
    assert [m.num_experts for m in collection.values() if isinstance(m, RouterSetDisagreement)] == [128]
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="num_experts"):
            RouterSetDisagreement(num_experts=bad)


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_without_num_experts_ids_outside_int16_raise_at_compute(k):
    """Without num_experts the ids of K > 2 are compared as int16: an id outside [0, 2**15) in a valid token
    (2**16 + 3 would alias to 3) makes compute() raise, naming the fields and num_experts. K <= 2 ids compare
    exactly, but a negative one (a -1 placeholder: no expert) raises too (once it read as a disagreement). In a
    padding token it is ignored; with num_experts large enough the same ids compare exactly."""
    rollout, trainer, mask = _wide_batch(300, k, seed=k)
    for bad in (-1, 2**15, 2**16 + int(trainer[0, 0, 1, 0]), -(2**40)):
        r = rollout.clone()
        r[0, 0, 1, 0] = bad
        metric = RouterSetDisagreement()
        with assert_no_host_sync():
            metric.update(rollout_experts=r, trainer_experts=trainer, response_mask=torch.ones_like(mask))
        if bad >= 0 and k <= 2:
            assert metric.compute().item() == _python_set_rate(r, trainer, torch.ones_like(mask))
            assert F.router_topk_disagreement_rate(r, trainer).item() == metric.compute().item()
        else:
            with pytest.raises(ValueError,
                               match=r"rollout_experts.*outside \[0, 32768\) in 1 valid tokens.*num_experts"):
                metric.compute()
            with pytest.raises(ValueError, match="num_experts"):
                F.router_topk_disagreement_rate(r, trainer)
        masked = mask.clone()
        masked[0, 0] = False
        assert F.router_topk_disagreement_rate(r, trainer, masked).item() == _python_set_rate(r, trainer, masked)
        if bad >= 0:
            wide = F.router_topk_disagreement_rate(r, trainer, mask, num_experts=bad + 1).item()
            assert wide == _python_set_rate(r, trainer, mask)
        got = F.router_set_disagreement(r, trainer)  # the per-token function compares any ids exactly
        assert got.tolist() == [[any(set(a) != set(b) for a, b in zip(ra, ta)) for ra, ta in zip(rr, tt)]
                                for rr, tt in zip(r.tolist(), trainer.tolist())]


def test_range_check_holds_for_ids_beyond_int32():
    """The range check reads the int32 halves for negatives only while every valid id fits in int32."""
    rollout = torch.tensor([[[[2**31 + 5, 3, 7]], [[2**40, 1, 2]]]])
    trainer = torch.tensor([[[[3, 2**31 + 5, 7]], [[1, 2, 2**40 + 1]]]])
    differs, outside = FM._set_differs_tokens(rollout, trainer, 2**41)
    assert differs.tolist() == [[False, True]] and outside.tolist() == [[False, False]]
    rollout[0, 1, 0, 0] = -1
    assert FM._set_differs_tokens(rollout, trainer, 2**41)[1].tolist() == [[False, True]]


def test_functional_rates_refuse_a_batch_without_response_tokens():
    """The public functions returned rate 0 (worst layer -1) for an all-zero mask: a made-up on-policy value."""
    from opbc_metrics.functional.moe import router_flip_rate, router_topk_disagreement_rate

    ids = torch.zeros(2, 3, 2, 2, dtype=torch.long)
    for fn in (router_flip_rate, router_topk_disagreement_rate):
        with pytest.raises(ValueError, match="no response token in the batch"):
            fn(ids, ids, torch.zeros(2, 3))
        assert fn(ids, ids, torch.ones(2, 3)) is not None


def _flip_rate_python(rollout, trainer, mask):
    """Top-1 flips over valid (token, layer) pairs, in plain Python."""
    pairs = flips = 0
    for rr, tt, mm in zip(rollout.tolist(), trainer.tolist(), mask.tolist()):
        for ra, ta, m in zip(rr, tt, mm):
            if m:
                pairs += len(ra)
                flips += sum(a[0] != b[0] for a, b in zip(ra, ta))
    return flips / pairs


@pytest.mark.parametrize("side", ["rollout", "trainer"])
@pytest.mark.parametrize("column", [0, 3])
def test_a_negative_expert_id_in_a_valid_token_raises_at_compute(side, column):
    """A -1 placeholder (a token the engine did not route or record) compared as an expert read as a router flip,
    inflating the rate the controller quarantines on. Now compute() (and the public function) raise, naming the
    fields, the count and what to do, wherever the id stands in the top-K; on a masked-out token it is ignored and
    the rate is the rate without that token."""
    rollout, trainer, mask = _wide_batch(64, 4, seed=3)
    ids = {"rollout": rollout.clone(), "trainer": trainer.clone()}
    ids[side][1, 2, 0, column] = -1
    ids[side][0, 5, 1, column] = -(2**40)
    metric = RouterFlipRate()
    with assert_no_host_sync():
        metric.update(rollout_experts=ids["rollout"], trainer_experts=ids["trainer"], response_mask=mask | True)
    with pytest.raises(ValueError, match=r"rollout_experts.*trainer_experts.*negative expert id in 2 valid "
                                         r"tokens.*response_mask"):
        metric.compute()
    with pytest.raises(ValueError, match="negative expert id in 2 valid tokens"):
        F.router_flip_rate(ids["rollout"], ids["trainer"])
    with pytest.raises(ValueError, match=r"outside \[0, 64\)\) in 2 valid tokens"):
        F.router_topk_disagreement_rate(ids["rollout"], ids["trainer"], num_experts=64)
    masked = mask.clone()
    masked[1, 2] = masked[0, 5] = False
    metric = RouterFlipRate()
    metric.update(rollout_experts=ids["rollout"], trainer_experts=ids["trainer"], response_mask=masked)
    want = _flip_rate_python(ids["rollout"], ids["trainer"], masked)
    assert metric.compute()[FM.FLIP_RATE_KEY].item() == pytest.approx(want, abs=1e-15)


@pytest.mark.parametrize("dtypes", [(torch.int64, torch.int64), (torch.int32, torch.int64), (torch.int16, torch.int32)])
def test_the_negative_check_in_chunks_equals_python(monkeypatch, dtypes):
    """The per-token check and the top-1 flips, in CPU chunks of a few tokens (a partial last one), for mixed id
    dtypes, equal a plain-Python pass."""
    monkeypatch.setattr(FM, "_CPU_CHUNK_IDS", 7 * 2 * 3)
    g = torch.Generator().manual_seed(5)
    rollout = torch.randint(-1, 4, (3, 11, 2, 3), generator=g)
    trainer = torch.randint(0, 4, (3, 11, 2, 3), generator=g)
    trainer[0, 0, 1, 2] = -5
    flips, negative = FM.top1_flips_and_negatives(rollout.to(dtypes[0]), trainer.to(dtypes[1]))
    assert flips.tolist() == [[[a[0] != b[0] for a, b in zip(ra, ta)] for ra, ta in zip(rr, tt)]
                              for rr, tt in zip(rollout.tolist(), trainer.tolist())]
    assert negative.tolist() == [[min(min(map(min, ra)), min(map(min, ta))) < 0 for ra, ta in zip(rr, tt)]
                                 for rr, tt in zip(rollout.tolist(), trainer.tolist())]


def test_a_negative_expert_id_in_a_collection_raises_from_the_moe_section():
    """In the default collection the moe section's compute raises; the logprob sections are not touched."""
    batch = dict(make_router_batch(batch=2, seq=5, seed=1))
    batch["rollout_experts"] = batch["rollout_experts"].clone()
    batch["rollout_experts"][0, 0, 0, 0] = -1
    batch["response_mask"] = torch.ones_like(batch["response_mask"])
    metrics = OPBCCollection(sections=["moe"])
    metrics.update(batch)
    with pytest.raises(ValueError, match="negative expert id"):
        metrics.compute()


def _negative_on_one_rank(rank, world, negative):
    from opbc_metrics import RouterFlipRate as Flip

    batch = make_router_batch(batch=3, seq=6, seed=10 + rank)
    rollout = batch["rollout_experts"].clone()
    if negative and rank == 1:
        rollout[0, 0, 2, 0] = -1  # (the first row's first token is always a response token)
    metric = Flip(num_layers=3)
    metric.update(rollout_experts=rollout, trainer_experts=batch["trainer_experts"],
                  response_mask=batch["response_mask"])
    try:
        return float(metric.compute()[FM.FLIP_RATE_KEY]), rollout, batch
    except ValueError as error:
        return str(error), rollout, batch


@pytest.mark.parametrize("negative", [False, True])
def test_negative_expert_id_count_syncs_across_ranks(negative):
    """The count is a synced sum: a -1 on one rank makes compute() raise on every rank; without it the synced rate
    equals the rate on the concatenated data."""
    from tests.ddp import run_distributed

    results = run_distributed(_negative_on_one_rank, world_size=2, args=(negative,), timeout=240)
    if negative:
        assert all(isinstance(v, str) and "negative expert id in 1 valid tokens" in v for v, *_ in results)
        return
    rollout = torch.cat([r for _, r, _ in results])
    trainer = torch.cat([b["trainer_experts"] for *_, b in results])
    mask = torch.cat([b["response_mask"] for *_, b in results])
    want = _flip_rate_python(rollout, trainer, mask)
    assert all(v == pytest.approx(want, abs=1e-15) for v, *_ in results)


def test_the_negative_check_on_an_empty_batch():
    """No token (B or T = 0): empty flips and flags, and the metric has no data (NoDataError, no value)."""
    from opbc_metrics.metric import NoDataError

    for shape in ((0, 4, 2, 3), (2, 0, 2, 3)):
        ids = torch.zeros(shape, dtype=torch.long)
        flips, negative = FM.top1_flips_and_negatives(ids, ids)
        assert flips.shape == shape[:3] and negative.shape == shape[:2]
        metric = RouterFlipRate()
        metric.update(rollout_experts=ids, trainer_experts=ids)
        with pytest.raises(NoDataError):
            metric.compute()


@pytest.mark.parametrize(("k", "num_experts"), [(2, None), (2, 8), (3, None), (3, 8)])
def test_the_set_disagreement_reads_the_flip_rates_negative_flags_in_a_collection(monkeypatch, k, num_experts):
    """In one view the flip rate's per-token negative flags stand for the set disagreement's own minima (one pass
    over the ids fewer): the set path takes no minimum of the ids, and both keys and both errors are those of the
    metrics alone, with negative ids and ids >= num_experts on masked tokens (ignored) and on valid ones (refused)."""
    g = torch.Generator().manual_seed(3)
    rollout = torch.randint(0, 8, (3, 9, 4, k), generator=g)
    trainer = torch.where(torch.rand(3, 9, 4, k, generator=g) < 0.2, torch.randint(0, 8, (3, 9, 4, k), generator=g),
                          rollout)
    mask = torch.rand(3, 9, generator=g) < 0.7
    mask[0, 0] = mask[0, 1] = False
    # outside the set path's bound (K <= 2 without num_experts: no bound, any id >= 0 compares exactly)
    big = 8 if num_experts else 2**15 if k > 2 else None
    rollout[0, 0, 1, 0] = -1  # masked: ignored by both
    trainer[0, 1, 2, k - 1] = 2**15 if big is None else big  # masked
    minima = []
    real_amin = torch.amin

    def counting_amin(x, *args, **kwargs):  # the per-token minima: over [tokens, L * K] rows (ids or int32 halves)
        if x.ndim == 2:
            minima.append(x.shape)
        return real_amin(x, *args, **kwargs)

    def pair():
        return (RouterFlipRate(num_layers=4), RouterSetDisagreement(num_experts=num_experts))

    alone = list(pair())
    for m in alone:
        m.update(rollout_experts=rollout, trainer_experts=trainer, response_mask=mask)
    view = BatchView(rollout_experts=rollout, trainer_experts=trainer, response_mask=mask)
    together = pair()
    together[0].update(view)
    monkeypatch.setattr(torch, "amin", counting_amin)
    with assert_no_host_sync():
        together[1].update(view)
    monkeypatch.setattr(torch, "amin", real_amin)
    assert minima == []
    for a, b in zip(alone, together):
        want, got = a.compute(), b.compute()
        want, got = (x if isinstance(x, dict) else {"v": x} for x in (want, got))
        assert want.keys() == got.keys() and all(torch.equal(want[key], got[key]) for key in want)
    for field, value in (("rollout", -1), ("trainer", -2), ("trainer", big))[: 3 if big else 2]:
        bad_r, bad_t = rollout.clone(), trainer.clone()
        (bad_r if field == "rollout" else bad_t)[1, 3, 0, k - 1] = value
        bad_mask = mask.clone()
        bad_mask[1, 3] = True
        view = BatchView(rollout_experts=bad_r, trainer_experts=bad_t, response_mask=bad_mask)
        flip, sets = pair()
        flip.update(view)
        sets.update(view)
        with pytest.raises(ValueError, match=r"outside|negative"):
            sets.compute()
        alone_set = RouterSetDisagreement(num_experts=num_experts)
        alone_set.update(rollout_experts=bad_r, trainer_experts=bad_t, response_mask=bad_mask)
        assert torch.equal(sets.out_of_range, alone_set.out_of_range)


@given(seed=st.integers(0, 10_000), layers=st.integers(1, 5), chunk=st.sampled_from([4, 10, 1 << 18]),
       repeats=st.booleans())
def test_k2_sets_and_flips_from_one_loop_in_a_collection_equal_the_reference(seed, layers, chunk, repeats):
    """A collection's moe section at K = 2 without num_experts runs one loop over the ids for both metrics (the flip
    rate's own pass is not run) and equals the Python reference, in chunks of a few ids (a partial last one), with
    repeated ids and negative ids on masked tokens."""
    import unittest.mock as mock

    g = torch.Generator().manual_seed(seed)
    rollout = torch.randint(0, 4, (3, 7, layers, 2), generator=g)
    trainer = torch.where(torch.rand(3, 7, layers, 2, generator=g) < 0.3,
                          torch.randint(0, 4, (3, 7, layers, 2), generator=g), rollout)
    if not repeats:  # distinct ids per (token, layer), as a router gives them
        rollout[..., 1] = (rollout[..., 0] + 1 + rollout[..., 1] % 3) % 4
        trainer[..., 1] = torch.where(trainer[..., 1] == trainer[..., 0], (trainer[..., 0] + 1) % 4, trainer[..., 1])
    mask = torch.rand(3, 7, generator=g) < 0.6
    mask[0, 0] = True
    mask[2, 6] = False
    rollout[2, 6, 0, 1] = -1  # masked: ignored
    metrics = OPBCCollection(sections=["moe"])
    with mock.patch.object(FM, "_CPU_CHUNK_IDS", chunk), \
            mock.patch.object(FM, "top1_flips_and_negatives", side_effect=AssertionError("a second pass")):
        metrics.update(rollout_experts=rollout, trainer_experts=trainer, response_mask=mask)
    got = {k: float(v) for k, v in metrics.compute().items()}
    want = router_reference(rollout.numpy(), trainer.numpy(), mask.numpy(), num_layers=DEFAULT_MOE_LAYERS)
    _assert_close(got, want)


def test_k2_loop_flips_equal_the_top1_compare_and_a_valid_negative_still_raises():
    """The loop's flips are the strided top-1 compare's; a negative id on a valid token raises from both metrics."""
    g = torch.Generator().manual_seed(1)
    rollout = torch.randint(0, 6, (2, 9, 3, 2), generator=g)
    trainer = torch.randint(0, 6, (2, 9, 3, 2), generator=g)
    flips = torch.empty(rollout.shape[:3], dtype=torch.bool)
    differs, negative = FM._set_differs_tokens(rollout, trainer, None, flips=flips)
    assert torch.equal(flips, rollout[..., 0] != trainer[..., 0])
    want = [[any(set(a) != set(b) for a, b in zip(ra, tb)) for ra, tb in zip(rr, tt)]
            for rr, tt in zip(rollout.tolist(), trainer.tolist())]
    assert differs.tolist() == want and not negative.any()
    rollout[1, 4, 2, 1] = -1
    metrics = OPBCCollection(sections=["moe"])
    metrics.update(rollout_experts=rollout, trainer_experts=trainer)
    for member in (metrics["moe/router/flip_rate"], metrics["moe/router/topk_disagreement_rate"]):
        with pytest.raises(ValueError, match=r"negative|outside"):
            member.compute()
