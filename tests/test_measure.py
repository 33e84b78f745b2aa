"""Tests of symmem.measure against hand arithmetic (float32 = 4 bytes, float64 = 8 bytes)."""

import subprocess
import sys
import weakref
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from symmem.measure import (  # noqa: E402  (after the importorskip)
    SavedReport,
    StepReport,
    param_bytes,
    plain_step,
    saved_bytes,
    training_step,
)

# Tiny MLP of the training tests: Linear(16, 32) -> ReLU -> Linear(32, 4), no biases, batch 8.
W1 = 32 * 16 * 4  # 2048: first weight
W2 = 4 * 32 * 4  # 512: second weight
PARAMS = W1 + W2  # 2560
X = 8 * 16 * 4  # 512: input batch
H = 8 * 32 * 4  # 1024: hidden activation (before or after ReLU), or its gradient
OUT = 8 * 4 * 4  # 128: model output
SCALAR = 4  # 0-dim float32 (the loss, its seed gradient, Adam's step)


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 4, bias=False))
    return model, torch.randn(8, 16)


def _sgd_run(steps=2):
    model, x = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    return training_step(model, lambda m: m(x).pow(2).mean(), opt, steps=steps, extra=[x])


# --------------------------------------------------------------------------- param_bytes


def test_param_bytes_counts_weights_and_biases():
    assert param_bytes(nn.Linear(8, 4)) == (8 * 4 + 4) * 4  # 144


def test_tied_weight_counts_once():
    a, b = nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=False)
    b.weight = a.weight  # same Parameter (how HF ties embeddings)
    assert param_bytes(nn.Sequential(a, b)) == 8 * 4 * 4  # 128, not 256
    c = nn.Linear(4, 8, bias=False)
    c.weight = nn.Parameter(a.weight.detach().t())  # another Parameter, same storage
    assert param_bytes(nn.Sequential(a, c)) == 8 * 4 * 4  # still 128


# --------------------------------------------------------------------------- saved_bytes


def test_linear_saves_its_input_only_when_input_needs_no_grad():
    lin, x = nn.Linear(8, 4), torch.randn(3, 8)
    # grad W = grad_out^T @ x needs x (3*8*4 = 96 bytes); grad x is not needed, so W is
    # not saved at all -- the count is 96 whether or not parameters are excluded.
    assert saved_bytes(lambda: lin(x), exclude=lin).total == 96
    assert saved_bytes(lambda: lin(x)).total == 96


def test_excluded_parameters_versus_counted_weight():
    lin, x = nn.Linear(8, 4), torch.randn(3, 8, requires_grad=True)
    # Now grad x = grad_out @ W needs W (8*4*4 = 128 bytes, saved as a view W.t()).
    assert saved_bytes(lambda: lin(x), exclude=lin).total == 96
    assert saved_bytes(lambda: lin(x)).total == 96 + 128
    assert saved_bytes(lambda: lin(x), exclude=[lin.weight]).total == 96
    report = saved_bytes(lambda: lin(x), exclude=lin)
    weight = [e for e in report.entries if e.shape == (8, 4)]
    assert len(weight) == 1 and not weight[0].counted  # reported, but not counted


def test_view_of_a_saved_tensor_counts_once():
    x = torch.randn(3, 4, requires_grad=True)

    def fn():
        y = x.exp()  # saves its result y
        return y.view(-1).sin()  # saves its input: a view of y's storage

    report = saved_bytes(fn)
    assert len(report.entries) == 2
    assert len({e.storage_key for e in report.entries}) == 1
    assert report.total == 3 * 4 * 4  # 48: one storage, not 96


def test_python_scalar_is_saved_as_float64_without_the_hooks():
    x = torch.randn(4, requires_grad=True)
    # Independent look at the graph: MulBackward0 keeps the scalar as a 0-dim float64.
    other = (x * 0.5).grad_fn._saved_other
    assert other.shape == () and other.dtype == torch.float64
    report = saved_bytes(lambda: x * 0.5)  # x itself is not saved (d(0.5 x)/dx = 0.5)
    assert report.total == 8
    assert [(e.shape, e.dtype, e.device) for e in report.entries] == [((), "float64", "cpu")]
    assert report.by_dtype() == {"float64": 8}


def test_by_dtype_and_saved_scalar_next_to_tensors():
    x = torch.randn(2, 3, requires_grad=True)
    # exp saves its result (2*3*4 = 24), * 0.125 saves the scalar (8), x is not saved.
    report = saved_bytes(lambda: x.exp() * 0.125)
    assert report.total == 24 + 8
    assert report.by_dtype() == {"float32": 24, "float64": 8}


def test_storage_freed_before_return_is_not_counted():
    x = torch.randn(5, requires_grad=True)

    def fn():
        x.sin().exp()  # discarded: exp's saved result (20 bytes) dies with its graph
        return x.cos()  # cos saves x (5*4 = 20 bytes); sin saved x as well

    report = saved_bytes(fn)
    assert report.total == 20
    assert {e.storage_key for e in report.entries} == {(x.data_ptr(), 20)}


def test_graph_built_before_fn_is_not_counted():
    x = torch.randn(5, requires_grad=True)
    h = x.exp()  # ExpBackward0 saves h: built before fn, not fn's memory
    report = saved_bytes(lambda: h * 2.0)  # saves only the scalar 2.0
    assert report.total == 8


def test_checkpointed_region_keeps_only_its_input_and_is_not_recomputed():
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(6, requires_grad=True)
    calls = []

    def region(a):
        calls.append(1)
        return a.sin().exp()  # sin saves a (24 bytes), exp saves its result (24 bytes)

    assert saved_bytes(lambda: region(x)).total == 6 * 4 * 2  # 48
    calls.clear()
    # Non-reentrant checkpoint saves its input x (24) and holders for the rest; counting
    # must not unpack (an unpack would recompute the region and keep its tensors).
    assert saved_bytes(lambda: checkpoint(region, x, use_reentrant=False)).total == 24
    assert len(calls) == 1


def test_saved_report_holds_no_tensor():
    x = torch.randn(4, requires_grad=True)
    refs = []

    def fn():
        y = x.exp()
        refs.append(weakref.ref(y))
        return y

    report = saved_bytes(fn)
    assert isinstance(report, SavedReport) and report.total == 16
    # The output and its graph are released on return. (A pack hook returning the tensor
    # itself would make exp's saved result own its own grad_fn: an uncollectable cycle.)
    assert refs[0]() is None


# --------------------------------------------------------------------------- training_step


def test_sgd_step_exact_timeline():
    r = _sgd_run()
    assert isinstance(r, StepReport)
    # SGD without momentum has no state, set_to_none leaves no grads: parameters + input.
    assert r.at_start == PARAMS + X  # 3072
    # Forward peak right after relu: its input h (still an argument) and its output a.
    assert r.phase_peaks["forward"] == PARAMS + X + H + H  # 5120
    # Backward, at threshold_backward (ReLU's backward), alive: parameters, x, loss and its
    # seed gradient ones_like(loss) (freed at the end of backward), grad W2, a (saved by
    # relu and the second mm), grad a (its input) and grad h (its output).
    # The output o and the pow/mean temporaries are already freed.
    peak = PARAMS + X + 2 * SCALAR + W2 + H + H + H
    assert peak == 6664
    assert r.peak == peak and r.phase_peaks["backward"] == peak
    assert (r.peak_phase, r.peak_op) == ("backward", "aten.threshold_backward.default")
    # The next mm (grad W1 = grad_h^T @ x) reaches the same 6664 = a and grad a freed,
    # grad W1 (2048 = 2 * H) allocated; the first sample at the peak is reported.
    assert [s.op for s in r.timeline if s.live_bytes == peak][1] == "aten.mm.default"
    # Optimizer: in-place param.add_(grad): parameters, x, loss, both grads.
    assert r.phase_peaks["optimizer"] == PARAMS + X + SCALAR + PARAMS  # 5636
    assert r.peak >= 2 * PARAMS  # parameters + gradients at least
    assert r.cuda_max_allocated is None


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_plain_step_agrees_with_the_tracker(opt):
    """With no gradient summed twice, a plain run (profiler allocation events, no dispatch
    mode) and the tracker see the same live bytes at the start and at each phase's maximum.
    AdamW's for-loop divides by a Python number, wrapped in an 8-byte tensor for that call
    only: plain_step leaves it out as the tracker does."""
    def run(measure):
        model, x = _mlp()
        make = torch.optim.SGD if opt == "sgd" else torch.optim.AdamW
        return measure(model, lambda m: m(x).pow(2).mean(), make(model.parameters(), lr=0.1, foreach=False),
                       extra=[x])
    tracked, plain = run(training_step), run(plain_step)
    assert (plain.at_start, plain.phase_peaks, plain.peak_phase) == \
        (tracked.at_start, tracked.phase_peaks, tracked.peak_phase)
    if opt == "sgd":
        assert plain.peak == 6664   # test_sgd_step_exact_timeline's arithmetic
    assert plain.peak_op.startswith("aten::")


def test_tracker_sums_out_of_place_where_a_plain_run_adds_in_place():
    """h = W x feeds two products; its two gradients meet in autograd's InputBuffer. A plain run
    adds the second into the first in place (``old.add_(new)``); under a dispatch mode
    (at::areAnyTensorSubclassLike is true) the engine computes ``old + new``, a third tensor."""
    def run(measure):
        torch.manual_seed(0)
        model, x = nn.Linear(4, 64, bias=False), torch.randn(64, 4)

        def loss(m):
            h = m(x)
            return (h * 2 + h * 3).sum()
        return measure(model, loss, torch.optim.SGD(model.parameters(), lr=0.1, foreach=False), extra=[x])
    tracked, plain = run(training_step), run(plain_step)
    start = 64 * 4 * 4 + 64 * 4 * 4     # 2048: the weight and x
    grad_h = 64 * 64 * 4                # 16384: h, each product, either gradient of h
    scalars = 4 + 4                     # the loss and its seed gradient
    # Forward: h, h * 2, h * 3 and their sum, with both float64 factors saved by MulBackward0.
    assert plain.phase_peaks["forward"] == tracked.phase_peaks["forward"] == start + 4 * grad_h + 2 * 8  # 67600
    # Tracker: both gradients and their out-of-place sum (the factors already released).
    assert tracked.phase_peaks["backward"] == start + scalars + 3 * grad_h   # 51208
    # Plain: the second gradient made while the first waits, the second factor not yet released.
    assert plain.phase_peaks["backward"] == start + scalars + 8 + 2 * grad_h  # 34832
    assert plain.phase_peaks["optimizer"] == tracked.phase_peaks["optimizer"] == start + 4 + 1024  # 3076


def test_timeline_covers_three_phases_and_backward_ops():
    r = _sgd_run()
    phases = [s.phase for s in r.timeline]
    assert phases[0] == "forward" and phases[-1] == "optimizer"
    assert phases == sorted(phases, key=("forward", "backward", "optimizer").index)
    ops = {(s.phase, s.op) for s in r.timeline}
    assert ("forward", "aten.relu.default") in ops
    assert ("backward", "aten.threshold_backward.default") in ops  # the engine is seen
    assert ("optimizer", "aten.add_.Tensor") in ops
    assert {("forward", "<start>"), ("backward", "<end>"), ("optimizer", "<end>")} <= ops


def test_single_step_matches_warm_step_for_stateless_sgd():
    assert _sgd_run(steps=1).peak == _sgd_run(steps=3).peak == 6664
    with pytest.raises(ValueError):
        _sgd_run(steps=0)


def test_input_not_in_extra_counts_from_its_first_use():
    model, x = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    r = training_step(model, lambda m: m(x).pow(2).mean(), opt)
    assert r.at_start == PARAMS  # x is unknown until the first mm reads it
    assert r.peak == 6664  # ... and counted from there on


def test_storage_grown_in_place_counts_once():
    model, x = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)

    def loss_fn(m):
        buf = torch.zeros(1)  # 4 bytes
        buf.resize_(1000)  # the same storage, moved to a new 4000-byte block
        return m(x).pow(2).mean() + buf[0]

    r = training_step(model, loss_fn, opt, extra=[x])
    after = [s.live_bytes for s in r.timeline if s.op == "aten.resize_.default"]
    assert after == [r.at_start + 4000]  # not 4004: the old address is not a second storage


def test_adam_state_is_counted_at_start():
    model, x = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    r = training_step(model, lambda m: m(x).pow(2).mean(), opt, extra=[x])
    # On CPU (not fused, not capturable) each parameter's step is a 0-dim float32 tensor.
    steps = [s["step"] for s in opt.state.values()]
    assert [(t.shape, t.dtype, t.device.type) for t in steps] == [((), torch.float32, "cpu")] * 2
    # exp_avg + exp_avg_sq (2 * 2560) + two 4-byte steps, beside parameters and input.
    assert r.at_start == PARAMS + X + 2 * PARAMS + 2 * SCALAR  # 8200
    # Adam's step needs temporaries beyond the parameters, grads and states.
    assert r.phase_peaks["optimizer"] > PARAMS + X + SCALAR + PARAMS + 2 * PARAMS + 2 * SCALAR


def test_loss_is_not_kept_alive():
    model, x = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    refs = []

    def loss_fn(m):
        loss = m(x).sum()
        refs.append(weakref.ref(loss))
        return loss

    training_step(model, loss_fn, opt, extra=[x])
    assert all(ref() is None for ref in refs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_allocator_peak_bounds_storage_peak():
    model, x = _mlp()
    model, x = model.cuda(), x.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    r = training_step(model, lambda m: m(x).pow(2).mean(), opt, extra=[x])
    assert r.peak == 6664  # same storages as on the CPU
    assert r.cuda_max_allocated >= r.peak  # blocks are rounded up to 512 bytes


def test_missing_torch_gives_clear_error():
    path = Path(__file__).resolve().parents[1] / "symmem" / "measure.py"
    code = (
        "import importlib.util, sys\n"
        "sys.modules['torch'] = None\n"
        f"spec = importlib.util.spec_from_file_location('m', {str(path)!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0
    assert "symmem.measure needs PyTorch: pip install 'symmem[torch]'" in done.stderr
