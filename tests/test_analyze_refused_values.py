"""``opbc-metrics analyze`` on values the collection refuses: an unknown stop reason dropped its whole batch, a
positive logprob aborted the whole run at compute (no line number, no output), and any ``ValueError`` of a
metric's compute aborted the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from opbc_metrics.batch import PROBABILITY_TOLERANCE
from opbc_metrics.functional.rollout import STOP_LENGTH_PCT_KEY, STOP_REASON_STRINGS
from opbc_metrics.mismatch.metrics import ImportanceSamplingESS
from tests.support import GOOD_SAMPLE, analyze_cli

NOT_LOGPROBS = "logprobs must be <= 0 (log-probabilities); values in [0, 1] look like probabilities"


def _jsonl(path: Path, samples: list[dict]) -> Path:
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    return path


def test_an_unknown_stop_reason_is_an_issue_of_its_line(tmp_path):
    """One "LENGTH" dropped its whole batch (here every line: "no valid sample")."""
    samples = [{**GOOD_SAMPLE, "stop_reason": STOP_REASON_STRINGS[i % 2]} for i in range(31)]
    samples[3] = {**GOOD_SAMPLE, "stop_reason": "LENGTH"}
    status, result, err = analyze_cli(_jsonl(tmp_path / "stop.jsonl", samples), tmp_path / "out")
    assert status == 0 and result is not None, err
    assert "stop.jsonl line 4: `stop_reason` must be one of 'stop', 'length'" in err and "got 'LENGTH'" in err, err
    assert result["input"]["samples"] == 30 and result["input"]["issues_total"] == 1
    assert result["input"]["issues"][0]["line"] == 4
    truncated = sum(s.get("stop_reason") == "length" for i, s in enumerate(samples) if i != 3)
    assert result["metrics"][STOP_LENGTH_PCT_KEY] == pytest.approx(100 * truncated / 30)


@pytest.mark.parametrize("key,value", [("trainer_logprobs", 0.7), ("rollout_logprobs", 4.5)])
def test_a_positive_logprob_is_an_issue_of_its_line(tmp_path, key, value):
    """It aborted the whole run at compute (rc 1, no line number, no output)."""
    samples = [dict(GOOD_SAMPLE) for _ in range(31)]
    samples[3] = {**GOOD_SAMPLE, key: [-1.0, value, -2.0]}
    # not issues: a positive value on a token outside the response, one within the rounding tolerance, +inf
    samples[4] = {**GOOD_SAMPLE, key: [-1.0, value, -2.0], "response_mask": [1, 0, 1]}
    samples[5] = {**GOOD_SAMPLE, key: [-1.0, PROBABILITY_TOLERANCE / 2, -2.0]}
    samples[6] = {**GOOD_SAMPLE, key: [-1.0, float("inf"), -2.0]}
    path = tmp_path / "pos.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))  # json writes inf as Infinity
    status, result, err = analyze_cli(path, tmp_path / "out")
    assert status == 0 and result is not None, err
    assert f"pos.jsonl line 4: `{key}` holds {value:g} at index 1: {NOT_LOGPROBS}" in err, err
    assert result["input"]["samples"] == 30 and result["input"]["issues_total"] == 1
    assert result["input"]["issues"][0]["line"] == 4
    assert "opbc/is/ess" in result["metrics"] and result["metrics"]["opbc/input/nonfinite_count"] == 1


def test_pt_rows_with_an_unknown_stop_reason_or_a_positive_logprob_are_issues_of_their_rows(tmp_path):
    g = torch.Generator().manual_seed(0)

    def record(step: int) -> dict:
        trainer = -torch.rand(8, 4, generator=g) - 0.1
        return {"trainer_logprobs": trainer, "rollout_logprobs": trainer + 0.01, "step": step,
                "response_mask": torch.ones(8, 4, dtype=torch.int64)}

    first, second = record(0), record(1)
    first["trainer_logprobs"][2, 3] = 0.5
    first["rollout_logprobs"][4, 0] = 3.0
    first["response_mask"][4, 0] = 0  # outside the response: kept
    first["stop_reasons"] = ["stop"] * 5 + ["LENGTH"] + ["length"] * 2
    second["stop_reasons"] = torch.tensor([0, 7, 1, 2, 0, 0, 1, 0])
    path = tmp_path / "rows.pt"
    torch.save([first, second], path)
    status, result, err = analyze_cli(path, tmp_path / "out", "--batch-size", "4", "--max-bad-fraction", "0.5")
    assert status == 0 and result is not None, err
    issues = {i["where"]: i["message"] for i in result["input"]["issues"]}
    assert set(issues) == {"record 0 row 2", "record 0 row 5", "record 1 row 1"}, issues
    logits = f"`trainer_logprobs` holds 0.5 at token 3: {NOT_LOGPROBS}, larger ones like logits"
    assert issues["record 0 row 2"] == logits
    assert "got 'LENGTH'" in issues["record 0 row 5"] and "int code 7" in issues["record 1 row 1"]
    assert result["input"]["samples"] == 13
    # 2 of record 0's 6 kept rows and 2 of record 1's 7 stopped on the length limit
    assert result["metrics"][STOP_LENGTH_PCT_KEY] == pytest.approx(100 * 4 / 13)
    assert "rows.pt record 0 row 2:" in err


def test_a_metric_refusing_its_values_at_compute_leaves_out_only_its_keys(tmp_path):
    """Any ValueError of compute() aborted the whole run with no output and no step or batch."""
    records = []
    for step in range(3):
        trainer = -torch.rand(8, 5) - 0.1
        mask = torch.ones(8, 5, dtype=torch.int64)
        if step == 1:
            mask[3, 2] = 2  # refused by the input health metric at compute (a .pt mask is not checked per row)
        records.append({"trainer_logprobs": trainer, "rollout_logprobs": trainer + 0.01, "response_mask": mask})
    torch.save(records, tmp_path / "mask.pt")
    status, result, err = analyze_cli(tmp_path / "mask.pt", tmp_path / "out")
    assert status == 1 and result is not None, err  # the outputs are written, the status says it failed
    assert "not computed: mask.pt whole run: computing opbc/input/nonfinite_count" in err, err
    assert "batch field `response_mask` held 1 value(s) other than 0 and 1" in err
    assert result["not_computed"]["opbc/input/num_tokens"].startswith("computing failed: batch field `response_mask`")
    assert "opbc/is/ess" in result["metrics"] and "opbc/input/num_tokens" not in result["metrics"]
    assert result["input"]["issues"][0]["where"] == "whole run" and result["input"]["bad_samples"] == 0
    status, result, err = analyze_cli(tmp_path / "mask.pt", tmp_path / "fail", "--on-error", "fail")
    assert status == 1 and result is None and "whole run: computing" in err and "(--on-error fail)" in err


def test_a_step_whose_metric_refuses_its_values_is_named_and_keeps_its_other_metrics(tmp_path, monkeypatch):
    original = ImportanceSamplingESS.compute

    def compute(self):
        if float(self.metric_state["count"]) > 3 * 8:  # steps 1, 2 and the whole run (3 tokens a sample, 8 at step 0)
            raise ValueError("batch field `trainer_logprobs` is refused (test)")
        return original(self)

    assert "count" in ImportanceSamplingESS().metric_state, "the test reads the token count"
    monkeypatch.setattr(ImportanceSamplingESS, "compute", compute)
    samples = [{**GOOD_SAMPLE, "step": s, "group_id": f"{s}-{i // 2}"} for s in range(3) for i in range(8 + 8 * s)]
    status, result, err = analyze_cli(_jsonl(tmp_path / "steps.jsonl", samples), tmp_path / "out")
    assert status == 1 and result is not None, err
    wheres = [i["where"] for i in result["input"]["issues"]]
    assert wheres == ["step 1", "step 2", "whole run"], wheres
    assert "steps.jsonl step 1: computing opbc/is/ess failed: batch field `trainer_logprobs` is refused (test)" in err
    points = result["steps"]["points"]
    assert [("opbc/is/ess" in p["metrics"], "opbc/is/seq_ess" in p["metrics"]) for p in points] == [
        (True, True), (False, True), (False, True)]
    assert "opbc/is/ess" in result["not_computed"] and "opbc/is/seq_ess" in result["metrics"]


def test_compute_failures_on_every_step_print_at_most_issues_shown_lines(tmp_path, monkeypatch):
    """A metric refusing its values at every step printed one line per step; they now share the issue cap."""
    import io

    from opbc_metrics.analysis import analyze_file

    def compute(self):
        raise ValueError("refused (test)")

    monkeypatch.setattr(ImportanceSamplingESS, "compute", compute)
    samples = [{**GOOD_SAMPLE, "step": s} for s in range(12) for _ in range(2)]
    stream = io.StringIO()
    result = analyze_file(str(_jsonl(tmp_path / "all.jsonl", samples)), issue_stream=stream, issues_shown=3)
    lines = stream.getvalue().splitlines()
    more = "... 10 more issue(s), all listed in the result"
    assert [line.split(":")[0] for line in lines] == ["not computed"] * 3 + [more]
    assert len(result["input"]["issues"]) == 13  # 12 steps and the whole run
