"""The optimizers beyond SGD and Adam, measured: Adagrad, RMSprop (without and with momentum),
Adafactor (torch.optim's, and transformers' as its Trainer runs it) and Lion
(lucidrains/lion-pytorch's reference update, copied below), each in every implementation it
has, on Hugging Face's GPT-2 on the CPU, fp32 and bf16 autocast, at two sizes: the training
step's peak, its phase and every phase's maximum, to the byte. Then each on its own, for
parameters of any rank in either order: its state and its step's largest moment. Every
optimizer runs with PyTorch's (or the reference's) default hyper-parameters."""
import inspect

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import sympy as sp  # noqa: E402

import symmem as sm  # noqa: E402
from symmem.measure import training_step  # noqa: E402
from helpers import assert_step_exact  # noqa: E402
from symmem.policy import OPTIMIZERS  # noqa: E402
from symmem.symbols import B_o  # noqa: E402

from test_gpt2_measured import POINTS, graph_of, hf_model, loss_fn  # noqa: E402


class Lion(torch.optim.Optimizer):
    """lucidrains/lion-pytorch, lion_pytorch/lion_pytorch.py (``Lion`` and ``update_fn``), its
    ops in the reference's order: one ``exp_avg`` per parameter, no step counter."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @staticmethod
    def update_fn(p, grad, exp_avg, lr, wd, beta1, beta2):
        p.data.mul_(1. - lr * wd)
        update = exp_avg.clone().mul_(beta1).add(grad, alpha=1. - beta1).sign_()
        p.add_(update, alpha=-lr)
        exp_avg.mul_(beta2).add_(grad, alpha=1. - beta2)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in filter(lambda p: p.grad is not None, group["params"]):
                (beta1, beta2), state = group["betas"], self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p)
                self.update_fn(p, p.grad, state["exp_avg"], group["lr"], group["weight_decay"], beta1, beta2)


class LionForeach(Lion):
    """lucidrains/lion-pytorch, lion_pytorch/foreach.py (``Lion.step``), its ops in the
    reference's order (the update scaled by ``-lr``, which the reference leaves out: no
    difference in memory)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd, (beta1, beta2) = group["lr"], group["weight_decay"], group["betas"]
            params, grads, exp_avgs = [], [], []
            for p in filter(lambda p: p.grad is not None, group["params"]):
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
            torch._foreach_mul_(params, 1. - lr * wd)
            updates = [t.clone() for t in exp_avgs]
            torch._foreach_lerp_(updates, grads, 1. - beta1)
            torch._foreach_sign_(updates)
            torch._foreach_add_(params, updates, alpha=-lr)
            torch._foreach_lerp_(exp_avgs, grads, 1. - beta2)


def optimizer(name, impl, params):
    """The real optimizer ``name`` in implementation ``impl``, with its default hyper-parameters."""
    if name == "adafactor" and not hasattr(torch.optim, "Adafactor"):
        pytest.skip("torch.optim.Adafactor needs torch >= 2.5")
    if impl == "fused" and "fused" not in inspect.signature(torch.optim.Adagrad).parameters:
        pytest.skip("this torch has no fused Adagrad")
    kw = {"foreach": impl == "foreach"}
    if impl == "fused":
        kw = {"fused": True}
    if name == "adagrad":
        return torch.optim.Adagrad(params, **kw)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, **kw)
    if name == "rmsprop-momentum":
        return torch.optim.RMSprop(params, momentum=0.9, **kw)
    if name == "adafactor":
        return torch.optim.Adafactor(params, **kw)
    if name == "adafactor-hf":   # as transformers' Trainer makes it (optim="adafactor")
        return transformers.optimization.Adafactor(params, lr=1e-3, scale_parameter=False, relative_step=False)
    if name == "adafactor-hf-momentum":
        return transformers.optimization.Adafactor(params, lr=1e-3, beta1=0.9, scale_parameter=False,
                                                   relative_step=False)
    if name == "lion":
        return (LionForeach if impl == "foreach" else Lion)(params)
    raise KeyError(name)


IMPLS = {"adagrad": ("for-loop", "foreach", "fused"), "rmsprop": ("for-loop", "foreach"),
         "rmsprop-momentum": ("for-loop", "foreach"), "adafactor": ("for-loop", "foreach"),
         "adafactor-hf": ("for-loop",), "adafactor-hf-momentum": ("for-loop",), "lion": ("for-loop", "foreach")}
CASES = [(point, precision, opt, impl) for opt, impls in IMPLS.items() for impl in impls
         for precision in ("fp32", "bf16-mixed") for point in (POINTS[0], POINTS[2])]


@pytest.mark.parametrize("point,precision,opt,impl", CASES,
                         ids=[f"h{p[2]}-V{p[5]}-{pr}-{o}-{i}" for p, pr, o, i in CASES])
def test_training_step_peak_exact(point, precision, opt, impl):
    """The peak to the byte, in the phase measured, and each phase's own maximum to the byte."""
    b, s, h, a, L, V, P, act = point
    cfg, model = hf_model(h, a, L, V, P, act)
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, opt, "cpu", impl, attention="eager"))
    ids = torch.randint(0, V, (b, s))
    fwd = loss_fn(model, ids, precision)
    report = training_step(model, lambda m: fwd(), optimizer(opt, impl, model.parameters()), extra=(ids,))
    assert_step_exact(est, report, b, s)


class Tensors(torch.nn.Module):
    """Parameters of the given shapes, in that order; the loss is the sum of their squares."""

    def __init__(self, shapes):
        super().__init__()
        torch.manual_seed(0)
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(sh) * 0.02) for sh in shapes])

    def forward(self):
        return sum((p * p).sum() for p in self.ps)


#: vectors first, a 3-d tensor (Adafactor factors its last two dimensions), a 0-dim one, sizes
#: that grow and shrink; and matrices first
SHAPES = [[(5,), (3, 4, 6), (7, 2), (), (40,), (2, 9)], [(6, 8), (11,), (2, 3, 5), (30, 1), (1,)]]


@pytest.mark.parametrize("shapes", SHAPES, ids=["vector-first", "matrix-first"])
@pytest.mark.parametrize("opt,impl", [(o, i) for o, impls in IMPLS.items() for i in impls],
                         ids=[f"{o}-{i}" for o, impls in IMPLS.items() for i in impls])
def test_state_and_step_temporaries_of_any_shape(shapes, opt, impl):
    """The optimizer on its own, for parameters of any rank in any order: its state (with the
    step counters) and the largest moment of its step above the step's start, to the byte."""
    model = Tensors(shapes)
    torch_opt = optimizer(opt, impl, model.parameters())
    report = training_step(model, lambda m: m(), torch_opt)
    o = OPTIMIZERS[opt]
    params = [(sm.Param(f"p{i}", tuple(sp.Integer(d) for d in sh)), 1) for i, sh in enumerate(shapes)]
    state = sum(int(o.state_elements(p)) * 4 + (4 if o.step_counter else 0) for p, _ in params)
    measured = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for st in torch_opt.state.values() for t in st.values() if torch.is_tensor(t)}
    assert state == sum(measured.values())
    marks = o.step_temps(impl, [p for p, _ in params], params)
    optimizer_phase = [x.live_bytes for x in report.timeline if x.phase == "optimizer"]
    assert max(int(t.subs(B_o, 4)) for _, t in marks) == max(optimizer_phase) - optimizer_phase[0]


def test_an_implementation_pytorch_lacks_is_refused():
    """RMSprop has no fused implementation: the estimate says so instead of guessing."""
    g = sm.models.preset("gpt2")
    with pytest.raises(sm.ConfigError, match="no fused implementation"):
        sm.estimate(g, sm.Policy("fp32", "rmsprop", "cuda", "fused"))


# --------------------------------------------------------------------------- 8-bit Adam

def profiled_step(opt) -> int:
    """The largest total of what one ``opt.step()`` allocates above its start, every allocation
    inside an op included: torch.profiler with ``profile_memory`` records the allocator's events,
    where the dispatch tracker of ``symmem.measure`` sees bitsandbytes' update as one custom op."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = top = 0
    for e in events:
        live += e.nbytes()
        top = max(top, live)
    assert live == 0, "the step keeps what it allocates"
    return top


def adam8bit(params):
    bnb = pytest.importorskip("bitsandbytes")
    return bnb.optim.AdamW8bit(params)


def adam8bit_state_bytes(opt) -> int:
    """Every distinct storage of the optimizer's state and its quantization maps."""
    tensors = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    tensors += list(opt.name2qmap.values())
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


#: 4096 elements, the first kept in 8 bits; 30000 (ceil(30000/256) = 118 blocks); vectors and
#: matrices below 4096 (32-bit states), in both orders
SHAPES_8BIT = [[(5,), (64, 64), (100, 300), (), (4095,)], [(100, 300), (7, 2), (4096,), (64, 128)]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shapes", SHAPES_8BIT, ids=["vector-first", "matrix-first"])
def test_adam8bit_state_and_cpu_step_of_any_shape(shapes, dtype):
    """bitsandbytes' AdamW8bit on tensors of any size: its state to the byte (a tensor of n >= 4096
    elements: 2n + 8 ceil(n/256), e.g. 30000 -> 60000 + 944; a smaller one 8n in float32; the two
    256-float maps once: 2048), and the CPU fallback's largest temporaries, every allocation inside
    its op (20n + 12 for an 8-bit state, 12n + 12 for a 32-bit one, + 4n for a bfloat16 tensor's
    float32 copy)."""
    model = Tensors(shapes).to(getattr(torch, dtype))
    opt = adam8bit(model.parameters())
    for _ in range(2):          # the state is made at the first step
        opt.zero_grad(set_to_none=True)
        model().backward()
        opt.step()
    model().backward()
    o = OPTIMIZERS["adam8bit"]
    params = [(sm.Param(f"p{i}", tuple(sp.Integer(d) for d in sh)), 1) for i, sh in enumerate(shapes)]
    state = sum(int(o.state_bytes(p)) for p, _ in params) + int(o.shared)
    assert state == adam8bit_state_bytes(opt)
    marks = o.step_temps("for-loop", [p for p, _ in params], params, "cpu")
    B_w = sm.symbols.B_w
    assert max(int(t.subs(B_w, 4 if dtype == "float32" else 2)) for _, t in marks) == profiled_step(opt)
    # on CUDA the update is one kernel per tensor, in place (bitsandbytes/backends/cuda/ops.py
    # passes pointers to kOptimizerStatic8bit2StateBlockwise and kOptimizer32bit2State)
    assert [t for _, t in o.step_temps("for-loop", [p for p, _ in params], params, "cuda")] == [0]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("point", [POINTS[1], POINTS[2]], ids=["h64", "h48"])
def test_adam8bit_training_step_exact(point, precision):
    """AdamW8bit on Hugging Face's GPT-2 (h=64: every matrix 8-bit, c_proj's 64x64 at the 4096
    boundary; h=48: c_proj's 48x48 and the 32x48 position table 32-bit): forward and backward
    to the byte, the optimizer's state to the byte, and the step's largest moment as the
    profiler measures the step of the same model and state."""
    b, s, h, a, L, V, P, act = point
    cfg, model = hf_model(h, a, L, V, P, act)
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, "adam8bit", "cpu", attention="eager"))
    ids = torch.randint(0, V, (b, s))
    fwd = loss_fn(model, ids, precision)
    opt = adam8bit(model.parameters())
    report = training_step(model, lambda m: fwd(), opt, extra=(ids,))
    ev = est.at(b=b, s=s)
    subs = est._subs({"b": b, "s": s})
    predicted = {phase: max(int(p.total.xreplace(subs)) for p in est.timeline if p.phase == phase)
                 for phase in report.phase_peaks}
    assert int(est.components["optimizer"].xreplace(subs)) == adam8bit_state_bytes(opt)
    # the dispatch tracker sees the update as one op: the optimizer phase is its start plus what
    # the profiler measures inside the op, for one more step of the same model
    start = next(x.live_bytes for x in report.timeline if x.phase == "optimizer")
    opt.zero_grad(set_to_none=True)
    fwd().backward()
    measured = {**report.phase_peaks, "optimizer": start + profiled_step(opt)}
    assert predicted == measured
    assert ev.peak == max(measured.values())
