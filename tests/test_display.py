"""Jupyter display: _repr_latex_, _repr_html_ and _repr_pretty_ of Estimate, Evaluation,
Graph and Solution, and Graph.describe (the listing with the saved tensors)."""
import html

import pytest

import symmem as sm
from symmem.solve import max_batch, max_seq
from symmem.symbols import L, V, b, h, s


def pretty(obj) -> str:
    """IPython's pretty printer when IPython is installed, else a minimal printer."""
    try:
        from IPython.lib.pretty import pretty as ipretty
    except ImportError:
        return fake_pretty(obj)
    return ipretty(obj)


class FakePrinter:
    def __init__(self):
        self.out = []

    def text(self, t):
        self.out.append(t)


def fake_pretty(obj, cycle=False) -> str:
    p = FakePrinter()
    obj._repr_pretty_(p, cycle)
    return "".join(p.out)


@pytest.fixture(scope="module")
def est():
    return sm.estimate(sm.models.preset("gpt2"), sm.Policy(precision="bf16-mixed", optimizer="adamw",
                                                           attention="eager"))


def tiny(name="<b>&tiny"):
    """A small graph with a user string that needs escaping in its name."""
    g = sm.Graph(name, {h: 8, V: 11, L: 2})
    ids = g.input("ids", (b, s))
    emb = g.param("emb", (V, h))
    x = g.add("embedding", ids, params=(emb,), name="embed")

    def body(gr, y):
        w = gr.param("w", (h, h))
        return gr.add("relu", gr.add("linear", y, params=(w,), name="layer/lin"), name="layer/relu")

    x = g.repeat(L, body, x, name="layer")
    x = g.add("layer_norm", x, params=(g.param("ln.w", (h,)),), name="ln")
    x = g.add("linear", x, params=(emb,), name="head")
    x = g.add("log_softmax", x, name="logp")
    g.add("nll_loss", x, ids, name="loss")
    return g


# ----- Estimate ---------------------------------------------------------------------

def test_estimate_latex_is_the_peak(est):
    tex = est._repr_latex_()
    assert tex.startswith("$\\max\\left(") and tex.endswith("$")
    assert "B_{a}" in tex and "s_{\\max}" in tex


def test_estimate_html_has_components_as_mathml_and_the_candidates(est):
    out = est._repr_html_()
    assert "<math" in out and out.count("<math") == len(est.components)
    for name in ("params", "grads", "master", "optimizer", "activations"):
        assert f">{name}<" in out
    assert f"{len(est.points)} candidate" in out
    for p in est.points:
        assert f"<li>{html.escape(p.where)}</li>" in out
    assert "<b>gpt2</b>" in out and html.escape(est.policy.describe()) in out


def test_estimate_html_escapes_the_model_name():
    e = sm.estimate(tiny())
    out = e._repr_html_()
    assert "&lt;b&gt;&amp;tiny" in out and "<b>&tiny" not in out
    assert "&lt;b&gt;&amp;tiny" in tiny()._repr_html_()


def test_estimate_pretty(est):
    text = pretty(est)
    lines = text.splitlines()
    assert lines[0] == "Estimate: gpt2"
    assert lines[1] == f"policy: {est.describe()}"
    for name, formula in est.components.items():
        assert f"  {name} = {formula}" in lines
    assert lines[-1].startswith(f"  peak = Max of {len(est.points)} candidates")
    assert fake_pretty(est) == text
    assert fake_pretty(est, cycle=True) == "Estimate(gpt2)"


# ----- Evaluation -------------------------------------------------------------------

def test_evaluation_displays(est):
    ev = est.at(b=8, s=1024)
    # README's number: 12 layers x b*s*4h elements x 2 bytes (gelu_new's float32 copy of its
    # bfloat16 input under CUDA autocast: 603,979,776) and the loss's 4-byte gradient, held
    # through backward, above the 21,071,077,892 before both were modelled
    assert ev.peak == 21_071_077_892 + 12 * 8 * 1024 * 3072 * 2 + 4 == 21_675_057_672
    tex = ev._repr_latex_()
    assert tex == ("$\\mathrm{peak}(b = 8, s = 1024) = 21{,}675{,}057{,}672\\ \\mathrm{bytes} "
                   "\\approx 20.19\\ \\mathrm{GiB}$")
    out = ev._repr_html_()
    for role, v in ev.peak_parts.items():
        if v:
            assert f">{role}<" in out and f">{v:,}<" in out and f">{v / 2**30:,.2f}<" in out
            assert f">{100 * v / ev.peak:.1f}%<" in out
    assert "21,675,057,672" in out and "20.19 GiB" in out
    assert html.escape(ev.peak_point.where) in out and "b = 8, s = 1024" in out
    assert pretty(ev) == ev.table() == fake_pretty(ev)


# ----- Graph ------------------------------------------------------------------------

def test_graph_describe_lists_saved_tensors():
    g = sm.models.preset("gpt2")
    text = g.describe()
    lines = text.splitlines()
    plain = str(g).splitlines()
    assert len(lines) == len(plain)
    for full, short in zip(lines, plain):     # the listing of str(graph), extended
        assert full.startswith(short)
        assert full == short or full[len(short):].startswith("  saves: ")
    assert "h  repeat x L  (drop)  (b, s, h)" in lines
    ln1 = next(x for x in lines if x.strip().startswith("h/ln_1  layer_norm"))
    assert ln1.startswith("    h/ln_1  layer_norm  (h/in)  (b, s, h)  [ln_1.weight, ln_1.bias]  saves: ")
    assert "layer-norm input = h/in (b*h*s x B_a)" in ln1
    assert "layer-norm mean (b*s x 4)" in ln1 and "layer-norm rstd (b*s x 4)" in ln1
    assert "  saves: " not in next(x for x in lines if x.startswith("embed  add"))
    # under a policy: bf16 autocast saves cached bf16 copies of the weights
    bf16 = g.describe(sm.Policy(precision="bf16-mixed"))
    assert "weight (autocast copy) (3*h**2 x B_a)" in bf16
    # a repeated body alone is described too (its inputs come from its parent)
    body = next(i for i in g.items if isinstance(i, sm.Repeat)).body
    assert body.describe().splitlines()[1] == ln1.strip()


def test_graph_pretty_and_html():
    g = sm.models.preset("gpt2")
    assert pretty(g) == g.describe() == fake_pretty(g)
    assert fake_pretty(g, cycle=True) == "Graph(gpt2)"
    out = g._repr_html_()
    assert out.count("<tr>") == len(str(g).splitlines()) + 1      # + the header
    assert "repeat &times; L" in out and "<b>h</b>" in out
    assert "padding-left:2.0em'>h/ln_1<" in out                    # the body is indented
    assert "layer-norm mean (b*s x 4)<br>layer-norm rstd (b*s x 4)" in out
    assert "ln_1.weight, ln_1.bias" in out and "h = 768, L = 12" in out


def test_graph_html_escapes_user_strings():
    out = tiny("a<b>&c")._repr_html_()
    assert "a&lt;b&gt;&amp;c" in out and "a<b>" not in out


# ----- Solution ---------------------------------------------------------------------

def test_solution_displays(est):
    sol = max_batch(est, "80GiB", reserve="10%", s=1024)
    tex = sol._repr_latex_()
    assert tex.startswith("$\\max\\, b = \\left\\lfloor") and "\\rfloor" in tex
    assert tex.endswith(f"= {sol.value}$")
    out = sol._repr_html_()
    assert f"<b>max b = {sol.value:,}</b>" in out
    assert f"peak at b = {sol.value:,}" in out and f"peak at b = {sol.value + 1:,}" in out
    assert f"{sol.at_value.peak:,} bytes" in out and "&le; usable" in out
    assert f"{sol.past_value.peak:,} bytes" in out and "&gt; usable" in out
    assert html.escape(sol.binding.where) in out and "<math" in out
    assert "s = 1024" in out
    assert pretty(sol) == str(sol) == fake_pretty(sol)


def test_solution_limited_by_the_model(est):
    sol = max_seq(est, "80GiB", b=1)
    out = sol._repr_html_()
    assert "limited by the model" in out and "s &lt;= s_max" in out
    assert sol._repr_latex_() == f"$\\max\\, s = {sol.value}$"


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16-master"])
def test_describe_lists_what_the_plan_saves(precision):
    """graph.describe lists, per node (a block's body in its first iteration), what the
    rules save; the plan's forward holds exactly those tensors for backward."""
    from symmem.footprints import trace
    from symmem.lowering import autograd, lower
    from symmem.plan import Compute
    g, policy = sm.models.preset("gpt2"), sm.Policy(precision=precision)
    t, plan = trace(g, policy), lower(g, policy)
    saved = g._saved(policy)
    firsts = {i.name: i for i in t.instances() if i.copy <= 1}
    assert set(saved) == set(firsts)
    holds = {e.node: [h for h in e.holds if h.holder == autograd(e.node, e.copy)]
             for e in plan.forward if isinstance(e, Compute) and e.copy <= 1}
    for name, inst in firsts.items():
        assert [row[0] for row in saved[name]] == [sv.label for sv in inst.fp.saved]
        assert len(holds[name]) == len(inst.fp.saved)
        for (label, value, numel, nbytes), sv in zip(saved[name], inst.fp.saved):
            if sv.ref == "new" or sv.ref.startswith("cast:"):
                assert (value, numel, nbytes) == (None, sv.numel, sv.dtype.nbytes)
            else:                                # a tensor of the graph: its storage
                where = inst.inputs[int(sv.ref[2:])] if sv.ref.startswith("in") else (name, inst.copy)
                assert numel * nbytes == t.info[where].nbytes


# ----- symmem.printing: the helpers every display uses ------------------------------

def test_html_table_escapes_the_header_and_indents_rows():
    from symmem.printing import html_table
    out = html_table(["role", "a<b"], [["x", "1"], ["y", "2"]], right=(1,), indent=[0, 1])
    assert out.startswith("<table><thead><tr><th style='text-align:left'>role</th>"
                          "<th style='text-align:right'>a&lt;b</th></tr></thead>")
    assert "<td style='text-align:left;padding-left:2.0em'>y</td>" in out
    assert out.count("<tr>") == 3 and "<thead>" not in html_table(None, [["x"]])


def test_values_in_text_and_latex():
    from symmem.printing import tex_number, tex_values, values_text
    assert values_text({"b": 8, "s": 1024}) == "b = 8, s = 1024"
    assert tex_values({"b": 8, "s_max": 1024}) == "b = 8, s_{\\max} = 1024"
    assert tex_number(21_071_077_892) == "21{,}071{,}077{,}892"


def test_displays_print_with_printing(est):
    """The Jupyter displays' formulas are symmem.printing's: the same LaTeX and MathML."""
    from symmem.printing import latex, mathml
    assert est._repr_latex_() == "$" + latex(est.peak) + "$"
    out = est._repr_html_()
    for v in est.components.values():
        assert mathml(v, display=False) in out
