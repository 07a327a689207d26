"""Property: any sequence of update / merge_state / load_state_dict / compute / reset over 1-4 collections
gives, at every compute, what one fresh collection fed the same data gives (keys and values)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opbc_metrics import OPBCCollection
from tests.data import make_batch

SECTIONS = ("mismatch", "per_round", "rollout")


def _batch(spec):
    size, seq, seed, empty_rows = spec
    b = make_batch(batch=size, seq=seq, seed=seed, empty_rows=min(empty_rows, size), dtype=torch.float64)
    b["rewards"] = torch.linspace(0.0, 1.0, size, dtype=torch.float64) * (seed % 3)
    return b


batch_specs = st.tuples(st.integers(1, 4), st.integers(1, 6), st.integers(0, 50), st.integers(0, 4))


@st.composite
def programs(draw):
    n = draw(st.integers(1, 4))
    # Mostly every collection starts with data, so that merges and loads meet data on both sides (without this,
    # 40 draws merged two collections holding data 0 times); the rest start empty.
    prefill = draw(st.sampled_from([True, True, True, False]))
    ops = [("update", i, (*draw(batch_specs)[:3], 0)) for i in range(n)] if prefill else []
    for _ in range(draw(st.integers(1, 12))):
        i = draw(st.integers(0, n - 1))
        kind = draw(st.sampled_from(["update", "update", "merge", "merge", "load", "compute", "compute", "reset"]))
        if kind == "update":
            ops.append(("update", i, draw(batch_specs)))
        elif kind in ("merge", "load"):
            if n == 1:
                continue
            j = draw(st.integers(0, n - 1).filter(lambda j, i=i: j != i))
            ops.append((kind, i, j, draw(st.booleans())))
        else:
            ops.append((kind, i))
    return n, ops


def _reference(batches):
    one = OPBCCollection(sections=SECTIONS)
    for b in batches:
        one.update(b)
    return one.compute()


def _assert_equal(got, want):
    assert set(got) == set(want), set(got) ^ set(want)
    for key, value in want.items():
        a, b = got[key].item(), value.item()
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) or (math.isnan(a) and math.isnan(b)), (key, a, b)


@settings(max_examples=40, deadline=None)
@given(programs())
def test_any_sequence_of_operations_equals_one_collection(program):
    n, ops = program
    collections = [OPBCCollection(sections=SECTIONS) for _ in range(n)]
    data: list[list[dict]] = [[] for _ in range(n)]
    for op in ops:
        kind, i = op[0], op[1]
        if kind == "update":
            b = _batch(op[2])
            collections[i].update(b)
            data[i].append(b)
        elif kind == "merge":
            j, as_state_dict = op[2], op[3]
            collections[i].merge_state(collections[j].state_dict() if as_state_dict else collections[j])
            data[i] = data[i] + data[j]
        elif kind == "load":
            j, through_dict_copy = op[2], op[3]
            state = collections[j].state_dict()
            if through_dict_copy:
                state = {k: v.clone() for k, v in state.items()}
            collections[i].load_state_dict(state)
            data[i] = list(data[j])
        elif kind == "reset":
            collections[i].reset()
            data[i] = []
        else:
            _assert_equal(collections[i].compute(), _reference(data[i]))
    for c, d in zip(collections, data, strict=True):
        _assert_equal(c.compute(), _reference(d))
