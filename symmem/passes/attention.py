"""The attention kernel: each ``attention`` node of the graph replaced by its kernel's
operators, as a decomposition in torch.fx replaces a call by the calls it makes.

A model writes its attention core as one node, ``g.add("attention", q, k, v, mask,
dropout=p, causal=True, weights_until=...)``, whose output is the (b, a, s, d) context.
:func:`prepare` resolves the policy's kernel (:mod:`symmem.policy.attention`: ``sdpa``
picks its backend per device, dtype and dropout as PyTorch does) and rewrites the node:

- ``eager``: k and v repeated to q's heads where the node has ``groups`` > 1 (grouped-query
  attention, transformers' ``repeat_kv``), ``matmul(q, k^T)``, ``* scaling`` (a Python
  number: an 8-byte wrapped scalar on the CPU), ``+ mask`` (each input after v added in
  order: T5's position bias, then its mask), softmax (in float32 with
  ``softmax_float32``), the cast to the value's dtype (the query's with
  ``probs_like="query"``: Llama's; none with ``probs_like="keep"``: BERT's and T5's), dropout (the
  repeated k and v live until the node ``returns_after`` names, where the model's eager
  function returns), ``matmul(probs, v)``; the probabilities are returned and kept by the model until
  ``weights_until`` has run (Hugging Face's blocks hold ``attn_weights``);
- ``math`` (``_scaled_dot_product_attention_math``): half inputs upcast to float32 (on
  the CPU), q and k each scaled by ``sqrt(scale)`` (a C++ scalar: nothing saved), the
  causal mask built as an (s, s) additive tensor (or, with ``bias_mask``, T5's position
  bias made the float mask: :func:`~symmem.rules.relative.bias_mask_rule`), ``matmul``,
  ``+ mask``, softmax, dropout, ``matmul(probs, v)``, the output cast back;
- ``flash``, ``mem-efficient``, ``cudnn``: one ``sdpa_kernel`` node (its rule in
  :mod:`symmem.rules.attention`); with ``bias_mask`` on CUDA (T5), the mem-efficient kernel
  with the position bias as its ``attn_bias`` and its gradient (:func:`_biased`).

Every kernel but eager is called with ``is_causal=True`` and no mask: transformers'
``create_causal_mask`` returns None for them when nothing is padded, so the model's
``causal_mask`` node is removed too. Two cases get a boolean mask instead (:func:`_masked`):
a sliding window from s = window on (the graph :func:`past_window` marks; below the window
the formulas require s < window) and a padded batch (BERT's ``padded``); SDPA converts the
mask to a float copy in each layer, and grouped-query k and v are repeated. Eager attention
and the masked path repeat k and v by the groups the model's bound a/k gives (:func:`_groups`:
none at k = a, as ``repeat_kv`` returns its input), each case under its requirement. The replacement's nodes keep the attention node's
scope attributes (``recompute="attention"`` for selective recomputation). A node with
``kernels`` (a tuple of kernel names) is modelled for those only: another is refused.
"""
from __future__ import annotations

from dataclasses import replace

import sympy as sp

from ..errors import ConfigError
from ..graph import Graph
from ..policy.attention import ATTENTION, check_kernel, resolve, sdpa_backend
from ..symbols import symbol
from .regions import mark

__all__ = ["prepare", "apply", "kernel_of", "kernels", "OWN_ATTRS", "window_of", "past_window"]

#: The attention node's own attributes (the others are scope attributes its replacement keeps;
#: it adds ``attention_kernel``, the kernel that made it).
OWN_ATTRS = ("dropout", "causal", "weights_until", "groups", "probs_like", "softmax_float32", "returns_after",
             "window", "padded", "kernels", "bias_mask", "window_masked")


def kernel_of(policy, dtype: str, dropout, head_dim, model_choice=None) -> tuple[str, tuple]:
    """The concrete kernel ``policy.attention`` runs for one attention node (``auto``: the
    model's own, ``model_choice``, else sdpa), and what it needs of a symbolic head
    dimension (:class:`~symmem.policy.attention.HeadDim`)."""
    kernel = resolve(policy.attention, model_choice)
    if kernel == "sdpa":
        return sdpa_backend(policy.device, dtype, dropout, head_dim)
    return kernel, check_kernel(kernel, policy.device, dtype, head_dim)


def prepare(graph: Graph, policy) -> Graph:
    """The graph with every attention node replaced by the operators of its kernel."""
    base = policy.ctx()
    needs = []
    masks_read_elsewhere = _read_by_other_ops(graph)

    def rewrite(node, sub: Graph) -> bool:
        if node.op == "causal_mask":      # removed where only attention reads it: is_causal instead
            if not _masks_window(policy, graph) or not node.attr("window_masked"):
                return (resolve(policy.attention, graph.attention) != "eager"
                        and node.name not in masks_read_elsewhere)
            # from s = window on: sdpa_mask's boolean (1, 1, s, s) mask, expanded to the batch
            attrs = {key: value for key, value in node.attrs if key not in ("window_masked", "kv_len")}
            m = sub.add("window_mask", *node.inputs, **attrs, name=node.name + "/bool")
            sub.add("mask_expand", m, *node.inputs, **attrs, name=node.name)
            return True
        if node.op == "padding_mask" and node.attr("padded") and not node.attr("boolean"):
            if resolve(policy.attention, graph.attention) == "eager":
                return False
            # SDPA gets sdpa_mask's boolean (b, 1, s, s) mask (no eager_mask after it)
            sub.add("padding_mask", *node.inputs, **{**dict(node.attrs), "boolean": True}, name=node.name)
            return True
        if node.op != "attention":
            return False
        q, k, v = node.inputs[:3]
        p = node.attr("dropout", 0.0)
        d = sp.sympify(sub.shape(q)[-1])
        ctx = base.float32() if node.attr("fp32") else base        # a module kept in float32
        kernel, head_needs = kernel_of(policy, ctx.act_name, p, d.xreplace(graph.bindings), graph.attention)
        if (node.attr("bias_mask") and policy.device == "cuda" and kernel in ("flash", "cudnn")
                and resolve(policy.attention, graph.attention) == "sdpa"):
            # T5's float attn_mask: flash takes none (sdp_utils.cpp's check_for_attn_mask), so
            # PyTorch runs the mem-efficient kernel, which takes the mask and its gradient
            kernel = "mem-efficient"
            head_needs = check_kernel(kernel, policy.device, ctx.act_name, d.xreplace(graph.bindings))
        if node.attr("kernels") and kernel not in node.attr("kernels"):
            here = [k for k in node.attr("kernels") if policy.device in ATTENTION.lookup(k).devices]
            raise ConfigError("attention", kernel, f"a kernel symmem models for {graph.name!r}'s attention "
                              f"on {policy.device} ({', '.join(here)})",
                              f"Use --attention {node.attr('kernels')[0]} (attn_implementation="
                              f"\"{node.attr('kernels')[0]}\").")
        masked = node.attr("window") is not None and _masks_window(policy, graph)
        if node.attr("padded") and kernel != "eager":
            if resolve(policy.attention, graph.attention) == "flash" and policy.device == "cuda":
                raise ConfigError("attention", kernel, "eager or sdpa attention for batches with padding "
                                  "(padded: true)", "flash_attention_2 unpads the batch into variable-length "
                                  "sequences, which symmem does not model: use --attention sdpa or eager.")
        with_mask = (masked and node.attr("window_masked")) or (node.attr("padded") and kernel != "eager")
        if with_mask and policy.device == "cuda" and kernel in ("flash", "cudnn"):
            # SDPA's flash kernel takes no attn_mask (sdp_utils.cpp's check_for_attn_mask):
            # PyTorch falls back to the mem-efficient one, which takes the float mask
            kernel = "mem-efficient"
            head_needs = check_kernel(kernel, policy.device, ctx.act_name, d.xreplace(graph.bindings))
        needs.extend(n.requirement(d) for n in head_needs)
        if kernel == "eager" or with_mask:
            node, need = _groups(node, graph.bindings)
            if need:
                needs.append(need)
        if masked:
            needs.append(_window_requirement(sub.shape(q)[-2], node.attr("window"), node.attr("window_masked")))
        biased = node.attr("bias_mask") and kernel == "mem-efficient"
        if biased:
            needs.append((16, sub.shape(k)[-2], "the keys' sequence is a multiple of 16: the mem-efficient kernel "
                                               "pads a mask's last dimension to one (preprocess_mask's pad_bias, "
                                               "copies of the batch-expanded mask in forward and backward), "
                                               "which is not modelled", "divides"))
        scope = {key: value for key, value in node.attrs if key not in OWN_ATTRS}
        with sub.scope(**scope, attention_kernel=kernel):
            if biased:
                _biased(node, sub, ctx)
            elif with_mask:
                _masked(node, sub, ctx, kernel)
            else:
                KERNELS[kernel](node, sub, ctx)
        return True

    out = graph.rewritten(rewrite)
    for lhs, rhs, reason, kind in dict.fromkeys(needs):
        out.require(lhs, rhs, reason, kind=kind)
    return out


def _masks_window(policy, graph: Graph) -> bool:
    """Does a sliding window change what the kernel keeps? Every kernel but eager (which
    gets the same (b, 1, s, s) float mask whatever the window: its values differ) and
    CUDA's flash (``flash_attention_2``, which takes the window as an argument)."""
    kernel = resolve(policy.attention, graph.attention)
    return kernel != "eager" and not (kernel == "flash" and policy.device == "cuda")


def _window_requirement(seq, window, past: bool) -> tuple:
    """Where the formulas of an SDPA kernel hold for a sliding window of ``window``: below it
    (``past`` False), transformers calls SDPA with ``is_causal`` and no mask
    (``_ignore_causal_mask_sdpa``); from s = window on (``past`` True), ``sdpa_mask``
    materialises the window's boolean mask (:func:`_masked`). An estimate derives
    the second region when it is asked for it (:attr:`symmem.engine.Estimate.past_window`)."""
    if past:
        return (window, seq, f"from the sliding window ({window}) on, transformers passes SDPA the window's "
                             "boolean mask; a shorter sequence gets is_causal and no mask (the estimate's "
                             "other region)", "at most")
    return (seq, window - 1, f"the sequence is shorter than the sliding window ({window}): transformers then "
                             "calls SDPA with is_causal and no mask; from the window on it materialises the "
                             "window's mask (the estimate's past_window region, which est.at uses by itself)",
            "at most")


def _groups(node, bindings) -> tuple:
    """The attention node with the groups transformers' ``repeat_kv`` really repeats by, and
    the requirement that keeps that true (None where groups are a number or unbound).

    ``repeat_kv(x, n_rep)`` returns x itself when n_rep == 1 and copies otherwise, so a
    symbolic a/k cannot stand for both: the model's bound values choose. Multi-head (a/k
    binds to 1): groups 1 (no copy), under the requirement a <= k (with k | a: k = a);
    grouped-query: the copies, under k <= a - 1. A requirement, not a Piecewise, because the
    two cases differ in which tensors exist and live how long (the copies and their
    gradients), not in one size: two graphs, each with its region."""
    n = sp.sympify(node.attr("groups", 1))
    if n.is_number:
        return node, None
    subs = {symbol(key) if isinstance(key, str) else key: value for key, value in bindings.items()}
    bound = n.xreplace(subs)
    if not bound.is_number:
        return node, None
    heads, kv = sp.fraction(n)
    if bound == 1:
        attrs = tuple(sorted({**dict(node.attrs), "groups": 1}.items()))
        return replace(node, attrs=attrs), (heads, kv, "multi-head attention (k = a): transformers' repeat_kv "
                                            "returns k and v themselves, where fewer kv heads are copied to a "
                                            "heads; build the model with that num_key_value_heads", "at most")
    return node, (kv, heads - 1, "grouped-query attention (k < a): transformers' repeat_kv copies k and v to a "
                                 "heads, where with k = a it returns them themselves; build the model with "
                                 "num_key_value_heads = num_attention_heads", "at most")


def _windowed(graph: Graph) -> list:
    """The graph's attention nodes with a sliding window."""
    return [item for g in graph.graphs() for item in g.items
            if getattr(item, "op", None) == "attention" and item.attr("window") is not None]


def window_of(graph: Graph):
    """The sliding window of the graph's attention (None: none)."""
    nodes = _windowed(graph)
    return nodes[0].attr("window") if nodes else None


def past_window(graph: Graph, policy):
    """The model from s = its sliding window on, where transformers passes SDPA the window's
    boolean mask: ``graph`` with the window's attention nodes and the causal mask they read
    marked ``window_masked`` (layers without the window keep ``is_causal``); None where the
    window changes nothing the kernel keeps (eager attention, CUDA's flash_attention_2, no
    window, inference) or that is marked already."""
    nodes = _windowed(graph)
    if (not nodes or any(n.attr("window_masked") for n in nodes) or policy.mode != "training"
            or not _masks_window(policy, graph)):
        return None
    # the masks the window's attention reads (Qwen2 also makes a full one, None for SDPA)
    masks = {n.inputs[3] for n in nodes if len(n.inputs) > 3}
    return mark(graph, lambda node: (node.op == "causal_mask" and node.name in masks)
                or (node.op == "attention" and node.attr("window") is not None), window_masked=True)


def kernels(graph: Graph) -> tuple[str, ...]:
    """The attention kernels a prepared graph runs, in order of first use."""
    out = []
    for item in graph.items:
        found = kernels(item.body) if hasattr(item, "body") else (item.attr("attention_kernel"),)
        out += [k for k in found if k and k not in out]
    return tuple(out)


def _read_by_other_ops(graph: Graph) -> set:
    """The values some node other than an attention node reads (bodies included)."""
    out = set()
    for item in graph.items:
        if hasattr(item, "body"):
            out |= _read_by_other_ops(item.body) | set(item.carried)
        elif item.op != "attention":
            out |= set(item.inputs)
    return out


def apply(plan, graph, policy):
    """Nothing to rewrite in the plan: :func:`prepare` did it in the graph."""
    return plan


def _prefix(node) -> str:
    """Where the kernel's operators are named: beside the node (``h/attn/context`` ->
    ``h/attn/scores``), or under it for a node at the top (``core`` -> ``core/scores``)."""
    return node.name.rsplit("/", 1)[0] + "/" if "/" in node.name else node.name + "/"


def _eager(node, g: Graph, ctx) -> None:
    q, k, v, *masks = node.inputs
    pre = _prefix(node)
    groups = node.attr("groups", 1)
    if sp.sympify(groups) != 1:        # grouped-query attention: k and v repeated to a heads
        k = g.add("repeat_kv", k, groups=groups, name=pre + "k_repeated")
        v = g.add("repeat_kv", v, groups=groups, name=pre + "v_repeated")
        for x in (k, v):         # eager_attention_forward's key_states, value_states until it returns
            g.hold(x, until=node.attr("returns_after", node.name))
    z = g.add("matmul", q, k, transpose_b=True, name=pre + "scores")
    z = g.add("scale", z, name=pre + "scale")
    for i, m in enumerate(masks):       # added in order (T5: its position bias, then the mask)
        z = g.add("add", z, m, name=pre + ("mask" if i == 0 else f"mask{i}"))
    z = g.add("softmax", z, float32=node.attr("softmax_float32", False), name=pre + "softmax")
    if node.attr("probs_like") != "keep":      # BERT's and T5's eager attention do not cast them
        z = g.add("type_as", z, q if node.attr("probs_like") == "query" else v, name=pre + "probs")
    z = g.add("dropout", z, p=node.attr("dropout", 0.0), name=pre + "attn_dropout")
    g.add("matmul", z, v, name=node.name)
    if node.attr("weights_until"):
        g.hold(z, until=node.attr("weights_until"))


def _math(node, g: Graph, ctx) -> None:
    mask = _bias_mask(node, g) if node.attr("bias_mask") else None
    with g.scope(autocast=False):      # autocast casts at scaled_dot_product_attention's entry
        _math_ops(node, g, ctx, mask)


def _bias_mask(node, g: Graph) -> str:
    """T5: transformers' ``create_position_bias_mask`` turns the position bias (the input after
    v; any mask after it is the eager one, unused) into SDPA's float attn_mask, kept by
    ``sdpa_attention_forward`` until it returns; autocast casts it at SDPA's entry."""
    pre = _prefix(node)
    mask = g.add("bias_mask", node.inputs[3], mode=node.attr("bias_mask"), name=pre + "bias_mask")
    g.hold(mask, until=node.attr("returns_after", node.name))
    mask = g.add("autocast_copy", mask, aten="scaled_dot_product_attention", name=pre + "mask_cast")
    g.hold(mask, until=node.name)
    return mask


def _biased(node, g: Graph, ctx) -> None:
    """T5's SDPA on CUDA: the mem-efficient kernel with the position bias as its ``attn_bias``
    (derived from PyTorch 2.13's ``attention.cpp`` and ``attention_backward.cu``, not
    measured). ``preprocess_mask`` expands the (1, a, s_q, s_k) mask to the batch (a view:
    ``sdpa_bias_expand``); the kernel saves that view; its backward allocates the bias's
    gradient at the expanded size (``_efficient_attention_backward``: (b, a, s_q, s_k), its
    last dimension rounded up to 16, which the pass requires of s_k), which ExpandBackward
    sums over the batch."""
    q, k, v = node.inputs[:3]
    mask = _bias_mask(node, g)
    mask = g.add("sdpa_bias_expand", mask, q, k, name=_prefix(node) + "mask_expanded")
    g.add("sdpa_kernel", q, k, v, mask, kernel="mem-efficient", dropout=node.attr("dropout", 0.0),
          aligned=True, name=node.name)


def _math_ops(node, g: Graph, ctx, attn_mask=None) -> None:
    """``_scaled_dot_product_attention_math`` (``aten/src/ATen/native/transformers/attention.cpp``),
    op by op, with what its C++ locals keep until it returns."""
    q, k, v = node.inputs[:3]
    pre = _prefix(node)
    upcast = ctx.act_name != "float32"      # half inputs run in float32, on every device
    if upcast:
        q, k, v = (g.add("to_float32", x, name=f"{pre}{n}_float") for x, n in zip((q, k, v), "qkv"))
        for x in (q, k, v):                 # query_acc, key_acc, value_acc
            g.hold(x, until=node.name)
    qs = g.add("scale", q, scalar="c++", name=pre + "q_scaled")
    mask = None
    if node.attr("causal"):
        mask = g.add("sdpa_causal_mask", q, name=pre + "causal_mask")
        g.hold(mask, until=node.name)       # the local attn_mask
    ks = g.add("scale", k, scalar="c++", name=pre + "k_scaled")
    z = g.add("matmul", qs, ks, transpose_b=True, name=pre + "scores")
    if attn_mask:                           # a float attn_mask: attn.add_(attn_mask)
        z = g.add("add", z, attn_mask, inplace=True, name=pre + "attn_masked")
    if mask:
        z = g.add("add", z, mask, inplace=True, name=pre + "masked")
    z = g.add("softmax", z, safe=True, name=pre + "softmax")
    z = g.add("dropout", z, p=node.attr("dropout", 0.0), name=pre + "attn_dropout")
    if upcast:
        # `attn.to(origin_dtype)`, the second value returned and dropped by the caller, is
        # made before the final matmul and lives until the function returns
        probs = g.add("to_compute", z, name=pre + "probs_returned")
        g.hold(probs, until=node.name)
        z = g.add("matmul", z, v, name=pre + "context_float")
        g.add("to_compute", z, name=node.name)
    else:
        g.add("matmul", z, v, name=node.name)


def _masked(node, g: Graph, ctx, kernel: str) -> None:
    """SDPA given a boolean mask (the node's input after v): a sliding window's from s = the
    window on, or a padded batch's (BERT). ``sdpa_attention_forward`` with a mask: with a
    mask ``use_gqa_in_sdpa`` is False on the CPU and CUDA, so grouped-query k and v are
    repeated (``repeat_kv``: copies, alive until the function returns) instead of passing
    ``enable_gqa``; ``is_causal`` is False; SDPA converts the boolean mask to a float
    (b, 1, s, s) copy in the query's dtype (:func:`~symmem.rules.masks.sdpa_bool_mask_rule`).
    CPU flash saves that copy as its ``attn_mask`` (measured); the math kernel adds it in
    place to the scores and drops it when it returns; CUDA's mem-efficient kernel saves it as
    its ``attn_bias``, padded to a multiple of 16 columns (``preprocess_mask``: derived, not
    measured)."""
    q, k, v, mask = node.inputs[:4]
    pre = _prefix(node)
    groups = node.attr("groups", 1)
    if sp.sympify(groups) != 1:
        k = g.add("repeat_kv", k, groups=groups, name=pre + "k_repeated")
        v = g.add("repeat_kv", v, groups=groups, name=pre + "v_repeated")
        for x in (k, v):         # sdpa_attention_forward's key, value until it returns
            g.hold(x, until=node.attr("returns_after", node.name))
    m = g.add("sdpa_bool_mask", mask, q, name=pre + "attn_mask")
    if kernel == "math":
        g.hold(m, until=node.name)         # scaled_dot_product_attention's local attn_mask
        plain = replace(node, inputs=(q, k, v), attrs=tuple((key, value) for key, value in node.attrs
                                                           if key != "causal"))
        with g.scope(autocast=False):
            _math_ops(plain, g, ctx, m)
        return
    g.add("sdpa_kernel", q, k, v, m, kernel=kernel, dropout=node.attr("dropout", 0.0), name=node.name)


def _fused(kernel):
    def build(node, g: Graph, ctx) -> None:
        q, k, v = node.inputs[:3]
        g.add("sdpa_kernel", q, k, v, kernel=kernel, dropout=node.attr("dropout", 0.0),
              causal=bool(node.attr("causal")), name=node.name)
    return build


KERNELS = {"eager": _eager, "math": _math, "flash": _fused("flash"),
           "mem-efficient": _fused("mem-efficient"), "cudnn": _fused("cudnn")}
