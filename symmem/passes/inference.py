"""Inference: a training graph turned into the prefill and one decoding step of generation.

``Policy(mode="inference")`` (``symmem infer``) asks for the memory of text generation with
a KV cache, as transformers' ``generate`` runs a causal LM under ``torch.no_grad``:

- **prefill**: the prompt's forward, ``model(input_ids, cache=cache, use_cache=True,
  logits_to_keep=1)`` on (b, s) token ids; each layer appends its keys and values (s
  positions) to the cache; the output head projects the last position only, as ``generate``
  asks (``policy.logits="all"``: every position, without ``logits_to_keep``);
- **decode**: one decoding step, ``model(next_ids, cache=cache)`` on (b, 1) ids with s + n_g - 1
  positions cached, after which the cache holds s + n_g (the step that feeds the n_g-th
  generated token; every earlier step has a shorter cache, so this one is the largest).

The graph of a step is the training graph rewritten (:func:`step_graph`):

- under ``torch.no_grad`` (``Ctx.no_grad``): autograd records nothing, so each op's would-be
  saved tensors are made and dropped inside it (:mod:`symmem.footprints`); no gradient, no
  optimizer state; the weights still require grad, so autocast caches their half copies until
  the forward ends, as in training;
- the loss and what only it reads removed (no labels: the forward returns the logits, the
  cache and, until it returns, the last hidden state);
- before each ``attention`` node, a ``kv_cache`` node for its keys and one for its values
  (:func:`~symmem.rules.cache.kv_cache_rule`): ``DynamicLayer.update``'s ``torch.cat``; the
  attention reads the cached tensors, and the model's locals that held the keys and values
  now hold the cache's (``key_states`` is rebound to what ``update`` returns);
- dropout off (generation runs ``model.eval()``: ``F.dropout`` returns its input);
- for the decoding step, every shape of one token: s -> 1, but the cache's positions
  (s + n_g) and the eager mask's columns (``kv_len``);
- OPT's positions over every position seen: called without an ``attention_mask``,
  ``OPTDecoder`` makes ``torch.ones(b, past_seen_tokens + q)`` (float32) and its int64
  ``cumsum`` positions, both (b, s + n_g) in the decoding step and kept until the decoder
  returns, of which it embeds the step's last column (``ones_like_ids`` with ``length``,
  ``cumsum_positions``, ``offset_ids`` with ``columns``); a StaticCache's counter is a
  tensor, so there ``past_seen_tokens + q`` is a 0-dim int64 too (``static_seq_length``).

The plan of a step (:func:`apply`): no backward, no optimizer; the cache's tensors are held
to the end (role ``cache``); in the decoding step the cache of s + n_g - 1 positions exists
before the step and each layer's old keys (values) are freed just after the cat that replaces
them.

Modelled: transformers' ``DynamicCache`` of ``DynamicLayer`` layers (the default of
``generate``). A sliding window (Mistral) makes ``DynamicSlidingWindowLayer`` layers, which
are the same while fewer than ``window`` positions are cached: the formulas then require
s + n_g <= window - 1.

``cache="static"``: transformers' ``StaticCache`` of ``StaticLayer`` layers. The cache nodes
make (b, k, T, d) tensors, T = ``max_cache_len`` (:func:`max_cache_len`), allocated at the
prefill's first update of each layer and written in place by the decoding step, before which
the whole cache exists; the eager mask has T columns; SDPA's decoding step gets a boolean
(1, 1, 1, T) mask (``static_sdpa_mask``) and makes a float copy of it inside each call
(``sdpa_float_mask``, held until the kernel returns); each layer keeps an 8-byte counter.
Refused: a sliding window (``StaticSlidingWindowLayer``) and SDPA on CUDA.

``cache="fp8"``: transformers' ``QuantizedCache(backend="fp8")`` of ``Fp8QuantizedLayer``
layers (:func:`_fp8_update`): fp8 keys and values with a float32 scale per tensor (the scale
nodes, held by the cache, and in a decoding step ``cache scale`` allocations before it); a
decoding step dequantizes the whole cache for attention and drops the previous fp8 tensors
when ``update`` returns. Refused: autocast (PyTorch cannot ``cat`` fp8 tensors under it) and
sliding-window layers (QuantizedCache refuses them).

``cache="quanto-int4"`` / ``"quanto-int2"``: transformers' ``QuantizedCache(backend="quanto")``
of ``QuantoQuantizedLayer`` layers (:func:`_quanto_update`, :func:`_quanto_plan`; the layout in
:mod:`symmem.rules.quanto`). The prefill quantizes each layer's keys and values whole (the
residual is empty); a decoding step dequantizes them and hands attention the cat of the
dequantized positions, the residual and the new one, then either appends the new position to
the residual or, when the residual reaches ``residual_length`` (R), re-quantizes both cats and
empties the residual (the flush). The cache is periodic in n_g, so a decoding step is derived
for a given residual state: ``policy.residual_position`` P positions in the residual before it
(decoding steps n_g with n_g - 1 = P mod R; P = R - 1, the default, is the flush), Q = s + n_g
- 1 - P quantized positions before it; the formulas require n_g >= P + 1 and R | n_g - 1 - P,
and q_group_size dividing kv heads x positions x head_dim of every tensor quantized, two groups
or more in each (of one, optimum-quanto keeps per-element statistics). Under autocast each
tensor is quantized in its own dtype (Llama's keys float32, its values bfloat16). Refused:
sliding-window layers. CUDA is assumed the same (the same quanto
operators; not measured). The HQQ backend is refused by the policy.

With one kv head (the model binding k = 1) a quantized cache's prefill hands attention the
states through a (b, 1, s, d) view (``kv_one_head``), contiguous, which ``repeat_kv`` expands
without copying, as it does the cache's tensors of the other caches.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import sympy as sp

from ..errors import ConfigError
from ..graph import Graph, Node, Repeat, _defines
from ..policy.attention import resolve
from ..policy.inference import QUANTO_BITS
from ..plan import Free, Compute, Hold, Key, Plan, Alloc
from ..symbols import n_g, s

__all__ = ["prepare", "apply", "step_graph", "cache_nodes", "cache_bytes", "CACHE_HOLDER", "CHECKED_OPS", "STEPS",
           "cache_length", "max_cache_len", "COUNTER_BYTES"]

#: The holder of the KV cache's tensors: the ``Cache`` object, alive for the whole generation.
CACHE_HOLDER = "kv cache"
#: The operators of the families whose generation is measured exact (Llama, Qwen2, Mistral,
#: GPT-2, GPT-NeoX, OPT: ``tests/test_inference_measured.py``); a model with any other is refused.
CHECKED_OPS = frozenset({
    "add", "attention", "carry", "causal_mask", "cumsum_positions", "dropout", "embedding", "gelu", "gelu_new",
    "heads", "input", "layer_norm", "linear", "log_softmax", "merge_heads", "mul", "nll_loss", "offset_ids",
    "ones_like_ids", "pad_labels", "position_embedding", "positions", "relu", "rms_norm", "rope", "rotary", "scale",
    "shift_labels", "silu", "split", "to_float32"})
#: The steps of generation symmem derives, in order.
STEPS = ("prefill", "decode")


def cache_length(step: str, policy=None) -> sp.Expr:
    """Positions a cache tensor holds after ``step``: s after the prefill, s + n_g after the
    decoding step; a static cache's ``max_cache_len`` after either (:func:`max_cache_len`)."""
    if policy is not None and policy.cache == "static":
        return max_cache_len(policy)
    return s if step == "prefill" else s + n_g


def max_cache_len(policy) -> sp.Expr:
    """A static cache's positions: the policy's ``max_cache_len``, else s + n_g (``generate``
    builds its StaticCache with ``max_cache_len=generation_config.max_length``, the prompt's
    length plus ``max_new_tokens``)."""
    return s + n_g if policy.max_cache_len is None else sp.Integer(policy.max_cache_len)


#: Bytes of a StaticLayer's ``cumulative_length`` (``torch.tensor(0, dtype=int)``: an int64).
COUNTER_BYTES = 8


def prepare(graph: Graph, policy) -> Graph:
    """The graph of the policy's inference step (``policy.step``); a training policy's as is."""
    if policy.mode != "inference":
        return graph
    return step_graph(graph, policy.step, policy)


def apply(plan: Plan, graph: Graph, policy) -> Plan:
    """The plan of one inference step: forward only; the cache held to the end; in the
    decoding step the previous cache allocated before it and freed layer by layer (a
    dynamic cache), or the whole cache allocated before it and written in place (static)."""
    if policy.mode != "inference":
        return plan
    if policy.cache in QUANTO_BITS:
        return _quanto_plan(plan, graph, policy)
    static, fp8 = policy.cache == "static", policy.cache == "fp8"
    names = set(cache_nodes(graph))
    sliding = set(cache_nodes(graph, sliding=True))
    scales = set(_nodes(graph, "kv_fp8_scale"))
    # where a decoding step's update returns, dropping the previous fp8 tensors
    returns = {n for n in _nodes(graph, "kv_fp8_dequantize") if n.endswith("v_dequantize")}
    forward, states, pending = [], list(plan.states), []
    counters = policy.device == "cpu" or policy.step == "decode"
    for e in plan.forward:
        if isinstance(e, Compute) and e.node in scales:     # an fp8 cache's scale, kept with it
            forward.append(replace(e, holds=e.holds + (Hold(e.out, CACHE_HOLDER),), role="cache"))
            continue
        if isinstance(e, Compute) and e.node in returns:
            forward += [e, *pending]
            pending = []
            continue
        if isinstance(e, Compute) and e.node in names:
            holds = e.holds + (Hold(e.out, CACHE_HOLDER),)
            new = e.new
            if static and not counters and e.node.endswith("k_cache"):
                # StaticLayer.lazy_initialization: `cumulative_length.to(device)`, a device copy
                new = new + ((Key("cache counter", e.node, e.copy), sp.Integer(COUNTER_BYTES)),)
                holds += (Hold(new[-1][0], CACHE_HOLDER),)
            e = replace(e, holds=holds, new=new, role="cache")
            if static and policy.step == "decode":    # index_copy_ into the cache allocated before
                forward.append(Free(Key("previous cache", e.node, e.copy), e.out_bytes, "cache"))
                forward.append(e)
                continue
            forward.append(e)
            if policy.step == "decode":       # `self.keys = cat(...)` drops the previous keys
                pending.append(Free(Key("previous cache", e.node, e.copy), _previous_bytes(e.out_bytes), "cache"))
                # DynamicSlidingWindowLayer makes both cats before it rebinds keys and values;
                # Fp8QuantizedLayer's locals hold them until it returns
                if not fp8 and (e.node not in sliding or e.node.endswith("v_cache")):
                    forward += pending
                    pending = []
            continue
        forward.append(e)
    counts = _counts(graph)
    if policy.step == "decode":
        first = {}
        for e in plan.forward:
            if isinstance(e, Compute) and e.node in names:
                first.setdefault(e.node, e.out_bytes)
        for name, nbytes in first.items():
            states.append(Alloc(Key("previous cache", name), nbytes if static else _previous_bytes(nbytes), "cache",
                                counts[name]))
        if fp8:                  # each cache tensor's float32 scale, from the prefill
            states += [Alloc(Key("cache scale", name), sp.Integer(4), "cache", counts[name]) for name in first]
    if static and counters:      # made by StaticCache() on the host: the device's on the CPU
        for name in cache_nodes(graph):
            if name.endswith("k_cache"):
                states.append(Alloc(Key("cache counter", name), sp.Integer(COUNTER_BYTES), "cache", counts[name]))
    return _inference_plan(plan, policy, states, forward)


def _inference_plan(plan: Plan, policy, states, forward, note: str = "") -> Plan:
    """``plan`` as an inference step's: these ``states`` and ``forward``, nothing after it."""
    note = (f"inference ({policy.step}): weights frozen, no loss, backward or optimizer step; "
            f"the KV cache holds {cache_length(policy.step, policy)} positions after the step{note}")
    return replace(plan, states=tuple(states), forward=tuple(forward), backward=(), optimizer=(),
                   notes=plan.notes + (note,))


#: The ops of a quanto cache's update whose outputs the cache holds.
QUANTO_HELD = ("kv_quanto_quantize", "kv_quanto_kept")


def _quanto_plan(plan: Plan, graph: Graph, policy) -> Plan:
    """The plan of a quanto cache's step (:func:`_quanto_update`): the quantized tensors and
    the residual held by the cache. Before a decoding step with P residual positions, each
    layer's quantized keys and values of Q = s + n_g - 1 - P positions and residual of P exist;
    an ordinary step keeps the quantized tensors (freed just before the ``kv_quanto_kept``
    nodes that stand for them) and frees each previous residual after its cat; the flush
    frees each previous quantized tensor after its re-quantization, then both residuals
    (``self.keys``, then ``self.values``, rebound to empty tensors)."""
    p, decode = policy.residual_position, policy.step == "decode"
    nodes = {n.name: n for x in graph.graphs() for n in x.items if isinstance(n, Node)}
    made = {}
    for e in plan.forward:
        if isinstance(e, Compute):
            made.setdefault(e.node, e.out_bytes)

    def previous(node) -> tuple[str, sp.Expr]:
        """What a held node replaces: its kind and bytes before the step."""
        if node.op == "kv_quanto_kept":
            return "previous cache", made[node.name]
        if node.op == "kv_quanto_quantize":
            return "previous cache", sp.expand(made[node.name].xreplace({n_g: n_g - p - 1}))
        return "previous residual", sp.expand(made[node.name] * p / (p + 1))

    def residual(node) -> sp.Expr:
        """The flush's previous residual: the returned cat's (s + n_g positions) P positions."""
        return sp.expand(made[node.inputs[0]].xreplace({n_g: p - s}))
    forward, pending = [], []
    held = _quanto_held(graph)
    for e in plan.forward:
        node = nodes.get(e.node) if isinstance(e, Compute) else None
        if node is None or node.name not in held:
            forward.append(e)
            continue
        e = replace(e, holds=e.holds + (Hold(e.out, CACHE_HOLDER),), role="cache")
        if not decode:
            forward.append(e)
            continue
        kind, nbytes = previous(node)
        free = Free(Key(kind, e.node, e.copy), nbytes, "cache")
        forward += [free, e] if node.op == "kv_quanto_kept" else [e, free]
        if node.op == "kv_quanto_quantize":      # the flush empties the residual after the values'
            pending.append(Free(Key("previous residual", e.node, e.copy), residual(node), "cache"))
            if e.node.endswith("v_quantized"):
                forward += pending
                pending = []
    counts, states = _counts(graph), list(plan.states)
    for node in (nodes[name] for name in held) if decode else ():
        kind, nbytes = previous(node)
        states.append(Alloc(Key(kind, node.name), nbytes, "cache", counts[node.name]))
        if node.op == "kv_quanto_quantize":
            states.append(Alloc(Key("previous residual", node.name), residual(node), "cache", counts[node.name]))
    after = ("all quantized" if policy.quanto_flush else f"s + n_g - {p + 1} quantized, {p + 1} in the residual")
    return _inference_plan(plan, policy, states, forward,
                           f" ({after}; the decoding steps n_g with n_g - 1 = {p} mod {policy.residual_length})"
                           if decode else " (all quantized)")


def _quanto_held(graph: Graph) -> tuple[str, ...]:
    """The nodes of a quanto cache's update whose outputs the cache holds, in order."""
    return tuple(n.name for g in graph.graphs() for n in g.items if isinstance(n, Node)
                 and (n.op in QUANTO_HELD or n.op == "kv_quanto_cat" and n.attr("residual")))


def _previous_bytes(nbytes) -> sp.Expr:
    """A cache tensor's bytes one position shorter (s + n_g - 1 positions for s + n_g)."""
    return sp.expand(sp.sympify(nbytes).xreplace({n_g: n_g - 1}))


def _counts(graph: Graph) -> dict:
    """How many times each node runs: a repeated block's once per iteration."""
    out = {}

    def walk(g: Graph, count):
        for item in g.items:
            if isinstance(item, Repeat):
                walk(item.body, count * item.count)
            else:
                out[item.name] = count
    walk(graph, sp.Integer(1))
    return out


def cache_bytes(plan: Plan, graph: Graph) -> sp.Expr:
    """The KV cache after the plan's step: each cache node's tensor once per iteration of its
    block (``2 L b k T d`` bytes per element for a Llama-type model, T the cached positions;
    1 byte an element in fp8), a static cache's counters (8 bytes a layer) and an fp8 cache's
    scales (4 bytes a tensor); a quanto cache's quantized tensors and residual."""
    names = set(cache_nodes(graph)) | set(_nodes(graph, "kv_fp8_scale")) | set(_quanto_held(graph))
    counts, seen = _counts(graph), {}
    for e in plan.forward:
        if isinstance(e, Compute) and e.node in names:
            seen.setdefault(e.node, e.out_bytes * counts[e.node])
    kept = [a.nbytes * a.count for a in plan.states
            if isinstance(a, Alloc) and a.key.kind in ("cache counter", "cache scale")]
    return sp.expand(sp.Add(*seen.values(), *kept))


def cache_nodes(graph: Graph, sliding: bool = False) -> tuple[str, ...]:
    """The ``kv_cache`` nodes of a graph, bodies included, in order (``sliding``: those of
    sliding-window attention only)."""
    return tuple(n.name for g in graph.graphs() for n in g.items if isinstance(n, Node) and n.op == "kv_cache"
                 and (not sliding or n.attr("window") is not None))


def _nodes(graph: Graph, op: str) -> tuple[str, ...]:
    """The names of a graph's ``op`` nodes, bodies included, in order."""
    return tuple(n.name for g in graph.graphs() for n in g.items if isinstance(n, Node) and n.op == op)


# ----- the graph of a step ----------------------------------------------------------------------
def step_graph(graph: Graph, step: str, policy=None) -> Graph:
    """``graph`` (a training forward) as the graph of inference step ``step`` (prefill or
    decode): the loss removed, a cache before each attention node (``policy.cache``: dynamic,
    the default, static, fp8 or quanto), and for the decoding step one token's shapes."""
    if step not in STEPS:
        raise ConfigError("inference step", step, f"one of {', '.join(STEPS)}")
    if not any(isinstance(n, Node) and n.op == "attention" for g in graph.graphs() for n in g.items):
        raise ConfigError("mode", "inference", "a model with attention layers (a causal LM) to cache keys and "
                                               "values for", "Use --mode training for this model.")
    others = sorted({n.op for x in graph.graphs() for n in x.items if isinstance(n, Node)} - CHECKED_OPS)
    if others:
        raise ConfigError("mode", "inference", "a model of the operators whose inference is measured exact (the "
                                               "llama, qwen2, mistral, gpt2, gpt_neox and opt families)",
                          f"This model also runs {', '.join(others)}: its generation is not measured, so symmem "
                          "refuses it rather than guess; use --mode training.")
    g = _without_loss(graph)
    static = policy is not None and policy.cache == "static"
    length = cache_length(step, policy)
    subs = {s: sp.Integer(1)} if step == "decode" else {}
    kernel = resolve(policy.attention, graph.attention) if policy is not None else "eager"
    if static and kernel != "eager" and policy.device != "cpu":
        raise ConfigError("cache", "static", f"--attention eager or --device cpu with a static cache (not {kernel} on "
                                             f"{policy.device})",
                          "A StaticCache's decoding step hands SDPA a boolean mask over max_cache_len positions, "
                          "which makes CUDA leave the flash kernel for mem-efficient attention with a padded float "
                          "mask: not modelled (measured on the CPU only). Use --attention eager.")
    # SDPA gets a materialised boolean mask in a static cache's decoding step
    sdpa_mask = static and step == "decode" and kernel != "eager"
    fp8 = policy is not None and policy.cache == "fp8"
    if fp8 and policy.prec.autocast:
        raise ConfigError("cache", "fp8", f"a model in one dtype, not --precision {policy.precision} (autocast)",
                          "Under torch.autocast, Fp8QuantizedLayer.update's torch.cat of float8 tensors fails in "
                          "autocast's type promotion ('Unexpected floating ScalarType in at::autocast::prioritize', "
                          "on the CPU and on CUDA alike), so transformers cannot generate so. Use --precision bf16 "
                          "(a bfloat16 model) or fp32, or --cache dynamic.")
    quanto = _quanto_spec(policy)
    out = _rebuilt(g, subs, length, cache_length(step), None, static, sdpa_mask, fp8, quanto)
    if step == "prefill" and (policy is None or policy.logits == "last"):
        _last_position_logits(out)
    windows = {n.attr("window") for x in out.graphs() for n in x.items
               if isinstance(n, Node) and n.op == "attention" and n.attr("window") is not None}
    if static and windows:
        raise ConfigError("cache", "static", "a model without sliding-window attention (a StaticCache of "
                                             "StaticLayer layers)",
                          f"This model's attention has a sliding window ({min(windows)}): transformers then makes "
                          "StaticSlidingWindowLayer layers, which symmem does not model; use --cache dynamic.")
    if (fp8 or quanto) and windows:
        raise ConfigError("cache", policy.cache, "a model without sliding-window attention (transformers' "
                                                 "QuantizedCache takes full-attention layers only)",
                          f"This model's attention has a sliding window ({min(windows)}), which QuantizedCache "
                          "refuses; use --cache dynamic.")
    if quanto and step == "decode":        # the steps n_g = P + 1, P + 1 + R, P + 1 + 2R, ...
        p, r = quanto.position, policy.residual_length
        why = (f"decoding step n_g finds (n_g - 1) mod residual_length positions in the residual; the formulas are "
               f"for residual_position {p}, the steps n_g = {p + 1}, {p + 1 + r}, {p + 1 + 2 * r}, ...: give "
               f"--residual-position (n_g - 1) mod {r} for another n_g")
        out.require(p + 1, n_g, why)
        out.require(r, n_g - 1 - p, why, "divides")
    if static and policy.max_cache_len is not None:
        out.require(s + n_g, length, "the prompt and the tokens generated fit in the static cache's "
                                     "max_cache_len positions (StaticLayer.update writes past its end otherwise)")
    for w in sorted(windows):
        out.require(s + n_g, w - 1, f"fewer positions cached than the sliding window ({w}): transformers' "
                                    "DynamicSlidingWindowLayer then keeps every position, as modelled; a longer "
                                    "generation keeps the last window - 1 only (not modelled)")
    for r in graph.requirements:            # what bounds the prompt bounds every position cached
        if r.lhs == s and r.kind == "at most":
            out.require(s + n_g, r.rhs, r.reason)
    return out


def _last_position_logits(g: Graph) -> None:
    """``generate``'s ``logits_to_keep=1``: the output head (the last top-level linear node the
    forward returns) reads the last position of its input (``last_position``, a view) and makes
    (b, 1, V) logits."""
    heads = [i for i, n in enumerate(g.items) if isinstance(n, Node) and n.op == "linear" and n.name in g.outputs]
    if not heads:
        raise ConfigError("logits", "last", "a causal LM whose forward returns its output head's logits",
                          "Use --logits all for this model.")
    i = heads[-1]
    head = g.items[i]
    x = head.inputs[0]
    xs = g._lookup_shape(x)
    name = f"{head.name}/last_position"
    last = Node(name, "last_position", (x,), shape=(xs[0], sp.Integer(1), *xs[2:]))
    new = replace(head, inputs=(name, *head.inputs[1:]), shape=(head.shape[0], sp.Integer(1), *head.shape[2:]))
    if any(head.name in n.inputs for n in g.items[i + 1:] if isinstance(n, Node)):
        raise ConfigError("logits", "last", "a model whose logits are returned as the output head makes them",
                          f"{g.name!r} computes on its logits after {head.name!r}: use --logits all.")
    g.items[i:i + 1] = [last, new]
    g._shapes[name], g._shapes[head.name] = last.shape, new.shape
    g._taken.add(name)


def _without_loss(graph: Graph) -> Graph:
    """The graph without the top-level nodes the outputs do not need (the loss, the labels): a
    node is needed when a needed node reads it or the model's code holds it until one runs."""
    needed, before = set(graph.outputs), None
    while needed != before:     # a local held until a needed node is made too (Qwen2's unread full mask)
        before = set(needed)
        needed |= {v for v, u in graph.locals if u in needed}
        for item in reversed(graph.items):
            defined = {n for n, _ in _defines(item)}
            if defined & needed:
                if isinstance(item, Repeat):
                    needed |= set(item.carried) | set(item.body.externals)
                else:
                    needed |= set(item.inputs)
    top = {item.name for item in graph.items if isinstance(item, Node)}

    def rewrite(node, sub) -> bool:           # True, adding nothing: removed
        return node.name in top and node.name not in needed and node.op != "input"
    out = graph.rewritten(rewrite)
    keep = {n for g in out.graphs() for n in g._shapes}
    # a local held until a removed node (the loss) is held until the forward ends instead
    out.locals = tuple((v, u) for v, u in out.locals if v in keep and u in keep)
    return out


def _root(g: Graph) -> Graph:
    while g.parent is not None:
        g = g.parent
    return g


def _rebuilt(g: Graph, subs: dict, length, seen, parent, static: bool = False, sdpa_mask: bool = False,
             fp8: bool = False, quanto=None) -> Graph:
    """A copy of ``g`` with every shape substituted (``subs``), the cache nodes inserted
    (``static``: a StaticCache's; ``fp8``: an fp8 QuantizedCache's, :func:`_fp8_update`;
    ``quanto``: a quanto QuantizedCache's, :func:`_quanto_update`) and the causal mask's columns set to the cache's length
    (``sdpa_mask``: SDPA's boolean mask, and its float copy inside each attention call);
    OPT's position mask and ids over the ``seen`` positions (s + n_g in the decoding step,
    whatever the cache), of which the step embeds its own (a decoding step: ``subs``)."""
    out = Graph(g.name, dict(g.bindings), parent=parent, externals=g.externals, outputs=g.outputs,
                requirements=g.requirements, attention=g.attention)
    out._taken = set(g._taken) if parent is None else parent._taken
    out._params = dict(g._params)
    moved: dict = {}
    holds: list = []

    def sub(shape):
        return tuple(sp.sympify(d).xreplace(subs) for d in shape)

    def put(item):
        out.items.append(item)
        for n, sh in _defines(item):
            out._shapes[n] = sh
        out._taken.add(item.name)

    def put_new(item) -> str:
        put(item)
        return item.name

    for item in g.items:
        if isinstance(item, Repeat):
            body = _rebuilt(item.body, subs, length, seen, out, static, sdpa_mask, fp8, quanto)
            # `hidden_states = layer(hidden_states)`: the model's loop keeps each layer's input
            # until the layer returns (in training the saved tensors outlive it anyway)
            body.locals = body.locals + tuple((c, o) for c, o in zip(item.carries, item.output))
            put(replace(item, body=body, shape=sub(item.shape)))
            for n in item.names:
                out._shapes[n] = sub(item.shape)
            continue
        attrs = dict(item.attrs)
        if item.op == "causal_mask":
            attrs["kv_len"] = length
        if item.op == "ones_like_ids":          # torch.ones(b, past_seen_tokens + q)
            attrs["length"] = seen
            if static and subs:                 # a decoding step's StaticCache counts in a tensor
                name = put_new(Node(f"{item.name}/seq_length", "static_seq_length", item.inputs[:1], shape=()))
                holds += [(name, u) for v, u in g.locals if v == item.name]
        if item.op == "offset_ids":             # position_ids[:, past_seen_tokens:] + offset
            attrs["columns"] = sub(item.shape)[-1]
        if item.op == "dropout" or item.op == "attention" and "dropout" in attrs:
            attrs["p" if item.op == "dropout" else "dropout"] = 0.0     # model.eval(): dropout is x itself
        if item.op == "attention" and sp.sympify(attrs.get("groups", 1)).xreplace(_root(g).bindings) == 1:
            attrs["groups"] = 1        # repeat_kv returns its input itself when n_rep == 1
        if item.op == "input" and "shape" in attrs:
            attrs["shape"] = sub(attrs["shape"])
        node = replace(item, shape=sub(item.shape), attrs=tuple(sorted(attrs.items())))
        if item.op in ("ones_like_ids", "cumsum_positions"):     # (b, positions seen)
            node = replace(node, shape=(*node.shape[:-1], seen))
        if item.op == "causal_mask":           # (b, 1, q, positions cached)
            node = replace(node, shape=(*node.shape[:3], length))
            if sdpa_mask:
                node = replace(node, op="static_sdpa_mask", shape=(sp.Integer(1), sp.Integer(1), node.shape[2], length))
        if item.op == "attention" and (fp8 or quanto):
            q, key, v, *rest = node.inputs
            update = _fp8_update if fp8 else partial(_quanto_update, spec=quanto)
            returned, held = update(out, put_new, _base(node.name), key, v, length, bool(subs))
            moved.update(returned)
            holds += held
            node = replace(node, inputs=(q, returned.get(key, key), returned.get(v, v), *rest))
        elif item.op == "attention":
            q, key, v, *rest = node.inputs
            base = _base(node.name)
            cached = []
            for value, which in ((key, "k"), (v, "v")):
                shape = out._lookup_shape(value)
                name = f"{base}{which}_cache"
                # one kv head (multi-query): the model's own 1, so that repeat_kv sees a view
                heads = _cached_heads(out, shape)
                put(Node(name, "kv_cache", (value,), attrs=(("kv_heads", heads), ("length", length),
                                                            ("static", static), ("which", which),
                                                            ("window", attrs.get("window"))),
                         shape=(shape[0], heads, length, shape[3])))
                moved[value] = name
                cached.append(name)
            # `key_states, value_states = cache.update(key_states, value_states)`: the caller's
            # keys live until update returns, after the values' cat
            holds.append((key, cached[1]))
            if sdpa_mask:
                (mask,) = rest
                qs = out._lookup_shape(q)
                fm = put_new(Node(f"{base}sdpa_float_mask", "sdpa_float_mask", (mask, q),
                                  shape=(qs[0], sp.Integer(1), qs[2], length)))
                holds.append((fm, node.name))
            node = replace(node, inputs=(q, *cached, *rest))
        put(node)
    out.locals = tuple((moved.get(v, v), u) for v, u in g.locals) + tuple(holds)
    return out


def _base(attention: str) -> str:
    """The prefix of the nodes an attention node's cache update adds (its block's path)."""
    return attention.rsplit("/", 1)[0] + "/" if "/" in attention else attention + "/"


def _one_head(g: Graph, put_new, base: str, pairs) -> dict:
    """A quantized cache's prefill quantizes the states and returns them to attention: for one
    kv head (the model binding k = 1) through their (b, 1, s, d) view (``kv_one_head``, which
    ``repeat_kv`` expands without a copy); ``{states: view}``."""
    out = {}
    for states, which in pairs:
        b, heads, q, d = g._lookup_shape(states)
        if heads != 1 and _cached_heads(g, (b, heads, q, d)) == 1:
            out[states] = put_new(Node(f"{base}{which}_one_head", "kv_one_head", (states,),
                                       shape=(b, sp.Integer(1), q, d)))
    return out


def _cache_shape(g: Graph, states: str, positions) -> tuple:
    """A cache tensor of ``positions`` for the (b, k, q, d) ``states``: (b, k, positions, d)."""
    sh = g._lookup_shape(states)
    return (sh[0], _cached_heads(g, sh), positions, sh[3])


def _cached_heads(g: Graph, shape):
    """The kv heads of a cache tensor as the model binds them: one kv head (multi-query) is
    the model's own 1, so that repeat_kv sees a view."""
    return 1 if sp.sympify(shape[1]).xreplace(_root(g).bindings) == 1 else shape[1]


def _fp8_update(g: Graph, put_new, base: str, key: str, value: str, length, decode: bool):
    """``Fp8QuantizedLayer.update`` (transformers 5.24 ``cache_utils.py``) for one attention
    node: the nodes it adds to ``g`` (``put_new``), then ``(returned, held)``: what the
    attention reads instead of the keys and values it was handed, and the locals update holds.

    - prefill (``lazy_initialization``): keys, then values, calibrated (``kv_fp8_scale``, kept
      by the cache) and quantized whole into the cache (``kv_cache`` with ``fp8="calibrated"``);
      update returns the states themselves, so attention reads them as in training;
    - decoding step: the new keys, then values, quantized with the prefill's scales
      (``kv_fp8_quantize``, locals of update until it returns), each cache's fp8 cat
      (``fp8="append"``), then each dequantized whole (``kv_fp8_dequantize``), which attention
      reads; the states handed in, the quantized new positions and (in the plan, from the
      inference pass) the previous fp8 tensors live until update returns, after the values'
      dequantization."""
    pairs = ((key, "k"), (value, "v"))

    def cache(states, which, inputs, fp8):
        shape = g._lookup_shape(states)
        heads = _cached_heads(g, shape)
        return put_new(Node(f"{base}{which}_cache", "kv_cache", inputs,
                            attrs=(("fp8", fp8), ("kv_heads", heads), ("length", length), ("which", which)),
                            shape=(shape[0], heads, length, shape[3])))
    if not decode:
        returned = _one_head(g, put_new, base, pairs)
        for states, which in pairs:
            states = returned.get(states, states)
            scale = put_new(Node(f"{base}{which}_scale", "kv_fp8_scale", (states,), shape=()))
            cache(states, which, (states, scale), "calibrated")
        return returned, []
    new = [put_new(Node(f"{base}{which}_new", "kv_fp8_quantize", (states,), shape=g._lookup_shape(states)))
           for states, which in pairs]
    cached = [cache(states, which, (n,), "append") for (states, which), n in zip(pairs, new)]
    returned = {states: put_new(Node(f"{base}{which}_dequantize", "kv_fp8_dequantize", (c, states),
                                     shape=g._lookup_shape(c)))
                for (states, which), c in zip(pairs, cached)}
    end = returned[value]
    return returned, [(key, end), (value, end), *((n, end) for n in new)]


@dataclass(frozen=True)
class QuantoSpec:
    """A quanto cache as a step's graph needs it: the codes' ``bits``, ``q_group_size``, the
    positions the residual holds before the decoding step (``position``) and whether that step
    re-quantizes everything (``flush``: the residual then reaches ``residual_length``)."""
    bits: int
    group: int
    position: int
    flush: bool


def _quanto_spec(policy) -> QuantoSpec | None:
    """The policy's quanto cache (None for another cache)."""
    if policy is None or policy.cache not in QUANTO_BITS:
        return None
    return QuantoSpec(QUANTO_BITS[policy.cache], policy.q_group_size, policy.residual_position, policy.quanto_flush)


def _quanto_update(g: Graph, put_new, base: str, key: str, value: str, length, decode: bool, spec: QuantoSpec):
    """``QuantizedLayer.update`` (transformers 5.25 ``cache_utils.py``) of a quanto cache for
    one attention node, as :func:`_fp8_update`: the nodes it adds, then ``(returned, held)``.

    - prefill (``lazy_initialization``): keys, then values, quantized whole
      (``kv_quanto_quantize``, kept by the cache; the residual is an empty tensor); update
      returns the states themselves;
    - decoding step, with P = ``spec.position`` positions in the residual before it and Q =
      s + n_g - 1 - P quantized: the keys', then the values' quantized tensors dequantized
      (``kv_quanto_dequantize``, locals until update returns), each cat of the dequantized
      positions, the residual and the new one (``kv_quanto_cat``, s + n_g positions), which
      attention reads; then either the residual's cat with the new position
      (``kv_quanto_cat`` with ``residual``, P + 1 positions; the quantized tensors kept as
      they were, ``kv_quanto_kept``) or, in the flush step (P + 1 = residual_length), both
      returned cats quantized (``kv_quanto_quantize``), each replacing the previous quantized
      tensor, and the residual emptied (the inference pass frees what they replace)."""
    pairs = ((key, "k"), (value, "v"))
    attrs = (("bits", spec.bits), ("group", spec.group))

    def node(states, which, suffix, op, inputs, positions, extra=()):
        b, heads, _, d = shape = _cache_shape(g, states, positions)
        if op != "kv_quanto_cat":
            root = _root(g)
            root.require(spec.group, heads * d * positions, "q_group_size divides each batch row of a quantized "
                         "cache tensor (kv heads x positions x head_dim): optimum-quanto's group() refuses it "
                         "otherwise", "divides")
            root.require(2 * spec.group, b * heads * d * positions, "a quantized cache tensor holds two groups or "
                         "more (b x kv heads x positions x head_dim >= 2 q_group_size): of a single group "
                         "optimum-quanto keeps a scale and shift per element (not modelled)")
        return put_new(Node(f"{base}{which}_{suffix}", op, inputs, attrs=attrs + extra, shape=shape))
    if not decode:
        returned = _one_head(g, put_new, base, pairs)
        for states, which in pairs:
            node(states, which, "quantized", "kv_quanto_quantize", (returned.get(states, states),), length)
        return returned, []
    quantized = length - 1 - spec.position
    if not spec.flush:
        for states, which in pairs:
            node(states, which, "quantized", "kv_quanto_kept", (states,), quantized)
    dequantized = [node(states, which, "dequantize", "kv_quanto_dequantize", (states,), quantized)
                   for states, which in pairs]
    returned = {states: node(states, which, "returned", "kv_quanto_cat", (d, states), length)
                for (states, which), d in zip(pairs, dequantized)}
    if spec.flush:
        last = [node(states, which, "quantized", "kv_quanto_quantize", (returned[states],), length)
                for states, which in pairs]
    else:
        last = [node(states, which, "residual", "kv_quanto_cat", (states,), spec.position + 1,
                     (("residual", True),)) for states, which in pairs]
    end = last[-1]
    return returned, [(key, end), (value, end), *((d, end) for d in dequantized)]
