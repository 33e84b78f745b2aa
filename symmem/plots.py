"""Plots of an :class:`~symmem.engine.Estimate` (matplotlib, an optional extra:
``pip install 'symmem[plot]'``).

- :func:`breakdown`: the bytes of each role at the peak, stacked, for one or several
  configurations;
- :func:`timeline`: the live bytes at every point of the training step, by role, with
  the phases shaded and the peak marked;
- :func:`versus`: the peak and each component against ``b`` or ``s``, with the budget
  and the largest value that fits (:func:`symmem.solve.solve`).

Every function returns the matplotlib :class:`~matplotlib.figure.Figure` and takes
``ax=`` to draw into an Axes of your own (the figure returned is then ``ax.figure``).
Without ``ax`` the figure is made with ``matplotlib.figure.Figure``, not with pyplot: it
is not registered with pyplot, so Jupyter shows it once (as the cell's value) and a
script saves it with ``fig.savefig(...)``; pass ``ax`` from ``plt.subplots()`` to use
pyplot's windows. Sizes are in GiB (2**30 bytes): the numbers plotted are the exact
byte counts divided by 2**30.
"""
from __future__ import annotations

import textwrap

import numpy as np
import sympy as sp

from .engine import Estimate
from .errors import ConfigError, Infeasible
from .printing import format_bytes
from .plan import ROLES
from .units import GiB

__all__ = ["breakdown", "timeline", "versus", "ROLE_COLORS", "GIB"]

#: Bytes in a GiB: every plot's unit.
GIB = GiB

#: One colour per role, the same in every plot.
ROLE_COLORS = {
    "params": "#4C72B0", "buffers": "#64B5CD", "master": "#8172B3", "optimizer": "#DD8452",
    "grads": "#C44E52", "activations": "#55A868", "batch": "#937860", "transient": "#8C8C8C",
}
_PHASE_COLORS = {"forward": "#4C72B0", "backward": "#C44E52", "optimizer": "#DD8452"}
_IMPORT_ERROR = "symmem.plots needs matplotlib: pip install 'symmem[plot]'"


def _axes(ax, figsize):
    """``(figure, axes)``: ``ax``'s, or a new pyplot-free Figure with one Axes."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(_IMPORT_ERROR) from e
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def _values_label(values: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


def _policy_label(est: Estimate) -> str:
    p = est.policy
    return f"{p.precision}, {p.optimizer} [{p.impl}], {p.device}"


def _legend_outside(ax, handles=None, labels=None):
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


# ----------------------------------------------------------------------------- breakdown

def breakdown(est: Estimate, at, *, ax=None):
    """Stacked bars of the bytes of each role at the peak (params, master, optimizer,
    grads, activations, transient), in GiB, one bar per configuration.

    ``at``: a dict of values (``{"b": 8, "s": 1024}``) or a list of them (e.g. ``b`` in
    1, 8, 32). Each bar is ``est.at(**values)``: its segments are ``peak_parts[role] /
    2**30``; the label under it names the configuration and where its peak is (phase and
    node); the number on top is the peak. Roles that hold nothing in every bar are left
    out of the legend."""
    configs = [at] if isinstance(at, dict) else list(at)
    if not configs or not all(isinstance(c, dict) for c in configs):
        raise ConfigError("at", at, "a dict of values, e.g. {'b': 8, 's': 1024}, or a non-empty "
                          "list of them")
    evs = [est.at(**c) for c in configs]
    fig, ax = _axes(ax, (max(5.0, 1.5 * len(evs) + 3.0), 4.8))
    x = np.arange(len(evs))
    bottom = np.zeros(len(evs))
    for role in ROLES:
        heights = np.array([ev.peak_parts[role] / GIB for ev in evs])
        if not heights.any():
            continue
        ax.bar(x, heights, 0.6, bottom=bottom, label=role, color=ROLE_COLORS[role])
        bottom += heights
    for xi, ev in zip(x, evs):
        ax.annotate(f"{ev.peak / GIB:,.2f} GiB", (xi, ev.peak / GIB), xytext=(0, 3),
                    textcoords="offset points", ha="center", va="bottom", fontsize=9)
    labels = [_values_label(c) + "\n" + "\n".join(textwrap.wrap(ev.peak_point.where, 18))
              for c, ev in zip(configs, evs)]
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_xlim(-0.6, len(evs) - 0.4)
    ax.set_ylim(0, max(ev.peak for ev in evs) / GIB * 1.12)
    ax.set_ylabel("GiB at the peak")
    ax.set_title(f"{est.graph.name}: memory at the peak by role\n{_policy_label(est)}", fontsize=10)
    handles, names = ax.get_legend_handles_labels()
    _legend_outside(ax, handles[::-1], names[::-1])     # top of the stack first
    return fig


# ------------------------------------------------------------------------------ timeline

def _timeline_data(est: Estimate, values: dict):
    """Per role, the exact bytes at each point of ``est.timeline``; the totals (whole
    bytes, rounded up as ``Estimate.at`` rounds the peak)."""
    subs = est._subs(values)
    parts = {r: [] for r in ROLES}
    totals = []
    for p in est.timeline:
        total = sp.Integer(0)
        for role, e in p.parts:
            v = sp.sympify(e).xreplace(subs)
            if not v.is_number:
                missing = sorted(str(x) for x in v.free_symbols)
                raise ConfigError("values", missing, "a value for every symbol",
                                  f"Pass them, e.g. timeline(est, {missing[0]}=...).")
            parts[role].append(v)
            total += v
        totals.append(int(sp.ceiling(total)))
    return parts, totals


def timeline(est: Estimate, *, ax=None, **values):
    """Live memory through one training step at ``values`` (e.g. ``b=8, s=1024``).

    Every point of ``est.timeline`` is drawn, in order: ``x`` is the index ``i`` of
    ``est.timeline[i]`` and the bar at ``x`` stacks that point's bytes by role (GiB); the
    black step line is the total. The forward, backward and optimizer phases are
    shaded and labelled, and the peak (the largest total, which is ``est.at(**values)
    .peak``) is marked and labelled with where it is.

    The repeated block (e.g. GPT-2's ``L`` layers) is counted as three copies (first,
    middle, last), the middle one extrapolated, so the timeline has no point for the middle
    iterations: for each point inside it there are two, at the
    first and at the last iteration (their bytes are affine in the iteration, so the
    maximum is at one of them). They are plotted as they are, one after the other, so
    inside the block the bars alternate between the two iterations (forward: first,
    last; backward: last, first); the span is marked "repeated block"."""
    ev = est.at(**values)                      # checks the values, as Estimate.at does
    parts, totals = _timeline_data(est, values)
    points = est.timeline
    n = len(points)
    fig, ax = _axes(ax, (11.0, 4.8))
    x = np.arange(n)
    bottom = np.zeros(n)
    for role in ROLES:
        heights = np.array([float(v) for v in parts[role]]) / GIB
        if not heights.any():
            continue
        ax.bar(x, heights, 1.0, bottom=bottom, label=role, color=ROLE_COLORS[role], linewidth=0)
        bottom += heights
    total_gib = np.array(totals) / GIB
    ax.step(x, total_gib, where="mid", color="black", linewidth=0.7, label="total")
    top = max(totals) / GIB
    ax.set_ylim(0, top * 1.32)
    ax.set_xlim(-0.5, n - 0.5)

    # phases: shaded bands, named above the plot
    start = 0
    xt = ax.get_xaxis_transform()
    for i in range(1, n + 1):
        if i == n or points[i].phase != points[start].phase:
            phase = points[start].phase
            ax.axvspan(start - 0.5, i - 0.5, color=_PHASE_COLORS.get(phase, "#999999"),
                       alpha=0.07, zorder=0, linewidth=0)
            if i - start >= 0.06 * n:
                ax.text((start + i - 1) / 2, 1.01, phase, transform=xt, ha="center", va="bottom",
                        fontsize=9, color=_PHASE_COLORS.get(phase, "black"))
            elif phase == "optimizer":
                ax.text(i - 0.5, 1.01, phase, transform=xt, ha="right", va="bottom", fontsize=9,
                        color=_PHASE_COLORS["optimizer"])
            start = i
    # the repeated block's points: brackets near the top
    i = 0
    while i < n:
        if points[i].iteration:
            j = i
            while j + 1 < n and points[j + 1].iteration and points[j + 1].phase == points[i].phase:
                j += 1
            y = 0.93
            order = ("first", "second", "second to last", "last")
            labels = sorted({p.iteration for p in points[i:j + 1]}, key=order.index)
            text = (f"repeated block: {' / '.join(labels)} iteration"
                    + (" alternate" if len(labels) > 1 else ""))
            ax.plot([i - 0.5, j + 0.5], [y, y], transform=xt, color="#555555", linewidth=1)
            ax.text((i + j) / 2, y + 0.01, text, transform=xt, ha="center", va="bottom", fontsize=7.5,
                    color="#555555")
            i = j + 1
        else:
            i += 1
    # the peak
    k = int(np.argmax(totals))
    ax.plot([k], [totals[k] / GIB], marker="v", color="black", markersize=7, linestyle="none",
            label="peak")
    right = k > n / 2
    ax.annotate(f"peak {format_bytes(totals[k])}\n{points[k].where}", (k, totals[k] / GIB),
                xytext=(-12 if right else 12, 8), textcoords="offset points",
                ha="right" if right else "left", va="bottom", fontsize=8,
                bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none", alpha=0.8))
    ax.set_xlabel("point of the step (index into est.timeline)")
    ax.set_ylabel("live GiB")
    ax.set_title(f"{est.graph.name} at {_values_label(ev.values)}: live memory through the step\n"
                 f"{_policy_label(est)}", fontsize=10, pad=18)
    handles, names = ax.get_legend_handles_labels()
    order = [names.index(r) for r in reversed(ROLES) if r in names] + \
        [names.index(m) for m in ("total", "peak")]
    _legend_outside(ax, [handles[i] for i in order], [names[i] for i in order])
    return fig


# ------------------------------------------------------------------------------- versus

def _budget(budget, reserve) -> tuple[int, int, str]:
    """``(total, reserve, label)`` from bytes, a size string or a Budget."""
    from .gpus import as_budget
    bud = as_budget(budget, reserve)
    name = f"{bud.gpu.name} " if bud.gpu is not None else ""
    return bud.total, bud.reserve, f"{name}{format_bytes(bud.total)}"


def versus(est: Estimate, symbol: str, values, budget=None, reserve=None, *, ax=None, **fixed):
    """The peak and each component (GiB) against ``symbol`` (``"b"`` or ``"s"``, or any
    other symbol of the model) at ``values``, every other symbol fixed by ``fixed`` or by
    the model's bindings, evaluated with ``est.evaluator``.

    With a ``budget`` (bytes, a size string such as ``"80GiB"``, or a
    :class:`symmem.gpus.Budget` from ``symmem.gpus.budget(...)``, which carries its own
    reserve) and an optional ``reserve`` (bytes, a size or a percentage, as
    :func:`symmem.solve.solve` takes it), the budget is a horizontal line (and, with a
    reserve, the usable bytes a dashed one) and the largest value of ``symbol`` that fits
    (``solve(est, symbol, ...)``) a vertical line, labelled; the axis extends to it if it
    lies outside ``values``. When nothing fits, the plot says so."""
    from .solve import solve
    from .symbols import TABLE, symbol as lookup
    lookup(symbol)
    if symbol in fixed:
        raise ConfigError(symbol, fixed[symbol], "not fixed: it is the symbol plotted against")
    xs = list(values)
    if not xs or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0
                         for v in xs):
        raise ConfigError("values", values, f"a non-empty list of positive integers for {symbol}")
    xs = [int(v) for v in xs]
    for v in (min(xs), max(xs)):
        est._subs({**fixed, symbol: v})            # the model's limits (s <= s_max)
    names = (symbol, *fixed)
    x = np.array(xs, dtype=np.int64)
    args = {symbol: x, **fixed}
    fig, ax = _axes(ax, (9.0, 4.8))
    peak = est.evaluator(*names)(**args)
    ax.plot(x, peak / GIB, color="black", linewidth=2.2, label="peak", zorder=3)
    for comp in est.components:
        if est.components[comp] == 0:
            continue
        y = est.evaluator(*names, component=comp)(**args)
        label = "activations (end of forward)" if comp == "activations" else comp
        ax.plot(x, y / GIB, color=ROLE_COLORS[comp], linewidth=1.3, label=label)
    if budget is not None:
        total, res, blabel = _budget(budget, reserve)
        ax.axhline(total / GIB, color="#B22222", linewidth=1.4, label=f"budget: {blabel}")
        if res:
            ax.axhline((total - res) / GIB, color="#B22222", linewidth=1.0, linestyle="--",
                       label=f"usable: {format_bytes(total - res)}\n({format_bytes(res)} reserve)")
        try:
            sol = solve(est, symbol, total, reserve=res, direction="max", **fixed)
        except Infeasible as e:
            ax.text(0.02, 0.95, f"nothing fits: the peak at {symbol} = {e.value:,} is "
                    f"{format_bytes(e.needed)} > usable {format_bytes(e.usable)}",
                    transform=ax.transAxes, va="top", fontsize=9, color="#B22222")
        except ConfigError:
            ax.text(0.02, 0.95, f"no largest {symbol}: the peak does not reach the budget",
                    transform=ax.transAxes, va="top", fontsize=9, color="#B22222")
        else:
            what = f"{symbol}_max = {sol.value:,}" + (" (model limit)" if sol.limit else "")
            ax.axvline(sol.value, color="#2E8B57", linewidth=1.2, linestyle=":", label=what)
            ax.plot([sol.value], [sol.at_value.peak / GIB], marker="o", color="#2E8B57",
                    linestyle="none")
            left = sol.value > (min(xs) + max(max(xs), sol.value)) / 2
            ax.annotate(f"{what}\npeak {format_bytes(sol.at_value.peak)}\n"
                        f"<= usable {format_bytes(sol.usable)}",
                        (sol.value, 0.04), xycoords=ax.get_xaxis_transform(),
                        xytext=(-5 if left else 5, 0), textcoords="offset points",
                        ha="right" if left else "left", va="bottom", fontsize=8,
                        color="#2E8B57",
                        bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none", alpha=0.85))
    from matplotlib.ticker import MaxNLocator
    top = max(float(np.max(peak)), total if budget is not None else 0) / GIB
    ax.set_ylim(0, top * 1.08)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(f"{symbol}: {TABLE[symbol].meaning}")
    ax.set_ylabel("GiB")
    at = f" at {_values_label(fixed)}" if fixed else ""
    ax.set_title(f"{est.graph.name}: memory against {symbol}{at}\n{_policy_label(est)}", fontsize=10)
    ax.grid(True, alpha=0.3)
    _legend_outside(ax)
    return fig
