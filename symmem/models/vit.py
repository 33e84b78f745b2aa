"""The vision transformer (Dosovitskiy et al. 2020) as Hugging Face's
``ViTForImageClassification`` runs it: the vit family of the model registry.

``ViTEmbeddings``: the image cut into P x P patches by a convolution of kernel and stride P
(with a bias), flattened to HW/P^2 tokens, a learned class token concatenated in front (a new
(b, 1 + HW/P^2, h) tensor), learned position embeddings added (a parameter of
1 + HW/P^2 rows: the image size is fixed by it), dropout. ``ViTLayer``, pre-norm: layer norm,
q, k, v projections (with biases where ``qkv_bias``), attention without a mask (one
``attention`` node the policy's kernel replaces: eager, SDPA), ``o_proj``, dropout, residual
add; layer norm, ``fc1``, GELU, ``fc2``, dropout, residual add. A final layer norm, the class
token's row (``sequence_output[:, 0, :]``, a view), the classifier and ``F.cross_entropy``.

At b = 1 (:attr:`~symmem.engine.Estimate.at_one`) the class token's gradient is a view of
the embeddings' whole (1, 1 + HW/P^2, h) gradient, which AccumulateGrad keeps through the
optimizer step (:func:`~symmem.rules.vision.cls_concat_rule`); the ``grads`` component still
counts the token's own h elements.

``recompute="full"`` is measured against transformers' activation checkpointing of every
``ViTLayer`` (``activation_checkpointing_enable()``, non-reentrant; ``tests/test_vit_measured.py``:
eager and SDPA, float32, bfloat16 autocast and a bfloat16 model, b = 1 and 2): each layer's
checkpoint keeps its input; its recomputation stops at ``fc2``, whose input and weight copy it
saves; the recomputed tensors are freed with ``fc2``'s kernels, before the engine sums the
bias's gradient.

Symbols: ``b``, ``h``, ``a``, ``L``, ``f``, the image's ``H``, ``W``, ``C``, the patch size ``P``
and the classes ``n_c``; the sequence is 1 + HW/P^2 tokens. All are bound to the config
(``image_size`` for H and W: the position embeddings have that many rows).

What a ``config.json`` key does here (transformers 5.24's ``configuration_vit.py`` and
``modeling_vit.py``):

* modelled: the fields of :class:`ViTConfig` (``id2label`` for its length: the classes);
* refused unless at the default (:data:`UNMODELLED`): ``problem_type`` other than single-label
  classification;
* ignored (:data:`IGNORED`): ``layer_norm_eps``, ``encoder_stride`` (masked image modelling
  only), ``pooler_output_size`` and ``pooler_act`` (ViTForImageClassification has no pooler),
  among others.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..graph import Graph
from ..policy.attention import HF_NAMES
from ..symbols import C, H, L, P, W, a, b, f, h, n_c
from . import checks
from .registry import BOOKKEEPING, TRAINING_STEP, Family, Unmodelled, register
from .resnet import cross_entropy

__all__ = ["ViTConfig", "build_vit", "PRESETS", "HF_IDS", "REQUIRED", "UNMODELLED", "IGNORED", "FAMILY"]


@dataclass(frozen=True)
class ViTConfig:
    """The fields of Hugging Face's ViTConfig that decide memory, with its defaults (ViT-Base/16 at
    224 x 224), and the classes (``num_labels``, or the length of ``id2label``; default 2)."""
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    qkv_bias: bool = True
    num_labels: int | None = None
    id2label: tuple | None = None
    attn_implementation: str | None = None
    name: str = "vit"

    def __post_init__(self):
        for key in ("image_size", "patch_size"):
            value = getattr(self, key)
            if isinstance(value, (list, tuple)):
                if len(value) != 2 or value[0] != value[1]:
                    raise ConfigError(key, list(value), "one number, or a square [n, n]",
                                      "symmem models square images and patches.")
                object.__setattr__(self, key, value[0])
        if self.id2label is not None:
            if not hasattr(self.id2label, "__len__") or isinstance(self.id2label, str):
                raise ConfigError("id2label", self.id2label, "a mapping from class index to label")
            object.__setattr__(self, "id2label", tuple(self.id2label))
        checks.positive_ints(self, "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                             "image_size", "patch_size", "num_channels", optional=("num_labels",))
        checks.heads_divide("hidden_size", self.hidden_size, self.num_attention_heads,
                            "transformers' ViTAttention splits the hidden size into the heads.")
        if self.image_size % self.patch_size:
            raise ConfigError("image_size", self.image_size, f"a multiple of patch_size ({self.patch_size})",
                              "ViTPatchEmbeddings' convolution would drop the last partial patch.")
        if self.num_labels is not None and self.id2label is not None and self.num_labels != len(self.id2label):
            raise ConfigError("num_labels", self.num_labels, f"the number of labels in id2label ({len(self.id2label)})",
                              "Give one of the two keys, or agreeing values.")
        checks.known("hidden_act", self.hidden_act, ("gelu",))
        checks.probabilities(self, "hidden_dropout_prob", "attention_probs_dropout_prob")
        checks.booleans(self, "qkv_bias")
        checks.attn_implementation(self)

    @property
    def classes(self) -> int:
        if self.num_labels is not None:
            return self.num_labels
        return len(self.id2label) if self.id2label is not None else 2

    def bindings(self) -> dict:
        return {h: self.hidden_size, L: self.num_hidden_layers, a: self.num_attention_heads,
                f: self.intermediate_size, H: self.image_size, W: self.image_size, P: self.patch_size,
                C: self.num_channels, n_c: self.classes}


def build_vit(cfg: ViTConfig) -> Graph:
    """The operator graph of one ViTForImageClassification training forward, loss included."""
    g = Graph(cfg.name, cfg.bindings())
    if cfg.attn_implementation is not None:
        g.attention = HF_NAMES[cfg.attn_implementation]
    g.require(a, h, "the attention heads split the hidden size evenly", kind="divides")
    g.require(P, H, "the image height is a whole number of patches", kind="divides")
    g.require(P, W, "the image width is a whole number of patches", kind="divides")
    tokens = H * W / P ** 2 + 1
    pixels = g.input("pixel_values", (b, C, H, W), dtype="param")
    labels = g.input("labels", (b,))
    proj = (g.param("embeddings.patch_embeddings.projection.weight", (h, C, P, P)),
            g.param("embeddings.patch_embeddings.projection.bias", (h,)))
    x = g.add("conv2d", pixels, params=proj, stride=P, padding=0, exact=True, name="embeddings/projection")
    x = g.add("patch_tokens", x, name="embeddings/patches")
    x = g.add("cls_concat", x, params=(g.param("embeddings.cls_token", (1, 1, h)),), name="embeddings/cat")
    x = g.add("add_param", x, params=(g.param("embeddings.position_embeddings", (1, tokens, h)),),
              name="embeddings/positions")
    embeddings = x = g.add("dropout", x, p=cfg.hidden_dropout_prob, name="embeddings")

    def block(g: Graph, x: str) -> str:
        def linear(name, y, n_in, n_out, bias=True):
            params = (g.param(f"{name}.weight", (n_out, n_in)),)
            if bias:
                params += (g.param(f"{name}.bias", (n_out,)),)
            return g.add("linear", y, params=params, name=f"layers/{name}")

        def norm(name, y):
            return g.add("layer_norm", y, params=(g.param(f"{name}.weight", (h,)), g.param(f"{name}.bias", (h,))),
                         name=f"layers/{name}")

        y = norm("layernorm_before", x)
        q, key, v = (g.add("heads", linear(f"attention.{n}_proj", y, h, h, cfg.qkv_bias), heads=a,
                           name=f"layers/attention/{n}_heads") for n in ("q", "k", "v"))
        with g.scope(recompute="attention"):
            z = g.add("attention", q, key, v, dropout=cfg.attention_probs_dropout_prob, causal=False,
                      probs_like="query", softmax_float32=True, weights_until="layers/output",
                      returns_after="layers/attention/merge", name="layers/attention/context")
        z = g.add("merge_heads", z, name="layers/attention/merge")
        z = linear("attention.o_proj", z, h, h)
        z = g.add("dropout", z, p=cfg.hidden_dropout_prob, name="layers/attention/dropout")
        x2 = g.add("add", z, x, name="layers/attention/residual")
        y2 = norm("layernorm_after", x2)
        z2 = g.add("gelu", linear("mlp.fc1", y2, h, f), name="layers/mlp/act")
        z2 = g.add("dropout", linear("mlp.fc2", z2, f, h), p=cfg.hidden_dropout_prob, name="layers/mlp/dropout")
        out = g.add("add", z2, x2, name="layers/output")
        # ViTAttention's locals until it returns (the q, k, v views; its input, the norm's
        # output), the MLP's input until it returns, `residual` and the layer's input (ViTModel's
        # loop rebinds hidden_states to what the layer returns) until the layer returns
        for value in (q, key, v, y):
            g.hold(value, until="layers/attention.o_proj")
        g.hold(y2, until="layers/mlp.fc2")
        g.hold(x, until=out)
        g.hold(x2, until=out)
        return out

    x = g.repeat(L, block, x, name="layers")
    x = g.output(g.add("layer_norm", x, params=(g.param("layernorm.weight", (h,)), g.param("layernorm.bias", (h,))),
                       name="layernorm"))
    # ViTModel's embedding_output until it returns
    g.hold(embeddings, until=x)
    cls = g.add("select_token", x, name="pooled")
    logits = g.output(g.add("linear", cls, params=(g.param("classifier.weight", (n_c, h)),
                                                   g.param("classifier.bias", (n_c,))), name="classifier"))
    cross_entropy(g, logits, labels)
    return g


def _vit(name, h_, L_, a_, f_):
    return ViTConfig(hidden_size=h_, num_hidden_layers=L_, num_attention_heads=a_, intermediate_size=f_,
                     num_labels=1000, name=name)


#: Google's ImageNet checkpoints (ViT-B/16 and ViT-L/16 at 224 x 224, 1000 classes).
PRESETS: dict[str, ViTConfig] = {
    "vit-base": _vit("vit-base", 768, 12, 12, 3072),
    "vit-large": _vit("vit-large", 1024, 24, 16, 4096),
}

HF_IDS = {"vit-base": "google/vit-base-patch16-224", "vit-large": "google/vit-large-patch16-224"}

REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")

UNMODELLED = (
    Unmodelled("problem_type", (None, "single_label_classification"),
               "regression and multi-label classification use another loss (MSELoss, BCEWithLogitsLoss)"),
    Unmodelled("gradient_checkpointing", (False,),
               "transformers then recomputes every layer in backward: use --recompute full"),
)

IGNORED = {
    **{k: v for k, v in BOOKKEEPING.items() if k not in ("id2label",)},
    **TRAINING_STEP,
    "layer_norm_eps": "a number inside layer norm, not a tensor",
    "initializer_range": "initialisation only",
    "encoder_stride": "ViTForMaskedImageModeling's decoder only",
    "pooler_output_size": "ViTForImageClassification builds ViTModel without its pooler",
    "pooler_act": "ViTForImageClassification builds ViTModel without its pooler",
}

FAMILY = register(Family(
    name="vit",
    description="Vision transformers as Hugging Face's ViTForImageClassification runs them (patch "
                "convolution, class token, learned positions, pre-norm encoder, class-token classifier)",
    config=ViTConfig,
    build=build_vit,
    model_types=("vit",),
    aliases={"_attn_implementation": "attn_implementation"},
    required=REQUIRED,
    presets=PRESETS,
    hf_ids=HF_IDS,
    unmodelled=UNMODELLED,
    ignored=IGNORED,
))
