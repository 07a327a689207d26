"""The HTML report as a user sees it: rendered by headless Chromium, its charts, labels and thresholds checked.

Two streams (the CLI fixture split in halves, with a ``step`` field) are analysed with the CLI's API and
rendered into one comparison report. A copy of the page with a probe script appended (the report itself
has no script) is loaded by Chromium, which writes the laid-out size and the text of every chart into the
DOM it dumps; a screenshot shows the charts were painted in the streams' colours. The test skips only when
Chromium is missing outside CI (``.ci/run`` installs it).
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from opbc_metrics.cli import analyze_file
from opbc_metrics.glossary import lookup
from opbc_metrics.report import (
    HEADLINES,
    STREAM_COLOURS,
    charts_available,
    fmt,
    glossary_sentence,
    policy_thresholds,
    render_report,
)

FIXTURE = Path(__file__).parent / "fixtures" / "cli" / "rollouts.jsonl"
WIDTH = 1400
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)

if CHROMIUM is None:
    if os.environ.get("CI"):
        pytest.fail("chromium is required in CI (.ci/run installs it: apt-get install -y chromium)",
                    pytrace=False)
    pytest.skip("chromium not found (apt-get install -y chromium)", allow_module_level=True)

PROBE = """<pre id="probe"></pre><script>
const out = {width: window.innerWidth, scrollWidth: document.documentElement.scrollWidth, charts: {}, cards: {}};
for (const svg of document.querySelectorAll("svg.chart")) {
  const r = svg.getBoundingClientRect();
  out.charts[svg.id] = {x: r.left + scrollX, y: r.top + scrollY, w: r.width, h: r.height,
    label: svg.getAttribute("aria-label"),
    texts: [...svg.querySelectorAll("text")].map(t => t.textContent.trim()).filter(t => t)};
}
for (const card of document.querySelectorAll(".card")) out.cards[card.id] = card.innerText;
document.getElementById("probe").textContent = JSON.stringify(out);
</script>"""


def _chromium(*args: str) -> subprocess.CompletedProcess:
    profile = tempfile.mkdtemp(prefix="opbc-chromium-")
    try:
        return subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
             f"--window-size={WIDTH},3000", *args],
            capture_output=True, text=True, timeout=180,
        )
    finally:
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    if not charts_available():
        pytest.fail("matplotlib (the report extra) is required to draw the report's charts")
    tmp = tmp_path_factory.mktemp("report")
    lines = [json.loads(x) for x in FIXTURE.read_text().splitlines() if x.strip()]
    results = {}
    for name, part in (("bf16", lines[:24]), ("async", lines[24:])):
        path = tmp / f"{name}.jsonl"
        path.write_text("".join(json.dumps({**s, "step": i // 6}) + "\n" for i, s in enumerate(part)))
        results[name] = analyze_file(str(path), batch_size=8)
    page = render_report(results)
    (tmp / "report.html").write_text(page)
    (tmp / "probe.html").write_text(page.replace("</body>", PROBE + "</body>"))
    proc = _chromium("--dump-dom", f"file://{tmp / 'probe.html'}")
    probe = re.search(r'<pre id="probe">(.+?)</pre>', proc.stdout, re.S)  # the JSON the probe script wrote
    assert probe, proc.stderr[-2000:]
    shot = tmp / "report.png"
    _chromium(f"--screenshot={shot}", f"file://{tmp / 'report.html'}")
    return results, page, json.loads(html.unescape(probe.group(1))), shot


def test_page_is_self_contained_and_fits_the_window(rendered):
    _, page, probe, _ = rendered
    assert "<script" not in page and not re.search(r'(src|href)="(?!#)', page)
    assert probe["scrollWidth"] <= probe["width"] == WIDTH


def test_every_chart_is_laid_out_without_overlap(rendered):
    results, _, probe, _ = rendered
    charts = probe["charts"]
    expected = {"chart-step-opbc-is-ess", "chart-step-opbc-is-seq_ess", "chart-step-opbc-logprob-abs_diff_mean",
                "chart-step-opbc-is-clipped_fraction", "chart-step-opbc-is-veto_fraction",
                "chart-step-moe-router-flip_rate", "chart-token-log-ratio", "chart-sequence-log-ratio",
                "chart-per-layer-moe-router-flip_rate"}
    if all(r["controller"]["available"] for r in results.values()):
        expected |= {"chart-decision-mix", "chart-decision-steps"}
    assert expected <= set(charts), sorted(expected - set(charts))
    boxes = []
    for cid, c in charts.items():
        assert 300 < c["w"] <= WIDTH and 100 < c["h"] < 1200, (cid, c)
        assert c["x"] >= 0 and c["x"] + c["w"] <= WIDTH, cid
        boxes.append((cid, c["x"], c["y"], c["x"] + c["w"], c["y"] + c["h"]))
    for i, (a, ax0, ay0, ax1, ay1) in enumerate(boxes):
        for b, bx0, by0, bx1, by1 in boxes[i + 1 :]:
            assert ax1 <= bx0 + 1 or bx1 <= ax0 + 1 or ay1 <= by0 + 1 or by1 <= ay0 + 1, (a, b)


def test_step_charts_draw_the_policy_thresholds_and_label_their_axes(rendered):
    results, _, probe, _ = rendered
    policy = policy_thresholds(results["bf16"])
    ess = probe["charts"]["chart-step-opbc-is-ess"]
    assert ess["label"] == "ESS (token) over steps"
    for text in ("ESS (token)", "step", "share of tokens, 0-1", "bf16", "async",
                 f"quarantine below {fmt(policy['min_ess'])}", f"replay below {fmt(policy['replay_ess'])}"):
        assert text in ess["texts"], (text, ess["texts"])
    clipped = probe["charts"]["chart-step-opbc-is-clipped_fraction"]["texts"]
    assert f"train_with_correction above {fmt(policy['max_clipped'])}" in clipped
    flip = probe["charts"]["chart-step-moe-router-flip_rate"]["texts"]
    assert f"quarantine above {fmt(policy['max_flip'])}" in flip
    hist = probe["charts"]["chart-token-log-ratio"]["texts"]
    assert f"clamp C = {fmt(policy['clamp'])}" in hist and f"veto V = {fmt(policy['veto'])}" in hist
    assert {"-1000", "-10", "-0.1", "-0.001", "0", "0.001", "0.1", "10", "1000"} <= set(hist)
    if "chart-decision-mix" in probe["charts"]:
        mix = probe["charts"]["chart-decision-mix"]["texts"]
        names = {d for r in results.values() for d, n in r["controller"]["decision_mix"].items() if n}
        assert names <= set(mix), (names, mix)
        assert any(t.startswith("bf16 (") for t in mix) and any(t.startswith("async (") for t in mix)


def test_cards_show_each_stream_with_unit_threshold_and_meaning(rendered):
    results, _, probe, _ = rendered
    policy = policy_thresholds(results["bf16"])
    cards = probe["cards"]
    for h in HEADLINES:
        if not any(h.key in r["metrics"] for r in results.values()):
            continue
        text = cards["card-" + re.sub(r"[^A-Za-z0-9_]+", "-", h.key).strip("-")]
        assert text.startswith(h.label) and f"unit: {h.unit}" in text, text
        assert glossary_sentence(lookup(h.key).what) in " ".join(text.split()), text
        for name, r in results.items():
            value = r["metrics"].get(h.key)
            assert f"{name}\n{fmt(value) if value is not None else '—'}" in text.replace("\t", "\n"), (name, text)
    ess = cards["card-opbc-is-ess"]
    assert (f"per group: quarantine below {fmt(policy['min_ess'])}; replay below {fmt(policy['replay_ess'])}"
            in ess)
    # the card of mean |Δlogp| is the absolute mean (the signed mean is another key)
    assert cards["card-opbc-logprob-abs_diff_mean"].startswith("mean |Δlogp|")
    assert "opbc/logprob/abs_diff_mean" in cards["card-opbc-logprob-abs_diff_mean"]


def test_charts_are_painted_in_the_stream_colours(rendered):
    import matplotlib.image

    _, _, probe, shot = rendered
    pixels = matplotlib.image.imread(str(shot))[..., :3]
    c = probe["charts"]["chart-step-opbc-is-ess"]
    if c["y"] + c["h"] > pixels.shape[0]:
        pytest.fail(f"the ESS chart is below the 3000 px screenshot ({c})")
    box = pixels[int(c["y"]) : int(c["y"] + c["h"]), int(c["x"]) : int(c["x"] + c["w"])]
    for colour in STREAM_COLOURS[:2]:
        rgb = [int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
        close = (abs(box - rgb) < 0.08).all(-1).sum()
        assert close > 50, (colour, close)  # the stream's line (and its legend entry) were drawn


def test_a_step_without_the_value_is_a_gap_in_its_line_not_a_segment_across_it(tmp_path):
    """The report's line over steps breaks where a step has no value (step 1 below has no valid token): a segment
    drawn from step 0 to step 2 would show a value for step 1 that was never measured."""
    if not charts_available():
        pytest.skip("matplotlib (the report extra) draws the charts")
    lines = [json.loads(x) for x in FIXTURE.read_text().splitlines() if x.strip()][:6]
    rows = [{**s, "step": i // 2} for i, s in enumerate(lines)]
    for s in rows[2:4]:  # step 1: no response token
        s["response_mask"] = [0] * len(s["trainer_logprobs"])
    path = tmp_path / "gap.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in rows))
    page = render_report({"gap": analyze_file(str(path), batch_size=8)})
    line = re.search(r'id="chart-step-opbc-is-ess-series-gap">\s*<path d="([^"]*)"', page).group(1)
    assert line.count("M") == 2 and "L" not in line  # two points (steps 0 and 2), no segment between them
