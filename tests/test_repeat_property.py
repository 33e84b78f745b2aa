"""Property: for random blocks, random policies and layer counts, the repeat walked once
agrees exactly with the unrolled graph (components symbolically, the peak numerically)."""
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import symmem as sm
from helpers import assert_repeat_matches_unrolled
from symmem.errors import ShapeError
from symmem.symbols import L, V, b, h, s

OPS = ["ln", "lin", "lin_bias", "relu", "gelu", "gelu_new", "scale", "dropout", "res", "mlp"]


def build(ops, tied, p_drop):
    g = sm.Graph("random", {h: 16, V: 50})
    ids = g.input("ids", (b, s))
    emb = g.param("emb", (V, h))
    x = g.add("embedding", ids, params=(emb,), name="embed")
    x = g.add("dropout", x, p=p_drop, name="embed_drop")

    def body(gr, y):
        first = y
        for i, op in enumerate(ops):
            n = f"blk/{i}_{op}"
            if op == "ln":
                y = gr.add("layer_norm", y, params=(gr.param(f"{i}.w", (h,)), gr.param(f"{i}.b", (h,))), name=n)
            elif op in ("lin", "lin_bias"):
                ps = (gr.param(f"{i}.w", (h, h)),) + ((gr.param(f"{i}.b", (h,)),) if op == "lin_bias" else ())
                y = gr.add("linear", y, params=ps, name=n)
            elif op == "dropout":
                y = gr.add("dropout", y, p=p_drop, name=n)
            elif op == "res":
                y = gr.add("add", y, first, name=n)
            elif op == "mlp":
                y = gr.add("linear", y, params=(gr.param(f"{i}.up", (4 * h, h)),), name=n + "_up")
                y = gr.add("gelu", y, name=n + "_act")
                y = gr.add("linear", y, params=(gr.param(f"{i}.down", (h, 4 * h)),), name=n + "_down")
            else:
                y = gr.add(op, y, name=n)
        return y

    x = g.repeat(L, body, x, name="blk")
    x = g.add("layer_norm", x, params=(g.param("lnf.w", (h,)), g.param("lnf.b", (h,))), name="ln_f")
    head = emb if tied else g.param("head", (V, h))
    x = g.add("linear", x, params=(head,), name="head")
    x = g.add("log_softmax", x, name="logp")
    g.add("nll_loss", x, ids, name="loss")
    return g


POLICIES = [sm.Policy("fp32", "adamw", "cpu"), sm.Policy("fp32", "sgd", "cuda"),
            sm.Policy("bf16-mixed", "adam", "cuda", "for-loop"), sm.Policy("bf16-mixed", "sgd-momentum", "cpu"),
            sm.Policy("bf16-master", "adamw", "cuda", "fused")]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=5), tied=st.booleans(),
       p_drop=st.sampled_from([0.0, 0.1]), policy=st.sampled_from(POLICIES), n=st.integers(1, 4),
       points=st.lists(st.tuples(st.integers(1, 64), st.integers(1, 4096)), min_size=2, max_size=4))
def test_repeat_equals_unrolled(ops, tied, p_drop, policy, n, points):
    g = build(ops, tied, p_drop)
    try:
        rep = sm.estimate(g, policy)
    except ShapeError:              # a block whose iterations still differ after peeling
        assume(False)
    assume(not any(r.broken({L: n}) for r in rep.requirements))   # e.g. L >= 2: a first iteration of its own
    g.bindings[L] = n
    assert_repeat_matches_unrolled(rep, sm.estimate(g.unrolled(), policy), n, points)


def test_the_generator_makes_both_kinds_of_block():
    """Blocks that free their input in the first iteration, and blocks that keep it."""
    assert sm.estimate(build(["scale", "relu"], True, 0.0), POLICIES[0])
    assert sm.estimate(build(["ln", "mlp", "res"], False, 0.1), POLICIES[2])
    first = sm.estimate(build(["lin"], True, 0.0), POLICIES[2])   # float32 in, bfloat16 out
    assert [r.lhs for r in first.requirements if r.rhs == L] == [2]
