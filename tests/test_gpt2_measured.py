"""The truth: Hugging Face's own GPT2LMHeadModel, measured on the CPU, against the formulas.

Random weights from a config (no download), eager attention, use_cache=False (the training
setting: a KV cache would keep extra copies of K and V). The CPU semantics is selected with
``device="cpu"``: dropout saves a noise tensor, ``x * 0.125`` saves an 8-byte scalar, the
optimizer defaults to its for-loop.
"""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem as sm  # noqa: E402
from symmem.measure import param_bytes, saved_bytes, training_step  # noqa: E402
from helpers import assert_step_exact  # noqa: E402

transformers.logging.set_verbosity_error()

# (b, s, h, a, L, V, n_positions, activation)
POINTS = [
    (2, 16, 32, 4, 2, 100, 32, "gelu_new"),
    (4, 32, 64, 4, 3, 500, 64, "gelu_new"),
    (3, 24, 48, 6, 2, 1000, 32, "gelu"),
    (2, 64, 32, 2, 1, 300, 64, "gelu_pytorch_tanh"),
]


def hf_model(h, a, L, V, P, act):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=h, n_head=a, n_layer=L, vocab_size=V, n_positions=P,
                                  activation_function=act, attn_implementation="eager",
                                  use_cache=False, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    return cfg, model


def graph_of(cfg):
    """symmem's graph of transformers' config object: its ``to_dict()`` leaves out the
    attention implementation the model was built with, so it is passed on as config.json
    would carry it."""
    return sm.models.from_hf_config({**cfg.to_dict(), "attn_implementation": cfg._attn_implementation})


def loss_fn(model, ids, precision):
    def fwd():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            return model(ids, labels=ids).loss
    return fwd


def optimizer(name, impl, params):
    kw = {"foreach": impl == "foreach", "fused": impl == "fused"} if impl != "for-loop" else {"foreach": False}
    if name == "adamw":
        return torch.optim.AdamW(params, **kw)
    if name == "adam":
        return torch.optim.Adam(params, **kw)
    kw.pop("fused", None)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9 if name in ("sgd-momentum", "sgd-nesterov") else 0.0,
                           nesterov=name == "sgd-nesterov", **kw)


@pytest.mark.parametrize("point", POINTS, ids=lambda p: "b{}-s{}-h{}-a{}-L{}-V{}-{}".format(*p[:6], p[7]))
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_params_and_saved_activations_exact(point, precision):
    b, s, h, a, L, V, P, act = point
    cfg, model = hf_model(h, a, L, V, P, act)
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, "sgd", "cpu"))
    ev = est.at(b=b, s=s)
    assert ev.bytes["params"] == param_bytes(model)
    ids = torch.randint(0, V, (b, s))
    measured = saved_bytes(loss_fn(model, ids, precision), exclude=model)
    assert ev.bytes["activations"] == measured.total  # 0 bytes off


BATCH_ONE = [((1, 32, 32, 2, 1, 300, 64, "gelu"), "fp32", "eager", "sgd"),
             ((1, 32, 32, 4, 2, 300, 32, "gelu_new"), "bf16-mixed", "eager", "adamw"),
             ((1, 24, 48, 6, 2, 200, 32, "gelu_new"), "fp32", "sdpa", "adamw"),
             ((1, 64, 32, 2, 1, 50, 64, "gelu"), "bf16-mixed", "sdpa", "sgd-momentum")]


@pytest.mark.parametrize("point,precision,attention,opt", BATCH_ONE,
                         ids=[f"s{p[1]}-h{p[2]}-{pr}-{at}-{o}" for p, pr, at, o in BATCH_ONE])
def test_batch_of_one_exact(point, precision, attention, opt):
    """At b = 1 ``labels_padded[..., 1:]`` is already contiguous, so the saved target is a view
    of the padded (1, s+1) labels (8 bytes more than b*s int64), and eager attention's head
    matmuls save views of the qkv storage instead of copies: the step derived for b = 1
    (``Estimate.at_one``, which ``at(b=1)`` uses) is exact, saved bytes and the whole step."""
    b, s, h, a, L, V, P, act = point
    cfg, model = hf_model(h, a, L, V, P, act)
    cfg._attn_implementation = model.config._attn_implementation = attention
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, opt, "cpu", "for-loop"))
    assert est.at_one is not est
    ids = torch.randint(0, V, (b, s))
    fwd = loss_fn(model, ids, precision)
    assert est.at(b=1, s=s).bytes["activations"] == saved_bytes(fwd, exclude=model).total
    report = training_step(model, lambda m: fwd(), optimizer(opt, "for-loop", model.parameters()), extra=(ids,))
    assert_step_exact(est.at_one, report, b, s)


def test_autocast_casts_back_one_gradient_at_a_time():
    """Under autocast a linear layer's gradients are cast back one at a time, each half copy
    freed before the next cast: Conv1D's addmm(bias, x, weight) casts back the bias's first.
    At b=1, s=16, h=32, L=2, V=100, bf16 autocast, AdamW the backward's peak is at mlp.c_proj's
    weight cast, where the bias's bfloat16 gradient (2h = 64 bytes) is already gone: 521,016."""
    b, s, h, a, L, V, P, act = 1, 16, 32, 4, 2, 100, 32, "gelu_new"
    cfg, model = hf_model(h, a, L, V, P, act)
    est = sm.estimate(graph_of(cfg), sm.Policy("bf16-mixed", "adamw", "cpu", "for-loop"))
    ids = torch.randint(0, V, (b, s))
    fwd = loss_fn(model, ids, "bf16-mixed")
    report = training_step(model, lambda m: fwd(), optimizer("adamw", "for-loop", model.parameters()), extra=(ids,))
    assert_step_exact(est.at_one, report, b, s)


TRAINING = [
    (POINTS[0], "fp32", "adamw", "for-loop"),
    (POINTS[0], "bf16-mixed", "adamw", "for-loop"),
    (POINTS[1], "fp32", "sgd", "for-loop"),
    (POINTS[1], "bf16-mixed", "adam", "foreach"),
    (POINTS[2], "fp32", "adamw", "fused"),
    (POINTS[3], "bf16-mixed", "sgd-momentum", "foreach"),
    (POINTS[1], "fp32", "sgd-nesterov", "for-loop"),
    (POINTS[0], "bf16-mixed", "sgd-nesterov", "for-loop"),
    (POINTS[2], "fp32", "sgd-nesterov", "foreach"),
]


@pytest.mark.parametrize("point,precision,opt,impl", TRAINING,
                         ids=[f"{p[7]}-{pr}-{o}-{i}" for p, pr, o, i in TRAINING])
def test_training_step_peak_exact(point, precision, opt, impl):
    """The peak to the byte, in the phase measured, and each phase's own maximum to the byte
    too: the formula must not be right only at the binding point."""
    b, s, h, a, L, V, P, act = point
    cfg, model = hf_model(h, a, L, V, P, act)
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, opt, "cpu", impl))
    ids = torch.randint(0, V, (b, s))
    fwd = loss_fn(model, ids, precision)
    report = training_step(model, lambda m: fwd(), optimizer(opt, impl, model.parameters()), extra=(ids,))
    assert_step_exact(est, report, b, s)


def test_every_byte_of_the_peak_explained():
    """b=2, s=16, h=32, a=4, L=2, V=100, fp32, AdamW for-loop on the CPU. Before forward the
    step holds the parameters, Adam's two states and its float32 step counter per tensor,
    and the batch: 4N + 8N + 4*28 + 8bs. At the peak (the last layer's gelu_new backward)
    the rest, by role, is what symmem lists, and the total is the measured one."""
    b, s, h, a, L, V, P, act = POINTS[0]
    cfg, model = hf_model(h, a, L, V, P, act)
    est = sm.estimate(graph_of(cfg), sm.Policy("fp32", "adamw", "cpu", "for-loop"))
    ev = est.at(b=b, s=s)
    ids = torch.randint(0, V, (b, s))
    report = training_step(model, lambda m: loss_fn(model, ids, "fp32")(), optimizer("adamw", "for-loop",
                                                                                     model.parameters()),
                           extra=(ids,))
    N = sum(p.numel() for p in model.parameters())            # 29,696
    tensors = len(list(model.parameters()))                    # 28 (wte and lm_head tied)
    assert (N, tensors) == (29_696, 28)
    assert report.at_start == 4 * N + 8 * N + 4 * tensors + 8 * b * s == 356_720
    parts = ev.peak_parts
    assert parts["params"] + parts["optimizer"] + parts["batch"] == report.at_start
    assert ev.peak_point.where == "backward h/mlp/gelu_new (last iteration)"
    # what has been made since: the gradients of the last layer's MLP output projection and
    # everything after it (ln_f, wte tied to lm_head), the saved activations of both layers,
    # and the gradients flowing back (transient)
    assert parts["grads"] == 4 * (V * h + 2 * h + 4 * h * h + h)
    assert report.peak == ev.peak == sum(parts.values())


class MasterOptimizer:
    """Half-precision weights with a float32 master copy, as Megatron-LM's and Apex O2's
    optimizers run it: cast the gradients to float32, step the masters, copy them back."""

    def __init__(self, model, make):
        self.params = list(model.parameters())
        self.masters = [p.detach().float().clone() for p in self.params]
        self.inner = make(self.masters)

    @property
    def state(self):
        return {**self.inner.state, "masters": {"weights": self.masters}}

    def zero_grad(self, set_to_none=True):
        for p in self.params + self.masters:
            p.grad = None

    def step(self):
        for m, p in zip(self.masters, self.params):
            m.grad = p.grad.float()
        self.inner.step()
        for m, p in zip(self.masters, self.params):
            p.data.copy_(m)
            m.grad = None


@pytest.mark.parametrize("point", POINTS[:3], ids=lambda p: "b{}-s{}-h{}-a{}-L{}-V{}-{}".format(*p[:6], p[7]))
def test_bf16_master_weights(point):
    """bfloat16 model, float32 master copy: saved activations exact (the CPU layer norm keeps
    its statistics in bfloat16), and the training step's peak."""
    b, s, h, a, L, V, P, act = point
    cfg, model = hf_model(h, a, L, V, P, act)
    model.to(torch.bfloat16)
    est = sm.estimate(graph_of(cfg), sm.Policy("bf16-master", "adamw", "cpu"))
    ev = est.at(b=b, s=s)
    ids = torch.randint(0, V, (b, s))
    assert ev.bytes["params"] == param_bytes(model)
    assert ev.bytes["activations"] == saved_bytes(lambda: model(ids, labels=ids).loss, exclude=model).total
    opt = MasterOptimizer(model, lambda ps: torch.optim.AdamW(ps, foreach=False))
    report = training_step(model, lambda m: m(ids, labels=ids).loss, opt, extra=(ids,))
    assert ev.peak == report.peak, (ev.peak_point.where, report.peak_phase, report.peak_op)
