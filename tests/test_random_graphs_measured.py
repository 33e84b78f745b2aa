"""Random graphs, run for real: a small interpreter executes a symmem graph in PyTorch on the
CPU (unrolled, with the ops' PyTorch code), and the formulas must match what autograd saves
(exactly) and the training step's peak (within 1%)."""
import math

import pytest

torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import symmem as sm  # noqa: E402
from symmem.errors import ShapeError  # noqa: E402
from symmem.measure import saved_bytes, training_step  # noqa: E402
from symmem.symbols import L  # noqa: E402

from test_repeat_property import OPS, build  # noqa: E402

F = torch.nn.functional


class Interpreter(torch.nn.Module):
    """Runs an unrolled symmem graph as PyTorch eager code."""

    def __init__(self, graph):
        super().__init__()
        self.graph = graph
        params, seen = torch.nn.ParameterDict(), set()
        for node in graph.items:
            for p in node.params:
                if p.name not in seen:
                    seen.add(p.name)
                    shape = [int(d.xreplace(graph.bindings)) for d in p.shape]
                    params[self.key(p.name)] = torch.nn.Parameter(torch.randn(*shape) * 0.02)
        self.params = params

    @staticmethod
    def key(name):
        return name.replace(".", "_").replace("/", "_")

    def forward(self, ids):
        # Values are dropped after their last use, as locals of eager code would be.
        last = {v: i for i, node in enumerate(self.graph.items) for v in node.inputs}
        env = {}
        for i, node in enumerate(self.graph.items):
            ins = [env[v] for v in node.inputs]
            ps = [self.params[self.key(p.name)] for p in node.params]
            env[node.name] = self.op(node, ins, ps, ids)
            del ins
            for v in set(node.inputs):
                if last[v] == i:
                    del env[v]
        return env[self.graph.items[-1].name]

    def op(self, node, ins, ps, ids):
        x = ins[0] if ins else None
        op = node.op
        if op == "input":
            return ids
        if op == "carry":
            return x
        if op == "embedding":
            return F.embedding(x, ps[0])
        if op == "dropout":
            return F.dropout(x, node.attr("p"), training=True)
        if op == "layer_norm":
            return F.layer_norm(x, (x.shape[-1],), ps[0], ps[1])
        if op == "linear":
            return F.linear(x, ps[0], ps[1] if len(ps) > 1 else None)
        if op == "relu":
            return F.relu(x)
        if op == "gelu":
            return F.gelu(x)
        if op == "gelu_new":   # transformers' NewGELUActivation
            return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
        if op == "scale":
            return x * 0.125
        if op == "add":
            return x + ins[1]
        if op == "log_softmax":
            return F.log_softmax(x, dim=-1)
        if op == "nll_loss":   # transformers' ForCausalLMLoss label shift
            labels = F.pad(ins[1], (0, 1), value=-100)[..., 1:].contiguous()
            return F.nll_loss(x.view(-1, x.shape[-1]), labels.view(-1), ignore_index=-100)
        raise NotImplementedError(op)


OPTIMIZERS = {"adamw": lambda ps: torch.optim.AdamW(ps, foreach=False),
              "adam": lambda ps: torch.optim.Adam(ps, foreach=False),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False),
              "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False)}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=4), tied=st.booleans(),
       p_drop=st.sampled_from([0.0, 0.1]), precision=st.sampled_from(["fp32", "bf16-mixed"]),
       optimizer=st.sampled_from(list(OPTIMIZERS)), n=st.integers(1, 3),
       bb=st.integers(2, 4), ss=st.integers(4, 24))
def test_random_graph_against_pytorch(ops, tied, p_drop, precision, optimizer, n, bb, ss):
    g = build(ops, tied, p_drop)
    policy = sm.Policy(precision, optimizer, "cpu")
    try:
        est = sm.estimate(g, policy)
    except ShapeError:
        assume(False)
    assume(not any(r.broken({L: n}) for r in est.requirements))   # e.g. L >= 2: a first iteration of its own
    g.bindings[L] = n
    torch.manual_seed(0)
    module = Interpreter(g.unrolled())
    ids = torch.randint(0, 50, (bb, ss))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32")

    def loss():
        with autocast:
            return module(ids)

    ev = est.at(b=bb, s=ss, L=n)
    assert ev.bytes["activations"] == saved_bytes(loss, exclude=module).total
    report = training_step(module, lambda m: loss(), OPTIMIZERS[optimizer](module.parameters()), extra=(ids,))
    assert abs(ev.peak - report.peak) <= 0.01 * report.peak, (ev.peak, report.peak, ev.peak_point.where,
                                                              report.peak_phase, report.peak_op)
