"""Random graphs, run for real: a small interpreter executes a symmem graph in PyTorch on the
CPU (unrolled, with the ops' PyTorch code; each layer under torch.utils.checkpoint when the
policy recomputes; K micro-batches when it accumulates), and the formulas must match what
autograd saves and the training step's peak, to the byte."""
import math

import pytest

torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, assume, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import symmem as sm  # noqa: E402
from symmem import passes  # noqa: E402
from symmem.errors import ShapeError  # noqa: E402
from symmem.measure import saved_bytes, training_step  # noqa: E402
from symmem.symbols import L  # noqa: E402

from test_repeat_property import OPS, build  # noqa: E402

F = torch.nn.functional


class Interpreter(torch.nn.Module):
    """Runs an unrolled symmem graph as PyTorch eager code: values are dropped after their
    last use, as locals of eager code would be. With ``checkpoint`` ("non-reentrant" or
    "reentrant") the nodes of each layer (the same ``layer`` attribute; with ``marked``, of
    the layers marked ``checkpoint=True`` only) run as one ``torch.utils.checkpoint`` region."""

    def __init__(self, graph, checkpoint=None, marked=False):
        super().__init__()
        self.graph, self.checkpoint, self.marked = graph, checkpoint, marked
        params, seen = torch.nn.ParameterDict(), set()
        for node in graph.items:
            for p in node.params:
                if p.name not in seen:
                    seen.add(p.name)
                    shape = [int(d.xreplace(graph.bindings)) for d in p.shape]
                    params[self.key(p.name)] = torch.nn.Parameter(torch.randn(*shape) * 0.02,
                                                                  requires_grad=p.trainable)
        self.params = params

    @staticmethod
    def key(name):
        return name.replace(".", "_").replace("/", "_")

    def forward(self, ids):
        items = self.graph.items
        last = {v: i for i, node in enumerate(items) for v in node.inputs}
        env, i = {}, 0
        while i < len(items):
            layer = items[i].attr("layer")
            j = i + 1
            if self.checkpoint is None or layer is None or (self.marked and not items[i].attr("checkpoint")):
                self.run(items[i:j], env, ids, last, i)
            else:
                while j < len(items) and items[j].attr("layer") == layer:
                    j += 1
                region = items[i:j]
                made = {n.name for n in region}
                inputs = list(dict.fromkeys(v for n in region for v in n.inputs if v not in made))
                outputs = [n.name for n in region if last.get(n.name, -1) >= j]

                def fn(*args, region=region, inputs=inputs, outputs=outputs, start=i, stop=j):
                    local = dict(zip(inputs, args))
                    keep = {v: stop for v in outputs}
                    self.run(region, local, ids, {**last, **keep}, start)
                    return tuple(local[o] for o in outputs)
                values = torch.utils.checkpoint.checkpoint(
                    fn, *[env[v] for v in inputs], use_reentrant=self.checkpoint == "reentrant")
                env.update(zip(outputs, values))
                del values
                for v in inputs:
                    if last[v] < j:
                        del env[v]
            i = j
        return env[items[-1].name]

    def run(self, nodes, env, ids, last, start):
        """Run ``nodes`` (the first at position ``start``) in ``env``, dropping each value after
        its last use."""
        for i, node in enumerate(nodes, start):
            ins = [env[v] for v in node.inputs]
            ps = [self.params[self.key(p.name)] for p in node.params]
            env[node.name] = self.op(node, ins, ps, ids)
            del ins
            for v in set(node.inputs):
                if last[v] == i:
                    del env[v]

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
        if op == "nll_loss":   # transformers' ForCausalLMLoss label shift (its padded labels stay a local)
            padded = F.pad(ins[1], (0, 1), value=-100)
            labels = padded[..., 1:].contiguous()
            return F.nll_loss(x.view(-1, x.shape[-1]), labels.view(-1), ignore_index=-100)
        raise NotImplementedError(op)


OPTIMIZERS = {"adamw": lambda ps: torch.optim.AdamW(ps, foreach=False),
              "adam": lambda ps: torch.optim.Adam(ps, foreach=False),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False),
              "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
              "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=False),
              "adagrad": lambda ps: torch.optim.Adagrad(ps, foreach=False),
              "rmsprop": lambda ps: torch.optim.RMSprop(ps, foreach=False),
              "rmsprop-momentum": lambda ps: torch.optim.RMSprop(ps, momentum=0.9, foreach=False),
              **({"adafactor": lambda ps: torch.optim.Adafactor(ps, foreach=False)}
                 if hasattr(torch.optim, "Adafactor") else {})}   # torch >= 2.5


#: spec -> how the interpreter checkpoints: the variant, and whether only marked layers
RECOMPUTE = {"none": (None, False), "full": ("non-reentrant", False), "full,reentrant": ("reentrant", False),
             "every:2": ("non-reentrant", False), "last:1": ("non-reentrant", True)}


# a region whose last node saves nothing through the checkpoint's hooks (x * 0.125): its
# backward runs before the recomputation, which stops at the layer norm
@example(ops=["ln", "scale"], tied=False, p_drop=0.0, precision="fp32", optimizer="sgd", n=2, recompute="full",
         accumulate=1, bb=2, ss=4)
# derandomize: the same 25 examples on every run, so that CI is deterministic (and the suite
# within its time); explore further by hand with a larger max_examples and derandomize=False
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=4), tied=st.booleans(),
       p_drop=st.sampled_from([0.0, 0.1]), precision=st.sampled_from(["fp32", "bf16-mixed"]),
       optimizer=st.sampled_from(list(OPTIMIZERS)), n=st.integers(1, 4),
       recompute=st.sampled_from(list(RECOMPUTE)), accumulate=st.sampled_from([1, 1, 2, 3]),
       bb=st.integers(2, 4), ss=st.integers(4, 24))
def test_random_graph_against_pytorch(ops, tied, p_drop, precision, optimizer, n, recompute, accumulate,
                                      bb, ss):
    assume(recompute != "every:2" or n % 2 == 0)
    # a known gap, pinned below: gelu_new's backward under the reentrant checkpoint
    assume(not (recompute == "full,reentrant" and "gelu_new" in ops))
    # and the order of autocast's cast-backs inside a reentrant checkpoint, pinned below
    assume(not (recompute == "full,reentrant" and precision == "bf16-mixed" and ops[0] in ("lin", "lin_bias", "mlp")))
    g = build(ops, tied, p_drop)
    g.bindings[L] = n                 # the model's own layers (a block may be derived with them bound)
    _against_pytorch(g, precision, optimizer, recompute, accumulate, bb, ss)


def _against_pytorch(g, precision, optimizer, recompute, accumulate, bb, ss):
    """symmem's estimate of the random graph ``g`` against the Interpreter running it: bytes
    saved for backward and the step's peak, exact. The optimizer gets the trainable weights,
    as transformers' Trainer passes them (Adagrad would make its state for every weight it is
    given, in its constructor)."""
    policy = sm.Policy(precision, optimizer, "cpu", recompute=recompute, accumulate=accumulate)
    try:
        est = sm.estimate(g, policy)
    except ShapeError:
        assume(False)
    torch.manual_seed(0)
    module = Interpreter(passes.prepare(g, policy).unrolled(), *RECOMPUTE[recompute])
    ids = torch.randint(0, 50, (bb, ss))

    def loss():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            return module(ids)
    probe = loss()
    assume(probe.requires_grad)       # some trainable weight reaches the loss
    del probe
    ev = est.at(b=bb, s=ss)
    assert ev.bytes["activations"] == saved_bytes(loss, exclude=module).total
    trainable = [p for p in module.parameters() if p.requires_grad]
    report = training_step(module, lambda m: loss(), OPTIMIZERS[optimizer](trainable), extra=(ids,),
                           accumulate=accumulate)
    assert ev.peak == report.peak, (ev.peak_point.where, report.peak_phase, report.peak_op)


#: which weights a random graph freezes (Param.trainable False), by name
FREEZE = {"embedding": lambda name: name in ("emb", "head"),
          "blocks": lambda name: name[:1].isdigit(),
          "norms and biases": lambda name: name.endswith((".b", ".w")) and "." in name and "lnf" not in name,
          "every other": lambda name: sum(map(ord, name)) % 2 == 0}


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=4), tied=st.booleans(),
       p_drop=st.sampled_from([0.0, 0.1]), precision=st.sampled_from(["fp32", "bf16-mixed"]),
       optimizer=st.sampled_from(["adamw", "sgd-momentum", "adagrad"]), n=st.integers(1, 3),
       recompute=st.sampled_from(["none", "full"]), accumulate=st.sampled_from([1, 2]),
       freeze=st.sampled_from(list(FREEZE)), bb=st.integers(2, 4), ss=st.integers(4, 16))
def test_random_graph_with_frozen_weights_against_pytorch(ops, tied, p_drop, precision, optimizer, n, recompute,
                                                          accumulate, freeze, bb, ss):
    """Frozen weights (requires_grad=False) anywhere in a random graph: no gradient or state
    for them, and each op saves only what the trainable inputs' gradients need."""
    from dataclasses import replace
    g = build(ops, tied, p_drop)
    g.bindings[L] = n
    g = g.with_params(lambda p: replace(p, trainable=not FREEZE[freeze](p.name)))
    assume(any(p.trainable for p, _ in g.params()))
    _against_pytorch(g, precision, optimizer, recompute, accumulate, bb, ss)


def _reentrant(ops, tied, precision, optimizer, bb, ss):
    """A one-layer random graph checkpointed reentrantly: symmem's estimate and PyTorch's step."""
    g = build(ops, tied, 0.0)
    g.bindings[L] = 1
    policy = sm.Policy(precision, optimizer, "cpu", recompute="full,reentrant")
    est = sm.estimate(g, policy)
    torch.manual_seed(0)
    module = Interpreter(passes.prepare(g, policy).unrolled(), "reentrant")
    ids = torch.randint(0, 50, (bb, ss))

    def loss():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            return module(ids)
    report = training_step(module, lambda m: loss(), OPTIMIZERS[optimizer](module.parameters()), extra=(ids,))
    return est, report


def test_reentrant_gelu_new_backward_is_one_tensor_above():
    """The known gap, pinned. gelu_new is several ops; its backward's largest moment is one
    tensor of its input's size above the moment symmem counts (its first op, the output's
    gradient and the input's beside one scratch tensor) when the output's gradient stays
    referenced through the composite's backward, as the reentrant checkpoint's backward
    keeps it: b*s*h*4 = 2*6*16*4 = 768 bytes here (fp32). Elsewhere the gradient is freed by
    the composite's first op and the count is exact."""
    est, report = _reentrant(["gelu_new"], True, "fp32", "adamw", 2, 6)
    subs = est._subs({"b": 2, "s": 6})
    gelu = [int(p.total.xreplace(subs)) for p in est.timeline if p.phase == "backward"
            and p.node == "blk/0_gelu_new"]
    assert report.peak == max(gelu) + 2 * 6 * 16 * 4
    assert report.peak_op == "aten.mul.Tensor" and report.peak_phase == "backward"


def test_reentrant_autocast_casts_the_input_gradient_back_first():
    """A block that starts with a linear under bf16 autocast, checkpointed reentrantly, L = 1:
    inside CheckpointFunction.backward the first layer's input gradient is cast back to
    float32 and its bfloat16 copy freed before the weight's gradient is cast back (the casts
    run in reverse order of their creation: linear(x, weight, bias) casts back x, the weight,
    then the bias). symmem casts them back in that order, one at a time: the peak exact."""
    est, report = _reentrant(["mlp"], False, "bf16-mixed", "sgd", 2, 4)
    ev = est.at(b=2, s=4)
    assert ev.peak == report.peak
    casts = [x.live_bytes for x in report.timeline if x.phase == "backward" and x.op == "aten._to_copy.default"]
    subs = est._subs({"b": 2, "s": 4})
    assert max(int(p.total.xreplace(subs)) for p in est.timeline if "(cast back)" in p.where) == max(casts)
