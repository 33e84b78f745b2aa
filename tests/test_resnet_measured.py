"""ResNet against PyTorch on the CPU: a torchvision-style implementation written here (torchvision
does not install beside this torch) and transformers' own ``ResNetForImageClassification``;
small widths, 32 x 32 and 64 x 32 images, basic and bottleneck blocks, float32 and bfloat16
autocast; parameters, buffers, bytes saved for backward, the training step's peak, its phase and
every phase's maximum, to the byte. The step is measured by ``plain_step`` (no dispatch mode):
under ``training_step``'s tracker the autograd engine sums a block input's two gradients out of
place, where a plain run adds in place (``test_tracker_sums_out_of_place``).
"""
import pytest
import sympy as sp

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import symmem as sm  # noqa: E402
from symmem.errors import ConfigError, UnknownName  # noqa: E402
from symmem.measure import param_bytes, plain_step, saved_bytes  # noqa: E402
from symmem.symbols import H, W, n_c  # noqa: E402
from test_gpt2_measured import optimizer  # noqa: E402

transformers.logging.set_verbosity_error()


# ----------------------------------------------------------- torchvision.models.resnet, as written there
def conv3x3(c_in, c_out, stride=1):
    return nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(c_in, c_out, stride=1):
    return nn.Conv2d(c_in, c_out, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet with a base width ``base`` instead of 64."""

    def __init__(self, block, layers, base=64, num_classes=1000, channels=3):
        super().__init__()
        self.inplanes = base
        self.conv1 = nn.Conv2d(channels, base, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(base)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, base, layers[0])
        self.layer2 = self._make_layer(block, 2 * base, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 4 * base, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 8 * base, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * base * block.expansion, num_classes)

    def _make_layer(self, block, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * block.expansion, stride),
                                       nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def hf_keys(block, layers, base, classes, channels=3, **extra):
    """The Hugging Face config.json of the same network."""
    e = 4 if block is Bottleneck else 1
    return {"model_type": "resnet", "num_channels": channels, "embedding_size": base,
            "hidden_sizes": [base * e * 2 ** i for i in range(4)], "depths": list(layers),
            "layer_type": "bottleneck" if block is Bottleneck else "basic", "num_labels": classes, **extra}


def assert_step_exact(est, report, **values):
    """``helpers.assert_step_exact`` for an image model: the peak, its phase and every phase's
    maximum at ``values`` (b, H, W)."""
    ev = est.at(**values)
    subs = est._subs(values)
    predicted = {phase: max(int(p.total.xreplace(subs)) for p in est.timeline if p.phase == phase)
                 for phase in report.phase_peaks}
    assert (predicted, ev.peak) == (report.phase_peaks, report.peak), \
        (ev.peak_point.where, report.peak_phase, report.peak_op)
    assert ev.peak_point.phase == report.peak_phase


def run_exact(model, keys, precision, opt, impl, b, hw, forward):
    """Parameters and buffers, saved bytes and the training step of ``model`` (``forward(model,
    x, y)`` gives the loss) against the graph of ``keys`` at (b, H, W)."""
    est = sm.estimate(sm.models.from_hf_config(keys), sm.Policy(precision, opt, "cpu", impl))
    values = {"b": b, "H": hw[0], "W": hw[1]}
    if precision == "bf16":
        model.to(torch.bfloat16)
    ev = est.at(**values)
    buffers = sum(t.untyped_storage().nbytes() for t in model.buffers())
    assert (ev.bytes["params"], ev.bytes["buffers"]) == (param_bytes(model), buffers)
    x = torch.randn(b, keys["num_channels"], *hw)
    if precision == "bf16":      # model.to(bfloat16), and images in it
        model.to(torch.bfloat16)
        x = x.to(torch.bfloat16)
    y = torch.randint(0, keys["num_labels"], (b,))

    def fwd(m=model):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            return forward(m, x, y)
    assert ev.bytes["activations"] == saved_bytes(fwd, exclude=model).total
    report = plain_step(model, fwd, optimizer(opt, impl, model.parameters()), extra=(x, y))
    assert_step_exact(est, report, **values)


def torchvision_loss(m, x, y):
    return F.cross_entropy(m(x), y)


# block, layers, base, classes, channels, (H, W), b, precision, optimizer, implementation
TORCHVISION = [
    (BasicBlock, (1, 1, 1, 1), 8, 10, 3, (32, 32), 2, "fp32", "sgd", "for-loop"),
    (BasicBlock, (2, 1, 1, 1), 8, 10, 3, (64, 32), 2, "bf16-mixed", "adamw", "for-loop"),
    (Bottleneck, (1, 1, 1, 1), 4, 10, 3, (32, 32), 2, "fp32", "adamw", "foreach"),
    (Bottleneck, (2, 1, 1, 1), 4, 7, 1, (32, 64), 3, "bf16-mixed", "sgd-momentum", "for-loop"),
    (Bottleneck, (1, 2, 1, 1), 8, 100, 3, (32, 32), 2, "fp32", "sgd", "for-loop"),
    (BasicBlock, (1, 1, 1, 1), 8, 10, 3, (32, 32), 2, "bf16", "sgd", "for-loop"),       # a bfloat16 model
    (Bottleneck, (1, 1, 1, 1), 4, 10, 3, (32, 32), 2, "bf16", "adamw", "for-loop"),
]


@pytest.mark.parametrize("block,layers,base,classes,channels,hw,b,precision,opt,impl", TORCHVISION,
                         ids=[f"{c[0].__name__}-{''.join(map(str, c[1]))}-w{c[2]}-{c[5][0]}x{c[5][1]}-b{c[6]}-"
                              f"{c[7]}-{c[8]}" for c in TORCHVISION])
def test_torchvision_resnet_exact(block, layers, base, classes, channels, hw, b, precision, opt, impl):
    """torchvision's in-place ReLU: the batch norm's output is overwritten (no new storage) and
    saved as the ReLU's result; max pooling's int64 indices; the logits freed inside the loss."""
    torch.manual_seed(0)
    model = ResNet(block, layers, base, classes, channels).train()
    keys = hf_keys(block, layers, base, classes, channels, implementation="torchvision")
    run_exact(model, keys, precision, opt, impl, b, hw, torchvision_loss)


HF = [
    ("basic", (1, 1, 1, 1), 8, 10, (32, 32), 2, "fp32", "adamw", "for-loop"),
    ("bottleneck", (2, 1, 1, 1), 4, 10, (32, 32), 2, "bf16-mixed", "sgd", "for-loop"),
    ("bottleneck", (1, 1, 1, 1), 4, 5, (64, 64), 2, "fp32", "sgd-momentum", "foreach"),
]


@pytest.mark.parametrize("layer_type,layers,base,classes,hw,b,precision,opt,impl", HF,
                         ids=[f"{c[0]}-{''.join(map(str, c[1]))}-{c[4][0]}-{c[6]}-{c[7]}" for c in HF])
def test_transformers_resnet_exact(layer_type, layers, base, classes, hw, b, precision, opt, impl):
    """transformers' ResNetForImageClassification (nn.ReLU not in place; the output object holds
    the logits until forward returns) from the same config.json."""
    block = Bottleneck if layer_type == "bottleneck" else BasicBlock
    keys = hf_keys(block, layers, base, classes)
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(transformers.ResNetConfig(**keys)).train()

    def loss(m, x, y):
        return m(pixel_values=x, labels=y).loss
    run_exact(model, keys, precision, opt, impl, b, hw, loss)


# ----------------------------------------------------------------------------- presets, config


#: parameters of torchvision's resnet18/50/152 (its documentation's table) and of
#: microsoft/resnet-18/50/152 (ResNetForImageClassification, counted below on the meta device)
PUBLISHED = {"resnet-18": 11_689_512, "resnet-50": 25_557_032, "resnet-152": 60_192_808}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts(name):
    """ResNet-50: stem conv 64*3*49 = 9,408 and its batch norm 128; 16 bottleneck blocks; the
    classifier 2048*1000 + 1000 = 2,049,000; in all 25,557,032 (torchvision's count), and
    transformers' class built from the preset's keys on the meta device agrees."""
    fam, cfg = sm.models.preset_config(name)
    g = fam.build(cfg)
    assert int(g.param_count().xreplace(g.bindings)) == PUBLISHED[name]
    keys = {"hidden_sizes": list(cfg.hidden_sizes), "depths": list(cfg.depths), "layer_type": cfg.layer_type,
            "embedding_size": cfg.embedding_size, "num_labels": cfg.classes}
    with torch.device("meta"):
        model = transformers.ResNetForImageClassification(transformers.ResNetConfig(**keys))
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]
    if name == "resnet-18":     # 224 x 224 RGB images, 1000 classes: bound, so the estimate needs only b
        assert sm.estimate(name, sm.Policy("fp32", "sgd")).at(b=1).bytes["params"] == 4 * PUBLISHED[name]


def test_image_size_is_symbolic_and_checked():
    """Activations grow with H*W; H and W must be multiples of the total stride (32)."""
    est = sm.estimate("resnet-18", sm.Policy("bf16-mixed", "sgd"))
    acts = est.components["activations"]
    assert {H, W} <= acts.free_symbols
    assert sp.expand(acts.subs({H: 2 * H, W: W}) - acts).free_symbols >= {H, W}
    with pytest.raises(ConfigError, match="multiple of the network's total stride"):
        est.at(b=2, H=200, W=224)
    small = est.at(b=2, H=64, W=96).peak
    assert small < est.at(b=2).peak       # 224 x 224 bound


def test_hf_config_keys():
    """id2label gives the classes; backbone keys are ignored; unmodelled keys refused by name."""
    keys = hf_keys(Bottleneck, (1, 1, 1, 1), 4, 10)
    del keys["num_labels"]
    g = sm.models.from_hf_config({**keys, "id2label": {str(i): f"c{i}" for i in range(7)},
                                  "out_features": ["stage4"], "out_indices": [4]})
    assert g.bindings[n_c] == 7
    fam = sm.models.family("resnet")
    assert fam.classify("out_features") == "ignored" and fam.classify("id2label") == "field"
    with pytest.raises(ConfigError, match="problem_type"):
        sm.models.from_hf_config({**keys, "problem_type": "regression"})
    with pytest.raises(UnknownName, match="layer_type"):
        sm.models.from_hf_config({**keys, "layer_type": "preactivation"})
    with pytest.raises(UnknownName, match="hidden_act"):
        sm.models.from_hf_config({**keys, "hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="one depth per stage"):
        sm.models.from_hf_config({**keys, "depths": [1, 1, 1]})
    with pytest.raises(ConfigError, match="the number of labels in id2label"):
        sm.models.from_hf_config({**keys, "num_labels": 3, "id2label": {"0": "a"}})
    with pytest.raises(ConfigError, match="multiples of 4"):
        sm.models.from_hf_config({**keys, "hidden_sizes": [18, 32, 64, 128]})
    with pytest.raises(UnknownName, match="implementation"):
        sm.models.from_hf_config({**keys, "implementation": "timm"})


def test_a_stage_is_one_repeated_block_and_recompute_is_refused():
    """A stage's blocks after its first are one repeated block (resnet-152's third stage: 35
    alike), whose formulas equal those of the graph written out block by block
    (``Graph.unrolled``: every iteration counted, nothing extrapolated) at every batch asked,
    each component, the peak and where it is. Neither implementation checkpoints its blocks:
    recomputation is refused, not silently ignored."""
    assert [(r.name, int(r.count)) for r in sm.models.preset("resnet-152").repeats()] == \
        [("layer1", 2), ("layer2", 7), ("layer3", 35), ("layer4", 2)]
    g = sm.models.preset("resnet-50")
    for policy in (sm.Policy(), sm.Policy("bf16-mixed", "adamw")):
        repeated, written_out = sm.estimate(g, policy), sm.estimate(g.unrolled(), policy)
        for bb in (1, 2, 8):
            one, other = repeated.at(b=bb), written_out.at(b=bb)
            assert (one.bytes, one.peak_point.where) == (other.bytes, other.peak_point.where)
    with pytest.raises(ConfigError, match="no gradient checkpointing"):
        sm.estimate(g, sm.Policy(recompute="full"))
