"""The contracts every metric keeps, for every metric class of the case table in ``tests/harness.py``:
the independent reference, no host sync in ``update``, chunked updates equal one update, permutation
invariance, functional equals class, ``forward`` semantics, state round trip and merge, fixed state size,
and DDP on uneven shards (gloo, two ranks) equal to one process on the concatenated data, with a constant
number of collectives per collection. Section test files keep only what is specific to them."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opbc_metrics import OPBCCollection
from opbc_metrics import functional as F
from opbc_metrics.batch import PER_SEQUENCE_FIELDS, UnreadFieldWarning, as_view
from opbc_metrics.collection import DEFAULT_SECTIONS
from opbc_metrics.testing import assert_no_host_sync
from tests.data import concat_batches, make_batch
from tests.ddp import run_distributed
from tests.harness import (
    MEMBERS,
    ONE_COLLECTION,
    SCENARIOS,
    SECTIONS,
    assert_close,
    assert_matches_reference,
    floats,
    missing_reference_keys,
    take,
    units,
)

SECTION_IDS = sorted(SECTIONS)
MEMBER_IDS = [f"{s}-{m}" for s, m in MEMBERS]


def _values(metric) -> dict[str, float]:
    compute = metric.compute_dict if hasattr(metric, "compute_dict") else metric.compute
    return floats(compute())


def _state_numel(metric) -> int:
    return sum(v.numel() for k, v in metric.state_dict().items() if not k.endswith("_extra_state"))


@pytest.fixture(params=MEMBERS, ids=MEMBER_IDS)
def case(request):
    """(section, factory) of one metric class."""
    section_name, name = request.param
    section = SECTIONS[section_name]
    return section, section.members[name]


# --- per metric class -----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [c for c in MEMBERS if SECTIONS[c[0]].reference is not None], indirect=True,
                         ids=lambda c: f"{c[0]}-{c[1]}")
def test_matches_the_independent_reference(case):
    section, make = case
    batches = section.batches()
    got = _values(section.feed(make(), batches))
    want = section.reference(concat_batches(batches))
    assert_matches_reference(section, got, want, where=type(make()).__name__)
    assert not missing_reference_keys(section, set(got), want, set(make().keys))


def test_update_never_syncs_host_and_device(case):
    section, make = case
    metric = make()
    for b in [*section.batches(), section.blank(section.batches()[0])]:
        for x in section.updates(b):
            with assert_no_host_sync():
                metric.update(x)


def test_chunked_updates_equal_one_update(case):
    section, make = case
    batches = section.batches()
    assert_close(_values(section.feed(make(), batches)), _values(section.feed(make(), [concat_batches(batches)])),
                 section)


def test_forward_returns_the_batch_value_and_accumulates(case):
    section, make = case
    a, b, c, _ = section.batches()  # one update each
    metric = make()
    metric.as_dict(metric(*section.updates(a)))
    out_b = floats(metric.as_dict(metric(*section.updates(b))))
    assert_close(out_b, _values(section.feed(make(), [b])), section)
    for x in section.updates(section.blank(c)):  # a batch without data: zero counts at most, the window unchanged
        metric(x)
    assert_close(_values(metric), _values(section.feed(make(), [a, b])), section)


def test_no_data_reports_no_keys(case):
    section, make = case
    name = next(n for n, m in section.members.items() if m is make)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "compute before update" warning either
        for metric in (make(), section.feed(make(), [section.blank(section.batches()[0])])):
            got = _values(metric)
            assert not got or (name in section.counters and not any(got.values())), got


def test_a_missing_field_is_a_clear_error(case):
    section, make = case
    metric = make()
    assert metric.required_fields or section.stepwise  # the per-step metrics take each field when present
    if metric.required_fields:
        with pytest.raises(ValueError, match=f"({'|'.join(f'`{f}`' for f in metric.required_fields)}).* is required"):
            metric.update({"unrelated": 1})


def test_state_round_trip_and_merge_mid_accumulation(case):
    section, make = case
    parts = section.batches()
    straight = _values(section.feed(make(), parts))
    first = section.feed(make(), parts[:2])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = make()
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert_close(_values(section.feed(resumed, parts[2:])), straight, section, where="state_dict")
    merged = section.feed(make(), parts[:2])
    merged.merge_state(section.feed(make(), parts[2:]))
    assert_close(_values(merged), straight, section, where="merge_state")


def test_state_size_is_fixed(case):
    section, make = case
    metric = make()
    batches = section.batches()
    section.feed(metric, batches[:1])
    size = _state_numel(metric)
    for b in [*batches[1:], concat_batches(batches)]:
        section.feed(metric, [b])
        assert _state_numel(metric) == size


# --- per section (every member in one collection) --------------------------------------------------------
@pytest.mark.parametrize("name", [n for n in SECTION_IDS if SECTIONS[n].functional is not None])
def test_functional_equals_class(name):
    section = SECTIONS[name]
    for b in section.batches()[:2]:
        got = {k: v for run in section.runs() for k, v in _values(section.feed(run, [b])).items()}
        func = floats(section.functional(b))
        assert func and set(func) <= set(got), set(func) - set(got)
        assert_close({k: got[k] for k in func}, func, section)


@pytest.mark.parametrize("name", SECTION_IDS)
def test_collection_without_data_reports_no_keys(name):
    """Without data (nothing seen, or a batch without any), no key: only the members that count their input
    (``counters``) report theirs, as zeros. Any other key, even 0, would be a made-up value."""
    section = SECTIONS[name]
    counted = {key for member in section.counters for key in section.members[member]().keys}
    for run in section.runs():
        for got in (_values(run), _values(section.feed(run, [section.blank(section.batches()[0])]))):
            assert set(got) <= counted and not any(got.values()), got


def _with_logprobs(x: dict) -> dict:
    """``x`` with mismatch fields added, one sequence per row of ``x`` (its response mask's shape where it has one)."""
    rows = next((len(x[f]) for f in PER_SEQUENCE_FIELDS if f in x and x[f] is not None), 4)
    rows, seq = x["response_mask"].shape if "response_mask" in x else (rows, 8)
    return {**make_batch(batch=rows, seq=seq, seed=rows, dtype=torch.float64), **x}


# sections none of whose members reads only mismatch fields: with mismatch they skip the batches without their fields
OPTIONAL = [n for n in SECTION_IDS
            if not any(f and set(f) <= set(make_batch())
                       for f in (m().required_fields for m in SECTIONS[n].members.values()))]


@pytest.mark.parametrize("name", OPTIONAL)
def test_collection_with_mismatch_skips_batches_without_the_sections_fields(name):
    section = SECTIONS[name]
    a, b, *_ = section.batches()
    mismatch = [make() for make in SECTIONS["mismatch"].members.values()]
    members = [make() for n, make in section.members.items() if n not in section.alone]
    both, mismatch_alone = OPBCCollection(metrics=[*mismatch, *members]), SECTIONS["mismatch"].collection()
    without = make_batch(seed=3, dtype=torch.float64)
    inputs = [without, *(y for x in (*section.updates(a), *section.updates(b)) for y in (_with_logprobs(x), without))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "compute before update" warning from a member that skipped every batch
        warnings.filterwarnings("ignore", category=UnreadFieldWarning)  # (make_batch's group_ids: no member reads them)
        both.update(without)
        mismatch_keys = set(_values(both))
        assert mismatch_keys and not mismatch_keys & {k for m in members for k in m.keys}
        for x in inputs[1:]:
            both.update(x)
        got = _values(both)
    assert_close({k: got.pop(k) for k in mismatch_keys}, _values(SECTIONS["mismatch"].feed(mismatch_alone, inputs)),
                 SECTIONS["mismatch"])  # the section's fields change no mismatch value
    assert_close(got, _values(section.feed(section.collection(), [a, b])), section)
    if name in DEFAULT_SECTIONS:  # the default collection lists the section's keys, reports them only with data
        default, prefix = OPBCCollection(), f"{name}/"
        default.update(without)
        assert any(k.startswith(prefix) for k in default.keys_produced)
        assert not any(k.startswith(prefix) for k in default.compute())


@pytest.mark.parametrize("name", SECTION_IDS)
def test_collection_update_never_syncs_host_and_device(name):
    section = SECTIONS[name]
    for run in section.runs():
        for x in (x for b in section.batches() for x in section.updates(b)):
            with assert_no_host_sync():
                run.update(x)


def test_collection_compute_decides_which_members_saw_data_in_one_host_read(monkeypatch):
    """compute() reads the host (a sync each on a GPU), but which members saw data, and which of their keys have
    data (key_counts), comes from one read for all members, not one per member: at most 3 reads for the default
    collection (which members have data; the input checks; the per-round rounds), where it took 35. The keys and
    values are those of each member's own compute()."""
    batch = make_batch(batch=6, seq=40, seed=4, dtype=torch.float64)
    batch["trainer_logprobs"][:, 3] = float("nan")  # no valid sequence: chi2_seq has no data, chi2_token has
    alone, metrics = OPBCCollection(), OPBCCollection()
    for c in (alone, metrics):
        c.update(batch)
    want = {k: v for m in alone.members() for k, v in m.compute_dict().items()}
    reads = {"n": 0}
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            reads["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    got = metrics.compute()
    monkeypatch.undo()
    assert 1 <= reads["n"] <= 3
    assert "opbc/kl/chi2_token" in got and "opbc/kl/chi2_seq" not in got and not any(k.startswith("moe/") for k in got)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_collection_values_are_copies_not_the_states():
    """A collection's compute() copies its values all at once (not one clone per value, as torchmetrics does), so
    no value is a state: later updates leave earlier values alone, and changing a value changes no state."""
    batch = make_batch(batch=4, seq=24, seed=5, dtype=torch.float64)
    metrics, twice = OPBCCollection(), OPBCCollection()
    metrics.update(batch)
    out = metrics.compute()
    kept = {k: v.clone() for k, v in out.items()}
    metrics.update(batch)
    assert all(torch.equal(out[k], kept[k]) for k in out)
    for value in out.values():
        value.add_(1.0)
    for _ in range(2):
        twice.update(batch)
    want, got = twice.compute(), metrics.compute()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert "opbc/input/num_tokens" in got and all(v.ndim == 0 for v in got.values())


def test_collection_reset_sets_states_without_module_bookkeeping(monkeypatch):
    """reset() gives every state a new tensor equal to its default, as torchmetrics does, but sets it as a plain
    attribute: nn.Module's __setattr__ (parameter/buffer/module checks, ~3 us a call) is not called for the ~100
    states and the per-metric flags of its members (it was ~190 times per reset of the default collection).
    Non-state attributes still take Module's path."""
    batch = make_batch(batch=4, seq=24, seed=6, dtype=torch.float64)
    metrics = OPBCCollection()
    metrics.update(batch)
    before = {(name, attr): getattr(m, attr) for name, m in metrics.items() for attr in m._defaults}
    calls = {"n": 0}
    original = torch.nn.Module.__setattr__

    def counted(self, name, value):
        calls["n"] += self is not metrics  # (the collection sets one flag of its own)
        return original(self, name, value)

    monkeypatch.setattr(torch.nn.Module, "__setattr__", counted)
    metrics.reset()
    assert calls["n"] == 0
    for (name, attr), old in before.items():
        member = metrics[name]
        new, default = getattr(member, attr), member._defaults[attr]
        if isinstance(default, torch.Tensor):
            assert new is not old and new is not default and torch.equal(new, default), (name, attr)
        else:
            assert new == [], (name, attr)
    member = next(iter(metrics.values()))
    member.extra = torch.nn.Linear(1, 1)  # not a state: a submodule, registered by Module's __setattr__
    assert calls["n"] >= 1 and "extra" in member._modules
    monkeypatch.undo()
    metrics.update(batch)
    fresh = OPBCCollection()
    fresh.update(batch)
    got, want = metrics.compute(), fresh.compute()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_collection_reset_refills_states_with_one_multi_tensor_copy(monkeypatch):
    """The collection's reset() refills every member's states from their defaults with one
    torch._foreach_copy_ (one launch on a GPU, where torchmetrics clones each of ~100 states), into new tensors
    that share storage with nothing; a member that overrides reset() still runs its own."""
    import opbc_metrics.metric as metric_module
    from opbc_metrics import ClippedFraction

    class OwnReset(ClippedFraction):
        resets = 0

        def reset(self):
            type(self).resets += 1
            super().reset()

    batch = make_batch(batch=4, seq=24, seed=6, dtype=torch.float64)
    metrics = OPBCCollection()
    metrics.add_metrics({"own_reset": OwnReset()})
    metrics.update(batch)
    copies = []
    original = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src: (copies.append(len(dst)), original(dst, src)))
    metric_module.reset_states(metrics.members())  # what metrics.reset() calls
    plain = [m for m in metrics.members() if not isinstance(m, OwnReset)]
    assert copies == [sum(len(m._defaults) for m in plain)] and OwnReset.resets == 1
    pointers = set()
    for m in metrics.members():
        assert m._update_count == 0 and m._computed is None and m._cache is None and not m._is_synced
        for name, default in m._defaults.items():
            state = getattr(m, name)
            assert torch.equal(state, default) and state.data_ptr() not in pointers, (type(m).__name__, name)
            assert state.data_ptr() != default.data_ptr()
            pointers.add(state.data_ptr())
    metrics.update(batch)
    fresh = OPBCCollection()
    fresh.add_metrics({"own_reset": OwnReset()})
    fresh.update(batch)
    got, want = metrics.compute(), fresh.compute()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_collection_update_folds_every_members_statistics_in_one_multi_tensor_op_per_reduction(monkeypatch):
    """The collection's update() computes every member's statistics, then folds them into the states with one
    torch._foreach_add_ / _maximum_ / _minimum_ each (one launch each on a GPU, where one add_ per state was ~90),
    with the values a member updated on its own would hold. It records the update as torchmetrics' wrapper does (a
    member's cached compute() is dropped), and a subclass with its own update() or accumulate() still runs it."""
    from opbc_metrics import ClippedFraction, ImportanceSamplingESS

    class OwnUpdate(ClippedFraction):
        updates = 0

        def update(self, batch=None, **fields):
            type(self).updates += 1
            super().update(batch, **fields)

    class OwnAccumulate(ClippedFraction):
        folds = 0

        def accumulate(self, **stats):
            type(self).folds += 1
            super().accumulate(**stats)

    batch = make_batch(batch=4, seq=24, seed=7, dtype=torch.float64)
    metrics = OPBCCollection()
    # (and a member with torchmetrics' compute_on_cpu, which its update wrapper applies after each update)
    # (input_checks off, as the mismatch section's members: InputHealth checks for the collection)
    metrics.add_metrics({"own_update": OwnUpdate(input_checks=False),
                         "own_accumulate": OwnAccumulate(input_checks=False),
                         "on_cpu": ClippedFraction(compute_on_cpu=True, input_checks=False)})
    calls: dict[str, list[int]] = {"_foreach_add_": [], "_foreach_maximum_": [], "_foreach_minimum_": []}

    def counted(op, log):
        return lambda dst, src: (log.append(len(dst)), op(dst, src))

    for name, log in calls.items():
        monkeypatch.setattr(torch, name, counted(getattr(torch, name), log))
    metrics.update(batch)
    assert OwnUpdate.updates == 1 and OwnAccumulate.folds == 1
    # the three members' own accumulates (two sums each) during the loop, then one fold per reduction
    # kind, the sums of every other member in one call (the default collection has states of all three kinds)
    assert [len(v) for v in calls.values()] == [4, 1, 1] and calls["_foreach_add_"][:3] == [2, 2, 2], calls
    assert sum(n for v in calls.values() for n in v[-1:]) > 60, calls  # the batch statistics of ~60 states
    view = as_view(batch)
    active = [m for m in metrics.members() if m.accepts(view)]
    assert len(active) >= 15 and all(m._update_count == 0 for m in metrics.members() if m not in active)
    for m in active:
        alone = m.clone()
        alone.reset()
        alone.update(batch)  # on its own: torchmetrics' update wrapper, its own accumulate
        for name in m._defaults:  # (alone, the kernel computes only the member's own statistics: other rounding)
            got, want = getattr(m, name), getattr(alone, name)
            assert torch.allclose(got, want, rtol=1e-9, atol=1e-12, equal_nan=True), (type(m).__name__, name)
        assert m._update_count == 1, type(m).__name__
    # a member's own compute() caches its value; the next collection update drops the cache
    member = next(m for m in metrics.members() if type(m) is ImportanceSamplingESS)
    before = member.compute()
    metrics.update(make_batch(batch=4, seq=24, seed=8, dtype=torch.float64))
    fresh = ImportanceSamplingESS()
    fresh.update(batch)
    fresh.update(make_batch(batch=4, seq=24, seed=8, dtype=torch.float64))
    assert torch.equal(member.compute(), fresh.compute()) and not torch.equal(member.compute(), before)


def _chunks(section, batch, n_chunks, dim):
    if dim == 1:  # along time: every field of rank >= 2 is cut at the same columns
        cols = torch.arange(batch["response_mask"].shape[1])
        return [{k: v.index_select(1, idx) for k, v in batch.items()} for idx in torch.tensor_split(cols, n_chunks)
                if idx.numel()]
    groups = units(batch, section.unit)
    parts = torch.tensor_split(torch.arange(len(groups)), n_chunks)
    return [take(batch, [i for g in p.tolist() for i in groups[g]]) for p in parts if p.numel()]


@pytest.mark.parametrize("name", SECTION_IDS)
@given(data=st.data(), n_chunks=st.integers(1, 5))
def test_property_chunked_updates_equal_one_update(name, data, n_chunks):
    section = SECTIONS[name]
    batch = data.draw(section.strategy)
    for i, whole in enumerate(section.runs()):
        expected = _values(section.feed(whole, [batch]))
        for dim in (0, 1) if section.time_split else (0,):
            chunked = section.feed(section.runs()[i], _chunks(section, batch, n_chunks, dim))
            assert_close(_values(chunked), expected, section, skip=section.unstable(batch))


@pytest.mark.parametrize("name", [n for n in SECTION_IDS if SECTIONS[n].permutable])
@given(data=st.data(), rnd=st.randoms(use_true_random=False))
def test_property_permuting_units_changes_nothing(name, data, rnd):
    section = SECTIONS[name]
    batch = data.draw(section.strategy)
    order = list(range(len(units(batch, "sequence"))))
    rnd.shuffle(order)
    for i, a in enumerate(section.runs()):
        b = section.runs()[i]
        assert_close(_values(section.feed(b, [take(batch, order)])), _values(section.feed(a, [batch])), section,
                     skip=section.unstable(batch))


# --- DDP: one spawned run for every case -----------------------------------------------------------------
@pytest.fixture(scope="module")
def ddp_results():
    from tests.harness import ddp_worker

    return run_distributed(ddp_worker, world_size=2, timeout=300)


def _per_rank(section, scenario):
    return [concat_batches(shard) for shard in section.shards(scenario)]


def _single(section, scenario):
    """The concatenation of every rank's shard."""
    return concat_batches(_per_rank(section, scenario))


def _expected(section, scenario, make):
    """The synced values: one process on the concatenation, or the rank reference of per-rank figures."""
    if section.rank_reference is not None:
        keys = set(_values(section.feed(make(), [_single(section, scenario)])))
        return {k: v for k, v in section.rank_reference(_per_rank(section, scenario)).items() if k in keys}
    return _values(section.feed(make(), [_single(section, scenario)]))


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("name", SECTION_IDS)
def test_ddp_collection_equals_one_process_on_the_concatenation(ddp_results, name, scenario):
    section = SECTIONS[name]
    expected = _expected(section, scenario, section.collection)
    if section.reference is not None and section.rank_reference is None:
        assert_matches_reference(section, expected, section.reference(_single(section, scenario)),
                                 where="single process")
    for rank, result in enumerate(ddp_results):
        values, n_collectives, _, restored = result[name, scenario]
        assert n_collectives <= 4, f"{n_collectives} collectives (3 reductions + the layout check)"
        assert restored, "compute() left synced states behind"
        assert_close(values, expected, section, where=f"rank {rank}")
    assert ddp_results[0][name, scenario][0] == ddp_results[1][name, scenario][0]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ddp_each_metric_alone_equals_one_process(ddp_results, case, scenario):
    section, make = case
    name = next(n for n, m in section.members.items() if m is make)
    expected = _expected(section, scenario, make)
    for rank, result in enumerate(ddp_results):
        assert_close(result[section.name, scenario][2][name], expected, section, where=f"rank {rank}")


def test_ddp_one_collection_of_every_section_syncs_in_constant_collectives(ddp_results):
    (values, n0), (values1, n1) = ddp_results[0]["everything"], ddp_results[1]["everything"]
    assert n0 == n1 and n0 <= 4, (n0, n1)
    assert values == values1
    for name in ONE_COLLECTION:  # the same values as each section's collection
        section = SECTIONS[name]
        own = ddp_results[0][name, "uneven"][0]
        assert_close({k: values[k] for k in own}, own, section, where=name)


# --- glossary: every metric class documented and found by its name and aliases ---------------------------
@pytest.mark.parametrize("case", MEMBERS, indirect=True, ids=MEMBER_IDS)
def test_glossary_entry_found_by_name_alias_and_key(case):
    from opbc_metrics import glossary

    _, make = case
    metric = make()
    entry = type(metric).glossary
    assert all(getattr(entry, f).strip() for f in ("what", "unit", "cap", "action"))
    for name in (entry.name, *entry.aliases, *type(metric).keys):  # the class keys (placeholders where settings decide)
        assert glossary.lookup(name) is entry, name
    markdown = glossary.glossary_markdown()
    assert f"## {entry.name}" in markdown and all(f"`{key}`" in markdown for key in type(metric).keys)


def test_ddp_global_values_not_means_of_rank_values_and_rollout_specifics(ddp_results):
    cat = _single(SECTIONS["mismatch"], "uneven")
    ess = F.importance_ess(cat["trainer_logprobs"], cat["rollout_logprobs"], cat["response_mask"]).item()
    rewards = _single(SECTIONS["rollout"], "uneven")["rewards"]
    for result in ddp_results:
        assert result["mismatch", "uneven"][0]["opbc/is/ess"] == pytest.approx(ess, rel=1e-12)
        assert abs(result["mean_of_rank_ess"] - ess) > 1e-3  # what averaging per-rank values would report
        # declared lower bound, global observed upper bound, on every rank
        assert result["chart_ranges"]["rollout/reward/max"] == pytest.approx((0.0, rewards.max().item()))
        assert result["deferred_error"] is not None and "response_lengths" in result["deferred_error"]
    assert ddp_results[0]["chart_ranges"] == ddp_results[1]["chart_ranges"]


def test_host_statistics_reach_accelerator_states_in_one_copy_per_dtype():
    """Statistics built on the host (the agent and endpoint sections' counts) for states on another device are
    moved in one copy per device and dtype, each keeping its shape ("meta" stands in for an accelerator here)."""
    from torchmetrics.utilities.data import dim_zero_sum

    from opbc_metrics.metric import _to_state_devices

    states = [torch.zeros(3, dtype=torch.float64, device="meta"), torch.zeros((), dtype=torch.float64, device="meta"),
              torch.zeros(2, 2, dtype=torch.float64, device="meta"),
              torch.zeros((), dtype=torch.float32, device="meta"), torch.zeros(2)]
    values = [torch.arange(3.0, dtype=torch.float64), torch.tensor(4.0, dtype=torch.float64),
              torch.ones(2, 2, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float32),
              torch.tensor([5.0, 6.0])]
    moved = _to_state_devices([(s, v, dim_zero_sum) for s, v in zip(states, values, strict=True)])
    got = [v for _, v, _ in moved]
    assert [v.device.type for v in got] == ["meta"] * 4 + ["cpu"]
    assert [v.shape for v in got] == [v.shape for v in values]
    assert got[4] is values[4]  # already on its state's device: untouched
    # float64 (three statistics) in one copy, float32 in another
    assert got[0]._base is got[1]._base is got[2]._base and got[3]._base is not got[0]._base


def test_a_shape_mismatch_says_what_to_do():
    """verl's attention mask over prompt + response ([B, P+T]) given as `response_mask` against logprobs [B, T]:
    the error keeps both field names and says to pass the response part (the message had no hint)."""
    logp = -torch.rand(4, 6, dtype=torch.float64)
    fields = {"trainer_logprobs": logp, "rollout_logprobs": logp - 0.01}
    attention = torch.ones(4, 9, dtype=torch.bool)
    with pytest.raises(ValueError) as exc:
        OPBCCollection().update(**fields, response_mask=attention)
    message = str(exc.value)
    assert message.startswith("batch field `response_mask` has shape (4, 9) but `trainer_logprobs` has shape (4, 6): ")
    assert "`response_mask[:, -6:]`" in message and "verl's own `response_mask`" in message
    assert "opbc_metrics.integrations.verl.verl_to_batch" in message
    ess = F.importance_ess(logp, logp - 0.01, attention[:, -6:])  # the hint's fix is accepted
    assert torch.isfinite(ess)
    OPBCCollection().update(**fields, response_mask=attention[:, -6:])
    # a logprob side over the whole sequence gets the same cut; any other mismatch: make the shapes equal
    with pytest.raises(ValueError, match=r"`rollout_logprobs\[:, -6:\]`; otherwise give it the shape of"):
        OPBCCollection().update(trainer_logprobs=logp, rollout_logprobs=-torch.rand(4, 9, dtype=torch.float64))
    for mask in (torch.ones(4, dtype=torch.bool), torch.ones(4, 3, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"`response_mask` has shape .*: make the shapes equal: give "
                           r"`response_mask` the shape of `trainer_logprobs`, \(4, 6\)$"):
            OPBCCollection().update(**fields, response_mask=mask)
