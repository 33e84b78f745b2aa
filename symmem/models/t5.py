"""T5 (v1.0 and v1.1) as Hugging Face's ``T5ForConditionalGeneration`` runs it: an encoder and a
decoder stack, relative position biases, cross-attention, a ReLU or gated-GELU feed-forward.

Two sequence lengths: the encoder's ``s`` (``input_ids``) and the decoder's ``s_d`` (``labels``,
from which the model makes its decoder inputs with ``_shift_right``); ``est.at(b=..., s=...,
s_d=...)``. The other symbols: ``h`` (d_model), ``f`` (d_ff), ``a`` (num_heads), ``d_h``
(d_kv, where num_heads * d_kv is not d_model), ``L`` (num_layers), ``V``, ``n_b``
(relative_attention_num_buckets).

What the model does, read off transformers 5's ``modeling_t5.py`` and measured on the CPU
(``tests/test_t5_measured.py``):

* the first layer of each stack computes the position bias (``compute_bias``: buckets of the
  relative positions, an (s, s) int64 tensor the embedding keeps, and an embedding of n_b x a
  weights), which every later layer of the stack receives and adds to its scores: the first
  layer is written out, the other L - 1 are a repeated block reading the bias (one tensor,
  counted once); the decoder's cross-attention adds a zero bias of (1, a, s_d, s) made in its
  first layer;
* ``T5LayerNorm`` is RMS-style, its statistics in float32 (:func:`~symmem.rules.relative.t5_layer_norm_rule`);
* dropout (``dropout_rate``) after the embeddings, on the attention probabilities, in the
  feed-forward, after every sub-layer and after each stack's final norm;
* the head is tied to the shared embedding: transformers 5's ``T5Config`` always sets
  ``tie_word_embeddings=True``, and a config's ``tie_word_embeddings: false`` (T5 v1.1)
  only switches off the scaling of the decoder's output by d_model^-0.5
  (``scale_decoder_outputs``);
* the loss is ``CrossEntropyLoss`` over the logits (b s_d, V) and the labels, unshifted.

Attention: eager, or SDPA as transformers calls it (``sdpa_attention_forward``): the bias
becomes SDPA's float mask (``create_position_bias_mask``: a contiguous copy per layer in the
encoder, ``torch.where`` with the causal pattern in the decoder), for which PyTorch runs the
math kernel on the CPU in training (dropout). On CUDA, flash takes no mask, so PyTorch runs the
mem-efficient kernel with the bias as its ``attn_bias``, whose gradient it makes at the
batch-expanded (b, a, s_q, s_k) size (:func:`symmem.passes.attention._biased`; derived from
PyTorch's sources, the bytes saved for backward checked against PyTorch's meta functions in
``tests/test_t5_measured.py``; s and s_d multiples of 16, required, else the mask is padded).
SDPA without dropout on the CPU (its flash kernel with a mask needing a gradient) is refused, as
are float16 models (``T5Block`` clamps float16 hidden states).

``recompute="full"`` is measured against transformers' activation checkpointing of every
``T5Block`` (``activation_checkpointing_enable()``, non-reentrant; ``tests/test_t5_measured.py``:
float32 and bfloat16 autocast with eager attention and SDPA, a bfloat16 model with eager
attention, ReLU and gated GELU, b = 1 to 3), and so are the modes that checkpoint some
blocks, each stack's written-out first block counted as its layer 0 (the ``first_layer_of``
attribute, :mod:`symmem.passes.regions`):

* ``nth:N``: ``activation_checkpointing_enable(every_n_layers=N)``, which numbers the
  ``GradientCheckpointingLayer`` modules in ``model.modules()`` order, the encoder's blocks 0 to
  L - 1, then the decoder's L to L + L_d - 1, and checkpoints those with ``index % N == 0``.
  symmem requires N to divide both L and L_d (refused otherwise), so that every stack's blocks
  0, N, 2N, ... are the checkpointed ones: block 0 (written out) and, of the repeated L - 1,
  layers 1 to N - 1 kept, the other L - N grouped N at a time, the first of each group
  checkpointed;
* ``last:N`` and ``Recompute.layers(a, z)``: in each stack, blocks 0 to L - N - 1 (a to z - 1)
  checkpointed, block 0 being the written-out one (measured: transformers' checkpointing with
  ``gradient_checkpointing`` switched off on the other blocks of each stack);
* ``selective``: the attention function (``eager_attention_forward``, or
  ``sdpa_attention_forward``, which makes the bias SDPA's mask) checkpointed with q, k, v, the
  mask and the position bias as its arguments (measured: the function patched to run in
  ``torch.utils.checkpoint``), in float32, and with eager attention in a bfloat16 model and
  under autocast too; no block is checkpointed, so the cross-attention's zero bias needs no
  gradient;
* ``every:K`` (K blocks as one region) would join the written-out block to repeated ones:
  refused (as is ``selective,reentrant``, :func:`refuse_checkpointing`).

The reentrant checkpoint (``,reentrant``) of the blocks runs them under ``no_grad``: the
cross-attention's zero bias is then a leaf of each recomputation only, and what the later blocks
receive is the first block's checkpoint's output, which requires grad. Its gradient, summed over
the decoder's blocks, goes back into that checkpoint and no ``.grad`` is kept (the node's
``grad_kept=False``): measured, ``full,reentrant`` kept it and its ``.grad`` as the non-reentrant
checkpoint does, 2 x 1 x 4 x 8 x 16 x 4 = 4,096 bytes too many at a = 4, s_d = 8, s = 16 in
float32 in backward and the optimizer step.

``T5Block`` is a ``GradientCheckpointingLayer`` called with positional arguments
(hidden states, mask, position bias, encoder states, encoder mask, cross bias) and ``cache`` bound
by ``functools.partial``; so

* each stack's first block, which computes the position bias, is a checkpointed region like the
  others where it is checkpointed (written out here, it has a ``layer`` attribute); the bias is
  its output, and every later block's checkpoint keeps it as an argument until that block's
  backward;
* ``T5Attention`` (its ``gradient_checkpointing`` flag set too, in every block whichever blocks
  are checkpointed) makes the cross-attention's zero bias with ``requires_grad = True``: a leaf
  whose (1, a, s_d, s) gradient, summed over the decoder blocks, AccumulateGrad keeps as its
  ``.grad``, the graph keeping both through the optimizer step
  (the ``zeros_bias`` node's ``grad_when_checkpointed``, set by :mod:`symmem.passes.recompute`);
* ``T5DenseGatedActDense``'s ``hidden_gelu`` and ``hidden_linear`` are Python locals until
  ``wo`` returns (the product saves them anyway, unless checkpointed).

With SDPA on the CPU in a bfloat16 model (any recompute mode) and under autocast with
``selective``, the measured step differs, and those combinations are refused
(:func:`refuse_checkpointing`): in a bfloat16 model the forward holds 256 bytes more than symmem
counts with every layer checkpointed (b = 2, s = 16, s_d = 8, d_model = 32, a = 4; 256 to 2,048
at other points, in an encoder block's attention), and with ``selective`` the recomputed
attention's backward 2,048 more (a bfloat16 model or autocast, the same point). The forward's
difference is in SDPA's math kernel, not in the recomputation: at the first encoder layer's
softmax PyTorch holds 1,920 bytes more than symmem counts with no recomputation as well (461,008
against 459,088 at that point), where the forward's peak lies elsewhere; not located further.
(Layers checkpointed under autocast, refused before the recompute pass kept the model's Python
locals in a recomputation, are measured exact: eager and SDPA, ``full``, ``nth:2``, ``last:1``.)
"""
from __future__ import annotations

from dataclasses import dataclass

from ..graph import Graph
from ..policy.attention import HF_NAMES
from ..symbols import L, V, a, b, d_h, f, h, n_b, s, s_d
from ..errors import ConfigError
from . import checks
from .registry import BOOKKEEPING, TRAINING_STEP, Family, Unmodelled, register

__all__ = ["T5Config", "build_t5", "FEED_FORWARD", "PRESETS", "HF_IDS", "ALIASES", "REQUIRED", "UNMODELLED",
           "IGNORED", "FAMILY"]

#: ``feed_forward_proj`` -> (gated, the activation's op): transformers reads "gated-ACT" or "ACT"
#: with ACT from ACT2FN; "gated-gelu" runs gelu_new.
FEED_FORWARD = {"relu": (False, "relu"), "gated-gelu": (True, "gelu_new"), "gelu_new": (False, "gelu_new"),
                "gated-relu": (True, "relu"), "gated-gelu_new": (True, "gelu_new"), "gated-silu": (True, "silu"),
                "silu": (False, "silu")}


@dataclass(frozen=True)
class T5Config:
    """The fields of transformers' T5Config that decide memory, with its defaults.
    ``num_decoder_layers`` None: as many as ``num_layers``. ``tie_word_embeddings`` False
    (T5 v1.1) switches off the scaling of the decoder's output only (the head stays tied in
    transformers 5)."""
    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_decoder_layers: int | None = None
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    dropout_rate: float = 0.1
    feed_forward_proj: str = "relu"
    tie_word_embeddings: bool = True
    scale_decoder_outputs: bool | None = None
    attn_implementation: str | None = None
    name: str = "t5"

    def __post_init__(self):
        checks.positive_ints(self, "vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads",
                             "relative_attention_num_buckets",
                             optional=("num_decoder_layers",))
        if self.num_layers < 2:
            raise ConfigError("num_layers", self.num_layers, "at least 2 (symmem writes the first layer, which "
                              "computes the position bias, out and repeats the other num_layers - 1)")
        if self.decoder_layers < 2:
            raise ConfigError("num_decoder_layers", self.num_decoder_layers, "at least 2 (the first layer "
                              "computes the position bias; symmem repeats the others)")
        checks.known("feed_forward_proj", self.feed_forward_proj, FEED_FORWARD)
        checks.probabilities(self, "dropout_rate")
        checks.booleans(self, "tie_word_embeddings")
        if self.scale_decoder_outputs is not None:
            checks.booleans(self, "scale_decoder_outputs")
        checks.attn_implementation(self)
        if self.attn_implementation not in (None, "eager", "sdpa"):
            raise ConfigError("attn_implementation", self.attn_implementation, "\"eager\" or \"sdpa\", "
                              "the implementations T5 has in transformers", "Set attn_implementation to "
                              "\"sdpa\" (transformers' default) or \"eager\".")

    @property
    def decoder_layers(self) -> int:
        return self.num_layers if self.num_decoder_layers is None else self.num_decoder_layers

    @property
    def scaled(self) -> bool:
        """Is the decoder's output scaled by d_model^-0.5 before the head? transformers 5:
        ``scale_decoder_outputs`` where the config gives it, else ``tie_word_embeddings``."""
        return self.tie_word_embeddings if self.scale_decoder_outputs is None else self.scale_decoder_outputs

    @property
    def own_head_dim(self) -> bool:
        """Is num_heads * d_kv other than d_model (then d_kv is the symbol d_h)?"""
        return self.d_kv * self.num_heads != self.d_model

    def bindings(self) -> dict:
        out = {h: self.d_model, f: self.d_ff, L: self.num_layers, a: self.num_heads, V: self.vocab_size,
               n_b: self.relative_attention_num_buckets}
        if self.own_head_dim:
            out[d_h] = self.d_kv
        return out


def build_t5(cfg: T5Config) -> Graph:
    """The operator graph of one T5ForConditionalGeneration training forward (``input_ids``
    (b, s), ``labels`` (b, s_d)), loss included."""
    g = Graph(cfg.name, cfg.bindings())
    if cfg.attn_implementation is not None:
        g.attention = HF_NAMES[cfg.attn_implementation]
    g.require(2, L, "T5's first layer computes the position bias: symmem writes it out and repeats the "
                    "other L - 1")
    d = d_h if cfg.own_head_dim else h / a
    inner = a * d
    if not cfg.own_head_dim:
        g.require(a, h, "the attention heads split the hidden size evenly", kind="divides")
    gated, act = FEED_FORWARD[cfg.feed_forward_proj]
    p = cfg.dropout_rate
    ids = g.input("input_ids", (b, s))
    labels = g.input("labels", (b, s_d))
    shared = g.param("shared.weight", (V, h))

    def layer(g: Graph, x: str, pre: str, wpre: str, decoder: bool, first: bool, bias, mask, enc, cross_bias):
        """One T5Block: ``pre`` names its values, ``wpre`` its weights. Returns (output, bias,
        cross bias): the first layer makes the biases, the others receive them."""
        x_in = x

        def norm(name, y):
            return g.add("t5_layer_norm", y, params=(g.param(f"{wpre}{name}.weight", (h,)),), residual=True,
                         name=f"{pre}{name}")

        def linear(name, y, n_in, n_out):
            return g.add("linear", y, params=(g.param(f"{wpre}{name}.weight", (n_out, n_in)),), name=f"{pre}{name}")

        def attention(sub, mod, y, kv, bias, masks, until):
            """T5Attention: q from y, k and v from kv (y, or the encoder's output)."""
            q = g.add("heads", linear(f"{sub}.{mod}.q", y, h, inner), heads=a, name=f"{pre}{sub}/q_heads")
            k = g.add("heads", linear(f"{sub}.{mod}.k", kv, h, inner), heads=a, name=f"{pre}{sub}/k_heads")
            v = g.add("heads", linear(f"{sub}.{mod}.v", kv, h, inner), heads=a, name=f"{pre}{sub}/v_heads")
            if bias == "compute":          # compute_bias: the stack's relative position bias
                pair = g.add("position_pair", q, k, name=f"{pre}{sub}/positions")
                rel = g.add("relative_position", pair, q, k, name=f"{pre}{sub}/relative_position")
                bucket = g.add("position_bucket", rel, bidirectional=not decoder, name=f"{pre}{sub}/bucket")
                table = g.param(f"{wpre}{sub}.{mod}.relative_attention_bias.weight", (n_b, a))
                values = g.add("embedding", bucket, params=(table,), name=f"{pre}{sub}/relative_attention_bias")
                bias = g.add("bias_heads", values, name=f"{pre}{sub}/position_bias")
                for v_ in (pair, rel):     # compute_bias's locals until it returns
                    g.hold(v_, until=values)
            elif bias == "zeros":
                # T5Attention sets requires_grad on it where transformers checkpoints the layers
                bias = g.add("zeros_bias", q, k, grad_when_checkpointed=True, checkpoint_check=refuse_checkpointing,
                             name=f"{pre}{sub}/position_bias")
            mode = "causal" if decoder and mod == "SelfAttention" else "contiguous"
            # the attention function (eager_attention_forward, or sdpa_attention_forward with the bias
            # made its mask): what selective recomputation redoes
            with g.scope(recompute="attention"):
                z = g.add("attention", q, k, v, bias, *masks, dropout=p, causal=False, probs_like="keep",
                          kernels=("eager", "math", "mem-efficient"), bias_mask=mode,
                          returns_after=f"{pre}{sub}/merge", weights_until=until, name=f"{pre}{sub}/context")
            z = g.add("merge_heads", z, name=f"{pre}{sub}/merge")
            z = linear(f"{sub}.{mod}.o", z, inner, h)
            for v_ in (q, k, v):           # T5Attention's locals until it returns
                g.hold(v_, until=z)
            return z, bias

        # self-attention (T5LayerSelfAttention)
        sa = "layer.0"
        y = norm(f"{sa}.layer_norm", x)
        out_sa = f"{pre}{sa}/residual"
        until = f"{pre}layer.1/residual" if decoder else f"{pre}ff/residual"
        z, bias = attention(sa, "SelfAttention", y, y, "compute" if first else bias,
                            (mask,) if mask else (), until)
        g.hold(y, until=z)
        z = g.add("dropout", z, p=p, name=f"{pre}{sa}/dropout")
        x = g.add("add", x, z, name=out_sa)
        x = g.add("fp16_clamp", x, name=f"{pre}{sa}/clamp")
        if decoder:                        # cross-attention (T5LayerCrossAttention)
            ca = "layer.1"
            y = norm(f"{ca}.layer_norm", x)
            z, cross_bias = attention(ca, "EncDecAttention", y, enc, "zeros" if first else cross_bias, (),
                                      f"{pre}ff/residual")
            g.hold(y, until=z)
            z = g.add("dropout", z, p=p, name=f"{pre}{ca}/dropout")
            x = g.add("add", x, z, name=f"{pre}{ca}/residual")
            x = g.add("fp16_clamp", x, name=f"{pre}{ca}/clamp")
        # feed-forward (T5LayerFF)
        ff = "layer.2" if decoder else "layer.1"
        y = norm(f"{ff}.layer_norm", x)
        locals_ = ()
        if gated:                          # act(wi_0(y)) * wi_1(y)
            z = g.add(act, linear(f"{ff}.DenseReluDense.wi_0", y, h, f), name=f"{pre}ff/act")
            lin = linear(f"{ff}.DenseReluDense.wi_1", y, h, f)
            locals_ = (z, lin)             # hidden_gelu, hidden_linear: locals until forward returns
            z = g.add("mul", z, lin, name=f"{pre}ff/gated")
        else:
            z = g.add(act, linear(f"{ff}.DenseReluDense.wi", y, h, f), name=f"{pre}ff/act")
        z = g.add("dropout", z, p=p, name=f"{pre}ff/inner_dropout")
        # `hidden_states.to(self.wo.weight.dtype)`: a float32 copy under autocast
        z = g.add("to_param_dtype", z, name=f"{pre}ff/to_wo_dtype")
        z = linear(f"{ff}.DenseReluDense.wo", z, f, h)
        g.hold(y, until=z)
        for v_ in locals_:                 # (saved by the product anyway, unless checkpointed)
            g.hold(v_, until=z)
        z = g.add("dropout", z, p=p, name=f"{pre}ff/dropout")
        x = g.add("add", x, z, name=f"{pre}ff/residual")
        out = g.add("fp16_clamp", x, name=f"{pre}ff/clamp")
        # T5Stack's loop keeps the layer's input until the layer returns
        g.hold(x_in, until=out)
        return out, bias, cross_bias

    def stack(name: str, ids_: str, decoder: bool, count: int, enc=None):
        emb = g.add("embedding", ids_, params=(shared,), name=f"{name}/embed_tokens")
        mask = g.add("causal_mask", ids_, name=f"{name}/causal_mask") if decoder else None
        x = g.add("dropout", emb, p=p, name=f"{name}/dropout")
        # one layer to recompute, as the repeated ones: layer 0 of the stack, whose others are the
        # block's iterations (layer ranges and nth:N count it so, :mod:`symmem.passes.regions`)
        with g.scope(layer=f"{name}/block.0", first_layer_of=f"{name}/blocks"):
            x, bias, cross = layer(g, x, f"{name}/block.0/", f"{name}.block.0.", decoder, True, None, mask, enc,
                                   None)

        def body(gb: Graph, x_: str) -> str:
            return layer(gb, x_, f"{name}/block/", f"{name}.block.", decoder, False, bias, mask, enc, cross)[0]

        rest = L - 1 if count == cfg.num_layers else count - 1
        x = g.repeat(rest, body, x, name=f"{name}/blocks")
        x = g.add("t5_layer_norm", x, params=(g.param(f"{name}.final_layer_norm.weight", (h,)),),
                  name=f"{name}/final_layer_norm")
        x = g.add("dropout", x, p=p, name=f"{name}/final_dropout")
        # T5Stack's locals until it returns: the embeddings, the mask, the biases
        for v_ in (emb, bias) + ((mask, cross) if decoder else ()):
            g.hold(v_, until=x)
        return x

    enc = g.output(stack("encoder", ids, False, cfg.num_layers))
    dec_ids = g.add("shift_right", labels, name="decoder_input_ids")
    x = g.output(stack("decoder", dec_ids, True, cfg.decoder_layers, enc))
    if cfg.scaled:                         # scale_decoder_outputs: * d_model ** -0.5
        x = g.add("scale", x, name="scaled_output")
    logits = g.output(g.add("linear", x, params=(shared,), name="lm_head"))
    # CrossEntropyLoss(logits.view(-1, V), labels.view(-1)): CPU autocast runs cross_entropy_loss
    # in float32 (a copy of the logits, held until it returns), CUDA's leaves it alone
    z = g.add("autocast_copy", logits, aten="cross_entropy_loss", name="logits_float")
    logp = g.add("log_softmax", z, name="log_softmax")
    loss = g.add("nll_loss", logp, labels, shifted=True, name="loss")
    g.hold(z, until=loss)
    # T5ForConditionalGeneration.forward's locals until it returns
    for v_ in (dec_ids, x):
        g.hold(v_, until=loss)
    return g


def refuse_checkpointing(graph: Graph, policy) -> None:
    """Checkpointed T5 layers (``full``, ``nth:N``, ``last:N``, ``Recompute.layers``; the module
    docstring says how each counts the stacks' written-out first blocks) are measured exact in
    float32 and under bfloat16 autocast with eager attention and SDPA, and in a bfloat16 model
    with eager attention, non-reentrant and reentrant; the attention function checkpointed
    (``selective``) in float32, and with eager attention under autocast and in a bfloat16 model
    too, non-reentrant. Refused: ``selective,reentrant`` (it holds 6,144 bytes more in backward
    than symmem counts at b = 2, s = 16, s_d = 8, a = 4 in float32, not located); SDPA (its
    math kernel, on the CPU) in a bfloat16 model with any recomputation, and under autocast
    with ``selective``, where the measured step differs (the module docstring says by how
    much). ``every:K`` is refused by
    :func:`symmem.passes.recompute.prepare` (K consecutive layers would join a written-out block
    to the repeated ones). CUDA's mem-efficient kernel is derived, not measured, in every
    precision."""
    sdpa = any(n.op == "bias_mask" for g in graph.graphs() for n in g.items if hasattr(n, "op"))
    selective = policy.recompute.mode == "selective"
    if policy.recompute.reentrant and selective:
        raise ConfigError("recompute", str(policy.recompute), "selective (non-reentrant) for T5: the reentrant "
                          "checkpoint of its attention function is not modelled exactly", "Drop ,reentrant, or "
                          "checkpoint whole layers (--recompute full,reentrant).")
    if sdpa and policy.prec.name != "fp32" and policy.device == "cpu" and (selective or not policy.prec.autocast):
        what = "checkpointed attention" if selective else "checkpointed layers"
        raise ConfigError("recompute", str(policy.recompute), f"eager attention for a T5 model in "
                          f"{policy.precision} with {what} (SDPA's math kernel is not modelled exactly there)",
                          "Use --attention eager, train in fp32, or leave recompute out.")


def _t5(name, d_model, d_ff, layers, heads, d_kv, **extra):
    return T5Config(d_model=d_model, d_ff=d_ff, num_layers=layers, num_heads=heads, d_kv=d_kv, name=name, **extra)


#: Google's checkpoints (Raffel et al. 2020, Table 14; the v1.1 release notes) as their
#: config.json files give them; vocabulary 32128 (32,100 tokens padded to a multiple of 128).
PRESETS: dict[str, T5Config] = {
    "t5-small": _t5("t5-small", 512, 2048, 6, 8, 64),
    "t5-base": _t5("t5-base", 768, 3072, 12, 12, 64),
    "t5-large": _t5("t5-large", 1024, 4096, 24, 16, 64),
    "t5-3b": _t5("t5-3b", 1024, 16384, 24, 32, 128),
    "t5-11b": _t5("t5-11b", 1024, 65536, 24, 128, 128),
    "t5-v1_1-base": _t5("t5-v1_1-base", 768, 2048, 12, 12, 64, feed_forward_proj="gated-gelu",
                        tie_word_embeddings=False),
}

HF_IDS = {"t5-small": "google-t5/t5-small", "t5-base": "google-t5/t5-base", "t5-large": "google-t5/t5-large",
          "t5-3b": "google-t5/t5-3b", "t5-11b": "google-t5/t5-11b", "t5-v1_1-base": "google/t5-v1_1-base"}

#: transformers' T5Config.attribute_map.
ALIASES = {"hidden_size": "d_model", "num_attention_heads": "num_heads", "num_hidden_layers": "num_layers",
           "head_dim": "d_kv", "_attn_implementation": "attn_implementation"}

#: The sizes a config.json must give; every other field takes transformers' default.
REQUIRED = ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads")

UNMODELLED = (
    Unmodelled("gradient_checkpointing", (False,),
               "transformers then recomputes every block in backward: use --recompute full (float32 or "
               "bf16-mixed, or bf16 with eager attention)"),
)

_DERIVED = "derived by transformers from feed_forward_proj, which symmem reads"

IGNORED = {
    **BOOKKEEPING,
    **TRAINING_STEP,
    "relative_attention_max_distance": "where the logarithmic buckets end: the buckets' values, not their number",
    "layer_norm_epsilon": "a number inside T5LayerNorm, not a tensor",
    "initializer_factor": "initialisation only",
    "dense_act_fn": _DERIVED, "is_gated_act": _DERIVED,
    "is_encoder_decoder": "T5ForConditionalGeneration is one whatever it says",
    "is_decoder": "T5ForConditionalGeneration sets it per stack on copies of the config",
    "classifier_dropout": "read only by T5ForSequenceClassification's head",
    "n_positions": "an old key transformers no longer reads (relative positions have no table)",
    "output_past": "an old key transformers no longer reads",
    "problem_type": "read only by the classification heads",
}

FAMILY = register(Family(
    name="t5",
    description="T5 v1.0 and v1.1 as Hugging Face's T5ForConditionalGeneration runs them (encoder and "
                "decoder, relative position bias, cross-attention, ReLU or gated-GELU feed-forward, "
                "eager or SDPA attention)",
    config=T5Config,
    build=build_t5,
    model_types=("t5",),
    aliases=ALIASES,
    required=REQUIRED,
    presets=PRESETS,
    hf_ids=HF_IDS,
    unmodelled=UNMODELLED,
    ignored=IGNORED,
))
