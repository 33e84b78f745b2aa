"""Mixtral as Hugging Face's ``MixtralForCausalLM`` runs it: the mixtral family.

transformers 5's ``modeling_mixtral.py`` is Mistral's decoder (:func:`~symmem.models.llama.build_decoder`,
no biases, an optional sliding window) with the SwiGLU MLP replaced by a sparse mixture of E
experts (``MixtralSparseMoeBlock``), each token routed to K of them:

* the router (``MixtralTopKRouter``): logits ``x W_r^T`` (N, E) for the N = b s tokens, a
  softmax in float32, ``topk`` (the K largest probabilities and their experts), the K weights
  renormalised in place to sum to one;
* the experts (``MixtralExperts``, 3-D weights ``gate_up_proj`` (E, 2f, h) and ``down_proj``
  (E, h, f)) through transformers' default ``experts_implementation``, ``grouped_mm``
  (``integrations/moe.py``, ``grouped_mm_experts_forward``): the S = N K (token, expert)
  pairs sorted by expert, the tokens' rows gathered into one (S, h) tensor, one grouped
  matrix product per projection over the per-expert row ranges, each row scaled by its
  routing weight, the rows put back in token order and summed over a token's K experts.

Every tensor of that path has S or N rows whatever the routing: the token counts per expert
only move the boundaries between the groups, so the formulas hold for any routing, balanced
or all on K experts (measured both ways).

``experts_implementation="batched_mm"`` (``integrations/moe.py``, ``batched_mm_experts_forward``;
:func:`batched_mm_experts`) is data-independent too: the rows repeated K times (S, h), each
pair's expert weights gathered (``gate_up_proj[expert_ids]`` (S, 2f, h), ``down_proj[
expert_ids]`` (S, h, f)), one ``torch.bmm`` a projection, which saves both operands, the gate,
the routing weights, the sum over a token's K pairs. Saved a layer, beside the router's: the
repeated rows S h, the gathered weights 3 S f h, the projections' outputs S 2f and S h, silu's
output and the gated product 2 S f (times the activations' bytes), the top-k weights N K 4:
827,520 bytes in float32 at N = 16, K = 2, h = 32, f = 64, where grouped_mm saves 41,872.
Under autocast ``bmm`` saves the operands' half copies; the float32 gathered gate-up weights
live, unsaved, in ``selected_weights`` until the down ones are gathered. Backward: each
gathered weight's gradient (S, out, in), summed into a zero tensor of the whole parameter by
IndexBackward0's out-of-place ``index_put``, whose result is the parameter's gradient (the
zeros and the result, both the parameter's size, live while it runs). Measured exact (float32, bfloat16
autocast, a bfloat16 model, eager and SDPA, K = 1, 2 and E, SGD and AdamW, balanced, all-on-K
and random routing, full recomputation); CUDA runs the same ops (its saved bytes checked on
the meta device).

``eager`` (``MixtralExperts.forward``, a Python loop over the experts hit) is refused: what it
holds depends on the tokens per expert and on how many experts are hit (measured). What an
expert saves is linear in its n_e rows (``torch.where``'s (n_e, 2) int64 indices, the gathered
rows, the projections' outputs, the routing weights' gather), so in float32 the sum depends on
S alone; but under autocast each expert's weight slices are cast anew and saved (autocast
caches leaves only; a slice is not one): 2 (2f h + h f) bytes per expert hit, E of them with
balanced routing, K with all tokens on K experts. An iteration's transients follow its own
n_e; in backward each ``gate_up_proj[e]`` and ``down_proj[e]`` select makes a zero gradient of
the whole 3-D parameter (SelectBackward0), added out of place to the sum of the others; the
one-hot expert mask (N, K, E + 1) int64 lives through the loop. The CUDA kernels ``deepgemm``
and ``sonicmoe`` are refused too.

``output_router_logits`` true (training with the load-balancing loss, weighted by
``router_aux_loss_coef``; :func:`load_balancing_loss`): every layer's router logits kept by
transformers' output recorder until forward ends, ``load_balancing_loss_func``'s loop over them
(a saved softmax per layer, top-K, ``histc``, running sums) and its final product, and in
backward each layer's logits gradient from that loss waiting for the layer's router. Measured
exact (``tests/test_mixtral_aux_measured.py``: float32, bfloat16 autocast, a bfloat16 model,
eager and SDPA, K = 1 to 3, b = 1 to 3, 2 to 4 layers, SGD and AdamW, full recomputation);
with recomputation of layer ranges or regrouped layers, or pipeline stages, it is refused.

Refused unless at the default (:data:`UNMODELLED`): ``router_jitter_noise`` (multiplies
the hidden states in place by noise) and the Llama family's refusals. The symbols: E
(``num_local_experts``) and K (``num_experts_per_tok``) beside Mistral's. Under expert parallelism (``--ep``, :mod:`symmem.passes.expert`) the experts'
nodes are replaced by :func:`ep_experts`, transformers' ``AllToAllEP`` dispatch and combine
(grouped_mm's experts only: batched_mm's under expert parallelism are refused).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..graph import Graph
from ..symbols import E, K, L, b, f, h, s
from .llama import IGNORED as LLAMA_IGNORED, UNMODELLED as LLAMA_UNMODELLED, Decoder, build_decoder, check_decoder
from .registry import Family, Unmodelled, register
from . import checks

__all__ = ["MixtralConfig", "build_mixtral", "moe_block", "grouped_mm_experts", "batched_mm_experts",
           "load_balancing_loss", "ep_experts", "in_ep_experts", "EXPERTS", "EXPERTS_IMPLEMENTATIONS", "PRESETS",
           "HF_IDS", "UNMODELLED", "IGNORED", "FAMILY"]

#: The nodes of :func:`moe_block` that run the experts (from the sorted pairs to the summed
#: output): what expert parallelism replaces (:func:`ep_experts`), and the values it reads.
EXPERTS = ("layers/mlp/experts/", "layers/mlp.experts.")
EXPERTS_OUT, ROWS, TOP_K_INDEX, TOP_K_WEIGHTS = ("layers/mlp/experts/out", "layers/mlp/rows",
                                                 "layers/mlp/router/top_k_index", "layers/mlp/router/top_k_weights")

#: The prefix of the nodes :func:`ep_experts` adds: with :data:`EXPERTS_OUT`, what the experts
#: module runs under expert parallelism (its forward, wrapped by transformers' ``ep_forward``).
EP_EXPERTS = "layers/mlp/ep/"

#: transformers' ``experts_implementation`` values symmem models (None: its default, grouped_mm).
EXPERTS_IMPLEMENTATIONS = (None, "grouped_mm", "batched_mm")


@dataclass(frozen=True)
class MixtralConfig:
    """The fields of Hugging Face's MixtralConfig that decide memory, with its defaults
    (Mixtral 8x7B's shape). ``num_key_value_heads`` None means ``num_attention_heads``."""
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    vocab_size: int = 32000
    head_dim: int | None = None
    hidden_act: str = "silu"
    sliding_window: int | None = None
    attention_dropout: float = 0.0
    tie_word_embeddings: bool = False
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    attn_implementation: str | None = None
    output_router_logits: bool = False
    experts_implementation: str | None = None
    name: str = "mixtral"

    def __post_init__(self):
        check_decoder(self)
        checks.positive_ints(self, "num_local_experts", "num_experts_per_tok")
        checks.booleans(self, "output_router_logits")
        if self.experts_implementation not in EXPERTS_IMPLEMENTATIONS:
            raise ConfigError("experts_implementation", self.experts_implementation,
                              "\"grouped_mm\" (transformers' default, or null), \"batched_mm\"",
                              "The others (eager's loop over the experts, the CUDA kernels deepgemm and "
                              "sonicmoe) are not modelled: remove the key or set one of these.")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ConfigError("num_experts_per_tok", self.num_experts_per_tok,
                              f"at most the number of experts num_local_experts ({self.num_local_experts})",
                              "Each token is routed to that many distinct experts.")

    @property
    def kv_heads(self) -> int:
        return self.num_attention_heads if self.num_key_value_heads is None else self.num_key_value_heads

    def decoder(self) -> Decoder:
        return Decoder(self.name, self.hidden_size, self.intermediate_size, self.num_hidden_layers,
                       self.num_attention_heads, self.kv_heads, self.vocab_size, self.head_dim,
                       dropout=self.attention_dropout, tie=self.tie_word_embeddings,
                       attn_implementation=self.attn_implementation, window=self.sliding_window)


def moe_block(g: Graph, y: str, experts_implementation: str | None = None) -> str:
    """``MixtralSparseMoeBlock`` on the post-attention norm's output ``y`` (b, s, h), with the
    experts of ``experts_implementation`` (None: transformers' default, grouped_mm); returns
    its (b, s, h) output. Names follow the parameters' (``mlp.gate.weight``,
    ``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``)."""
    N = b * s

    def add(op, *inputs, name, **attrs):
        return g.add(op, *inputs, name=f"layers/mlp/{name}", **attrs)

    rows = add("reshape", y, shape=(N, h), name="rows")
    # MixtralTopKRouter: logits, softmax(logits.float()), topk, renormalised in place
    logits = g.add("linear", rows, params=(g.param("mlp.gate.weight", (E, h)),), name="layers/mlp.gate")
    probs = add("softmax", add("to_float32", logits, name="router/float"), name="router/probs")
    index = add("topk_indices", probs, k=K, name="router/top_k_index")
    top = add("topk", probs, index, name="router/top_k")
    weights = add("div_inplace", top, add("sum_last", top, name="router/sum"), name="router/top_k_weights")
    g.hold(probs, until=weights)       # the router's probabilities until it returns
    experts = batched_mm_experts if experts_implementation == "batched_mm" else grouped_mm_experts
    out = experts(g, rows, index, weights)
    moe = add("reshape", out, shape=(b, s, h), name="out")
    # the block's locals until it returns (the router's logits in `_`, the top-k weights and
    # indices) and the layer's `hidden_states` (y)
    for value in (logits, index, weights, y):
        g.hold(value, until=moe)
    return moe


def grouped_mm_experts(g: Graph, rows: str, index: str, weights: str) -> str:
    """``grouped_mm_experts_forward`` on the (N, h) rows, the top-k indices and weights (N, K):
    returns :data:`EXPERTS_OUT` (N, h)."""
    S = b * s * K

    def add(op, *inputs, name, **attrs):
        return g.add(op, *inputs, name=f"layers/mlp/{name}", **attrs)

    # sort the pairs by expert, gather the rows and the weights
    expert_ids = add("index_tensor", index, shape=(S,), dtype="int64", name="experts/expert_ids_g")
    perm = add("index_tensor", index, shape=(S,), dtype="int64", name="experts/perm")
    tokens = add("index_tensor", perm, shape=(S,), dtype="int64", name="experts/perm_div_k")
    xs = add("gather_rows", rows, tokens, name="experts/selected_hidden_states")
    flat = add("reshape", weights, shape=(S,), name="experts/sample_weights")
    wg = add("gather_rows", flat, perm, name="experts/sample_weights_g")
    # histc's input: expert_ids_g.float() on the CPU, .int() on CUDA: 4 bytes either way
    hist_in = add("index_tensor", expert_ids, shape=(S,), dtype="float32", name="experts/histc_input")
    counts = add("index_tensor", hist_in, shape=(E,), dtype="float32", name="experts/tokens_per_expert")
    offs = add("index_tensor", counts, shape=(E,), dtype="int32", name="experts/offsets")
    gate_up = g.add("grouped_mm", xs, offs, params=(g.param("mlp.experts.gate_up_proj", (E, 2 * f, h)),),
                    name="layers/mlp.experts.gate_up_proj")
    gate = add("split", gate_up, parts=2, index=0, name="experts/gate")
    up = add("split", gate_up, parts=2, index=1, name="experts/up")
    act = add("mul", add("silu", gate, name="experts/act"), up, name="experts/gated")
    down = g.add("grouped_mm", act, offs, params=(g.param("mlp.experts.down_proj", (E, h, f)),),
                 name="layers/mlp.experts.down_proj")
    weighted = add("mul", down, add("reshape", wg, shape=(S, 1), name="experts/sample_weights_col"),
                   name="experts/weighted")
    # inv_perm = empty_like(perm); inv_perm[perm] = arange(S): the arange is scratch
    inverse = add("index_tensor", perm, shape=(S,), dtype="int64", temp=8 * S, name="experts/inv_perm")
    unsorted = add("gather_rows", weighted, inverse, name="experts/weighted_out")
    summed = add("sum_topk", unsorted, k=K, name="experts/final_hidden_states")
    out = g.add("type_as", summed, rows, name=EXPERTS_OUT)
    # the experts' locals until they return (the sorted ids, the permutation, the gathered rows
    # and weights, histc's input and counts, the offsets, the last `proj_out` and `weighted_out`)
    for value in (expert_ids, perm, xs, wg, hist_in, counts, offs, down, unsorted):
        g.hold(value, until=out)
    return out


def batched_mm_experts(g: Graph, rows: str, index: str, weights: str) -> str:
    """``batched_mm_experts_forward`` on the (N, h) rows, the top-k indices and weights (N, K):
    every row repeated K times (S, h), each pair's expert weights gathered (``gate_up_proj[
    expert_ids]`` (S, 2f, h), then ``down_proj[expert_ids]`` (S, h, f)), one matrix-vector
    product a pair (``torch.bmm``), the gate, the routing weights, the sum over a token's K
    pairs; returns the (N, h) output."""
    S = b * s * K

    def add(op, *inputs, name, **attrs):
        return g.add(op, *inputs, name=f"layers/mlp/batched_mm/{name}", **attrs)

    xs = add("repeat_rows", rows, k=K, name="selected_hidden_states")
    expert_ids = add("reshape", index, shape=(S,), name="expert_ids")
    w_gate_up = g.add("gather_param", expert_ids, params=(g.param("mlp.experts.gate_up_proj", (E, 2 * f, h)),),
                      name="layers/mlp.experts.gate_up_proj")
    gate_up = add("batched_linear", xs, w_gate_up, name="gate_up")
    gate = add("split", gate_up, parts=2, index=0, name="gate")
    up = add("split", gate_up, parts=2, index=1, name="up")
    act = add("mul", add("silu", gate, name="act"), up, name="gated")
    w_down = g.add("gather_param", expert_ids, params=(g.param("mlp.experts.down_proj", (E, h, f)),),
                   name="layers/mlp.experts.down_proj")
    g.hold(w_gate_up, until=w_down)            # `selected_weights` until rebound
    down = add("batched_linear", act, w_down, name="down")
    weighted = add("mul", down, add("reshape", weights, shape=(S, 1), name="sample_weights"), name="weighted")
    summed = add("sum_topk", weighted, k=K, name="final_hidden_states")
    out = add("type_as", summed, rows, name="out")
    # its locals until it returns: the repeated rows, the down weights, `proj_out`, `weighted_out`
    for value in (xs, w_down, down, weighted):
        g.hold(value, until=out)
    return out


def in_ep_experts(node: str) -> bool:
    """Is ``node`` run by the experts module under expert parallelism (:func:`ep_experts`: the
    dispatch, the experts and the combine, up to the module's output)? FSDP2 makes that module
    a unit of its own (:mod:`symmem.passes.shard`)."""
    return node.startswith(EP_EXPERTS) or node == EXPERTS_OUT


def ep_experts(g: Graph, ep, worst: bool = False, cast: bool = False) -> str:
    """The experts of :func:`moe_block` under transformers' expert parallelism over ``ep``
    ranks (``distributed/expert_parallel.py``: the ``grouped_gemm`` style keeps ``E / ep``
    experts a rank, ``ep_dispatch_experts`` runs ``AllToAllEP`` in training), reading the
    block's rows, top-k indices and weights; returns :data:`EXPERTS_OUT` (N, h).

    Dispatch: ``argsort`` of the S = N K expert ids (its sorted values are scratch), the rows
    ``x[order // K]`` to send (S, h), the counts per expert (``scatter_add_`` of an S-long
    ``ones_like``; the counts exchanged), ``all_to_all_single_autograd`` to the R rows this
    rank's experts run (balanced routing: R = S), their local expert ids
    (``arange(E/ep).repeat(ep).repeat_interleave``) and unit weights. The experts: the
    grouped_mm path of :func:`moe_block` on R rows with K = 1 and E / ep experts, with
    ``_is_expert_parallel``'s sentinel mask (bool (R, 1)): the gathered rows masked in place,
    each projection's output masked into a new tensor. Combine: the R outputs sent back (S, h),
    put in (token, slot) order (``empty_like`` then ``index_put_`` by the order), times the
    routing weights, summed over the K slots. Lifetimes follow the Python locals of
    ``_dispatch_tokens``, the experts' forward, ``_combine_tokens`` and ``AllToAllEP.__call__``.
    ``cast``: the module is an FSDP2 unit under ``MixedPrecisionPolicy``, whose pre-forward
    casts its floating inputs to the parameters' dtype (``cast_forward_inputs``): the float32
    routing weights are copied (the rows are in it already), and the combine is in it."""
    N, S = b * s, b * s * K
    R, E_r = (ep * S if worst else S), E / ep

    def add(op, *inputs, name, **attrs):
        return g.add(op, *inputs, name=f"layers/mlp/{name}", **attrs)

    rows, index, weights = ROWS, TOP_K_INDEX, TOP_K_WEIGHTS
    if cast:
        # FSDP's pre-forward, before the all-gather and outside what its post-backward waits for
        weights = add("to_param_dtype", weights, name="fsdp_cast/top_k_weights")
    # _dispatch_tokens
    order = add("index_tensor", index, shape=(S,), dtype="int64", temp=8 * S, name="ep/order")
    send_index = add("index_tensor", order, shape=(S,), dtype="int64", name="ep/order_div_k")
    send = add("gather_rows", rows, send_index, name="ep/send_tokens")
    send_counts = add("index_tensor", index, shape=(E,), dtype="int64", temp=8 * S, name="ep/send_counts")
    recv_counts = add("index_tensor", send_counts, shape=(E,), dtype="int64", name="ep/recv_counts")
    received = add("all_to_all", send, rows=R, name="ep/recv_tokens")
    ids = add("index_tensor", recv_counts, shape=(R,), dtype="int64", temp=8 * E, name="ep/recv_expert_ids")
    unit = add("index_tensor", received, shape=(R, 1), dtype="like", name="ep/recv_weights")
    for value in (send, send_counts, recv_counts):          # _dispatch_tokens' locals
        g.hold(value, until=unit)
    # the experts' forward on the R received rows, K = 1, E / ep experts
    expert_ids = add("index_tensor", ids, shape=(R,), dtype="int64", name="ep/experts/expert_ids_g")
    perm = add("index_tensor", ids, shape=(R,), dtype="int64", name="ep/experts/perm")
    tokens = add("index_tensor", perm, shape=(R,), dtype="int64", name="ep/experts/perm_div_k")
    xs = add("gather_rows", received, tokens, name="ep/experts/selected_hidden_states")
    wg = add("gather_rows", add("reshape", unit, shape=(R,), name="ep/experts/sample_weights"), perm,
             name="ep/experts/sample_weights_g")
    hist_in = add("index_tensor", expert_ids, shape=(R,), dtype="float32", name="ep/experts/histc_input")
    counts = add("index_tensor", hist_in, shape=(E_r,), dtype="float32", name="ep/experts/tokens_per_expert")
    offs = add("index_tensor", counts, shape=(E_r,), dtype="int32", name="ep/experts/offsets")
    mask = add("index_tensor", expert_ids, shape=(R, 1), dtype="bool", name="ep/experts/sentinel_mask")
    xs = add("masked_fill", xs, mask, inplace=True, name="ep/experts/selected_masked")
    gate_up = g.add("grouped_mm", xs, offs, params=(g.param("mlp.experts.gate_up_proj", (E_r, 2 * f, h)),),
                    name="layers/mlp/ep/experts.gate_up_proj")
    gate_up = add("masked_fill", gate_up, mask, name="ep/experts/gate_up_masked")
    gate = add("split", gate_up, parts=2, index=0, name="ep/experts/gate")
    up = add("split", gate_up, parts=2, index=1, name="ep/experts/up")
    act = add("mul", add("silu", gate, name="ep/experts/act"), up, name="ep/experts/gated")
    down = g.add("grouped_mm", act, offs, params=(g.param("mlp.experts.down_proj", (E_r, h, f)),),
                 name="layers/mlp/ep/experts.down_proj")
    down = add("masked_fill", down, mask, name="ep/experts/down_masked")
    weighted = add("mul", down, add("reshape", wg, shape=(R, 1), name="ep/experts/sample_weights_col"),
                   name="ep/experts/weighted")
    inverse = add("index_tensor", perm, shape=(R,), dtype="int64", temp=8 * R, name="ep/experts/inv_perm")
    unsorted = add("gather_rows", weighted, inverse, name="ep/experts/weighted_out")
    expert_out = add("sum_topk", unsorted, k=1, name="ep/experts/final_hidden_states")
    for value in (expert_ids, perm, xs, wg, hist_in, counts, offs, mask, down, unsorted):   # its locals
        g.hold(value, until=expert_out)
    # _combine_tokens
    back = add("all_to_all", expert_out, rows=S, name="ep/recv_out")
    ordered = add("gather_rows", back, order, name="ep/token_outputs")
    scaled = add("mul", ordered, add("reshape", weights, shape=(S, 1), name="ep/top_k_weights_col"),
                 name="ep/weighted")
    summed = add("sum_topk", scaled, k=K, name="ep/output")
    g.hold(back, until=summed)
    # AllToAllEP.__call__'s locals: the received rows, ids and weights, the experts' output
    for value in (received, ids, unit, expert_out, order) + ((weights,) if cast else ()):
        g.hold(value, until=summed)
    return g.add("type_as", summed, rows, name=EXPERTS_OUT)


def load_balancing_loss(g: Graph, loss: str) -> str:
    """``output_router_logits``: transformers' ``load_balancing_loss_func`` (``modeling_mixtral.py``
    lines 475-546, ``attention_mask`` None: training without padding) on the router logits the
    output recorder kept, one (N, E) tensor per layer, then ``loss += router_aux_loss_coef *
    aux_loss`` (line 633, in place); returns the loss.

    The recorder (``OutputRecorder(MixtralTopKRouter, index=0)``, ``utils/output_capturing.py``)
    appends each layer's logits to a list that the model's outputs keep until forward ends. The
    loss loops over the layers: ``softmax`` (saved for backward, L of them), ``topk`` (its
    values ``_`` and the int64 indices live until the next iteration rebinds them; the values'
    TopkBackward0 node goes with them), ``histc`` of a float32 copy of the indices (S floats)
    added to a running (E,) count, ``routing_weights.float().sum(dim=0)`` added to a running
    (E,) sum. Then both divided by the rows (a Python number: the sum's division keeps it as
    a 0-dim float64), the product of the two (which keeps the token fractions for backward),
    ``torch.sum``, times E (a Python int kept as a 0-dim int64) and times the coefficient (a
    0-dim float64). The loss's value is returned in the outputs as ``aux_loss``.

    Backward runs the load-balancing loss first (its nodes are the newest): each layer's
    logits receive a (N, E) gradient that waits, in the dtype of the logits, until that
    layer's backward reaches its router, where the router's own gradient is added to it."""
    N, S = b * s, b * s * K

    def add(op, *inputs, name, **attrs):
        return g.add(op, *inputs, name=f"aux/{name}", **attrs)

    # torch.zeros(num_experts) twice; `_` and `selected_experts` are not bound yet
    counts0 = add("index_tensor", shape=(E,), dtype="float32", name="tokens_per_expert_sum0")
    probs0 = add("index_tensor", shape=(E,), dtype="float32", name="router_prob_sum0")
    values0 = add("unbound", shape=(N, K), name="values0")
    index0 = add("unbound", shape=(N, K), name="selected_experts0")

    def layer(g: Graph, carried):
        counts, probs, values_before, index_before = carried

        def add(op, *inputs, name, **attrs):
            return g.add(op, *inputs, name=f"aux/{name}", **attrs)

        logits = g.recorded("layers", "layers/mlp.gate", name="aux/layer_gate")
        g.output(logits)                   # in the outputs' router_logits until forward ends
        weights = add("softmax", logits, name="routing_weights")
        index = add("topk_indices", weights, k=K, name="selected_experts")
        values = add("topk", weights, index, discarded=True, name="values")
        for value in (values_before, index_before):      # rebound by this topk
            g.hold(value, until=values)
        # histc(selected_experts.reshape(-1).to(float32), bins=E) (float32 on the CPU, int32
        # on CUDA: 4 bytes either way), added to the running count
        flat = add("index_tensor", index, shape=(S,), dtype="float32", name="histc_input")
        hist = add("index_tensor", flat, shape=(E,), dtype="float32", name="histc")
        counts = add("add", counts, hist, name="tokens_per_expert_sum")
        summed = add("sum_rows", add("to_float32", weights, name="routing_weights_float"), name="router_prob")
        probs = add("add", probs, summed, name="router_prob_sum")
        return counts, probs, values, index

    counts, probs, values, index = g.repeat(L, layer, (counts0, probs0, values0, index0), name="aux")
    fractions = add("index_tensor", counts, shape=(E,), dtype="float32", name="tokens_per_expert")
    per_expert = add("scale", probs, name="router_prob_per_expert")          # / total_rows
    row = add("reshape", per_expert, shape=(1, E), name="router_prob_per_expert_row")
    product = add("mul", fractions, row, name="product")
    aux = add("scale", add("sum_all", product, name="overall_loss"), name="aux_loss")   # * num_experts
    # the function's locals until it returns
    for value in (counts, probs, values, index, per_expert):
        g.hold(value, until=aux)
    g.output(aux)
    weighted = g.add("scale", aux, name="aux/weighted")       # router_aux_loss_coef * aux_loss
    return g.add("add", loss, weighted, inplace=True, name="loss_with_aux")


def build_mixtral(cfg: MixtralConfig) -> Graph:
    """The operator graph of one MixtralForCausalLM training forward, loss included (with the
    load-balancing loss where ``output_router_logits`` is true: :func:`load_balancing_loss`)."""
    g = build_decoder(cfg.decoder(), mlp=lambda g, y: moe_block(g, y, cfg.experts_implementation))
    g.bindings.update({E: cfg.num_local_experts, K: cfg.num_experts_per_tok})
    g.require(K, E, "each token is routed to K distinct experts")
    if cfg.output_router_logits:
        load_balancing_loss(g, "loss")
    return g


#: Mistral AI's Mixtral 8x7B v0.1 as its config.json gives it (the sliding window is null).
PRESETS = {"mixtral-8x7b": MixtralConfig(name="mixtral-8x7b")}
HF_IDS = {"mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1"}

UNMODELLED = LLAMA_UNMODELLED + (
    Unmodelled("router_jitter_noise", (0.0, 0),
               "noise multiplied into the hidden states in place before the router"),
)

IGNORED = {
    **LLAMA_IGNORED,
    "router_aux_loss_coef": "a number weighing the load-balancing loss (output_router_logits), not a tensor",
}

FAMILY = register(Family(
    name="mixtral",
    description="Mixtral as Hugging Face's MixtralForCausalLM runs it (Mistral's decoder with a sparse "
                "mixture of E experts, top-K routing, transformers' grouped_mm or batched_mm experts)",
    config=MixtralConfig,
    build=build_mixtral,
    model_types=("mixtral",),
    aliases={"_attn_implementation": "attn_implementation", "num_experts": "num_local_experts",
             "_experts_implementation": "experts_implementation"},
    required=("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
    presets=PRESETS,
    hf_ids=HF_IDS,
    unmodelled=UNMODELLED,
    ignored=IGNORED,
))
