"""Endpoint-capability probe and coverage metrics: real-format fixtures with hand-written expectations,
an independent plain-Python reference on generated responses, properties and contracts."""

from __future__ import annotations

import copy
import io
import itertools
import json
import math
import random
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opbc_metrics import OPBCCollection, glossary
from opbc_metrics.endpoint import (
    ENDPOINT_METRICS,
    EndpointResponseCount,
    SeedSupportCoverage,
    TokenIdsCoverage,
    probe_response,
)
from opbc_metrics.functional import endpoint as FE
from opbc_metrics.testing import assert_no_host_sync
from tests.data import make_batch
from tests.ddp import count_collectives, run_distributed

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "endpoint").glob("*.json"))
FLAGS = (
    "token_ids_available",
    "prompt_token_ids_available",
    "sampled_logprobs_available",
    "top_logprobs_available",
    "seed_requested",
    "seed_supported",
)
KEYS = [*(f"endpoint/capabilities/{f}" for f in FLAGS), "endpoint/capabilities/num_responses"]


def load(path):
    return json.loads(Path(path).read_text())


# --- the independent reference ---------------------------------------------------------------------
def ref_flags(resp, req):
    chat = resp["object"] == "chat.completion"
    per_choice = []
    for c in resp["choices"]:
        lp = c.get("logprobs")
        if chat:
            items = (lp or {}).get("content") or []
            tokens = [it["token"] for it in items]
            sampled = len(items) > 0
            top = len(items) > 0 and all(len(it.get("top_logprobs") or []) > 0 for it in items)
            prompt = bool(resp.get("prompt_token_ids"))
        else:
            tokens = lp["tokens"] if lp else []
            sampled = bool(lp) and any(v is not None for v in lp["token_logprobs"])
            nonnull = [e for e in ((lp or {}).get("top_logprobs") or []) if e is not None]
            top = len(nonnull) > 0 and all(len(e) > 0 for e in nonnull)
            prompt = bool(c.get("prompt_token_ids")) or bool(resp.get("prompt_token_ids"))
        ids = bool(c.get("token_ids")) or (len(tokens) > 0 and all(re.fullmatch(r"token_id:-?\d+", t) for t in tokens))
        per_choice.append((ids, prompt, sampled, top))
    out = {name: all(row[i] for row in per_choice) for i, name in enumerate(FLAGS[:4])}
    out["seed_requested"] = req is not None and req.get("seed") is not None
    out["seed_supported"] = out["seed_requested"] and bool(resp.get("system_fingerprint"))
    return out


def ref_window(exchanges):
    n = len(exchanges)
    rows = [ref_flags(resp, req) for resp, req in exchanges]
    out = {f"endpoint/capabilities/{f}": (sum(r[f] for r in rows) / n if n else 0.0) for f in FLAGS}
    out["endpoint/capabilities/num_responses"] = float(n)
    return out


def assert_window(out, expected, keys=KEYS):
    assert set(out) == set(keys)
    for key in keys:
        assert out[key].dtype == torch.float64
        got = out[key].item()
        assert math.isclose(got, expected[key], rel_tol=1e-12, abs_tol=1e-15), (key, got, expected[key])


# --- generated responses ---------------------------------------------------------------------------
def random_exchange(rng: random.Random):
    chat = rng.random() < 0.5
    n_tokens = rng.randint(0, 3)  # zero-token generations included
    as_ids = rng.random() < 0.3
    choices = []
    for i in range(rng.choice([1, 1, 2])):
        tokens = [f"token_id:{rng.randint(0, 150000)}" if as_ids else rng.choice(["Hi", "!", " there"])
                  for _ in range(n_tokens)]
        choice = {"index": i, "finish_reason": "stop"}
        if chat:
            choice["message"] = {"role": "assistant", "content": "x" * n_tokens}
        else:
            choice["text"] = "x" * n_tokens
        r = rng.random()
        if r < 0.3:
            choice["logprobs"] = None
        elif r < 0.4:
            pass  # field absent
        else:
            # Top-k alternatives at every position, at none, or at some (a partial answer is not coverage).
            top_mode = rng.choice(["all", "none", "some"])
            with_top = [top_mode == "all" or (top_mode == "some" and rng.random() < 0.5) for _ in tokens]
            if chat:
                choice["logprobs"] = {"content": [
                    {"token": t, "logprob": -0.5, "bytes": None,
                     "top_logprobs": [{"token": t, "logprob": -0.5, "bytes": None}] if top else []}
                    for t, top in zip(tokens, with_top)]}
            else:
                choice["logprobs"] = {
                    "tokens": tokens,
                    "token_logprobs": [None if (j == 0 and rng.random() < 0.3) else -0.5 for j in range(n_tokens)],
                    "top_logprobs": None if top_mode == "none" and rng.random() < 0.5 else [
                        {t: -0.5} if top else rng.choice([{}, None]) for t, top in zip(tokens, with_top)],
                    "text_offset": list(range(n_tokens)),
                }
        t = rng.random()
        if t < 0.4:
            choice["token_ids"] = [rng.randint(0, 150000) for _ in range(n_tokens)]
        elif t < 0.5:
            choice["token_ids"] = None
        if not chat and rng.random() < 0.4:
            choice["prompt_token_ids"] = [1, 2, 3]
        choices.append(choice)
    resp = {"id": "r", "object": "chat.completion" if chat else "text_completion", "created": 0, "model": "m",
            "choices": choices}
    if rng.random() < 0.4:
        resp["prompt_token_ids"] = [151644, 872]
    f = rng.random()
    if f < 0.4:
        resp["system_fingerprint"] = "fp_0123456789"
    elif f < 0.6:
        resp["system_fingerprint"] = None
    s = rng.random()
    req = None if s < 0.2 else {"seed": rng.randint(0, 9)} if s < 0.6 else {"seed": None} if s < 0.8 else {}
    return resp, req


def random_exchanges(seed: int, n: int):
    rng = random.Random(seed)
    return [random_exchange(rng) for _ in range(n)]


@st.composite
def exchange_lists(draw, max_size=10):
    return random_exchanges(draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, max_size)))


def _split(exchanges):
    return [resp for resp, _ in exchanges], [req for _, req in exchanges]


# --- fixtures in the real formats ------------------------------------------------------------------
def test_fixtures_cover_each_format():
    names = {p.stem for p in FIXTURES}
    assert {"openai_chat_logprobs", "openai_completions_legacy_logprobs", "openai_chat_no_logprobs",
            "vllm_chat_token_ids", "vllm_completions_token_ids"} <= names
    assert (Path(__file__).parent / "fixtures" / "endpoint" / "README.md").exists()


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_probe_reads_fixture(path):
    data = load(path)
    assert "OpenAI API reference" in data["_comment"] or "vLLM docs" in data["_comment"]
    caps = probe_response(data["response"], data["request"])
    assert caps.api == data["expected"]["api"]
    assert caps.flags() == {f: data["expected"][f] for f in FLAGS}
    # The reference agrees with the hand-written expectations too.
    assert ref_flags(data["response"], data["request"]) == {f: data["expected"][f] for f in FLAGS}
    # Without the request, no seed counts as requested.
    assert not probe_response(data["response"]).seed_supported


def test_coverage_over_fixtures():
    data = [load(p) for p in FIXTURES]
    m = OPBCCollection(sections=["endpoint"])
    m.update(endpoint_responses=[d["response"] for d in data], endpoint_requests=[d["request"] for d in data])
    out = m.compute()
    for flag in FLAGS:
        share = sum(d["expected"][flag] for d in data) / len(data)
        assert out[f"endpoint/capabilities/{flag}"].item() == pytest.approx(share, rel=1e-12), flag
    assert out["endpoint/capabilities/num_responses"].item() == len(data)


def test_hand_computed_coverage():
    vllm_chat = load(FIXTURES[[p.stem for p in FIXTURES].index("vllm_chat_token_ids")])
    openai_chat = load(FIXTURES[[p.stem for p in FIXTURES].index("openai_chat_logprobs")])
    m = OPBCCollection(sections=["endpoint"])
    # vLLM: ids yes, seed no (null fingerprint); OpenAI: ids no, seed yes. Two of each plus one OpenAI.
    m.update(endpoint_responses=[vllm_chat["response"]] * 2, endpoint_requests=vllm_chat["request"])
    m.update(endpoint_responses=[openai_chat["response"]] * 3, endpoint_requests=openai_chat["request"])
    out = {k: v.item() for k, v in m.compute().items()}
    assert out["endpoint/capabilities/token_ids_available"] == pytest.approx(2 / 5)
    assert out["endpoint/capabilities/seed_supported"] == pytest.approx(3 / 5)
    assert out["endpoint/capabilities/seed_requested"] == 1.0
    assert out["endpoint/capabilities/sampled_logprobs_available"] == 1.0
    assert out["endpoint/capabilities/num_responses"] == 5.0


def test_client_objects_with_model_dump():
    class Obj:
        def __init__(self, data):
            self._data = data

        def model_dump(self):
            return copy.deepcopy(self._data)

    data = load(FIXTURES[[p.stem for p in FIXTURES].index("vllm_chat_token_ids")])
    caps = probe_response(Obj(data["response"]), Obj(data["request"]))
    assert caps.flags() == {f: data["expected"][f] for f in FLAGS}


def test_top_logprobs_need_alternatives_at_every_position():
    item = {"token": "a", "logprob": -0.1, "top_logprobs": [{"token": "a", "logprob": -0.1}]}
    bare = {"token": "b", "logprob": -0.2, "top_logprobs": []}
    assert probe_response(_chat(logprobs={"content": [item, item]})).top_logprobs_available
    assert not probe_response(_chat(logprobs={"content": [item, bare]})).top_logprobs_available
    assert probe_response(_completion(top_logprobs=[{"x": -0.1}], token_logprobs=[-0.1])).top_logprobs_available
    two = _completion(tokens=["x", "y"], token_logprobs=[None, -0.1], top_logprobs=[None, {"y": -0.1}],
                      text_offset=[0, 1])
    assert probe_response(two).top_logprobs_available  # a null entry (echoed first token) is allowed
    two["choices"][0]["logprobs"]["top_logprobs"] = [{"x": -0.3}, {}]
    assert not probe_response(two).top_logprobs_available


def test_multiple_choices_need_the_capability_in_every_choice():
    data = load(FIXTURES[[p.stem for p in FIXTURES].index("vllm_completions_token_ids")])
    resp = copy.deepcopy(data["response"])
    second = copy.deepcopy(resp["choices"][0])
    second.update(index=1, token_ids=None, logprobs=None)
    resp["choices"].append(second)
    caps = probe_response(resp)
    assert not caps.token_ids_available and not caps.sampled_logprobs_available
    assert caps.prompt_token_ids_available


# --- against the reference on generated responses --------------------------------------------------
@given(exchange_lists())
def test_probe_and_window_match_reference(exchanges):
    for resp, req in exchanges:
        assert probe_response(resp, req).flags() == ref_flags(resp, req)
    responses, requests = _split(exchanges)
    assert_window(FE.endpoint_capabilities(responses, requests), ref_window(exchanges))


@given(exchange_lists(), st.lists(st.integers(0, 10), max_size=3))
def test_chunked_updates_equal_one_update(exchanges, cuts):
    responses, requests = _split(exchanges)
    whole, chunked = OPBCCollection(sections=["endpoint"]), OPBCCollection(sections=["endpoint"])
    whole.update(endpoint_responses=responses, endpoint_requests=requests)
    bounds = [0, *sorted(min(c, len(responses)) for c in cuts), len(responses)]
    for lo, hi in itertools.pairwise(bounds):
        chunked.update(endpoint_responses=responses[lo:hi], endpoint_requests=requests[lo:hi])
    # A collection leaves out optional-input members that saw no data: no response, no endpoint keys.
    expected = {k: v.item() for k, v in whole.compute().items()}
    assert_window(chunked.compute(), expected, keys=KEYS if responses else [])


@given(exchange_lists(), st.randoms(use_true_random=False))
def test_permuting_responses_changes_nothing(exchanges, rnd):
    shuffled = list(exchanges)
    rnd.shuffle(shuffled)
    expected = {k: v.item() for k, v in FE.endpoint_capabilities(*_split(exchanges)).items()}
    assert_window(FE.endpoint_capabilities(*_split(shuffled)), expected)


@given(exchange_lists())
def test_bounds(exchanges):
    out = FE.endpoint_capabilities(*_split(exchanges))
    for flag in FLAGS:
        assert 0.0 <= out[f"endpoint/capabilities/{flag}"].item() <= 1.0
    assert out["endpoint/capabilities/seed_supported"] <= out["endpoint/capabilities/seed_requested"]


# --- contracts -------------------------------------------------------------------------------------
def test_requests_one_body_for_all_or_none():
    responses = [load(p)["response"] for p in FIXTURES]
    one = FE.endpoint_capabilities(responses, {"seed": 5})
    fingerprinted = sum(bool(r.get("system_fingerprint")) for r in responses) / len(responses)
    assert one["endpoint/capabilities/seed_supported"].item() == pytest.approx(fingerprinted)
    none = FE.endpoint_capabilities(responses)
    assert none["endpoint/capabilities/seed_requested"].item() == 0.0


def test_update_never_syncs_host_and_device():
    responses, requests = _split(random_exchanges(1, 12))
    for metric in (OPBCCollection(sections=["endpoint"]), *[cls() for cls in ENDPOINT_METRICS]):
        with assert_no_host_sync():
            metric.update(endpoint_responses=responses, endpoint_requests=requests)


def test_state_size_fixed_and_round_trip():
    parts = [_split(random_exchanges(s, 6)) for s in range(4)]
    straight = OPBCCollection(sections=["endpoint"])
    for responses, requests in parts:
        straight.update(endpoint_responses=responses, endpoint_requests=requests)
    first = OPBCCollection(sections=["endpoint"])
    first.update(endpoint_responses=parts[0][0], endpoint_requests=parts[0][1])
    size = sum(v.numel() for v in first.state_dict().values())
    first.update(endpoint_responses=parts[1][0], endpoint_requests=parts[1][1])
    assert sum(v.numel() for v in first.state_dict().values()) == size
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = OPBCCollection(sections=["endpoint"])
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    for responses, requests in parts[2:]:
        resumed.update(endpoint_responses=responses, endpoint_requests=requests)
    assert_window(resumed.compute(), {k: v.item() for k, v in straight.compute().items()})


def test_empty_window_values():
    out = {}
    for cls in ENDPOINT_METRICS:
        metric = cls()
        metric.update(endpoint_responses=[])
        out.update({k: v.item() for k, v in metric.compute_dict().items()})
    assert out == {}  # no response in the window: no keys (the functional API keeps its documented values)
    assert ref_window([]) == {k: v.item() for k, v in FE.endpoint_capabilities([]).items()}
    # A collection leaves out members whose optional inputs never carried data.
    m = OPBCCollection(sections=["endpoint"])
    assert m.compute() == {}
    m.update(endpoint_responses=[])
    assert m.compute() == {}


def test_joins_collection_by_choice_or_as_members():
    batch = make_batch(seed=0, dtype=torch.float64)
    exchanges = random_exchanges(3, 8)
    responses, requests = _split(exchanges)
    both = OPBCCollection(sections=["mismatch", "agent", "endpoint"])
    both.update(batch)  # no endpoint_responses / trajectory_pairs: those members skip it
    both.update(dict(batch, endpoint_responses=responses, endpoint_requests=requests))
    out = both.compute()
    assert "opbc/is/ess" in out
    assert not any(k.startswith("agent/") for k in out)  # no trajectory_pairs arrived: agent keys left out
    assert_window({k: v for k, v in out.items() if k.startswith("endpoint/")}, ref_window(exchanges))
    members = OPBCCollection([TokenIdsCoverage(), SeedSupportCoverage(), EndpointResponseCount()])
    members.update(endpoint_responses=responses, endpoint_requests=requests)
    assert len(members.compute()) == 5
    default = OPBCCollection()  # a default section: keys only once responses arrive
    default.update(batch)
    assert any(k.startswith("endpoint/") for k in default.keys_produced)
    assert not any(k.startswith("endpoint/") for k in default.compute())


def _chat(**choice):
    return {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                                                      **choice}]}


def _completion(**logprobs):
    base = {"tokens": ["x"], "token_logprobs": [-0.1], "top_logprobs": None, "text_offset": [0]}
    base.update(logprobs)
    return {"object": "text_completion", "choices": [{"index": 0, "text": "x", "logprobs": base}]}


@pytest.mark.parametrize(
    "responses, requests, field",
    [
        ({"choices": []}, None, "endpoint_responses"),
        (["not json"], None, r"endpoint_responses\[0\].*`response`"),
        ([{"object": "chat.completion"}], None, "`choices`"),
        ([{"object": "chat.completion", "choices": []}], None, "`choices`"),
        ([{"object": "chat.completion", "choices": {"0": {}}}], None, "`choices`"),
        ([{"object": "chat.completion", "choices": [{"index": 0}]}], None, r"choices\[0\]\.message"),
        ([{"object": "text_completion", "choices": [{"index": 0}]}], None, r"choices\[0\]\.text"),
        ([{"choices": [{"index": 0}]}], None, r"choices\[0\]\.message"),
        ([{"object": "chat.completion.chunk", "choices": [{"delta": {}}]}], None, "`object`"),
        ([_chat(logprobs={"content": [{"token": "x"}]})], None, r"choices\[0\]\.logprobs\.content\[0\]\.logprob"),
        ([_chat(logprobs={"content": [{"logprob": -1.0}]})], None, r"content\[0\]\.token"),
        ([_chat(logprobs={"content": "x"})], None, r"logprobs\.content"),
        ([_chat(logprobs={"content": [{"token": "x", "logprob": -1, "top_logprobs": [{"token": "y"}]}]})], None,
         r"top_logprobs\[0\]\.logprob"),
        ([_chat(token_ids=["1"])], None, r"choices\[0\]\.token_ids"),
        ([_chat(token_ids=[True])], None, r"choices\[0\]\.token_ids"),
        ([dict(_chat(), prompt_token_ids="1 2 3")], None, "prompt_token_ids"),
        ([dict(_chat(), system_fingerprint=5)], None, "system_fingerprint"),
        ([_completion(token_logprobs=None)], None, r"logprobs\.token_logprobs"),
        ([_completion(tokens=None)], None, r"logprobs\.tokens"),
        ([_completion(token_logprobs=[-0.1, -0.2])], None, r"logprobs\.token_logprobs"),
        ([_completion(token_logprobs=["-0.1"])], None, r"token_logprobs\[0\]"),
        ([_completion(top_logprobs=[{"x": "high"}])], None, r"top_logprobs\[0\]"),
        ([_chat()], [{"seed": "7"}], "seed"),
        ([_chat()], [{"seed": 1}, {"seed": 2}], "endpoint_requests"),
        ([_chat()], 5, "endpoint_requests"),
        ([_chat()], ["not a request"], "request"),
    ],
)
def test_bad_input_names_the_field(responses, requests, field):
    for metric in (TokenIdsCoverage(), OPBCCollection(sections=["endpoint"])):
        with pytest.raises(ValueError, match=field):
            metric.update(endpoint_responses=responses, endpoint_requests=requests)


def test_metric_alone_requires_the_field():
    with pytest.raises(ValueError, match="endpoint_responses"):
        TokenIdsCoverage().update(trajectory_pairs=[])


def test_glossary_entries_and_aliases():
    for name in ("token_ids_available", "sampled_logprobs_available", "top_logprobs_available", "seed_supported"):
        entry = glossary.lookup(name)
        assert entry.name == name
        assert all(getattr(entry, f).strip() for f in ("what", "unit", "cap", "action"))
    assert glossary.lookup("prompt_token_ids_available").name == "token_ids_available"
    assert glossary.lookup("endpoint/capabilities/seed_requested").name == "seed_supported"
    md = glossary.glossary_markdown()
    for key in KEYS:
        assert f"`{key}`" in md


# --- DDP -------------------------------------------------------------------------------------------
SHARDS = {"uneven": [[(20, 9), (21, 3)], [(22, 5)]], "rank_without_data": [[(23, 7)], []]}


def _compute_counting_collectives(metrics):
    """``metrics.compute()`` as floats, and the number of collectives it issued."""
    with count_collectives() as calls:
        out = {k: v.item() for k, v in metrics.compute().items()}
    return out, calls["n"]


def _endpoint_worker(rank, world_size):
    out = {}
    for scenario, shards in SHARDS.items():
        metrics = OPBCCollection(sections=["endpoint"])
        alone = [cls() for cls in ENDPOINT_METRICS]
        for seed, n in shards[rank]:
            responses, requests = _split(random_exchanges(seed, n))
            metrics.update(endpoint_responses=responses, endpoint_requests=requests)
            for m in alone:
                m.update(endpoint_responses=responses, endpoint_requests=requests)
        values, n_collectives = _compute_counting_collectives(metrics)
        single = {}
        for m in alone:
            single.update({k: v.item() for k, v in m.compute_dict().items()})
        out[scenario] = (values, single, n_collectives, metrics["EndpointResponseCount"].responses.item())
    return out


def test_ddp_sync_equals_single_process_on_concatenated_responses():
    results = run_distributed(_endpoint_worker, world_size=2)
    for scenario, shards in SHARDS.items():
        exchanges = [e for rank_shards in shards for seed, n in rank_shards for e in random_exchanges(seed, n)]
        expected = ref_window(exchanges)
        for rank, result in enumerate(results):
            values, single, n_collectives, local = result[scenario]
            assert 1 <= n_collectives <= 4  # 3 reductions + the layout check
            assert local == sum(n for _, n in shards[rank])
            for got in (values, single):
                assert set(got) == set(KEYS)
                for key in KEYS:
                    assert math.isclose(got[key], expected[key], rel_tol=1e-12, abs_tol=1e-15), (scenario, key)
