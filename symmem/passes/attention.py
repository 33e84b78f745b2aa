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
  :mod:`symmem.rules.attention`).

Every kernel but eager is called with ``is_causal=True`` and no mask: transformers'
``create_causal_mask`` returns None for them when nothing is padded, so the model's
``causal_mask`` node is removed too. The replacement's nodes keep the attention node's
scope attributes (``recompute="attention"`` for selective recomputation). A node with
``kernels`` (a tuple of kernel names) is modelled for those only: another is refused.
"""
from __future__ import annotations

import sympy as sp

from ..errors import ConfigError
from ..graph import Graph
from ..policy.attention import check_kernel, resolve, sdpa_backend

__all__ = ["prepare", "apply", "kernel_of", "kernels", "OWN_ATTRS"]

#: The attention node's own attributes (the others are scope attributes its replacement keeps;
#: it adds ``attention_kernel``, the kernel that made it).
OWN_ATTRS = ("dropout", "causal", "weights_until", "groups", "probs_like", "softmax_float32", "returns_after",
             "window", "padded", "kernels", "bias_mask")


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
            return (resolve(policy.attention, graph.attention) != "eager"
                    and node.name not in masks_read_elsewhere)
        if node.op != "attention":
            return False
        q, k, v = node.inputs[:3]
        p = node.attr("dropout", 0.0)
        d = sp.sympify(sub.shape(q)[-1])
        ctx = base.float32() if node.attr("fp32") else base        # a module kept in float32
        kernel, head_needs = kernel_of(policy, ctx.act_name, p, d.xreplace(graph.bindings), graph.attention)
        if node.attr("kernels") and kernel not in node.attr("kernels"):
            raise ConfigError("attention", kernel, f"a kernel symmem models for {graph.name!r}'s attention "
                              f"({', '.join(node.attr('kernels'))})",
                              f"Use --attention {node.attr('kernels')[0]} (attn_implementation="
                              f"\"{node.attr('kernels')[0]}\").")
        needs.extend(n.requirement(d) for n in head_needs)
        if node.attr("padded") and kernel != "eager":
            raise ConfigError("attention", kernel, "eager attention for batches with padding (padded: true)",
                              "transformers then passes SDPA a boolean (b, 1, s, s) mask, which symmem does not "
                              "model: use --attention eager, or padded: false for batches without padding.")
        if node.attr("window") is not None and kernel != "eager":
            needs.append(_window_requirement(sub.shape(q)[-2], node.attr("window")))
        scope = {key: value for key, value in node.attrs if key not in OWN_ATTRS}
        with sub.scope(**scope, attention_kernel=kernel):
            KERNELS[kernel](node, sub, ctx)
        return True

    out = graph.rewritten(rewrite)
    for lhs, rhs, reason, kind in dict.fromkeys(needs):
        out.require(lhs, rhs, reason, kind=kind)
    return out


def _window_requirement(seq, window) -> tuple:
    """A sliding window (``window``: its length) changes nothing eager allocates: transformers
    builds the same (b, 1, s, s) float mask with other values (measured). The other kernels get
    no mask and ``is_causal`` only while the sequence is shorter than the window; from s =
    window on, ``sdpa_mask`` materialises a boolean mask, SDPA converts it to a float copy that
    it saves, and transformers repeats k and v instead of passing ``enable_gqa``: not modelled,
    so a requirement."""
    return (seq, window - 1, f"the sequence is shorter than the sliding window ({window}): transformers then "
                             "calls SDPA with is_causal and no mask; a longer one materialises the window's "
                             "mask, which symmem models for eager attention only (--attention eager)", "at most")


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
    mask = None
    if node.attr("bias_mask"):
        # T5: transformers' create_position_bias_mask turns the position bias into SDPA's float
        # attn_mask (the input after v; any mask after it is the eager one, unused), kept by
        # sdpa_attention_forward until it returns; autocast casts it at SDPA's entry
        pre = _prefix(node)
        mask = g.add("bias_mask", node.inputs[3], mode=node.attr("bias_mask"), name=pre + "bias_mask")
        g.hold(mask, until=node.attr("returns_after", node.name))
        mask = g.add("autocast_copy", mask, aten="scaled_dot_product_attention", name=pre + "mask_cast")
        g.hold(mask, until=node.name)
    with g.scope(autocast=False):      # autocast casts at scaled_dot_product_attention's entry
        _math_ops(node, g, ctx, mask)


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


def _fused(kernel):
    def build(node, g: Graph, ctx) -> None:
        q, k, v = node.inputs[:3]
        g.add("sdpa_kernel", q, k, v, kernel=kernel, dropout=node.attr("dropout", 0.0), name=node.name)
    return build


KERNELS = {"eager": _eager, "math": _math, "flash": _fused("flash"),
           "mem-efficient": _fused("mem-efficient"), "cudnn": _fused("cudnn")}
