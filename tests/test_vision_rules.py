"""The convolutional rules of ``symmem.rules.vision`` against PyTorch on the CPU, op by op: the
bytes saved for backward (hand formula, PyTorch's saved-tensor hooks and symmem agreeing), the
output's shape and dtype, float32 and bfloat16 autocast. Feature maps are (b, c, 2s, 2s): ``s``
stands for the side a stride of 2 halves."""
from __future__ import annotations

import pytest
import sympy as sp

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

import symmem as sm  # noqa: E402
from symmem.errors import ShapeError  # noqa: E402
from symmem.rules.vision import window_out  # noqa: E402
from symmem.symbols import b, s  # noqa: E402
from test_rules import POLICIES, compare, float_input, graph, leaf  # noqa: E402


def feature_map(g, c=4):
    return float_input(g, (b, c, 2 * s, 2 * s))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("stride", [1, 2])
def test_conv2d_saves_input_and_weight(policy, stride):
    """ConvolutionBackward0 saves the input (4b(2s)^2 elements) and the weight; under autocast
    the input's bfloat16 copy (2 bytes) and the weight's cached copy (6*4*9 = 216 elements)."""
    g = graph()
    x = feature_map(g)
    w = g.param("conv.weight", (6, 4, 3, 3))
    g.add("conv2d", x, params=(w,), stride=stride, padding=1, exact=True, name="conv")
    if policy.prec.autocast:
        formula = 2 * 16 * b * s ** 2 + 2 * 216
    else:
        formula = 4 * 16 * b * s ** 2

    def make(bb, ss):
        conv = nn.Conv2d(4, 6, 3, stride=stride, padding=1, bias=False)
        t = leaf(bb, 4, 2 * ss, 2 * ss)
        return (lambda: conv(t)), conv
    compare(g, policy, make, formula=formula)
    assert g.shape("conv") == (b, 6, 2 * s / stride, 2 * s / stride)


@pytest.mark.parametrize("policy", POLICIES)
def test_batch_norm_then_relu_in_place(policy):
    """Batch norm saves its input (16bs^2 elements in x's dtype) and C float32 mean and invstd
    (2 * 4 * 4 = 32 bytes); the in-place ReLU saves its result, the batch norm's output
    storage (a second 16bs^2 elements). Under autocast the feature map is bfloat16 (a
    convolution's output) and batch norm, on neither autocast list, keeps it."""
    half = policy.prec.autocast
    g = graph()
    x = g.input("x", (b, 4, 2 * s, 2 * s), dtype="bfloat16" if half else "float32", requires_grad=True)
    params = (g.param("bn.weight", (4,)), g.param("bn.bias", (4,)))
    g.add("relu_", g.add("batch_norm", x, params=params, name="bn"), name="relu")

    def make(bb, ss):
        bn = nn.BatchNorm2d(4).train()
        t = leaf(bb, 4, 2 * ss, 2 * ss, dtype=torch.bfloat16 if half else torch.float32)
        return (lambda: F.relu(bn(t), inplace=True)), bn
    compare(g, policy, make, formula=2 * (2 if half else 4) * 16 * b * s ** 2 + 32)


@pytest.mark.parametrize("policy", POLICIES)
def test_max_pool2d_saves_input_and_int64_indices(policy):
    """3 x 3 windows, stride 2, padding 1 on (b, 4, 2s, 2s): the input (16bs^2 float32
    elements) and the int64 index of each of the 4bs^2 outputs."""
    g = graph()
    g.add("max_pool2d", feature_map(g), kernel=3, stride=2, padding=1, exact=True, name="pool")

    def make(bb, ss):
        t = leaf(bb, 4, 2 * ss, 2 * ss)
        return (lambda: F.max_pool2d(t, 3, 2, 1)), ()
    compare(g, policy, make, formula=4 * 16 * b * s ** 2 + 8 * 4 * b * s ** 2)


@pytest.mark.parametrize("policy", POLICIES)
def test_mean_pool_saves_nothing(policy):
    """``nn.AdaptiveAvgPool2d((1, 1))`` is a mean: nothing saved, output (b, 4, 1, 1)."""
    g = graph()
    g.add("mean_pool", feature_map(g), name="pool")

    def make(bb, ss):
        t = leaf(bb, 4, 2 * ss, 2 * ss)
        return (lambda: F.adaptive_avg_pool2d(t, (1, 1))), ()
    compare(g, policy, make, formula=0)


@pytest.mark.parametrize("policy", POLICIES)
def test_cross_entropy_saves_log_probabilities_labels_and_weight(policy):
    """``F.cross_entropy`` of (b, 10) logits: the float32 log-probabilities (CPU autocast casts
    cross_entropy_loss's input to float32), the int64 labels and the float32 total weight:
    40b + 8b + 4 (the labels are the batch's own tensor, saved as the target)."""
    g = graph()
    x = g.input("x", (b, 10), dtype="bfloat16" if policy.prec.autocast else "float32", requires_grad=True)
    labels = g.input("labels", (b,))
    from symmem.models.resnet import cross_entropy
    cross_entropy(g, x, labels)

    def make(bb, ss):
        t = leaf(bb, 10, dtype=torch.bfloat16 if policy.prec.autocast else torch.float32)
        y = torch.randint(0, 10, (bb,))
        return (lambda: F.cross_entropy(t, y)), ()
    compare(g, policy, make, formula=48 * b + 4, check_out=False)


def test_window_formula():
    """floor((x + 2p - k)/stride) + 1; exact: x/stride + floor((2p - k)/stride) + 1."""
    H = sm.symbols.H
    assert window_out(224, 7, 2, 3) == 112          # floor(223/2) + 1
    assert window_out(112, 3, 2, 1) == 56           # floor(111/2) + 1
    assert window_out(H, 7, 2, 3, exact=True) == H / 2
    assert window_out(H, 1, 2, 0, exact=True) == H / 2
    assert window_out(H, 3, 1, 1, exact=True) == H
    assert window_out(H, 3, 2, 1) == sp.floor((H - 1) / 2) + 1


def test_conv2d_refuses_wrong_channels():
    g = graph()
    x = feature_map(g, c=3)
    with pytest.raises(ShapeError, match="4 input channels"):
        g.add("conv2d", x, params=(g.param("w", (6, 4, 3, 3)),), padding=1, name="conv")
