"""ResNet (He et al. 2015) as an image classifier: the resnet family of the model registry.

Two implementations of one architecture, chosen by the config's ``implementation``:

* ``"transformers"`` (the default, what a Hugging Face ``config.json`` describes):
  ``ResNetForImageClassification`` of transformers 5's ``modeling_resnet.py``: each
  ``ResNetConvLayer`` is conv, ``BatchNorm2d`` and ``nn.ReLU()`` (not in place: the ReLU's
  output is a new tensor and the batch norm's output is freed after it); the model's output
  object holds the logits until the forward returns;
* ``"torchvision"``: ``torchvision.models.resnet``: the same layers with
  ``nn.ReLU(inplace=True)``, which overwrites the batch norm's output (nothing allocated) and
  the residual sum; the logits are a temporary of ``F.cross_entropy(model(x), y)``.

Both: a stem (7 x 7 convolution of stride 2, batch norm, ReLU, 3 x 3 max pooling of stride
2), stages of basic blocks (two 3 x 3 convolutions) or bottleneck blocks (1 x 1, 3 x 3,
1 x 1; the stride on the 3 x 3, "ResNet v1.5", unless ``downsample_in_bottleneck``), a
shortcut (1 x 1 convolution and batch norm) where a block changes the width or the size,
``out += identity`` in place, ReLU; global average pooling, a linear classifier and
``F.cross_entropy``. The parameters are the same in both (torchvision's ``resnet50`` and
microsoft/resnet-50: 25,557,032).

Symbols: ``b``, the image's height ``H``, width ``W`` and channels ``C``, the classes ``n_c``;
the stage widths and depths are numbers. H and W must be divisible by the total stride (32
for four stages) so that every feature map is exactly H/2^k by W/2^k (a clear error
otherwise); they are bound to ``image_size`` (224) and can be given to ``.at(H=..., W=...)``.

What a ``config.json`` key does here (transformers 5.24's ``configuration_resnet.py``):

* modelled: the fields of :class:`ResNetConfig` (``id2label`` for its length: the classes);
* refused unless at the default (:data:`UNMODELLED`): ``problem_type`` other than single-label
  classification (another loss), ``gradient_checkpointing``;
* ignored (:data:`IGNORED`, each with its reason): the backbone's ``out_features``,
  ``out_indices`` and ``stage_names`` (``ResNetBackbone`` only), among others.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..graph import Graph
from ..symbols import C, H, W, b, n_c
from . import checks
from .registry import BOOKKEEPING, TRAINING_STEP, Family, Unmodelled, register

__all__ = ["ResNetConfig", "build_resnet", "cross_entropy", "PRESETS", "HF_IDS", "REQUIRED", "UNMODELLED",
           "IGNORED", "FAMILY", "IMPLEMENTATIONS"]

#: implementation -> (ReLU in place, logits held until the forward returns)
IMPLEMENTATIONS = {"transformers": (False, True), "torchvision": (True, False)}


@dataclass(frozen=True)
class ResNetConfig:
    """The fields of Hugging Face's ResNetConfig, with its defaults (ResNet-50), plus the
    classes (``num_labels``, or the length of ``id2label``; transformers' default 2), the
    image size H = W the formulas are bound to, and which implementation runs it."""
    num_channels: int = 3
    embedding_size: int = 64
    hidden_sizes: tuple = (256, 512, 1024, 2048)
    depths: tuple = (3, 4, 6, 3)
    layer_type: str = "bottleneck"
    hidden_act: str = "relu"
    downsample_in_first_stage: bool = False
    downsample_in_bottleneck: bool = False
    num_labels: int | None = None
    id2label: tuple | None = None
    image_size: int = 224
    implementation: str = "transformers"
    name: str = "resnet"

    def __post_init__(self):
        for key in ("hidden_sizes", "depths"):
            value = getattr(self, key)
            if not isinstance(value, (list, tuple)) or not value:
                raise ConfigError(key, value, "a non-empty list of positive integers, one per stage")
            object.__setattr__(self, key, tuple(value))
            for v in value:
                if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    raise ConfigError(key, list(value), "a list of positive integers, one per stage")
        if len(self.depths) != len(self.hidden_sizes):
            raise ConfigError("depths", list(self.depths), f"one depth per stage ({len(self.hidden_sizes)} "
                              "hidden_sizes)", "Give depths and hidden_sizes the same length.")
        if self.id2label is not None:
            if not hasattr(self.id2label, "__len__") or isinstance(self.id2label, str):
                raise ConfigError("id2label", self.id2label, "a mapping from class index to label")
            object.__setattr__(self, "id2label", tuple(self.id2label))
        checks.positive_ints(self, "num_channels", "embedding_size", "image_size", optional=("num_labels",))
        if self.num_labels is not None and self.id2label is not None and self.num_labels != len(self.id2label):
            raise ConfigError("num_labels", self.num_labels, f"the number of labels in id2label ({len(self.id2label)})",
                              "Give one of the two keys, or agreeing values.")
        checks.known("layer_type", self.layer_type, ("basic", "bottleneck"))
        checks.known("hidden_act", self.hidden_act, ("relu",))
        checks.known("implementation", self.implementation, tuple(IMPLEMENTATIONS))
        checks.booleans(self, "downsample_in_first_stage", "downsample_in_bottleneck")
        if self.layer_type == "bottleneck":
            for w in self.hidden_sizes:
                if w % 4:
                    raise ConfigError("hidden_sizes", list(self.hidden_sizes), "multiples of 4 (a bottleneck "
                                      f"block's inner width is a quarter of its output; {w} is not)")
        if self.image_size % self.stride:
            raise ConfigError("image_size", self.image_size, f"a multiple of the network's total stride "
                              f"({self.stride})", "symmem derives the feature maps' sizes exactly for such "
                              "images; resize or pad the images.")

    @property
    def classes(self) -> int:
        if self.num_labels is not None:
            return self.num_labels
        return len(self.id2label) if self.id2label is not None else 2

    @property
    def stride(self) -> int:
        """The total stride: 4 in the stem, 2 in each stage but the first (unless
        ``downsample_in_first_stage``)."""
        return 4 * 2 ** (len(self.depths) - 1 + bool(self.downsample_in_first_stage))

    def bindings(self) -> dict:
        return {C: self.num_channels, H: self.image_size, W: self.image_size, n_c: self.classes}


def cross_entropy(g: Graph, logits: str, labels: str) -> str:
    """``F.cross_entropy(logits, labels)`` (mean over the batch) as ATen's ``cross_entropy_loss``
    runs it: the logits as autocast gives them (:func:`~symmem.rules.vision.ce_input_rule`),
    ``log_softmax`` in their dtype, ``nll_loss``; the logits live until it returns. Returns
    the loss's value."""
    x = g.add("ce_input", logits, name="loss/input")
    logp = g.add("ce_log_softmax", x, name="loss/log_softmax")
    loss = g.add("nll_loss", logp, labels, shifted=True, name="loss")
    # the arguments of cross_entropy (the logits, and CPU autocast's float32 copy of them) are
    # referenced until it returns
    g.hold(logits, until=loss)
    g.hold(x, until=loss)
    return loss


def build_resnet(cfg: ResNetConfig) -> Graph:
    """The operator graph of one training forward of a ResNet classifier, loss included."""
    inplace, hold_logits = IMPLEMENTATIONS[cfg.implementation]
    g = Graph(cfg.name, cfg.bindings(), checkpointing=False)     # no gradient checkpointing in ResNet
    g.require(cfg.stride, H, f"the image height is a multiple of the network's total stride ({cfg.stride})",
              kind="divides")
    g.require(cfg.stride, W, f"the image width is a multiple of the network's total stride ({cfg.stride})",
              kind="divides")
    x = g.input("pixel_values", (b, C, H, W), dtype="param")
    labels = g.input("labels", (b,))

    def conv(g, name, y, c_in, c_out, k, stride):
        w = g.param(f"{name}.weight", (c_out, c_in, k, k))
        return g.add("conv2d", y, params=(w,), stride=stride, padding=k // 2, exact=True, name=name)

    def bn(g, name, y, width):
        params = (g.param(f"{name}.weight", (width,)), g.param(f"{name}.bias", (width,)))
        for buf in ("running_mean", "running_var"):
            g.buffer(f"{name}.{buf}", (width,), dtype="param")
        g.buffer(f"{name}.num_batches_tracked", (), dtype="int64")
        return g.add("batch_norm", y, params=params, name=name)

    def relu(g, name, y):
        return g.add("relu_" if inplace else "relu", y, name=name)

    def block(g, p, x, c_in, width, stride):
        """One basic or bottleneck block named ``p`` on x (c_in channels)."""
        if cfg.layer_type == "basic":
            y = relu(g, f"{p}.relu1", bn(g, f"{p}.bn1", conv(g, f"{p}.conv1", x, c_in, width, 3, stride), width))
            y = bn(g, f"{p}.bn2", conv(g, f"{p}.conv2", y, width, width, 3, 1), width)
        else:
            inner = width // 4
            s1, s2 = (stride, 1) if cfg.downsample_in_bottleneck else (1, stride)
            y = relu(g, f"{p}.relu1", bn(g, f"{p}.bn1", conv(g, f"{p}.conv1", x, c_in, inner, 1, s1), inner))
            y = relu(g, f"{p}.relu2", bn(g, f"{p}.bn2", conv(g, f"{p}.conv2", y, inner, inner, 3, s2), inner))
            y = bn(g, f"{p}.bn3", conv(g, f"{p}.conv3", y, inner, width, 1, 1), width)
        identity = x
        if c_in != width or stride != 1:
            identity = bn(g, f"{p}.downsample.1", conv(g, f"{p}.downsample.0", x, c_in, width, 1, stride), width)
        y = g.add("add", y, identity, inplace=True, name=f"{p}.residual")
        out = relu(g, f"{p}.relu", y)
        g.hold(identity, until=out)      # the block's local `identity` (`residual`) until it returns
        return out

    x = relu(g, "relu", bn(g, "bn1", conv(g, "conv1", x, C, cfg.embedding_size, 7, 2), cfg.embedding_size))
    x = g.add("max_pool2d", x, kernel=3, stride=2, padding=1, exact=True, name="maxpool")
    c_in = cfg.embedding_size
    for i, (width, depth) in enumerate(zip(cfg.hidden_sizes, cfg.depths)):
        # a stage's first block (which may change the width and the size), then its other
        # blocks, alike: one repeated block, so that a deep stage costs what a shallow one does
        stride = 2 if i > 0 or cfg.downsample_in_first_stage else 1
        x = block(g, f"layer{i + 1}.0", x, c_in, width, stride)
        c_in = width
        if depth == 2:
            x = block(g, f"layer{i + 1}.1", x, width, width, 1)
        elif depth > 2:
            x = g.repeat(depth - 1, lambda sub, y, rest=f"layer{i + 1}.1-{depth - 1}", width=width:
                         block(sub, rest, y, width, width, 1), x, name=f"layer{i + 1}")
    x = g.add("mean_pool", x, name="avgpool")
    x = g.add("flatten", x, name="flatten")
    fc = (g.param("fc.weight", (n_c, c_in)), g.param("fc.bias", (n_c,)))
    logits = g.add("linear", x, params=fc, name="fc")
    if hold_logits:          # ImageClassifierOutputWithNoAttention holds them until forward returns
        g.output(logits)
    cross_entropy(g, logits, labels)
    return g


def _resnet(name, depths, layer_type="bottleneck", widths=(256, 512, 1024, 2048)):
    return ResNetConfig(hidden_sizes=widths, depths=depths, layer_type=layer_type, num_labels=1000, name=name)


#: Microsoft's ImageNet checkpoints (He et al. 2015, as transformers ports them; torchvision's
#: resnet18/50/152 have the same tensors): 1000 classes, 224 x 224 RGB images.
PRESETS: dict[str, ResNetConfig] = {
    "resnet-18": _resnet("resnet-18", (2, 2, 2, 2), "basic", (64, 128, 256, 512)),
    "resnet-50": _resnet("resnet-50", (3, 4, 6, 3)),
    "resnet-152": _resnet("resnet-152", (3, 8, 36, 3)),
}

HF_IDS = {"resnet-18": "microsoft/resnet-18", "resnet-50": "microsoft/resnet-50",
          "resnet-152": "microsoft/resnet-152"}

REQUIRED = ("hidden_sizes", "depths")

UNMODELLED = (
    Unmodelled("problem_type", (None, "single_label_classification"),
               "regression and multi-label classification use another loss (MSELoss, BCEWithLogitsLoss)"),
    Unmodelled("gradient_checkpointing", (False,), "ResNet has no gradient checkpointing in transformers"),
)

IGNORED = {
    **{k: v for k, v in BOOKKEEPING.items() if k not in ("id2label",)},
    **TRAINING_STEP,
    "out_features": "ResNetBackbone only (the classifier does not read it)",
    "out_indices": "ResNetBackbone only (the classifier does not read it)",
    "stage_names": "ResNetBackbone only (names of the stages)",
    "initializer_range": "initialisation only",
}

FAMILY = register(Family(
    name="resnet",
    description="ResNet image classifiers (basic or bottleneck blocks, batch norm, ReLU, max and average "
                "pooling) as transformers' ResNetForImageClassification or torchvision runs them",
    config=ResNetConfig,
    build=build_resnet,
    model_types=("resnet",),
    required=REQUIRED,
    presets=PRESETS,
    hf_ids=HF_IDS,
    unmodelled=UNMODELLED,
    ignored=IGNORED,
))
