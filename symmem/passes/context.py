"""Context parallelism: the plan of one of ``c`` ranks that split every sequence between them.

PyTorch's ``context_parallel`` (``torch.distributed.tensor.experimental``; what torchtitan and
accelerate run on Hugging Face models) shards the batch's sequence dimension over ``c`` ranks,
load-balanced: the sequence is cut into ``2c`` chunks and rank ``r`` keeps chunks ``r`` and
``2c - 1 - r``, so that causal attention costs each rank alike. Everything but attention is
per token, so each rank runs the model on ``s / c`` positions: every value, saved tensor,
gradient and scratch of the step is its ``s / c`` form (``s`` replaced by ``s / c``; the
parameters, gradients and optimizer states do not depend on ``s``). Attention becomes ring
attention (``_templated_ring_attention`` and its backward in torch 2.13, with
``context_parallel``'s defaults: keys and values all-gathered once, ``convert_to_f32``, load
balancing), run below autograd: autograd saves what the kernel alone would (q, k, v, the
merged output and log-sum-exp of the rank's rows). On ranks 0 to c - 2 the merged output is a
concatenation of two half-chunks, (b, a, s, d) in memory, so merging its heads copies it
(:func:`~symmem.rules.attention.sdpa_kernel_rule` under ``Ctx.ring``).

While the ring runs it adds, with ``Q`` the query's bytes on one rank, ``Qf`` the same in
float32, ``KV`` the key's and value's, ``KVf`` in float32, ``L`` the float32 log-sum-exp and
``KVc`` the bytes of k and v that are not contiguous (``key.contiguous()`` copies them: Hugging
Face's heads are transposed views), each moment a candidate of the peak (the largest depends on
the shapes), named after the kernel's node:

- **forward**: a merge ``out - sigmoid(lse_i - lse) * (out - out_i)`` at a step of whole
  queries on a rank >= 1 -- the gathered keys and values ``c*KV``, the running output and
  log-sum-exp, the step's own (and its float32 copy in a half dtype), the sigmoid and two
  float32 temporaries: ``c*KV + 3 Qf + 2 L`` (``+ Qf`` in a half dtype) beyond the kernel's
  output and log-sum-exp; and the first step (``ring: first step``): the gathered keys and
  values, their concatenation (kept until the all-gather is waited for), the contiguous copies:
  ``c*KV + KV + KVc`` (``+ Qf`` in a half dtype with c > 2: the second step's concatenation
  beside the float32 copy of the first output).
- **backward**, around the ring's second step: with ``R = Qf + 3 KVf + (c + 1) KV`` (the float32
  accumulators of dq, dk, dv, the gathered keys and values and their concatenation, the
  concatenated float32 dk, dv sent on and the one received), beyond the gradients the kernel
  alone makes: the kernel on a rank >= 1 (whole queries, half the keys) ``R + Q + KV/2``; on
  rank 0 (``ring: half queries``: the second half of its queries, every key, a contiguous half
  of the log-sum-exp) ``R + KV + Q/2 + L/2``; a rank >= 1 sending its dk, dv on (``ring: dk, dv
  sent``) ``R + KVf - KV/2``; rank 0 updating half of dq (``ring: dq updated``) ``R + Qf - Q/2 +
  L/2``; and for c > 2 the second step's concatenation of keys and values beside the first
  step's contiguous copies (``ring: second keys``) ``R + KV + KVc``.

Each is the most loaded rank's; measured to the byte on 2 to 4 CPU processes
(``tests/test_context_measured.py``: the ring alone in float32 and bfloat16, grouped-query
heads, and a Llama's whole step). The degree stays the symbol ``c`` (bound where it is a
number; a symbolic ``c`` is taken as more than 2); the formulas require ``2c | s`` (the
load-balanced chunks). Assumed and refused otherwise: causal attention by a fused kernel
(flash, mem-efficient or cuDNN: the ring merges their log-sum-exp) with no mask (no sliding
window, no padding), training. torch's ``context_parallel`` dispatches the CUDA kernels; on the
CPU the tests run the same ring functions over the CPU flash kernel. A collective's input is
counted until the ring waits for it, as NCCL's asynchronous work keeps it. Not counted: the
per-step RNG state of CUDA's flash kernel (bytes); on CUDA the kernel's backward scratch is
counted at the kernel's moments (for half the rows on rank 0's). Megatron with Transformer
Engine's ring (``AttnFuncWithCPAndKVP2P``: point-to-point, a receive buffer per step, per-step
outputs) keeps other buffers; it is not modelled.
"""
from __future__ import annotations

from dataclasses import replace

import sympy as sp

from ..errors import ConfigError
from ..graph import Node
from ..plan import Backward, Compute, Mark, Plan
from ..requirements import Requirement
from ..rules.attention import backward_scratch
from ..symbols import c, s

__all__ = ["prepare", "apply", "ring_forward", "ring_backward", "FUSED"]

#: The kernels whose log-sum-exp the ring merges its steps with.
FUSED = ("flash", "mem-efficient", "cudnn")


def kernels(graph) -> dict:
    """{name: node} of the fused attention kernels of ``graph`` (after the attention pass)."""
    return {n.name: n for n in graph.nodes() if n.op == "sdpa_kernel"}


def prepare(graph, policy):
    """The graph as it is, after refusing what ring attention does not run."""
    if not policy.parallel.splits("cp"):
        return graph
    cp = policy.parallel.cp
    fix = "Use --attention sdpa or flash on a causal decoder (Llama, Mistral, Qwen2, GPT-2, ...), or leave --cp out."
    found = kernels(graph)
    for n in graph.nodes():
        kernel = n.attr("attention_kernel")
        if kernel is not None and kernel not in FUSED:
            raise ConfigError("cp", cp, f"1 with the {kernel} attention kernel: ring attention merges the "
                              "log-sum-exp of a fused kernel (flash, mem-efficient, cudnn)", fix)
    if not found:
        raise ConfigError("cp", cp, f"1 for {graph.name}: it has no fused attention kernel to run as a ring",
                          fix)
    for n in found.values():
        if len(n.inputs) > 3 or not n.attr("causal"):
            what = "a mask (a sliding window or padding)" if len(n.inputs) > 3 else "non-causal attention"
            raise ConfigError("cp", cp, f"1 with {what} in {n.name!r}: torch's load-balanced ring attention "
                              "runs causal attention with no mask", fix)
    return graph


def ring_forward(q, kv, lse, half: bool, clones, later_cat: bool) -> dict:
    """The ring's bytes in forward beyond the kernel's output and log-sum-exp, at each of its
    largest moments (module docstring), by name: a merge at a step of whole queries
    (``"merge"``: ``c*KV + 3 Qf + 2 L``, ``+ Qf`` in a half dtype) and the first step
    (``"first step"``: ``c*KV + KV`` and the contiguous copies of k and v, ``clones``; in a half
    dtype with more than two ranks, the second step's concatenation beside the float32 copy of
    the first output, ``+ Qf``, ``later_cat``). ``q`` = (Q, Qf), ``kv`` = (KV, KVf), ``lse`` = L:
    bytes of one rank's rows."""
    (_, qf), (kv, _) = q, kv
    return {"merge": c * kv + 3 * qf + 2 * lse + (qf if half else 0),
            "first step": c * kv + kv + clones + (qf if half and later_cat else 0)}


def ring_backward(q, kv, lse, clones, later_cat: bool) -> dict:
    """The ring's bytes in backward beyond the gradients the kernel makes, at each of its
    largest moments (module docstring), by name: at the second step's kernel on a rank >= 1
    (``"kernel"``) and on rank 0 (``"half queries"``), when a rank >= 1 sends its dk, dv on
    (``"dk, dv sent"``), when rank 0 updates the second half of dq (``"dq updated"``) and, with
    more than two ranks (``later_cat``), when the second step concatenates the keys and values
    it sends on while the first step's contiguous copies of k and v (``clones``) are alive
    (``"second keys"``). ``q`` = (Q, Qf), ``kv`` = (KV, KVf), ``lse`` = L: bytes of one rank's
    rows."""
    (q, qf), (kv, kvf) = q, kv
    half = sp.Rational(1, 2)
    ring = qf + 3 * kvf + (c + 1) * kv          # accumulators, gathered and sent k, v, dk, dv
    out = {"kernel": ring + q + half * kv,
           "half queries": ring + kv + half * q + half * lse,
           "dk, dv sent": ring + kvf - half * kv,
           "dq updated": ring + qf - half * q + half * lse}
    if later_cat:
        out["second keys"] = ring + kv + clones
    return out


class _Ring:
    """One kernel's bytes on one rank (of its ``s / c`` rows, before the pass divides ``s``):
    ``q`` = (Q, Qf), ``kv`` = (KV, KVf), ``lse`` = L, ``half``: a half dtype, ``clones``: the
    bytes of k and v the ring copies to make them contiguous."""

    def __init__(self, e: Compute, node: Node, info: dict, bindings: dict):
        def tensor(x):
            return info.get((x, e.copy)) or info[(x, 0)]
        q, k, v = (tensor(x) for x in node.inputs[:3])
        per = sp.simplify(e.out_bytes / q.numel)          # the kernel's bytes per element
        self.q = (e.out_bytes, 4 * q.numel)
        self.kv = (per * (k.numel + v.numel), 4 * (k.numel + v.numel))
        self.lse = sum((nb for key, nb in e.new if key.name.endswith(":log-sum-exp")), sp.Integer(0))
        self.half = sp.sympify(per).xreplace(bindings) != 4     # B_a is bound by the precision
        self.clones = sum((per * x.numel for x in (k, v) if not x.contiguous), sp.Integer(0))


def apply(plan: Plan, graph, policy) -> Plan:
    if not policy.parallel.splits("cp"):
        return plan
    from ..footprints import trace
    found = kernels(graph)
    info, bindings = trace(graph, policy).info, policy.bindings()
    cp = policy.parallel.cp
    later_cat = not isinstance(cp, int) or cp > 2
    rings = {}                                     # (node, copy) -> _Ring

    def event(e, forward: bool):
        if isinstance(e, Compute) and e.node in found:
            if (e.node, e.copy) not in rings:
                rings[(e.node, e.copy)] = _Ring(e, found[e.node], info, bindings)
            ring = rings[(e.node, e.copy)]
            moments = ring_forward(ring.q, ring.kv, ring.lse, ring.half, ring.clones, later_cat)
            merged = replace(e, temp=e.temp + moments["merge"])
            if not forward:                       # recomputed in backward: the merge only
                return (merged,)
            own = e.out_bytes + sum((nb for _, nb in e.new), sp.Integer(0)) + e.temp
            first = Mark("forward", f"{e.node} (ring: first step)", (("transient", own + moments["first step"]),),
                         e.copy)
            return (first, merged)
        if isinstance(e, Backward) and e.node in found:
            node = found[e.node]

            def scratch(rows):
                return backward_scratch(node.attr("kernel"), policy.device, (*node.shape[:2], rows, node.shape[3]))
            return (replace(e, events=tuple(y for x in e.events
                                            for y in _backward(e, rings, scratch, later_cat, x))),)
        return (e,)

    def phase(events, forward: bool):
        return tuple(y for e in events for y in event(e, forward))

    plan = replace(plan, forward=phase(plan.forward, True), backward=phase(plan.backward, False),
                   later=tuple(replace(mb, forward=phase(mb.forward, True), backward=phase(mb.backward, False))
                               for mb in plan.later))
    if not rings:
        raise ConfigError("cp", cp, "a step whose attention kernels run (none found in the plan)")
    plan = plan.mapped_bytes(lambda x: sp.sympify(x).xreplace({s: s / c}))
    req = Requirement(2 * c, s, "context parallelism cuts each sequence into 2c load-balanced chunks", "divides")
    note = (f"context parallel over c = {cp} (torch's load-balanced ring attention): every activation of s / c "
            f"positions; the ring's gathered keys and values and float32 merges at the attention kernels")
    return replace(plan, requirements=plan.requirements + (req,), notes=plan.notes + (note,))


def _backward(group: Backward, rings: dict, scratch, later_cat: bool, e):
    """The kernel's own mark with the ring's bytes at its second step, and after it the ring's
    other moments (:func:`ring_backward`): the kernel's scratch ``scratch(rows)`` is there at
    the kernel's moments only, for half the rows on rank 0's."""
    if not (isinstance(e, Mark) and e.node == group.node):
        return (e,)
    ring = rings.get((group.node, group.copy)) or next(v for (n, _), v in rings.items() if n == group.node)
    own = scratch(s)
    out = []
    for name, extra in ring_backward(ring.q, ring.kv, ring.lse, ring.clones, later_cat).items():
        extra = {"kernel": extra, "half queries": extra - own + scratch(s / 2)}.get(name, extra - own)
        out.append(replace(e, node=e.node if name == "kernel" else f"{e.node} (ring: {name})",
                           extra=e.extra + (("transient", extra),)))
    return tuple(out)
