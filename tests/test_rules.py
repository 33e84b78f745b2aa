"""Each op rule of ``symmem.rules`` against PyTorch on the CPU, byte for byte.

For every rule a one- or few-node symmem graph and the same computation in PyTorch
(written the way PyTorch / Hugging Face code does it) are compared on:

* the bytes autograd saves for backward at the end of forward (symmem's
  ``activations`` component; PyTorch's :func:`symmem.measure.saved_bytes` with the
  parameters excluded), exactly, at two or more sizes;
* the output shape, and the output's bytes per element (the rule's dtype);
* the symbolic formula itself where it is short, pinned with the hand arithmetic,
  so that a wrong rule fails even if the measuring harness were wrong.

Policies: ``fp32`` and ``bf16-mixed`` (``torch.autocast("cpu", dtype=torch.bfloat16)``),
both with ``device="cpu"`` since that is what is measured here (``bf16-master`` once, for
layer_norm's statistics). Under ``bf16-mixed`` the
formulas keep ``B_a`` (bytes of the compute dtype, bound to 2) for tensors in autocast's
dtype; a graph input declared ``"bfloat16"`` has a literal 2.

At b = 1 some reshapes and slices past the batch dimension are views that copy at b >= 2;
those tests derive the step for b = 1 (``Policy.batch_one``, what ``Estimate.at_one`` does).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import sympy as sp

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional
transformers = pytest.importorskip("transformers")

import symmem as sm  # noqa: E402
from symmem.measure import saved_bytes  # noqa: E402
from symmem.rules import (AUTOCAST, F32, RULES, Ctx, DType, autocast_policy,  # noqa: E402
                          get_rule, rule)
from symmem.symbols import B_a, V, a, b, h, s, s_max  # noqa: E402

FP32 = sm.Policy("fp32", "sgd", "cpu")
BF16 = sm.Policy("bf16-mixed", "sgd", "cpu")
POLICIES = [pytest.param(FP32, id="fp32"), pytest.param(BF16, id="bf16-autocast")]

# (b, s) pairs every comparison is made at; h (and a, V) are bound in the graph.
SIZES = ((2, 3), (3, 5))
H = 8


# --------------------------------------------------------------------------- helpers


def graph(**bindings) -> sm.Graph:
    """A test graph with h = 8 unless told otherwise (a, V, s_max as given)."""
    names = {"h": h, "a": a, "V": V, "s_max": s_max}
    binds = {h: H}
    binds.update({names[k]: v for k, v in bindings.items()})
    return sm.Graph("t", binds)


def float_input(g: sm.Graph, shape, dtype="float32", name="x") -> str:
    return g.input(name, shape, dtype=dtype, requires_grad=True)


def leaf(*shape, dtype=torch.float32) -> torch.Tensor:
    """A float leaf tensor that requires grad (the graph's float input)."""
    return torch.randn(*shape).to(dtype).requires_grad_()


def infos(g: sm.Graph, policy: sm.Policy) -> dict:
    """value -> Footprint, by running each node's rule (a flat graph), as the walk does."""
    ctx, out = policy.ctx(), {}
    for node in g.items:
        out[node.name] = get_rule(node.op)(node, [out[i].out for i in node.inputs], ctx)
    return out


def elem_bytes(dtype, policy: sm.Policy) -> int:
    return int(sp.sympify(dtype.nbytes).subs(policy.bindings()))


def concrete(shape, g: sm.Graph, bb: int, ss: int) -> tuple:
    subs = {b: bb, s: ss, **g.bindings}
    return tuple(int(sp.sympify(d).subs(subs)) for d in shape)


def measure(fn, exclude=(), autocast=False):
    """Saved bytes of ``fn()`` (a forward), run under CPU bf16 autocast if asked; and the
    output's shape and bytes per element."""
    box = {}

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fn()
        box["shape"], box["itemsize"] = tuple(out.shape), out.element_size()
        return out

    report = saved_bytes(run, exclude=exclude)
    return report, box


def activations(g: sm.Graph, policy: sm.Policy) -> sp.Expr:
    return sm.estimate(g, policy).components["activations"]


def same(expr, expected) -> bool:
    return sp.expand(sp.sympify(expr) - sp.sympify(expected)) == 0


class RuleMismatch(AssertionError):
    """symmem disagrees with PyTorch (or with the hand formula); a failing measurement
    (PyTorch versus the hand formula) is a plain AssertionError instead, so the two read apart."""


def at(expr, g: sm.Graph, policy: sm.Policy, bb: int, ss: int) -> int:
    return int(sp.sympify(expr).subs({b: bb, s: ss, **g.bindings, **policy.bindings()}))


def compare(g: sm.Graph, policy: sm.Policy, make, *, formula=None, sizes=SIZES, check_out=True):
    """symmem's activations (and the last node's shape and dtype) versus PyTorch.

    ``make(b, s)`` returns ``(fn, exclude)``: the PyTorch forward and the parameters
    not to count. ``formula``: the expected activations by hand (``B_a`` may appear; it is
    bound by the policy). Three independent checks, in this order: PyTorch's saved bytes
    equal the hand formula (the truth, a plain AssertionError); symmem's formula equals it;
    symmem's exact bytes equal PyTorch's (both RuleMismatch).
    """
    measured = {}
    for bb, ss in sizes:
        fn, exclude = make(bb, ss)
        report, out = measure(fn, exclude, policy.prec.autocast)
        detail = [(e.shape, e.dtype, e.storage_nbytes) for e in report.entries if e.counted]
        measured[bb, ss] = report.total, out, detail
        if formula is not None:
            assert report.total == at(formula, g, policy, bb, ss), \
                f"b={bb} s={ss}: PyTorch saved {report.total} bytes {detail}, hand formula {formula}"
    est = sm.estimate(g, policy)
    got = est.components["activations"]
    if formula is not None and not same(got.subs(policy.bindings()),
                                        sp.sympify(formula).subs(policy.bindings())):
        raise RuleMismatch(f"activations formula {got}, expected {formula}")
    last = g.items[-1].name
    info = infos(g, policy)[last].out
    for (bb, ss), (total, out, detail) in measured.items():
        model = est.at(b=bb, s=ss).bytes["activations"]
        if model != total:
            raise RuleMismatch(f"b={bb} s={ss}: symmem {model} bytes ({got}), PyTorch {total} "
                               f"bytes saved {detail}")
        if check_out:
            if concrete(g.shape(last), g, bb, ss) != out["shape"]:
                raise RuleMismatch(f"shape: symmem {g.shape(last)}, PyTorch {out['shape']}")
            if elem_bytes(info.dtype, policy) != out["itemsize"]:
                raise RuleMismatch(f"output dtype: symmem {info.dtype}, PyTorch "
                                   f"{out['itemsize']} bytes/element")


# --------------------------------------------------------------------------- linear


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_linear_nn_linear(policy, bias):
    g = graph()
    x = float_input(g, (b, s, h))
    w = g.param("w", (4, h))                          # nn.Linear weight: (out, in)
    params = (w, g.param("bias", (4,))) if bias else (w,)
    g.add("linear", x, params=params, name="lin")
    assert g.shape("lin") == (b, s, 4)
    if policy is FP32:
        formula = 4 * b * s * h                       # addmm/mm saves its input: b*s*h * 4 bytes
    else:
        # the input's bf16 copy (b*s*h * B_a) and the weight's bf16 copy (4*h * B_a);
        # the bias's copy is not saved (addmm needs no bias to differentiate)
        formula = B_a * b * s * h + B_a * 4 * h

    def make(bb, ss):
        lin = nn.Linear(H, 4, bias=bias)
        x_ = leaf(bb, ss, H)
        return (lambda: lin(x_)), lin

    compare(g, policy, make, formula=formula)


@pytest.mark.parametrize("policy", POLICIES)
def test_linear_conv1d(policy):
    g = graph()
    x = float_input(g, (b, s, h))
    w, bias = g.param("w", (h, 3 * h)), g.param("bias", (3 * h,))   # Conv1D weight: (in, out)
    g.add("linear", x, params=(w, bias), conv1d=True, name="c_attn")
    assert g.shape("c_attn") == (b, s, 3 * h)
    if policy is FP32:
        formula = 4 * b * s * h                       # x.view(-1, h) saved: b*s*h * 4
    else:
        formula = B_a * b * s * h + B_a * 3 * h * h    # bf16 x (b*s*h) and bf16 W (h*3h)

    def make(bb, ss):
        W = nn.Parameter(torch.randn(H, 3 * H) * 0.02)
        bias_ = nn.Parameter(torch.zeros(3 * H))
        x_ = leaf(bb, ss, H)
        # transformers.pytorch_utils.Conv1D.forward
        fn = lambda: torch.addmm(bias_, x_.view(-1, H), W).view(bb, ss, 3 * H)  # noqa: E731
        return fn, [W, bias_]

    compare(g, policy, make, formula=formula)


def test_conv1d_module_from_transformers_matches_addmm():
    """The hand-written addmm above is what transformers' Conv1D does (same saved bytes)."""
    from transformers.pytorch_utils import Conv1D

    conv = Conv1D(3 * H, H)
    x_ = leaf(2, 3, H)
    W, bias_ = conv.weight, conv.bias
    for autocast in (False, True):
        by_module, _ = measure(lambda: conv(x_), conv, autocast)
        by_hand, _ = measure(lambda: torch.addmm(bias_, x_.view(-1, H), W).view(2, 3, 3 * H),
                             conv, autocast)
        assert by_module.total == by_hand.total == (2 * 3 * H * (2 if autocast else 4)
                                                    + (H * 3 * H * 2 if autocast else 0))


def test_linear_input_without_grad_fp32_saves_input():
    """The weight gradient needs x, so x is saved even when x needs no gradient."""
    g = graph()
    x = g.input("x", (b, s, h), dtype="float32")      # requires_grad=False
    g.add("linear", x, params=(g.param("w", (4, h)),), name="lin")

    def make(bb, ss):
        lin = nn.Linear(H, 4, bias=False)
        x_ = torch.randn(bb, ss, H)
        return (lambda: lin(x_)), lin

    compare(g, FP32, make, formula=4 * b * s * h)


def test_linear_input_without_grad_autocast_saves_no_weight_copy():
    g = graph()
    x = g.input("x", (b, s, h), dtype="float32")      # requires_grad=False: e.g. raw features
    g.add("linear", x, params=(g.param("w", (4, h)),), name="lin")

    def make(bb, ss):
        lin = nn.Linear(H, 4, bias=False)
        x_ = torch.randn(bb, ss, H)
        return (lambda: lin(x_)), lin

    # Truth: only the bf16 copy of x (b*s*h * 2 bytes); W's bf16 copy is not kept.
    compare(g, BF16, make, formula=B_a * b * s * h)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shared", [True, False], ids=["shared-weight", "two-weights"])
def test_weight_used_twice_is_cast_once(policy, shared):
    """Two linears sharing one Param (y = W(W x)). Autocast caches the bf16 copy of a leaf
    that requires grad, so a tied weight's copy exists and is saved once."""
    g = graph()
    x = float_input(g, (b, s, h))
    w1 = g.param("w1", (h, h))
    w2 = w1 if shared else g.param("w2", (h, h))
    y1 = g.add("linear", x, params=(w1,), name="lin1")
    g.add("linear", y1, params=(w2,), name="lin2")
    if policy is FP32:
        formula = 4 * b * s * h * 2                   # x and y1, b*s*h * 4 each
    else:
        # bf16 copy of x, y1 itself (already bf16), and one (shared) or two bf16 weights
        formula = 2 * B_a * b * s * h + (1 if shared else 2) * B_a * h * h

    def make(bb, ss):
        l1, l2 = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)
        if shared:
            l2.weight = l1.weight                     # one Parameter, as HF ties weights
        m = nn.Sequential(l1, l2)
        x_ = leaf(bb, ss, H)
        return (lambda: m(x_)), m

    compare(g, policy, make, formula=formula)


# --------------------------------------------------------------------------- views


def test_split_and_heads_are_views_that_save_nothing():
    g = graph(a=2)
    x = float_input(g, (b, s, 3 * h))
    for i, n in enumerate("qkv"):
        part = g.add("split", x, parts=3, index=i, name=n)
        assert g.shape(part) == (b, s, h)
        hd = g.add("heads", part, heads=a, name=f"{n}_heads")
        assert g.shape(hd) == (b, a, s, h / a)
    inf = infos(g, FP32)
    assert inf["q"].alias == 0 and inf["q_heads"].alias == 0     # no new storage
    assert not inf["q_heads"].out.contiguous
    for policy in (FP32, BF16):
        assert activations(g, policy) == 0

    def make(bb, ss):
        x_ = leaf(bb, ss, 3 * H)

        def fn():
            q, k, v = x_.split(H, dim=2)
            return v.view(bb, ss, 2, H // 2).transpose(1, 2)
        return fn, ()

    for policy in (FP32, BF16):
        compare(g, policy, make)


@pytest.mark.parametrize("policy", POLICIES)
def test_merge_heads_copies_and_a_following_linear_saves_the_copy(policy):
    g = graph(a=2)
    x = float_input(g, (b, a, s, h / a))
    m = g.add("merge_heads", x, name="merge")
    assert g.shape(m) == (b, s, h)
    assert infos(g, policy)["merge"].alias is None              # reshape of a transpose copies
    assert activations(g, policy) == 0                          # the copy itself saves nothing
    g.add("linear", m, params=(g.param("w", (h, h)), g.param("bias", (h,))), conv1d=True,
          name="c_proj")
    if policy is FP32:
        formula = 4 * b * s * h                                 # c_proj saves the f32 copy
    else:
        formula = B_a * b * s * h + B_a * h * h                 # its bf16 cast, and bf16 W

    def make(bb, ss):
        W, bias = nn.Parameter(torch.randn(H, H)), nn.Parameter(torch.zeros(H))
        x_ = leaf(bb, 2, ss, H // 2)

        def fn():
            y = x_.transpose(1, 2).reshape(bb, ss, H).contiguous()   # GPT2Attention.forward
            return torch.addmm(bias, y.view(-1, H), W).view(bb, ss, H)  # Conv1D.forward
        return fn, [W, bias]

    compare(g, policy, make, formula=formula)


# --------------------------------------------------------------------------- matmul


@pytest.mark.parametrize("policy", POLICIES)
def test_matmul_contiguous_operands_saved_as_they_are(policy):
    """probs @ v with both contiguous: bmm saves views of both inputs (fp32), or their
    bf16 copies under autocast."""
    g = graph(a=2)
    p = float_input(g, (b, a, s, s), name="p")
    v = float_input(g, (b, a, s, h / a), name="v")
    g.add("matmul", p, v, name="ctx")
    assert g.shape("ctx") == (b, a, s, h / a)
    if policy is FP32:
        formula = 4 * (b * a * s * s + b * s * h)               # both inputs, 4 bytes each
    else:
        formula = B_a * (b * a * s * s + b * s * h)             # both bf16 copies

    def make(bb, ss):
        p_, v_ = leaf(bb, 2, ss, ss), leaf(bb, 2, ss, H // 2)
        return (lambda: torch.matmul(p_, v_)), ()

    compare(g, policy, make, formula=formula)


def _qk_graph(bind_a=2):
    g = graph(a=bind_a)
    x = float_input(g, (b, s, 3 * h), name="qkv")
    q = g.add("heads", g.add("split", x, parts=3, index=0, name="q"), heads=a, name="qh")
    k = g.add("heads", g.add("split", x, parts=3, index=1, name="k"), heads=a, name="kh")
    g.add("matmul", q, k, transpose_b=True, name="scores")
    return g


def _qk_make(bb, ss, heads=2):
    d = H // heads
    x_ = leaf(bb, ss, 3 * H)

    def fn():
        q, k, _ = x_.split(H, dim=2)                     # GPT2Attention.forward
        q = q.view(bb, ss, heads, d).transpose(1, 2)
        k = k.view(bb, ss, heads, d).transpose(1, 2)
        return torch.matmul(q, k.transpose(-1, -2))      # eager_attention_forward
    return fn, ()


@pytest.mark.parametrize("policy", POLICIES)
def test_matmul_of_head_views_copies_both_operands(policy):
    """q @ k^T on head views (b >= 2): matmul's reshape to 3-D copies each operand."""
    g = _qk_graph()
    assert g.shape("scores") == (b, a, s, s)
    # q and k copies: b*s*h elements each, in the compute dtype (4, or B_a under autocast)
    formula = 2 * b * s * h * (4 if policy is FP32 else B_a)
    compare(g, policy, _qk_make, formula=formula)


def test_matmul_of_head_views_at_batch_one_saves_views():
    """At b = 1 the reshape of a (1, a, s, d) head view to (a, s, d) is a view, so bmm saves
    views of the qkv storage itself: the whole b*s*3h input (at b=1, s=3, h=8 fp32: 288 bytes),
    not two copies of b*s*h (192). The step derived for b = 1 (Policy.batch_one) says so, and
    the estimate's at(b=1) and its formula's case split use it."""
    g = _qk_graph()
    one = dataclasses.replace(FP32, batch_one=True)
    # Truth at b = 1: the whole qkv input, b*s*3h * 4 bytes, kept alive by the q and k views
    compare(g, one, _qk_make, sizes=((1, 3), (1, 5)), formula=12 * b * s * h)
    est = sm.estimate(g, FP32)
    assert est.at(b=1, s=3).bytes["activations"] == 12 * 3 * H == 288
    assert est.at(b=2, s=3).bytes["activations"] == 2 * 2 * 3 * H * 4      # two copies at b >= 2
    assert est.cases("activations") == sp.Piecewise((12 * s * h, sp.Eq(b, 1)), (8 * b * s * h, True))


def test_matmul_transpose_b_of_contiguous_operand_saves_a_view():
    g = graph(a=2)
    x = float_input(g, (b, a, s, h / a), name="x")
    y = float_input(g, (b, a, s, h / a), name="y")
    r = g.add("relu", y, name="r")                    # saves r, contiguous
    g.add("matmul", x, r, transpose_b=True, name="scores")

    def make(bb, ss):
        x_, y_ = leaf(bb, 2, ss, H // 2), leaf(bb, 2, ss, H // 2)
        return (lambda: torch.matmul(x_, F.relu(y_).transpose(-1, -2))), ()

    # Truth: x and relu(y), b*s*h * 4 bytes each; no copy of relu(y)^T.
    compare(g, FP32, make, formula=2 * 4 * b * s * h)


# --------------------------------------------------------------------------- elementwise


@pytest.mark.parametrize("policy", POLICIES)
def test_scale_saves_a_float64_scalar(policy):
    g = graph()
    x = float_input(g, (b, s, h))
    g.add("scale", x, name="scaled")
    # x * 0.125: MulBackward0 saves the wrapped Python number, a 0-dim float64: 8 bytes
    # (x itself is not needed: d(c x)/dx = c)

    def make(bb, ss):
        x_ = leaf(bb, ss, H)
        return (lambda: x_ * 0.125), ()

    compare(g, policy, make, formula=8)


def test_scale_on_bf16_under_autocast():
    g = graph()
    x = float_input(g, (b, s, h), dtype="bfloat16")
    g.add("scale", x, name="scaled")

    def make(bb, ss):
        x_ = leaf(bb, ss, H, dtype=torch.bfloat16)
        return (lambda: x_ * (H ** -0.5)), ()

    compare(g, BF16, make, formula=8)


@pytest.mark.parametrize("policy", POLICIES)
def test_add_saves_nothing_and_broadcasts(policy):
    g = graph()
    x = float_input(g, (b, s, h), name="x")
    y = float_input(g, (1, s, h), name="y")
    g.add("add", x, y, name="sum")
    assert g.shape("sum") == (b, s, h)

    def make(bb, ss):
        x_, y_ = leaf(bb, ss, H), leaf(1, ss, H)
        return (lambda: x_ + y_), ()

    compare(g, policy, make, formula=0)


def test_add_promotes_bf16_and_float32_to_float32():
    """The residual: bf16 branch + float32 stream is float32 (tensor-tensor promotion)."""
    g = graph()
    x = float_input(g, (b, s, h), dtype="bfloat16", name="x")
    y = float_input(g, (b, s, h), name="y")
    g.add("add", x, y, name="sum")

    def make(bb, ss):
        x_, y_ = leaf(bb, ss, H, dtype=torch.bfloat16), leaf(bb, ss, H)
        return (lambda: x_ + y_), ()

    compare(g, BF16, make, formula=0)
    assert infos(g, BF16)["sum"].out.dtype.nbytes == 4


# (policy, input dtype): bf16 activations only occur under autocast
POLICY_DTYPES = [pytest.param(FP32, "float32", id="fp32"),
                 pytest.param(BF16, "float32", id="bf16-autocast-float32-input"),
                 pytest.param(BF16, "bfloat16", id="bf16-autocast-bf16-input")]


@pytest.mark.parametrize("policy,dtype", POLICY_DTYPES)
def test_dropout_saves_noise_of_input_dtype(policy, dtype):
    """CPU dropout is ``x * noise`` (noise = bernoulli(1-p) / (1-p), x's dtype); the mul saves
    the noise. Under autocast mul is not cast: a bf16 input gives bf16 noise."""
    g = graph()
    x = float_input(g, (b, s, h), dtype=dtype)
    g.add("dropout", x, p=0.1, name="drop")
    nbytes = 4 if dtype == "float32" else 2
    tdtype = torch.float32 if dtype == "float32" else torch.bfloat16

    def make(bb, ss):
        x_ = leaf(bb, ss, H, dtype=tdtype)
        return (lambda: F.dropout(x_, p=0.1, training=True)), ()

    compare(g, policy, make, formula=nbytes * b * s * h)   # the noise: b*s*h elements


@pytest.mark.parametrize("policy", POLICIES)
def test_dropout_p0_returns_its_input_and_saves_nothing(policy):
    g = graph()
    x = float_input(g, (b, s, h))
    g.add("dropout", x, p=0.0, name="drop")
    assert infos(g, policy)["drop"].alias == 0          # x itself
    x_ = leaf(2, 3, H)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=policy.prec.autocast):
        assert F.dropout(x_, p=0.0, training=True) is x_
        assert nn.Dropout(0.0).train()(x_) is x_

    def make(bb, ss):
        x_ = leaf(bb, ss, H)
        return (lambda: F.dropout(x_, p=0.0, training=True)), ()

    compare(g, policy, make, formula=0)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_saves_its_input(policy, approximate):
    g = graph()
    x = float_input(g, (b, s, h))
    g.add("gelu", x, approximate=approximate, name="gelu")

    def make(bb, ss):
        x_ = leaf(bb, ss, H)
        return (lambda: F.gelu(x_, approximate=approximate)), ()

    compare(g, policy, make, formula=4 * b * s * h)     # x: b*s*h * 4 (gelu not autocast on CPU)


def test_gelu_on_bf16_under_autocast():
    g = graph()
    x = float_input(g, (b, s, h), dtype="bfloat16")
    g.add("gelu", x, name="gelu")

    def make(bb, ss):
        x_ = leaf(bb, ss, H, dtype=torch.bfloat16)
        return (lambda: F.gelu(x_)), ()

    compare(g, BF16, make, formula=2 * b * s * h)


@pytest.mark.parametrize("policy,dtype", POLICY_DTYPES)
def test_gelu_new_saves_four_tensors_and_three_scalars(policy, dtype):
    """transformers' NewGELUActivation: 0.5*x*(1 + tanh(c*(x + 0.044715*x**3))).
    pow saves x; tanh saves its result; the final mul saves 0.5*x and 1+tanh; the three
    Python constants 0.044715, c and 0.5 are saved as 0-dim float64 (3 * 8 bytes).
    On the CPU pow is not autocast, so all four are in x's dtype."""
    from transformers.activations import NewGELUActivation

    g = graph()
    x = float_input(g, (b, s, h), dtype=dtype)
    g.add("gelu_new", x, name="gelu_new")
    nbytes = 4 if dtype == "float32" else 2
    tdtype = torch.float32 if dtype == "float32" else torch.bfloat16
    act = NewGELUActivation()

    def make(bb, ss):
        x_ = leaf(bb, ss, H, dtype=tdtype)
        return (lambda: act(x_)), ()

    compare(g, policy, make, formula=4 * nbytes * b * s * h + 24)


@pytest.mark.parametrize("policy", POLICIES)
def test_relu_saves_its_output(policy):
    g = graph()
    x = float_input(g, (b, s, h))
    g.add("relu", x, name="relu")

    def make(bb, ss):
        x_ = leaf(bb, ss, H)
        return (lambda: F.relu(x_)), ()

    compare(g, policy, make, formula=4 * b * s * h)


# --------------------------------------------------------------------------- dtype casts


def test_to_compute_casts_float32_to_bf16_under_autocast_and_saves_nothing():
    """softmax output (float32) .type(value.dtype) -> bf16 copy; the cast saves nothing."""
    g = graph()
    x = float_input(g, (b, s, h))
    g.add("to_compute", x, name="probs")
    fp = infos(g, BF16)["probs"]
    assert fp.alias is None and elem_bytes(fp.out.dtype, BF16) == 2

    def make(bb, ss):
        x_ = leaf(bb, ss, H)
        return (lambda: x_.type(torch.bfloat16)), ()

    compare(g, BF16, make, formula=0)


def test_to_compute_is_a_no_op_on_the_compute_dtype():
    """Values the GPT-2 builder makes are in the policy's compute dtype: no copy."""
    g = graph(V=11)
    ids = g.input("ids", (b, s))
    e = g.add("embedding", ids, params=(g.param("wte", (V, h)),), name="wte")   # fp32: compute
    y = g.add("linear", e, params=(g.param("w", (h, h)),), name="lin")          # bf16: compute
    g.add("to_compute", e, name="c_e")
    g.add("to_compute", y, name="c_y")
    assert infos(g, FP32)["c_e"].alias == 0
    assert infos(g, FP32)["c_y"].alias == 0
    assert infos(g, BF16)["c_y"].alias == 0
    assert infos(g, BF16)["c_e"].alias is None          # float32 embedding -> bf16 copy


@pytest.mark.parametrize("policy,dtype", [(FP32, "float32"), (BF16, "bfloat16")],
                         ids=["fp32-float32", "bf16-bfloat16"])
def test_to_compute_of_a_value_already_in_the_compute_dtype_is_a_no_op(policy, dtype):
    g = graph()
    x = float_input(g, (b, s, h), dtype=dtype)
    r = g.add("relu", x, name="r")
    c = g.add("to_compute", r, name="c")
    g.add("gelu", c, name="gelu")
    tdtype = torch.float32 if dtype == "float32" else torch.bfloat16
    nbytes = 4 if dtype == "float32" else 2

    def make(bb, ss):
        x_ = leaf(bb, ss, H, dtype=tdtype)

        def fn():
            r_ = F.relu(x_)
            c_ = r_.type(tdtype)
            assert c_ is r_
            return F.gelu(c_)
        return fn, ()

    compare(g, policy, make, formula=nbytes * b * s * h)   # relu's output, saved by both


@pytest.mark.parametrize("policy", POLICIES)
def test_to_float32_of_linear_output(policy):
    """logits.float(): a float32 copy of bf16 logits (saves nothing); in fp32, logits itself."""
    g = graph()
    x = float_input(g, (b, s, h))
    y = g.add("linear", x, params=(g.param("w", (4, h)),), name="lin")
    g.add("to_float32", y, name="f")
    fp = infos(g, policy)["f"]
    assert (fp.alias == 0) is (policy is FP32)
    formula = 4 * b * s * h if policy is FP32 else B_a * b * s * h + B_a * 4 * h  # linear's only

    def make(bb, ss):
        lin = nn.Linear(H, 4, bias=False)
        x_ = leaf(bb, ss, H)

        def fn():
            logits = lin(x_)
            out = logits.float()
            assert (out is logits) is (policy is FP32)
            return out
        return fn, lin

    compare(g, policy, make, formula=formula)


def test_to_float32_of_float32_input_is_a_no_op():
    g = graph()
    x = float_input(g, (b, s, h))
    g.add("to_float32", x, name="f")
    for policy in (FP32, BF16):
        assert infos(g, policy)["f"].alias == 0
        assert activations(g, policy) == 0


# --------------------------------------------------------------------------- layer_norm


def _ln_make(dtype=torch.float32):
    def make(bb, ss):
        ln = nn.LayerNorm(H)
        x_ = leaf(bb, ss, H, dtype=dtype)
        return (lambda: ln(x_)), ln
    return make


def _ln_graph(dtype="float32"):
    g = graph()
    x = float_input(g, (b, s, h), dtype=dtype)
    g.add("layer_norm", x, params=(g.param("ln.weight", (h,)), g.param("ln.bias", (h,))),
          name="ln")
    return g


@pytest.mark.parametrize("policy", POLICIES)
def test_layer_norm_float32_input(policy):
    g = _ln_graph()
    assert g.shape("ln") == (b, s, h)
    # input x (b*s*h * 4) and per-row mean and rstd (b*s rows, float32: 2 * b*s * 4)
    compare(g, policy, _ln_make(), formula=4 * b * s * h + 8 * b * s)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_norm_mean_and_rstd_are_float32_even_under_autocast(dtype):
    g = _ln_graph(dtype)
    saved = {sv.label: sv for sv in infos(g, BF16)["ln"].saved}
    mean, rstd = saved["layer-norm mean"], saved["layer-norm rstd"]
    for sv in (mean, rstd):
        assert sv.dtype.nbytes == 4 and same(sv.numel, b * s)
    tdtype = torch.float32 if dtype == "float32" else torch.bfloat16
    report, _ = measure(_ln_make(tdtype)(2, 3)[0], (), autocast=True)
    stats = [e for e in report.entries if e.shape == (2, 3, 1)]
    assert [(e.dtype, e.storage_nbytes) for e in stats] == [("float32", 24)] * 2


def test_layer_norm_half_weights_without_autocast_keeps_statistics_in_bf16():
    """bf16-master (bf16 weights and activations, no autocast): input and weights are all
    bf16, so the CPU kernel's mean and rstd are bf16 too (float32 only for mixed inputs)."""
    policy = sm.Policy("bf16-master", "sgd", "cpu")
    g = _ln_graph("bfloat16")

    def make(bb, ss):
        ln = nn.LayerNorm(H).to(torch.bfloat16)
        x_ = leaf(bb, ss, H, dtype=torch.bfloat16)
        return (lambda: ln(x_)), ln

    # the bf16 input (2 bytes) and bf16 mean and rstd (2 * b*s * 2)
    compare(g, policy, make, formula=2 * b * s * h + 4 * b * s)


def test_layer_norm_bf16_input_under_cpu_autocast():
    g = _ln_graph("bfloat16")
    # Truth on the CPU: the bf16 input itself (2 bytes) + float32 mean and rstd.
    compare(g, BF16, _ln_make(torch.bfloat16), formula=2 * b * s * h + 8 * b * s)


# --------------------------------------------------------------------------- softmax


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_float32_input_saves_output(policy, op):
    g = graph()
    x = float_input(g, (b, s, h))
    g.add(op, x, name="sm")
    torch_op = getattr(F, op)

    def make(bb, ss):
        x_ = leaf(bb, ss, H)
        return (lambda: torch_op(x_, dim=-1)), ()

    compare(g, policy, make, formula=4 * b * s * h)       # the float32 output


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_bf16_input_under_cpu_autocast(op):
    g = graph()
    x = float_input(g, (b, s, h), dtype="bfloat16")
    g.add(op, x, name="sm")
    torch_op = getattr(F, op)

    def make(bb, ss):
        x_ = leaf(bb, ss, H, dtype=torch.bfloat16)
        return (lambda: torch_op(x_, dim=-1)), ()

    compare(g, BF16, make, formula=2 * b * s * h)         # Truth: the bf16 output


@pytest.mark.parametrize("op,cpu,cuda", [
    ("aten::layer_norm", False, True), ("aten::native_layer_norm", False, True),
    ("aten::softmax.int", False, True), ("aten::log_softmax.int", False, True),
    ("aten::pow.Tensor_Scalar", False, True),
    ("aten::addmm", True, True), ("aten::matmul", True, True),      # controls: cast on both
])
def test_which_ops_autocast_casts_on_cpu_and_on_cuda(op, cpu, cuda):
    """Why the layer_norm / softmax / log_softmax rules fit CUDA but not the CPU: these ops
    have an AutocastCUDA kernel (run in float32) while AutocastCPU falls through (they run
    in the input's dtype). The gelu_new rule already makes this distinction for pow."""
    dump = getattr(torch._C, "_dispatch_dump_table", None)
    if dump is None:
        pytest.skip("this PyTorch has no torch._C._dispatch_dump_table")
    lines = {line.split(":")[0]: line for line in dump(op).splitlines()}
    assert ("fallthrough" not in lines["AutocastCPU"]) is cpu
    assert ("fallthrough" not in lines["AutocastCUDA"]) is cuda


# --------------------------------------------------------------------------- autocast table
#
# symmem.rules.autocast records, per device, the cast policy torch.autocast applies to each
# aten op. The tests below pin it three ways: the ops our rules run, by hand (the CUDA
# column from the source, the CPU column from the source and from running the ops); the
# whole table against the kernels the installed PyTorch registers; and the CPU column
# against the dtypes the ops really return under torch.autocast("cpu", dtype=bfloat16).

LOW, FP32_, SET_OPT = "lower_precision_fp", "fp32", "fp32_set_opt_dtype"

# (aten op, the rule that runs it or None, CUDA policy, CPU policy). CUDA, PyTorch 2.13:
# aten/src/ATen/autocast_mode.h, AT_FORALL_LOWER_PRECISION_FP (lines 820-853: addmm, matmul,
# mm, linear, bmm, scaled_dot_product_attention), AT_FORALL_FP32 (855-914: pow.Tensor_Scalar,
# layer_norm, native_layer_norm, nll_loss), AT_FORALL_FP32_SET_OPT_DTYPE (916-927:
# softmax.int, log_softmax.int), registered for AutocastCUDA in aten/src/ATen/autocast_mode.cpp,
# TORCH_LIBRARY_IMPL(aten, Autocast, m). CPU: autocast_mode.cpp,
# TORCH_LIBRARY_IMPL(aten, AutocastCPU, m), "lower_precision_fp cast policy" (bmm, mm, addmm,
# linear, matmul, scaled_dot_product_attention) and "fp32 cast policy" (nll_loss,
# cross_entropy_loss). None: the op falls through (not on any list).
OUR_AUTOCAST_OPS = [
    ("linear", "linear", LOW, LOW),
    ("addmm", "linear", LOW, LOW),                      # GPT-2's Conv1D
    ("matmul", "matmul", LOW, LOW),
    ("mm", None, LOW, LOW),
    ("bmm", None, LOW, LOW),
    ("scaled_dot_product_attention", None, LOW, LOW),
    ("layer_norm", "layer_norm", FP32_, None),
    ("native_layer_norm", None, FP32_, None),
    ("softmax.int", "softmax", SET_OPT, None),
    ("log_softmax.int", "log_softmax", SET_OPT, None),
    ("pow.Tensor_Scalar", "gelu_new", FP32_, None),
    ("nll_loss", "nll_loss", FP32_, FP32_),
    ("cross_entropy_loss", None, None, FP32_),          # CUDA: log_softmax + nll_loss, each fp32
    ("embedding", "embedding", None, None),
    ("gelu", "gelu", None, None),
    ("relu", "relu", None, None),
    ("tanh", "gelu_new", None, None),
    ("mul.Tensor", "scale", None, None),
    ("add.Tensor", "add", None, None),
    ("dropout", "dropout", None, None),
    ("native_dropout", "dropout", None, None),
]


@pytest.mark.parametrize("op,used_by,cuda,cpu", OUR_AUTOCAST_OPS, ids=[o[0] for o in OUR_AUTOCAST_OPS])
def test_autocast_table_for_the_ops_of_our_rules(op, used_by, cuda, cpu):
    assert used_by is None or used_by in RULES
    assert autocast_policy("cuda", op) == cuda
    assert autocast_policy("cpu", op) == cpu


@pytest.mark.parametrize("device,key", [("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")])
def test_autocast_table_lists_the_kernels_pytorch_registers(device, key):
    """Every op of the table, and no other, has a kernel under the device's autocast key in
    the installed PyTorch (the CPU wheel registers the AutocastCUDA kernels too). A failure
    after a PyTorch upgrade means the lists changed: update symmem/rules/autocast.py."""
    get = getattr(torch._C, "_dispatch_get_registrations_for_dispatch_key", None)
    if get is None:
        pytest.skip("this PyTorch has no torch._C._dispatch_get_registrations_for_dispatch_key")
    registered = {name.removeprefix("aten::") for name in get(key) if name.startswith("aten::")}
    table = set(AUTOCAST[device])
    assert (sorted(registered - table), sorted(table - registered)) == ([], []), \
        f"PyTorch {torch.__version__} registers (missing here, extra here) under {key}"


def _autocast_case(op):
    """A call of aten ``op`` on floating tensors of a given dtype (integer indices stay int64)."""
    def r(*shape):
        return lambda dt: torch.randn(*shape).to(dt)
    x, w, ids = r(2, 3, 4), r(5, 4), torch.randint(0, 5, (2, 3))
    return {
        "linear": lambda dt: F.linear(x(dt), w(dt)),
        "addmm": lambda dt: torch.addmm(r(5)(dt), r(6, 4)(dt), r(4, 5)(dt)),
        "matmul": lambda dt: torch.matmul(x(dt), r(4, 3)(dt)),
        "mm": lambda dt: torch.mm(r(6, 4)(dt), r(4, 5)(dt)),
        "bmm": lambda dt: torch.bmm(x(dt), r(2, 4, 3)(dt)),
        "scaled_dot_product_attention":
            lambda dt: F.scaled_dot_product_attention(r(1, 2, 3, 4)(dt), r(1, 2, 3, 4)(dt), r(1, 2, 3, 4)(dt)),
        "layer_norm": lambda dt: F.layer_norm(x(dt), (4,), r(4)(dt), r(4)(dt)),
        "native_layer_norm": lambda dt: torch.native_layer_norm(x(dt), (4,), r(4)(dt), r(4)(dt), 1e-5)[0],
        "softmax.int": lambda dt: F.softmax(x(dt), dim=-1),
        "log_softmax.int": lambda dt: F.log_softmax(x(dt), dim=-1),
        "pow.Tensor_Scalar": lambda dt: torch.pow(x(dt), 3.0),
        "nll_loss": lambda dt: F.nll_loss(r(6, 5)(dt), ids.view(-1)),
        "cross_entropy_loss": lambda dt: F.cross_entropy(r(6, 5)(dt), ids.view(-1)),
        "embedding": lambda dt: F.embedding(ids, w(dt)),
        "gelu": lambda dt: F.gelu(x(dt)),
        "relu": lambda dt: F.relu(x(dt)),
        "tanh": lambda dt: torch.tanh(x(dt)),
        "mul.Tensor": lambda dt: x(dt) * x(dt),
        "add.Tensor": lambda dt: x(dt) + x(dt),
        "dropout": lambda dt: F.dropout(x(dt), 0.5, training=True),
        "native_dropout": lambda dt: torch.native_dropout(x(dt), 0.5, True)[0],
    }[op]


@pytest.mark.parametrize("op", [o[0] for o in OUR_AUTOCAST_OPS])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_autocast_table_cpu_column_is_what_cpu_autocast_does(op, dtype):
    """Run ``op`` on ``dtype`` inputs under torch.autocast("cpu", dtype=torch.bfloat16): the
    output has the dtype Ctx.autocast_dtype predicts (None: the inputs' dtype). float32
    inputs tell lower_precision_fp from the rest, bfloat16 inputs tell fp32 from the rest."""
    ctx = BF16.ctx()
    sym = F32 if dtype == "float32" else ctx.act
    want = ctx.autocast_dtype(op, sym)
    want_name = dtype if want is None else (ctx.act_name if want == ctx.act else want.name)
    call = _autocast_case(op)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = call(getattr(torch, dtype))
    assert str(out.dtype) == f"torch.{want_name}", (op, dtype, autocast_policy("cpu", op))


def test_ctx_autocast_dtype_maps_each_policy():
    half = DType("compute", B_a, 2)
    cuda, cpu = (Ctx(autocast=True, device=d, act=half, act_name="float16") for d in ("cuda", "cpu"))
    assert cuda.autocast_dtype("linear") == half and cpu.autocast_dtype("linear") == half
    assert cuda.autocast_dtype("layer_norm") == F32 and cpu.autocast_dtype("layer_norm") is None
    assert cuda.autocast_dtype("softmax.int") == F32 and cuda.autocast_dtype("norm.Scalar") == F32
    assert cuda.autocast_dtype("gelu") is None
    # promote: the widest floating input (float32 over the half dtype)
    assert cpu.autocast_dtype("cat", half, F32) == F32 and cpu.autocast_dtype("cat", half, half) == half
    # autocast off: nothing is cast, on either device
    assert Ctx(autocast=False, device="cuda").autocast_dtype("linear") is None
    with pytest.raises(sm.ConfigError, match="binary_cross_entropy"):
        cuda.autocast_dtype("binary_cross_entropy")
    assert cpu.autocast_dtype("binary_cross_entropy") == F32
    with pytest.raises(sm.UnknownName, match="unknown autocast device 'tpu'"):
        Ctx(autocast=True, device="tpu").autocast_dtype("linear")


def test_rules_take_their_casts_from_the_table(monkeypatch):
    """No rule branches on the device for a cast: give the CPU CUDA's table and the casting
    rules give on the CPU exactly what they give on CUDA."""
    import symmem.rules.autocast as ac

    g = graph(V=11)
    x = float_input(g, (b, s, h), dtype="bfloat16")
    y = g.add("layer_norm", x, params=(g.param("ln.weight", (h,)), g.param("ln.bias", (h,))))
    q = g.add("linear", y, params=(g.param("w", (h, h)), g.param("bias", (h,))), conv1d=True)
    q = g.add("heads", q, heads=2)
    g.add("softmax", g.add("matmul", q, q, transpose_b=True))
    logits = g.add("linear", y, params=(g.param("lm_head", (V, h)),))
    g.add("nll_loss", g.add("log_softmax", logits), g.input("labels", (b, s)))
    cuda = sm.Policy("bf16-mixed", "sgd", "cuda")
    assert infos(g, BF16) != infos(g, cuda)                 # layer_norm, softmax, log_softmax
    monkeypatch.setattr(ac, "AUTOCAST", {"cuda": ac.AUTOCAST["cuda"], "cpu": ac.AUTOCAST["cuda"]})
    assert infos(g, BF16) == infos(g, cuda)


def test_rules_do_not_import_the_graph():
    """symmem.rules reads nodes through the NodeLike protocol, never symmem.graph."""
    import ast
    import pathlib

    import symmem.rules
    for path in pathlib.Path(symmem.rules.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                assert "graph" not in (node.module or ""), (path.name, node.module)
            elif isinstance(node, ast.Import):
                assert all("graph" not in a.name for a in node.names), path.name


def test_registry_refuses_duplicates_and_overrides_per_call():
    with pytest.raises(ValueError, match="a rule for 'relu' is already registered"):
        rule("relu")(lambda node, ins, ctx: None)

    def loud_relu(node, ins, ctx):
        return get_rule("relu")(node, ins, ctx)

    assert get_rule("relu", overrides={"relu": loud_relu}) is loud_relu
    assert get_rule("gelu", overrides={"relu": loud_relu}) is RULES["gelu"]
    assert get_rule("relu") is RULES["relu"] is not loud_relu


# --------------------------------------------------------------------------- embeddings


@pytest.mark.parametrize("policy", POLICIES)
def test_embedding_saves_its_int64_indices(policy):
    g = graph(V=11)
    ids = g.input("ids", (b, s))
    g.add("embedding", ids, params=(g.param("wte", (V, h)),), name="wte")
    assert g.shape("wte") == (b, s, h)

    def make(bb, ss):
        wte = nn.Embedding(11, H)
        ids_ = torch.randint(0, 11, (bb, ss))
        return (lambda: wte(ids_)), wte

    # the indices: b*s * 8 bytes; the output is float32 (embedding is not autocast)
    compare(g, policy, make, formula=8 * b * s)


@pytest.mark.parametrize("policy", POLICIES)
def test_position_embedding_saves_the_position_ids(policy):
    g = graph(s_max=16)
    ids = g.input("ids", (b, s))
    g.add("position_embedding", g.add("positions", ids, name="position_ids"), params=(g.param("wpe", (s_max, h)),),
          name="wpe")
    assert g.shape("wpe") == (1, s, h)

    def make(bb, ss):
        wpe = nn.Embedding(16, H)

        def fn():
            # GPT2Model.forward
            position_ids = torch.arange(ss) + 0
            return wpe(position_ids.unsqueeze(0))
        return fn, wpe

    compare(g, policy, make, formula=8 * s)                # s int64 position ids


@pytest.mark.parametrize("policy", POLICIES)
def test_gpt2_embedding_front(policy):
    """wte(ids) + wpe(positions), then dropout: ids (8bs) + positions (8s) + float32 noise."""
    g = graph(V=11, s_max=16)
    ids = g.input("ids", (b, s))
    tok = g.add("embedding", ids, params=(g.param("wte", (V, h)),), name="wte")
    pos = g.add("position_embedding", g.add("positions", ids, name="position_ids"),
                params=(g.param("wpe", (s_max, h)),), name="wpe")
    x = g.add("add", tok, pos, name="embed")
    g.add("dropout", x, p=0.1, name="drop")
    # the residual stream stays float32 under autocast (embedding is not autocast)
    formula = 8 * b * s + 8 * s + (4 * b * s * h if policy is BF16 else B_a * b * s * h)

    def make(bb, ss):
        m = nn.ModuleDict({"wte": nn.Embedding(11, H), "wpe": nn.Embedding(16, H)})
        ids_ = torch.randint(0, 11, (bb, ss))

        def fn():
            pos_ = (torch.arange(ss) + 0).unsqueeze(0)
            return F.dropout(m["wte"](ids_) + m["wpe"](pos_), p=0.1, training=True)
        return fn, m

    compare(g, policy, make, formula=formula)


def _hf_config(**kw):
    kw = {"n_embd": H, "n_head": 2, "n_layer": 1, "vocab_size": 11, "n_positions": 16,
          "bos_token_id": 0, "eos_token_id": 0, **kw}
    cfg = transformers.GPT2Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


@pytest.mark.parametrize("policy", POLICIES)
def test_causal_mask_shape_dtype_and_nothing_saved(policy):
    from transformers.masking_utils import create_causal_mask

    g = graph()
    ids = g.input("ids", (b, s))
    g.add("causal_mask", ids, name="mask")
    assert g.shape("mask") == (b, 1, s, s)
    fp = infos(g, policy)["mask"]
    assert not fp.out.requires_grad and fp.saved == ()
    assert activations(g, policy) == 0
    cfg = _hf_config()
    for bb, ss in SIZES:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=policy.prec.autocast):
            emb = nn.Embedding(11, H)(torch.randint(0, 11, (bb, ss)))
            mask = create_causal_mask(config=cfg, inputs_embeds=emb, attention_mask=None,
                                      cache=None, position_ids=torch.arange(ss).unsqueeze(0))
        assert tuple(mask.shape) == concrete(g.shape("mask"), g, bb, ss)
        assert mask.element_size() == elem_bytes(fp.out.dtype, policy) == 4
        # a full (b, 1, s, s) storage, not a broadcast view: b*s*s * 4 bytes
        assert mask.untyped_storage().nbytes() == int(fp.out.nbytes.subs(
            {b: bb, s: ss, **policy.bindings()}))


# --------------------------------------------------------------------------- loss


def _shift(labels):
    """ForCausalLMLoss's label shift: pad with -100, drop the first column."""
    padded = F.pad(labels, (0, 1), value=-100)
    return padded[..., 1:].contiguous()


def _nll_make(bb, ss):
    logp_ = leaf(bb, ss, 11)
    labels_ = torch.randint(0, 11, (bb, ss))

    def fn():
        target = _shift(labels_).view(-1)
        return F.nll_loss(logp_.view(-1, 11), target, ignore_index=-100, reduction="mean")
    return fn, ()


def test_nll_loss_at_batch_one_saves_the_padded_labels():
    """At b = 1 labels[..., 1:] of the (1, s+1) padded labels is already contiguous, so
    .contiguous() returns the view and the saved target keeps the whole padded storage, s+1
    int64 (b=1, s=3, V=11: 132 + 32 + 4 = 168 bytes), where b >= 2 saves a copy of b*s."""
    g = graph(V=11)
    logp = float_input(g, (b, s, V), name="logp")
    g.add("nll_loss", logp, g.input("labels", (b, s)), name="loss")
    # Truth at b = 1: log-probs, the padded labels b*(s+1) * 8, total_weight 4
    compare(g, dataclasses.replace(FP32, batch_one=True), _nll_make, sizes=((1, 3), (1, 5)),
            formula=4 * b * s * V + 8 * b * (s + 1) + 4)
    assert sm.estimate(g, FP32).at(b=1, s=3).bytes["activations"] == 132 + 32 + 4


@pytest.mark.parametrize("policy", POLICIES)
def test_nll_loss_saves_logp_shifted_labels_and_total_weight(policy):
    g = graph(V=11)
    logp = float_input(g, (b, s, V), name="logp")
    labels = g.input("labels", (b, s))
    g.add("nll_loss", logp, labels, name="loss")
    assert g.shape("loss") == ()

    # log-probs b*s*V * 4, the shifted int64 labels b*s * 8, total_weight 0-dim float32: 4
    compare(g, policy, _nll_make, formula=4 * b * s * V + 8 * b * s + 4)


@pytest.mark.parametrize("policy", POLICIES)
def test_lm_head_and_loss_against_transformers_ForCausalLMLoss(policy):
    """linear (lm_head) -> logits.float() -> log_softmax -> nll_loss, versus
    transformers' ForCausalLMLoss (cross_entropy = log_softmax + nll_loss)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = graph(V=11)
    x = float_input(g, (b, s, h))
    labels = g.input("labels", (b, s))
    logits = g.add("linear", x, params=(g.param("lm_head", (V, h)),), name="lm_head")
    lf = g.add("to_float32", logits, name="logits_float")
    logp = g.add("log_softmax", lf, name="log_softmax")
    g.add("nll_loss", logp, labels, name="loss")
    loss_part = 4 * b * s * V + 8 * b * s + 4            # float32 log-probs, labels, weight
    if policy is FP32:
        formula = 4 * b * s * h + loss_part              # lm_head saves x
    else:
        formula = B_a * b * s * h + B_a * V * h + loss_part   # bf16 x and bf16 W

    def make(bb, ss):
        head = nn.Linear(H, 11, bias=False)
        x_ = leaf(bb, ss, H)
        labels_ = torch.randint(0, 11, (bb, ss))
        return (lambda: ForCausalLMLoss(head(x_), labels_, vocab_size=11)), head

    compare(g, policy, make, formula=formula)


# --------------------------------------------------------------------------- attention block


def _attention_graph(heads=2, attn_p=0.1, source="input"):
    """The attention half of a GPT-2 block. ``source``: the block's input x is a float32
    graph input, or (as in the GPT-2 builder) the output of a token embedding."""
    g = graph(a=heads, V=11)
    ids = g.input("ids", (b, s))
    if source == "input":
        x = float_input(g, (b, s, h))
    else:
        x = g.add("embedding", ids, params=(g.param("wte", (V, h)),), name="wte")
    mask = g.add("causal_mask", ids, name="mask")

    def conv1d(name, y, n_in, n_out):
        w_, b_ = g.param(f"{name}.weight", (n_in, n_out)), g.param(f"{name}.bias", (n_out,))
        return g.add("linear", y, params=(w_, b_), conv1d=True, name=name)

    y = g.add("layer_norm", x, params=(g.param("ln.weight", (h,)), g.param("ln.bias", (h,))),
              name="ln_1")
    qkv = conv1d("c_attn", y, h, 3 * h)
    q, k, v = (g.add("heads", g.add("split", qkv, parts=3, index=i, name=n), heads=a,
                     name=f"{n}_heads") for i, n in enumerate("qkv"))
    z = g.add("matmul", q, k, transpose_b=True, name="scores")
    z = g.add("scale", z, name="scale")
    z = g.add("add", z, mask, name="masked")
    z = g.add("softmax", z, name="softmax")
    z = g.add("to_compute", z, name="probs")
    z = g.add("dropout", z, p=attn_p, name="attn_dropout")
    z = g.add("matmul", z, v, name="context")
    z = g.add("merge_heads", z, name="merge")
    conv1d("c_proj", z, h, h)
    return g


def _attention_make(heads=2, attn_p=0.1, source="input"):
    from transformers.masking_utils import create_causal_mask
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    cfg = _hf_config(n_head=heads, attn_pdrop=attn_p, resid_pdrop=0.0)

    def make(bb, ss):
        m = nn.ModuleDict({"wte": nn.Embedding(11, H), "ln_1": nn.LayerNorm(H),
                           "attn": GPT2Attention(cfg, layer_idx=0)})
        m.train()
        ids_ = torch.randint(0, 11, (bb, ss))
        x_ = leaf(bb, ss, H)

        def fn():
            x = x_ if source == "input" else m["wte"](ids_)
            mask = create_causal_mask(config=cfg, inputs_embeds=x, attention_mask=None,
                                      cache=None, position_ids=torch.arange(ss).unsqueeze(0))
            return m["attn"](m["ln_1"](x), attention_mask=mask)[0]
        return fn, m
    return make


def test_gpt2_attention_module_is_the_block_we_model():
    """Sanity check of the reference: GPT2Attention runs eager_attention_forward, scales by
    head_dim ** -0.5 and applies attn dropout in training."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    attn = GPT2Attention(_hf_config(attn_pdrop=0.1), layer_idx=0)
    assert attn.config._attn_implementation == "eager"
    assert math.isclose(attn.scaling, (H // 2) ** -0.5)
    assert not attn.reorder_and_upcast_attn


def _attention_formula(policy, attn_p=0.1, source="input"):
    """The block's saved bytes by hand (B_a: the compute dtype's bytes)."""
    if policy is FP32:
        # ln_1: x (4bsh) + mean, rstd (8bs); c_attn: ln output (4bsh); q, k copies (8bsh);
        # scale: float64 scalar (8); softmax output (4bas^2); context matmul: v copy (4bsh)
        # and the probabilities; c_proj: the merged copy (4bsh). With dropout, the
        # probabilities are its output (4bas^2) and it saves its noise (4bas^2); without,
        # they are the softmax output, already counted.
        f = 24 * b * s * h + 8 * b * s + 8 + 4 * b * a * s**2
        f += 8 * b * a * s**2 if attn_p else 0
    else:
        # ln_1 as in fp32 (its input is float32): 4bsh + 8bs; c_attn: bf16 ln output
        # (B_a bsh) + bf16 W (3h^2 B_a); q, k copies (2 B_a bsh); scalar 8; softmax output,
        # float32 since the mask is (4bas^2); v copy (B_a bsh); merged copy (B_a bsh); c_proj
        # bf16 W (h^2 B_a). The probabilities' bf16 copy (B_a bas^2) is what the context
        # matmul saves at p = 0; with dropout it saves the output (B_a bas^2) and the
        # dropout its bf16 noise (B_a bas^2).
        f = (4 * b * s * h + 8 * b * s + 5 * B_a * b * s * h + 4 * B_a * h * h + 8
             + 4 * b * a * s**2)
        f += 2 * B_a * b * a * s**2 if attn_p else B_a * b * a * s**2
    if source == "embedding":
        f += 8 * b * s                                   # the int64 token ids
    return f


@pytest.mark.parametrize("policy", POLICIES)
def test_attention_block_end_to_end(policy):
    g = _attention_graph()
    assert g.shape("c_proj") == (b, s, h)
    compare(g, policy, _attention_make(), formula=_attention_formula(policy),
            sizes=((2, 3), (3, 5), (2, 8)))


@pytest.mark.parametrize("policy", POLICIES)
def test_attention_block_at_batch_one(policy):
    """At b=1 PyTorch saves the whole qkv storage through the q, k, v views instead of three
    copies of b*s*h (see the matmul test at batch one): the same bytes, so the block still matches."""
    compare(_attention_graph(), policy, _attention_make(), formula=_attention_formula(policy),
            sizes=((1, 3), (1, 6)))


@pytest.mark.parametrize("policy", POLICIES)
def test_attention_block_from_embedding(policy):
    """The block fed by a token embedding, as in the GPT-2 builder: the indices (8bs) on top."""
    compare(_attention_graph(source="embedding"), policy, _attention_make(source="embedding"),
            formula=_attention_formula(policy, source="embedding"))


@pytest.mark.parametrize("policy", POLICIES)
def test_attention_block_without_attention_dropout(policy):
    """attn_pdrop = 0: dropout returns the probabilities themselves and the context matmul
    saves them (fp32: the softmax output, already saved by softmax; bf16: the bf16 copy).
    Block fed by an embedding, so that its values are in the policy's compute dtype."""
    compare(_attention_graph(attn_p=0.0, source="embedding"), policy,
            _attention_make(attn_p=0.0, source="embedding"),
            formula=_attention_formula(policy, attn_p=0.0, source="embedding"))


def test_attention_block_without_attention_dropout_float32_input():
    compare(_attention_graph(attn_p=0.0), FP32, _attention_make(attn_p=0.0),
            formula=_attention_formula(FP32, attn_p=0.0))
