"""symmem.plots: every function returns a Figure whose data are the exact numbers."""
import sys

import numpy as np
import pytest

import symmem as sm
from symmem import plots
from symmem.errors import ConfigError
from symmem.gpus import budget
from symmem.plan import ROLES
from symmem.solve import solve

GIB = 2**30


@pytest.fixture(scope="module")
def mpl():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    return matplotlib


@pytest.fixture(scope="module")
def est():
    return sm.estimate(sm.models.preset("gpt2"), sm.Policy(precision="bf16-mixed", optimizer="adamw", attention="eager"))


def bars(ax) -> dict:
    """role -> bar heights, from the axes' bar containers."""
    return {c.get_label(): [r.get_height() for r in c] for c in ax.containers}


def line(ax, label):
    (found,) = [ln for ln in ax.get_lines() if ln.get_label() == label]
    return found


def test_breakdown_bars_are_the_parts_at_the_peak(mpl, est, tmp_path):
    from matplotlib.figure import Figure
    configs = [{"b": 1, "s": 1024}, {"b": 8, "s": 1024}, {"b": 32, "s": 1024}]
    fig = plots.breakdown(est, configs)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    evs = [est.at(**c) for c in configs]
    heights = bars(ax)
    assert set(heights) == {r for r in ROLES if any(ev.peak_parts[r] for ev in evs)}
    for role, hs in heights.items():
        assert hs == [ev.peak_parts[role] / GIB for ev in evs]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks[1].startswith("b=8, s=1024\n") and "log_softmax" in ticks[1]
    assert [t.get_text() for t in ax.texts] == [f"{ev.peak / GIB:,.2f} GiB" for ev in evs]
    fig.savefig(tmp_path / "breakdown.png")
    assert (tmp_path / "breakdown.png").stat().st_size > 10_000


def test_breakdown_one_configuration_and_an_axes_of_your_own(mpl, est):
    from matplotlib.figure import Figure
    fig = Figure()
    ax = fig.add_subplot()
    assert plots.breakdown(est, {"b": 4, "s": 512}, ax=ax) is fig
    ev = est.at(b=4, s=512)
    assert {r: hs[0] for r, hs in bars(ax).items()} == \
        {r: v / GIB for r, v in ev.peak_parts.items() if v}
    with pytest.raises(ConfigError):
        plots.breakdown(est, [])


def test_timeline_plots_every_point_and_marks_the_peak(mpl, est, tmp_path):
    fig = plots.timeline(est, b=8, s=1024)
    ax = fig.axes[0]
    ev = est.at(b=8, s=1024)
    n = len(est.timeline)
    total = line(ax, "total").get_ydata()
    assert len(total) == n
    assert max(total) == ev.peak / GIB
    peak = line(ax, "peak")
    k = int(np.argmax(total))
    assert list(peak.get_xdata()) == [k] and list(peak.get_ydata()) == [ev.peak / GIB]
    assert est.timeline[k].where == ev.peak_point.where
    stacked = np.sum([hs for hs in bars(ax).values()], axis=0)   # the bars add up to the total
    assert stacked == pytest.approx(total, rel=1e-12)
    texts = [t.get_text() for t in ax.texts]
    assert {"forward", "backward", "optimizer"} <= set(texts)
    assert any(t.startswith("peak 20.19 GiB\nbackward log_softmax") for t in texts)
    assert any("first / last iteration" in t for t in texts)
    fig.savefig(tmp_path / "timeline.png")


def test_timeline_needs_every_value(mpl, est):
    with pytest.raises(ConfigError):
        plots.timeline(est, b=8)


def test_versus_batch_with_budget_and_b_max(mpl, est, tmp_path):
    values = list(range(1, 65))
    fig = plots.versus(est, "b", values, budget="80GiB", reserve="10%", s=1024)
    ax = fig.axes[0]
    evs = [est.at(b=v, s=1024) for v in values]
    pk = line(ax, "peak")
    assert list(pk.get_xdata()) == values
    assert list(pk.get_ydata()) == [ev.peak / GIB for ev in evs]
    act = line(ax, "activations (end of forward)")
    assert list(act.get_ydata()) == [ev.bytes["activations"] / GIB for ev in evs]
    assert "master" not in [ln.get_label() for ln in ax.get_lines()]      # zero under autocast
    assert list(line(ax, "budget: 80.00 GiB").get_ydata()) == [80.0, 80.0]
    usable = 80 * GIB - (80 * GIB) // 10
    (u,) = [ln for ln in ax.get_lines() if ln.get_label().startswith("usable")]
    assert list(u.get_ydata()) == [usable / GIB] * 2
    sol = solve(est, "b", "80GiB", reserve="10%", s=1024)
    bmax = line(ax, f"b_max = {sol.value}")
    assert list(bmax.get_xdata()) == [sol.value, sol.value] and sol.value == 30
    fig.savefig(tmp_path / "versus.png")


def test_versus_sequence_with_a_gpu_budget(mpl, est):
    bud = budget(gpu="T4")
    fig = plots.versus(est, "s", range(64, 1025, 64), budget=bud, b=4)
    ax = fig.axes[0]
    assert list(line(ax, "budget: T4 14.76 GiB").get_ydata()) == [bud.total / GIB] * 2
    sol = solve(est, "s", bud.total, reserve=bud.reserve, b=4)
    (m,) = [ln for ln in ax.get_lines() if ln.get_label().startswith("s_max = ")]
    assert m.get_xdata()[0] == sol.value == 1024 and "model limit" in m.get_label()
    with pytest.raises(ConfigError, match="reserve = '200%' is not valid"):
        plots.versus(est, "s", [64], budget=bud, reserve="200%", b=4)


def test_versus_without_budget_and_when_nothing_fits(mpl, est):
    ax = plots.versus(est, "b", [1, 2], s=1024).axes[0]
    assert {ln.get_label() for ln in ax.get_lines()} == \
        {"peak", "params", "grads", "optimizer", "activations (end of forward)"}
    ax = plots.versus(est, "b", [1, 2], budget="1GiB", s=1024).axes[0]
    assert any(t.get_text().startswith("nothing fits") for t in ax.texts)
    with pytest.raises(ConfigError):                 # beyond the model's s_max
        plots.versus(est, "s", [512, 2048], b=1)
    with pytest.raises(ConfigError):
        plots.versus(est, "b", [0, 1], s=8)


def test_a_clear_message_without_matplotlib(est, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)     # import fails
    with pytest.raises(ImportError, match=r"symmem.plots needs matplotlib: pip install 'symmem\[plot\]'"):
        plots.breakdown(est, {"b": 1, "s": 8})
