"""Reports: LaTeX that parses back to the same formulas, escaping of user text, a LaTeX
document that compiles, the three formats' contents, and the ``report`` and ``formula``
commands.

The parse-back tests use sympy's LaTeX parser with the ANTLR backend
(``antlr4-python3-runtime==4.11.*``, in the ``test`` extra)."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import sympy as sp
from sympy.core.function import AppliedUndef

import symmem as sm
from symmem import render as rd
from symmem.cli import main
from symmem.engine import canonical
from symmem.errors import Infeasible
from symmem.gpus import budget as make_budget
from symmem.solve import max_batch, max_seq
from symmem.symbols import TABLE

GPT2_BUDGET = "H100-80GB"
NASTY = r"my_model 100% & $x\y <script>alert(1)</script> {a}^~#"


# ----------------------------------------------------------------------------- fixtures

def answer(est, *, s, gpu=None, budget=None, reserve="10%") -> dict:
    """What the report command passes to render: the budget and max_batch's answer for it
    at ``s`` (the Solution, or the Infeasible it raised)."""
    bud = make_budget(gpu=gpu, bytes=budget, reserve=reserve)
    try:
        return {"budget": bud, "solution": max_batch(est, bud, s=s)}
    except Infeasible as e:
        return {"budget": bud, "solution": e}


@pytest.fixture(scope="module")
def ests():
    """gpt2 under fp32 and bf16-mixed (adamw, cuda, foreach): about 0.6 s each."""
    return {p: sm.estimate(sm.models.preset("gpt2"), sm.Policy(precision=p, attention="eager"))
            for p in ("fp32", "bf16-mixed")}


@pytest.fixture(scope="module")
def est16(ests):
    return ests["bf16-mixed"]


@pytest.fixture(scope="module")
def reports(est16):
    """The three formats of gpt2, bf16-mixed, b=8, s=1024, on an H100 (10% reserve)."""
    given = answer(est16, s=1024, gpu=GPT2_BUDGET)
    return {fmt: rd.render(est16, fmt, b=8, s=1024, **given) for fmt in rd.FORMATS}


@pytest.fixture(scope="module")
def solution(est16):
    bud = make_budget(gpu=GPT2_BUDGET)
    return max_batch(est16, bud.total, reserve=bud.reserve, s=1024)


# ----------------------------------------------------------------------------- parse back

def _parse(tex: str) -> sp.Expr:
    """sympy's LaTeX parser, then its names mapped back to symmem's symbols and its
    ``max`` (ANTLR reads ``\\max(...)`` as an undefined function) to ``Max``."""
    parse_latex = pytest.importorskip("sympy.parsing.latex").parse_latex
    pytest.importorskip("antlr4", reason="the test extra installs antlr4-python3-runtime==4.11.*")
    expr = parse_latex(tex, backend="antlr")
    back = {parse_latex(info.latex, backend="antlr"): info.symbol for info in TABLE.values()}
    expr = expr.xreplace(back)
    return expr.replace(lambda e: isinstance(e, AppliedUndef) and e.func.__name__ == "max",
                        lambda e: sp.Max(*e.args, evaluate=False))


def _same(a, b) -> bool:
    if isinstance(a, sp.Max) or isinstance(b, sp.Max):
        return isinstance(a, sp.Max) and isinstance(b, sp.Max) and len(a.args) == len(b.args) \
            and {sp.expand(x) for x in a.args} == {sp.expand(x) for x in b.args}
    return sp.expand(a - b) == 0


def test_every_symbol_name_parses_back_to_a_distinct_symbol():
    from sympy.parsing.latex import parse_latex
    pytest.importorskip("antlr4")
    parsed = [parse_latex(info.latex, backend="antlr") for info in TABLE.values()]
    assert all(isinstance(p, sp.Symbol) for p in parsed)
    assert len({p.name for p in parsed}) == len(TABLE)
    assert parse_latex(r"s_{\max}", backend="antlr").name == "s_{max}"


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("component", ["params", "grads", "master", "optimizer", "activations"])
def test_component_latex_parses_back(ests, precision, component):
    expr = ests[precision].components[component]
    assert sp.expand(_parse(rd.latex(expr)) - expr) == 0


def test_peak_latex_parses_back(ests):
    """The whole ``\\max`` of fp32's 25 candidates, in one line (ANTLR takes ~8 s on it)."""
    peak = ests["fp32"].peak
    tex = rd.latex(peak)
    assert tex.startswith(r"\max\left({L {\left(") and "\n" not in tex
    assert _same(_parse(tex), peak)


def test_peak_latex_parses_back_bf16(est16):
    """bf16-mixed's candidates with the model's numbers (short enough to parse fast),
    and the one that is the peak at b = 8, s = 1024 in symbols."""
    bound = sp.Max(*(canonical(a.xreplace(est16.bindings)) for a in est16.peak.args), evaluate=False)
    assert len(bound.args) == len(est16.points) > 1
    assert _same(_parse(rd.latex(bound)), bound)
    active = canonical(est16.at(b=8, s=1024).peak_point.total)
    assert sp.expand(_parse(rd.latex(active)) - active) == 0


def test_max_batch_boundary_parses_back(solution):
    assert isinstance(solution.boundary, sp.floor) and solution.value == 30
    assert sp.expand(_parse(rd.latex(solution.boundary)).args[0] - solution.boundary.args[0]) == 0
    # and the LaTeX's numbers give the answer
    assert _parse(rd.latex(solution.boundary_numeric)).xreplace(
        {TABLE["M"].symbol: solution.total, TABLE["R"].symbol: solution.reserve}) == 30


def test_quadratic_boundary_parses_back(est16):
    """max_seq's boundary is a root of a quadratic: a square root inside a floor."""
    sol = max_seq(est16, "16GiB", b=8)
    tex = rd.latex(sol.boundary)
    assert r"\sqrt{" in tex and r"\lfloor" in tex
    assert sp.expand(_parse(tex).args[0] - sol.boundary.args[0]) == 0


def test_breakdown_parses_back_to_the_peak_point(est16):
    ev = est16.at(b=8, s=1024)
    tex = rd.latex_breakdown(est16, underbrace=False, display=False, b=8, s=1024)
    assert sp.expand(_parse(tex) - ev.peak_point.total) == 0
    shown = rd.latex_breakdown(est16, b=8, s=1024)
    assert shown.startswith(r"\begin{aligned}") and r"\underbrace{" in shown
    assert [r for r in ev.peak_parts if r"_{\text{%s}}" % r in shown] == \
        [r for r, v in ev.peak_parts.items() if v]


def _unlayout(tex: str) -> str:
    """The display form with its layout removed, in the export form's spelling."""
    tex = re.sub(r"\\(begin|end)\{aligned\}(\[t\])?|\\\\(\[[^]]*\])?|\\quad|&|\\,|^%.*$", " ",
                 tex, flags=re.M)
    tex = tex.replace(r"\max\bigl(", r"\max\left(").replace(r"\bigr)", r"\right)}")
    tex = tex.replace(r"\bigl(", r"{\left(").replace(r"\max\left(", r"\max\left({")
    return " ".join(tex.split())


@pytest.mark.parametrize("component", ["params", "optimizer", "activations"])
def test_display_form_is_the_export_form_laid_out(ests, component):
    expr = ests["bf16-mixed"].components[component]
    shown = rd.latex(expr, display=True, lhs=r"\mathrm{x}", width=40)
    assert shown.count(r"\\") >= 1          # broken over lines at width 40
    body = _unlayout(shown).split("=", 1)[1]
    assert body.split() == rd.latex(expr).split()
    assert sp.expand(_parse(body) - expr) == 0


def test_display_max_has_one_candidate_per_row(est16):
    rows = rd.latex_rows(est16.peak, lhs=r"\mathrm{peak}")
    assert rows[0].startswith(r"\mathrm{peak} = \max\bigl(\, & L \bigl(")
    assert rows[-1].endswith(r"\,\bigr)")
    cands = []
    for row in rows:
        if row.startswith(r"& \quad "):
            cands[-1].append(row[len(r"& \quad "):])
        else:
            cands.append([row.split("&", 1)[1]])
    # one row opens each candidate; its lines are the export form's tokens, laid out
    texts = [" ".join(c).strip().removesuffix(r",\,").removesuffix(r"\,\bigr)") for c in cands]
    texts = [t.replace(r"\bigl(", r"{\left(").replace(r"\bigr)", r"\right)}").split() for t in texts]
    assert texts == [rd.latex(a).split() for a in est16.peak.args]


def test_sums_are_printed_L_then_b_then_s(est16):
    tex = rd.latex(est16.components["activations"])
    assert tex.startswith(r"L {\left(")
    i_b, i_s, i_rest = tex.index(r"b {\left("), tex.index(" + 8 s"), tex.index(r"B_{a} V h")
    assert i_b < i_s < i_rest
    # the canonical form itself is kept: the L group holds every term with L
    assert canonical(est16.components["activations"]) == est16.components["activations"]
    # group=False is sympy's own order
    assert rd.latex(est16.components["activations"], group=False) != tex


def test_printer_is_a_sympy_latex_printer():
    from sympy.printing.latex import LatexPrinter
    assert issubclass(rd.LatexPrinter, LatexPrinter)
    b, s, L = (TABLE[n].symbol for n in ("b", "s", "L"))
    assert rd.LatexPrinter().doprint(L * (b + 1)) == r"L {\left(b + 1\right)}"
    assert rd.latex(sp.Max(4 + s, 123 * L, evaluate=False)).count("{") >= 2   # braced arguments


def test_data_parallel_degree_is_not_a_differential():
    """ANTLR reads ``d h`` as the differential dh: the export form braces d."""
    a, d, h, L = (TABLE[n].symbol for n in ("a", "d", "h", "L"))
    expr = a * d * h + L * d * (h + 1) + d**2
    tex = rd.latex(expr)
    assert "{d}" in tex and sp.expand(_parse(tex) - expr) == 0
    assert "{d}" not in rd.latex(expr, display=True)


def test_mathml_is_presentation_mathml(est16):
    m = rd.mathml(est16.components["activations"], lhs="activations")
    assert m.startswith('<math display="block"><mrow><mi>activations</mi><mo>=</mo>')
    assert "<msub><mi>B</mi><mi>a</mi></msub>" in m and "http" not in m
    mx = rd.mathml(est16.peak)
    assert mx.count("<mtr>") == len(est16.peak.args)


# ----------------------------------------------------------------------------- escaping

def test_tex_escape_every_special_character():
    assert rd.tex_escape("\\ { } $ & # ^ _ ~ % < > |") == (
        r"\textbackslash{} \{ \} \$ \& \# \textasciicircum{} \_ \textasciitilde{} \% "
        r"\textless{} \textgreater{} \textbar{}")
    assert rd.tex_escape("café naïve Straße") == r"caf\'{e} na\"{i}ve Stra\ss{}e"
    assert rd.tex_escape("模型\n") == "[U+6A21][U+578B] "


def test_html_and_markdown_escape():
    assert rd.html_escape('<script>"&\'') == "&lt;script&gt;&#34;&amp;&#39;"
    assert rd.md_escape("a_b*c|d <x> $5") == r"a\_b\*c\|d &lt;x&gt; \$5"


def test_user_text_is_escaped_in_every_format(est16):
    tex = rd.render(est16, "latex", b=8, s=1024, title=NASTY)
    assert r"\title{my\_model 100\% \& \$x\textbackslash{}y \textless{}script\textgreater{}" in tex
    for raw in (NASTY, "my_model", "100% &", "& $x", "<script>", "{a}^~#"):
        assert raw not in tex
    html = rd.render(est16, "html", b=8, s=1024, title=NASTY)
    assert "<script" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    md = rd.render(est16, "markdown", b=8, s=1024, title=NASTY)
    assert "<script" not in md and md.startswith(r"# my\_model 100% &amp; \$x\\y &lt;script&gt;")


# ----------------------------------------------------------------------------- LaTeX compiles

def _pdflatex(tex: str, tmp_path: Path) -> Path:
    if shutil.which("pdflatex") is None:
        pytest.skip("pdflatex is not installed (make test installs texlive-latex-base and "
                    "texlive-latex-recommended from Debian's packages)")
    (tmp_path / "report.tex").write_text(tex, encoding="utf-8")
    run = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "report.tex"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    log = (tmp_path / "report.log").read_text(encoding="latin-1")
    assert run.returncode == 0, run.stdout[-3000:]
    pdf = tmp_path / "report.pdf"
    assert pdf.is_file() and pdf.read_bytes().startswith(b"%PDF")
    # long formulas are broken over lines: nothing sticks out of the text by more than 2pt
    over = [float(x) for x in re.findall(r"Overfull \\hbox \(([\d.]+)pt too wide\)", log)]
    assert all(x < 2 for x in over), over
    # only the Type 1 fonts a minimal TeX ships: no bitmap font generated by METAFONT
    assert ".pk>" not in log
    return pdf


def _pdf_text(pdf: Path) -> str | None:
    if shutil.which("pdftotext") is None:
        return None
    return subprocess.run(["pdftotext", str(pdf), "-"], capture_output=True, text=True).stdout


def test_latex_report_compiles(reports, tmp_path):
    pdf = _pdflatex(reports["latex"], tmp_path)
    text = _pdf_text(pdf)
    if text is not None:
        assert "symmem report: gpt2" in text and "124,439,808" in text


def test_latex_with_user_text_still_compiles(est16, tmp_path):
    tex = rd.render(est16, "latex", b=1, s=64, **answer(est16, s=64, budget="1GiB", reserve=0),
                    title=NASTY + " café 模型")
    pdf = _pdflatex(tex, tmp_path)
    text = _pdf_text(pdf)
    if text is not None:
        assert "100% & $x\\y <script>alert(1)</script>" in text


# ----------------------------------------------------------------------------- contents

def test_every_format_holds_glossary_formulas_numbers_and_boundary(est16, reports, solution):
    from symmem.rules import RULES
    ev = est16.at(b=8, s=1024)
    numbers = [f"{ev.bytes[k]:,}" for k in ("params", "optimizer", "activations", "peak")] + \
        [f"{ev.peak_parts['transient']:,}", f"{ev.bytes['activations'] / 2**30:,.2f}"]
    # 16,284,222,980 + 12 x 8*1024*3072 x 2 (gelu_new's float32 copy, CUDA autocast); peak also + 4
    assert numbers[2] == "16,888,202,756" and numbers[3] == "21,675,057,672"
    for fmt, text in reports.items():
        for n in numbers:
            assert n in text, (fmt, n)
        for info in (TABLE["s_max"], TABLE["B_a"], TABLE["M"], TABLE["R"]):
            assert rd.html_escape(info.meaning) in text or rd.md_escape(info.meaning) in text or \
                rd.tex_escape(info.meaning) in text, (fmt, info.meaning)
        assert "backward log" in text                  # where the peak is
        assert "85,045,477,376" in text and "76,540,929,639" in text   # M and M - R
        layer_norm = RULES["layer_norm"]             # the rule's home, wherever it lives
        assert f"{layer_norm.__module__}.{layer_norm.__name__}" in text.replace(r"\_", "_")
        assert "Korthikanti" in text and "Rajbhandari" in text
    tex, md, html = reports["latex"], reports["markdown"], reports["html"]
    for k, v in est16.components.items():
        body = " ".join(rd.latex_rows(v, lhs=r"\mathrm{%s}" % k))
        assert " ".join(body.split()[:6]) in tex and " ".join(body.split()[:6]) in md
        assert rd.mathml(v, lhs=k) in html
    assert r"b_{\max} = 30" in tex and r"b_{\max} = 30" in md and "b<sub>max</sub> = 30</strong>" in html
    c1 = solution.at_value.bytes["peak"] - est16.at(b=29, s=1024).peak
    assert f"{c1:,}".replace(",", "{,}") in tex and f"{c1:,}" in html
    assert r"\begin{align*}" in tex and r"\documentclass" in tex and tex.rstrip().endswith(r"\end{document}")


def test_no_budget_no_boundary(est16):
    md = rd.render(est16, "markdown", b=8, s=1024)
    assert "largest micro-batch" not in md and "$R$" not in md


def test_infeasible_budget_is_reported(est16):
    given = answer(est16, s=1024, budget="1GiB")
    assert isinstance(given["solution"], Infeasible)
    md = rd.render(est16, "markdown", b=8, s=1024, **given)
    assert "Nothing fits at $s = 1{,}024$: no value of b fits" in md


def test_reports_take_the_solution_and_never_solve(est16, reports, solution, monkeypatch):
    """render formats the answer it is given: the solver is not called, and a Solution
    alone gives the same numbers (its budget named by its sizes)."""
    import symmem.solve

    def refuse(*args, **kwargs):
        raise AssertionError("render called the solver")
    monkeypatch.setattr(symmem.solve, "max_batch", refuse)
    monkeypatch.setattr(symmem.solve, "solve", refuse)
    md = rd.render(est16, "markdown", b=8, s=1024, solution=solution)
    assert r"$b_{\max} = 30$" in md and "76,540,929,639" in md
    assert "Budget: 79.20 GiB minus a 7.92 GiB reserve" in md
    bud = make_budget(gpu=GPT2_BUDGET)
    assert rd.render(est16, "markdown", b=8, s=1024, solution=solution, budget=bud) == \
        reports["markdown"]


def test_a_solution_that_does_not_belong_is_a_config_error(est16, solution):
    with pytest.raises(sm.ConfigError, match="a solution at the report's s = 512"):
        rd.render(est16, "markdown", b=8, s=512, solution=solution)
    with pytest.raises(sm.ConfigError, match="the budget the solution was solved for"):
        rd.render(est16, "markdown", b=8, s=1024, solution=solution,
                  budget=make_budget(bytes="1GiB"))
    with pytest.raises(sm.ConfigError, match="the answer of max_batch for the budget given"):
        rd.render(est16, "markdown", b=8, s=1024, budget=make_budget(gpu=GPT2_BUDGET))
    with pytest.raises(sm.ConfigError, match="the largest micro-batch b"):
        rd.render(est16, "markdown", b=8, s=1024, solution=max_seq(est16, "16GiB", b=8))
    infeasible = answer(est16, s=1024, budget="1GiB")["solution"]
    with pytest.raises(sm.ConfigError, match="the Budget that nothing fits"):
        rd.render(est16, "markdown", b=8, s=1024, solution=infeasible)


def test_markdown_has_math_blocks(reports):
    md = reports["markdown"]
    assert md.count("$$\n") % 2 == 0 and md.count("$$\n") >= 6
    assert "\\begin{aligned}\n\\mathrm{peak} = \\max\\bigl(" in md


def test_html_is_self_contained(reports):
    html = reports["html"]
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    assert not re.search(r"""(src|href)\s*=""", html, re.I)
    assert "http://" not in html and "https://" not in html
    assert "<script" not in html and "<link" not in html and "@import" not in html
    assert html.count('<math display="block">') >= 8
    assert html.count("<table>") == html.count("</table>")


def test_rules_and_their_docstrings(est16, reports):
    from symmem.rules import RULES
    ops = rd._ops(est16.prepared)           # what was counted: the kernels' operators, not "attention"
    assert ops[:4] == ["input", "embedding", "positions", "position_embedding"] and "layer_norm" in ops
    assert "attention" not in ops
    html = reports["html"]
    for op in ops:
        assert f"<code>{RULES[op].__module__}.{RULES[op].__name__}</code>" in html
    assert rd._summary(RULES["softmax"]) == (
        "``F.softmax(x, -1)`` saves its output (SoftmaxBackward: result).")


def test_templates_use_strict_undefined_and_tex_safe_delimiters():
    import jinja2
    env = rd.environment()
    assert env.variable_start_string == "(((" and env.block_start_string == "((*"
    assert not env.autoescape and env.undefined is jinja2.StrictUndefined
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("((( missing )))").render()
    assert env.from_string(r"\frac{a}{b} ((( x | tex_escape )))").render(x="_") == r"\frac{a}{b} \_"


def test_unknown_format_is_a_config_error(est16):
    with pytest.raises(sm.ConfigError, match="one of latex, markdown, html"):
        rd.render(est16, "pdf", b=1, s=8)


# ----------------------------------------------------------------------------- CLI

def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_report_to_a_file(capsys, tmp_path, reports):
    out = tmp_path / "gpt2.tex"
    code, stdout, err = run(capsys, "report", "gpt2", "--batch", 8, "--seq", 1024, "--precision",
                            "bf16-mixed", "--attention", "eager", "--gpu", GPT2_BUDGET, "--format", "latex", "-o", out)
    assert code == 0 and stdout == "" and f"wrote {out}" in err
    assert out.read_text() == reports["latex"]


def test_cli_report_to_stdout_defaults(capsys):
    code, out, err = run(capsys, "report", "gpt2", "--format", "markdown")
    assert code == 0 and err == ""
    assert out.startswith("# symmem report: gpt2") and "Bytes at b = 1, s = 1,024" in out


def test_cli_report_names_the_model_after_its_folder(capsys, tmp_path):
    """A config folder's name is user text: escaped in LaTeX and HTML, and the LaTeX compiles."""
    folder = tmp_path / NASTY.replace("/", "")
    folder.mkdir()
    src = Path(__file__).resolve().parents[1] / "examples" / "tiny-gpt2" / "config.json"
    (folder / "config.json").write_text(src.read_text())
    code, html, _ = run(capsys, "report", folder, "--format", "html", "--seq", 64)
    assert code == 0 and "<script" not in html
    assert "my_model 100% &amp; $x\\y &lt;script&gt;alert(1)&lt;script&gt;" in html
    code, tex, _ = run(capsys, "report", folder / "config.json", "--format", "latex", "--seq", 64,
                       "--budget", "1GiB")
    assert code == 0 and r"my\_model 100\% \& \$x\textbackslash{}y \textless{}script" in tex
    _pdflatex(tex, tmp_path)


def test_cli_formula_latex_and_sympy(capsys, ests):
    est = ests["bf16-mixed"]
    code, out, _ = run(capsys, "formula", "--model", "gpt2", "--precision", "bf16-mixed", "--attention", "eager",
                       "--component", "activations", "--format", "latex")
    assert code == 0 and out == rd.latex(est.components["activations"]) + "\n"
    assert sp.expand(_parse(out.strip()) - est.components["activations"]) == 0
    names = {k: v.symbol for k, v in TABLE.items()}
    code, out, _ = run(capsys, "formula", "--model", "gpt2", "--precision", "bf16-mixed", "--attention", "eager",
                       "--component", "activations", "--format", "sympy")
    assert code == 0 and sp.expand(sp.sympify(out, locals=names) - est.components["activations"]) == 0
    code, out, _ = run(capsys, "formula", "--model", "gpt2", "--precision", "bf16-mixed", "--attention", "eager",
                       "--format", "sympy", "--all")
    # sympify reads the peak back; an evaluated Max of 36 candidates takes sympy ~8 s to
    # compare them, so the test keeps it unevaluated
    unevaluated = {**names, "Max": lambda *args: sp.Max(*args, evaluate=False)}
    assert code == 0 and _same(sp.sympify(out, locals=unevaluated), est.peak)
    # by default: the candidates that bind somewhere on the grid, listed on stderr
    code, out, err = run(capsys, "formula", "--model", "gpt2", "--precision", "bf16-mixed", "--attention", "eager",
                         "--format", "sympy")
    few = sp.sympify(out, locals=unevaluated)
    assert code == 0 and len(few.args) == len(est.regions()) < len(est.peak.args)
    assert {sp.expand(x) for x in few.args} == {sp.expand(r.point.total) for r in est.regions()}
    assert "backward log_softmax: the peak at" in err and "--all" in err


def test_cli_formula_from_a_config(capsys):
    tiny = Path(__file__).resolve().parents[1] / "examples" / "tiny-gpt2"
    code, out, _ = run(capsys, "formula", "--config", tiny, "--component", "params",
                       "--format", "sympy")
    assert code == 0 and out.startswith("B_w*V*h + B_w*h*s_max")


def test_cli_errors(capsys, tmp_path):
    code, out, err = run(capsys, "formula", "--model", "gpt2", "--component", "weights")
    assert code == 1 and out == "" and err.startswith(
        "symmem: error: component = 'weights' is not valid: expected one of peak, params")
    with pytest.raises(SystemExit) as e:
        main(["report", "gpt2", "--format", "pdf"])
    assert e.value.code == 2 and "invalid choice: 'pdf'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["formula", "--model", "gpt2", "--format", "mathml"])
    assert e.value.code == 2
    code, _, err = run(capsys, "report", "gtp2")
    assert code == 1 and "Did you mean 'gpt2'?" in err
    code, _, err = run(capsys, "report", tmp_path / "missing" / "config.json")
    assert code == 1 and "No such file or folder was found." in err
    code, _, err = run(capsys, "report", "gpt2", "-o", tmp_path / "no" / "dir" / "r.md")
    assert code == 1 and "--output" in err and "Traceback" not in err
    code, _, err = run(capsys, "report", "gpt2", "--gpu", "H100")
    assert code == 1 and "Did you mean 'H100-80GB'?" in err


def test_cli_help_has_examples(capsys):
    """Each command's --help shows its own examples (tests/test_examples.py runs them)."""
    for cmd, mine, other in (("report", "symmem report gpt2 --batch 8", "symmem formula"),
                             ("formula", "symmem formula --model gpt2", "symmem report")):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        out = capsys.readouterr().out
        assert mine in out and other not in out


def test_image_model_report_has_no_sequence(capsys, tmp_path):
    """An image model's formulas have no s: the report needs no --seq, names no s, its regions
    are ranges of b, the transformer-layer source is left out, and the LaTeX compiles."""
    code, md, err = run(capsys, "report", "--model", "resnet-18", "--batch", 8, "--gpu", "A100-40GB",
                        "--format", "markdown")
    assert code == 0, err
    assert "| Values | $b = 8$ |" in md and "## Bytes at b = 8\n" in md and "At $b = 8$ the peak" in md
    assert re.search(r"at \d+% of the grid, \$b\$ from [\d,]+ to [\d,]+", md)
    assert "$s" not in md and "b \\cdot s" not in md and "Korthikanti" not in md
    assert re.search(r"\$b_\{\\max\} = [\d{},]+\$: the peak", md)
    code, tex, err = run(capsys, "report", "--model", "resnet-18", "--batch", 8, "--format", "latex")
    assert code == 0, err
    _pdflatex(tex, tmp_path)
