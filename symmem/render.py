"""Reports: an estimate as documents people can read, typeset and reuse.

:func:`render` fills one of three Jinja2 templates in ``templates/`` (``report.tex.j2``,
``report.md.j2``, ``report.html.j2``) with :func:`report_context`: the model and policy,
a symbol glossary, each component's formula, the peak and where it is, exact bytes at
the chosen values, the largest micro-batch that fits a budget with its closed form, and
where each term comes from (the rule of each operator, the papers).

A report computes nothing: the caller solves and passes the answer. With a budget, pass
``solution``, what :func:`symmem.solve.max_batch` gave for it (a
:class:`~symmem.solve.Solution`, or the :class:`~symmem.errors.Infeasible` it raised,
which the report states as "nothing fits"), and the :class:`~symmem.gpus.Budget` for its
label::

    bud = symmem.gpus.budget(gpu="H100-80GB")
    sol = symmem.solve.max_batch(est, bud, s=1024)
    render(est, "latex", b=8, s=1024, solution=sol, budget=bud)

Every formula, number and user text is printed by :mod:`symmem.printing` (the LaTeX and
MathML printers, the escaping), through the environment's filters. The templates'
delimiters do not clash with TeX (``((* block *))``, ``((( variable )))``,
``((= comment =))``); autoescaping is off and every text a user supplies (a model name
from a folder name, a title) goes through an explicit filter: ``tex_escape``,
``html_escape`` or ``md_escape``.

The printing functions this module used to define (``latex``, ``latex_rows``,
``mathml``, ``tex_escape``, …) are re-exported here for existing code; new code imports
them from :mod:`symmem.printing`.
"""
from __future__ import annotations

import inspect
import re
from functools import lru_cache
from pathlib import Path

import sympy as sp

from .engine import Estimate, canonical
from .errors import ConfigError, Infeasible
from .gpus import Budget
from .printing import (WIDTH, LatexPrinter, MathMLPrinter, html_escape, latex, latex_max_rows,
                       latex_parts, latex_rows, mathml, mathml_max, mathml_parts, md_escape,
                       rst_html, rst_md, rst_tex, tex_escape, tex_number)
from .plan import ROLES
from .symbols import TABLE, M, R, b, s
from .units import GiB

__all__ = ["environment", "report_context", "render", "latex_breakdown", "FORMATS",
           "TEMPLATES", "SOURCES",
           # re-exported from symmem.printing
           "LatexPrinter", "MathMLPrinter", "latex", "latex_rows", "latex_max_rows", "mathml",
           "mathml_max", "tex_escape", "html_escape", "md_escape"]

#: The report formats and their templates.
FORMATS = {"latex": "report.tex.j2", "markdown": "report.md.j2", "html": "report.html.j2"}

#: Where the templates are: ``templates/`` beside the package (the repository's root).
TEMPLATES = Path(__file__).resolve().parent / "templates"   # also ./templates in the source tree


def latex_breakdown(est: Estimate, point=None, *, underbrace: bool = True, display: bool = True,
                    width: int = WIDTH, **values) -> str:
    """The peak at one point of the step as the sum of its role parts
    (:func:`symmem.printing.latex_parts` of the point's parts in canonical form).

    ``point`` is a :class:`~symmem.counter.Point` (e.g. the binding candidate of a
    solve); by default the peak point at ``values`` (``b=8, s=1024``). Each part is
    ``\\underbrace{…}_{\\text{role}}`` (``underbrace=True``) or bracketed. ``display=False``
    gives one line; without underbraces that line parses back to the point's total."""
    if point is None:
        point = est.at(**values).peak_point
    return latex_parts([(role, canonical(e)) for role, e in point.parts],
                       underbrace=underbrace, display=display, width=width)


@lru_cache(maxsize=4)
def environment(path: str | None = None):
    """The Jinja2 environment over ``templates/`` (or ``path``): TeX-safe delimiters
    (``((* *))``, ``((( )))``, ``((= =))``), ``StrictUndefined``, no autoescaping, and
    the filters the templates use (escaping, formulas, numbers)."""
    import jinja2
    where = Path(path) if path is not None else TEMPLATES
    if not (where / FORMATS["latex"]).is_file():
        raise ConfigError("templates", str(where), "a folder holding symmem's report templates "
                          "(report.tex.j2, report.md.j2, report.html.j2)")
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(where)),
        block_start_string="((*", block_end_string="*))",
        variable_start_string="(((", variable_end_string=")))",
        comment_start_string="((=", comment_end_string="=))",
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
        autoescape=False, undefined=jinja2.StrictUndefined)
    rows = " \\\\\n".join
    env.globals["symbol"] = sp.Symbol
    env.filters.update(
        tex_escape=tex_escape, html_escape=html_escape, md_escape=md_escape,
        rst_tex=rst_tex, rst_html=rst_html, rst_md=rst_md,
        tex=lambda e: latex(e),
        tex_display=lambda e, lhs=None: latex(e, display=True, lhs=lhs),
        tex_align=lambda e, lhs=None: rows(latex_rows(e, lhs=lhs)),
        tex_max=lambda cands, lhs=None, labels=False: rows(latex_max_rows(
            [c for _, c in cands], lhs=lhs, labels=[w for w, _ in cands] if labels else None)),
        tex_breakdown=lambda parts, underbrace=True: latex_parts(parts, underbrace=underbrace),
        tex_num=tex_number,
        mathml=lambda e, lhs=None, display=True: mathml(e, lhs=lhs, display=display),
        mathml_max=lambda cands, lhs=None: mathml_max([c for _, c in cands], lhs=lhs),
        mathml_breakdown=mathml_parts,
        commas=lambda n: f"{n:,}",
        gib=lambda n: f"{n / GiB:,.2f}",
        pct=lambda x: f"{x:.1f}",
    )
    return env


# -------------------------------------------------------------------------------- contents

#: The papers the formulas check against, for the reports' sources section.
SOURCES = (
    {"authors": "V. Korthikanti, J. Casper, S. Lym, L. McAfee, M. Andersch, M. Shoeybi, B. Catanzaro",
     "year": 2022, "title": "Reducing Activation Recomputation in Large Transformer Models",
     "where": "MLSys 2023; arXiv:2205.05198",
     "what": "Activations per layer",
     "formula": s * b * TABLE["h"].symbol * (34 + 5 * TABLE["a"].symbol * s / TABLE["h"].symbol),
     "note": "bytes, with 2-byte activations and 1-byte dropout masks; symmem's per-layer "
             "activations of GPT-2 with GELU equal it plus the layer-norm statistics the paper "
             "leaves out.",
     "sequence": True},       # a transformer layer's: not shown for a model without s
    {"authors": "S. Rajbhandari, J. Rasley, O. Ruwase, Y. He", "year": 2020,
     "title": "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
     "where": "SC20; arXiv:1910.02054",
     "what": "Model states of mixed-precision Adam, N parameters",
     "formula": sp.Symbol("N") * (TABLE["B_w"].symbol + TABLE["B_g"].symbol + TABLE["B_m"].symbol
                                  + 2 * TABLE["B_o"].symbol),
     "note": "bytes: 16 bytes per parameter priced 2 + 2 + 4 + 4 + 4; symmem's params, grads, "
             "master and optimizer components add up to it."},
)

def _ops(graph) -> list[str]:
    """The ops of ``graph`` (repeated bodies included), in order of first appearance."""
    from .graph import Repeat
    seen: dict[str, None] = {}

    def visit(g):
        for item in g.items:
            if isinstance(item, Repeat):
                visit(item.body)
            else:
                seen.setdefault(item.op, None)
    visit(graph)
    return list(seen)


def _summary(fn) -> str:
    """The first sentence of a rule's docstring (its summary line, whole)."""
    doc = inspect.getdoc(fn) or ""
    para = " ".join(doc.split("\n\n", 1)[0].split())
    m = re.search(r"(?<=[.!?])\s+(?=[A-Z`(])", para)
    return para[:m.start()] if m else para


def _rules(graph) -> list[dict]:
    from .rules import RULES
    out = []
    for op in _ops(graph):
        fn = RULES.get(op)
        if fn is not None:
            out.append({"op": op, "rule": f"{fn.__module__}.{fn.__name__}", "summary": _summary(fn)})
    return out


def _sym(k):
    return TABLE[k].symbol if isinstance(k, str) and k in TABLE else sp.sympify(k)


def _value_text(v) -> str:
    v = sp.sympify(v)
    return f"{int(v):,}" if v.is_Integer else str(v)


def _boundary(sol, est, s_value):
    """The closed form of the largest micro-batch: ``floor((M - R - c0) / c1)`` with the
    binding candidate's bytes at b = 0 (c0) and per sequence (c1), when it is linear in b;
    else the solver's boundary as it is."""
    if sol.boundary is None:
        return None
    out = {"formula": sol.boundary, "numeric": sol.boundary_numeric, "c0": None, "c1": None}
    terms = sol.linear_terms() if sol.direction == "max" else None
    if terms is not None:
        c0, c1 = terms
        subs = {**est.bindings, **({} if s_value is None else {s: s_value})}
        n0, n1 = int(c0.xreplace(subs)), int(c1.xreplace(subs))
        out.update(c0=c0, c1=c1, c0_bytes=n0, c1_bytes=n1, check=(sol.usable - n0) // n1)
    return out


def _answer(solution, budget, s_value):
    """``(budget, solution, infeasible)`` for the report from what the caller passed:
    the Budget (by default the solution's total and reserve), the Solution or None, and
    the first line of an Infeasible's message or None. Raises ConfigError when they do
    not belong together."""
    if solution is None:
        if budget is not None:
            raise ConfigError("solution", None, "the answer of max_batch for the budget given",
                              "Pass solution=symmem.solve.max_batch(est, budget, s=...) "
                              "(or the Infeasible it raises) with budget=.")
        return None, None, None
    if isinstance(solution, Infeasible):
        if budget is None:
            raise ConfigError("budget", None, "the Budget that nothing fits",
                              "Pass budget= with an Infeasible solution.")
        if solution.symbol != "b" or solution.usable != budget.usable:
            raise ConfigError("solution", str(solution).splitlines()[0],
                              f"max_batch's answer for {budget.label}")
        return budget, None, str(solution).splitlines()[0]
    if solution.symbol != "b" or solution.direction != "max":
        raise ConfigError("solution", f"{solution.direction} {solution.symbol}",
                          "the largest micro-batch b (symmem.solve.max_batch)")
    if solution.fixed.get("s", s_value) != s_value:
        raise ConfigError("solution", f"solved at s = {solution.fixed['s']}",
                          f"a solution at the report's s = {s_value}")
    if budget is None:
        budget = Budget(total=solution.total, reserve=solution.reserve)
    elif (budget.total, budget.reserve) != (solution.total, solution.reserve):
        raise ConfigError("budget", budget.label,
                          f"the budget the solution was solved for ({solution.total:,} bytes "
                          f"less a reserve of {solution.reserve:,})")
    return budget, solution, None


def report_context(est: Estimate, *, b: int, s: int | None, solution=None, budget: Budget | None = None,
                   title: str | None = None) -> dict:
    """Everything a report shows, as data (sympy expressions, integers, plain text): the
    templates format it. Nothing is solved here.

    ``solution`` adds the largest micro-batch that fits a budget: what
    :func:`symmem.solve.max_batch` returned for it at this ``s`` (a
    :class:`~symmem.solve.Solution`), or the :class:`~symmem.errors.Infeasible` it raised
    (the report says that nothing fits). ``budget`` is that :class:`~symmem.gpus.Budget`
    (its label names the device); with a Solution it defaults to the solution's total and
    reserve, with an Infeasible it is required."""
    from . import __version__
    bud, sol, infeasible = _answer(solution, budget, s)
    regions = est.regions()
    b_sym, s_sym = TABLE["b"].symbol, TABLE["s"].symbol
    ev = est.at(b=b, **({} if s is None else {"s": s}))     # s None: an image model's formulas have none
    peak = ev.peak
    bindings = est.bindings
    comps = [{"name": k, "expr": v, "bytes": ev.bytes[k], "pct": 100 * ev.bytes[k] / peak}
             for k, v in est.components.items()]
    point = ev.peak_point
    parts = [(role, canonical(e)) for role, e in point.parts if sp.expand(e) != 0]
    peak_parts = [{"role": r, "bytes": ev.peak_parts[r], "pct": 100 * ev.peak_parts[r] / peak}
                  for r in ROLES if ev.peak_parts.get(r)]
    shown = [*est.components.values(), est.peak]
    boundary = _boundary(sol, est, s) if sol is not None else None
    if boundary is not None:
        shown.append(boundary["formula"])
    used = set().union(*(sp.sympify(e).free_symbols for e in shown)) | {b_sym} | ({s_sym} if s is not None else set())
    if bud is not None:
        used |= {M, R}
    values = {**bindings, b_sym: b, **({} if s is None else {s_sym: s})}
    if bud is not None:
        values.update({M: bud.total, R: bud.reserve})
    glossary = []
    for name, info in TABLE.items():
        if info.symbol not in used:
            continue
        v = values.get(info.symbol)
        kind = "chosen" if info.symbol in (b_sym, s_sym) else \
            "budget" if info.symbol in (M, R) else "model" if info.symbol in est.graph.bindings \
            or name in est.graph.bindings else "policy" if v is not None else ""
        glossary.append({"name": name, "symbol": info.symbol, "latex": info.latex,
                         "meaning": info.meaning, "value": None if v is None else _value_text(v),
                         "source": kind})
    name = est.graph.name
    return {
        "version": __version__,
        "title": title if title is not None else f"symmem report: {name}",
        "model": {"name": name, "parameters": int(est.prepared.param_count().xreplace(bindings)),
            "bindings": [{"name": str(k), "symbol": _sym(k), "latex": latex(_sym(k)),
                          "value": sp.sympify(v)} for k, v in est.graph.bindings.items()]},
        "policy": {"precision": est.policy.precision, "optimizer": est.policy.optimizer,
                   "device": est.policy.device, "implementation": est.policy.impl,
                   "description": est.describe()},
        "b": b, "s": s,
        "glossary": glossary,
        "components": comps,
        "peak": {"expr": est.peak, "candidates": [(p.where, canonical(p.total)) for p in est.points],
                 "count": len(est.points), "bytes": peak, "where": point.where, "phase": point.phase,
                 "node": point.node, "active": canonical(point.total), "parts": parts,
                 "breakdown": peak_parts,
                 "regions": [{"where": r.point.where, "share": f"{100 * r.share:.0f}",
                              "over": "b" if r.s is None else "b*s",      # an image model's grid is b alone
                              "bs": f"{r.b[0]:,} to {r.b[1]:,}" if r.s is None else f"{r.bs[0]:,} to {r.bs[1]:,}"}
                             for r in regions],
                 "binding": [(r.point.where, canonical(r.point.total)) for r in regions]},
        "budget": None if bud is None else {
            "label": bud.label, "total": bud.total, "reserve": bud.reserve, "usable": bud.usable,
            "infeasible": infeasible,
            "solution": None if sol is None else {
                "value": sol.value, "at": sol.at_value.peak,
                "past": None if sol.past_value is None else sol.past_value.peak,
                "binding": sol.binding.where, "limit": sol.limit, "boundary": boundary}},
        "rules": _rules(est.prepared),      # the operators counted: the kernels' own
        "sources": [p for p in SOURCES if s is not None or not p.get("sequence")],
    }


def render(est: Estimate, fmt: str, *, b: int, s: int | None, solution=None,
           budget: Budget | None = None, title: str | None = None) -> str:
    """A report of ``est`` at ``b`` and ``s`` (None for a model whose formulas have no s: an
    image model) as ``fmt``: ``"latex"`` (a standalone
    document for pdflatex), ``"markdown"`` (``$$`` math blocks) or ``"html"`` (one
    self-contained page, math in MathML). With ``solution`` (and ``budget``), as
    :func:`report_context` takes them, the report adds the largest micro-batch that fits
    and its closed form, or says that nothing fits."""
    if fmt not in FORMATS:
        raise ConfigError("format", fmt, f"one of {', '.join(FORMATS)}")
    ctx = report_context(est, b=b, s=s, solution=solution, budget=budget, title=title)
    return environment().get_template(FORMATS[fmt]).render(**ctx)
