"""LoRA: every weight frozen, trainable adapters beside the targeted linear layers, as
``peft``'s ``get_peft_model`` leaves a model (:class:`~symmem.policy.adapters.LoRA`).

:func:`prepare` rewrites the graph. Each parameter becomes frozen (``Param.trainable``
False): no gradient, no optimizer state, and the rules save only what the trainable
inputs' gradients need (a frozen linear layer keeps its weight, not its input). Each linear
node ``N`` whose module name ends with a target becomes, in the order of
``peft.tuners.lora.layer.Linear.forward``::

    N.base_layer = linear(x)                    # the frozen layer
    N.lora_x     = x in the adapters' dtype     # _cast_input_dtype: a copy under autocast,
                                                # held by forward's local until it returns
    N.lora_dropout                              # lora_dropout (none at peft's default 0)
    N.lora_A     = linear(., A: r x in)         # trainable, no bias
    N.lora_B     = linear(., B: out x r)
    N.lora_scale = . * scaling                  # a Python number (an 8-byte scalar on the CPU)
    N            = N.base_layer + N.lora_scale

Around a quantized layer (:mod:`symmem.passes.quantize`) peft's ``lora.bnb`` layer runs
instead (``peft.tuners.lora.bnb.Linear4bit.forward``): ``result = base(x).clone()``; with
autocast off (``torch.is_autocast_enabled()``, the CUDA flag, so on the CPU always) x is cast
to the adapters' dtype and their output back to the result's (``N.lora_out``) before
``result + output``.

In a half-precision model (``bf16``, ``fp16``: ``model.to(dtype)``) ``get_peft_model``
upcasts the adapters to float32 (``autocast_adapter_dtype=True``, its default): their
weights, gradients and optimizer states are float32 (``Param.dtype``), ``N.lora_x`` is a
float32 copy of x, the sum is float32 (type promotion) and ``result.to(torch_result_dtype)``
casts it back (``N``, after ``N.lora_sum``).

A target that matches no linear layer is an error that lists the model's.
"""
from __future__ import annotations

from dataclasses import replace

from ..errors import ConfigError
from ..graph import Graph
from ..policy.adapters import DEFAULT_TARGETS, LORA_DTYPES

__all__ = ["default_targets", "prepare", "apply", "linear_modules", "module_of", "LINEAR"]


def module_of(node) -> str:
    """The module name of a node: ``h/attn.c_attn`` -> ``attn.c_attn``, ``lm_head`` -> ``lm_head``."""
    return node.name.rsplit("/", 1)[-1]


#: the linear layers LoRA wraps: plain, and bitsandbytes' (the quantize pass's)
LINEAR = ("linear", "linear_int4", "linear_int8")


def _matches(node, targets) -> bool:
    mod = module_of(node)
    return node.op in LINEAR and any(mod == t or mod.endswith("." + t) for t in targets)


def linear_modules(graph: Graph) -> tuple[str, ...]:
    """The module names of the graph's linear layers, the names LoRA can target."""
    out = []
    for item in graph.items:
        if hasattr(item, "body"):
            out += linear_modules(item.body)
        elif item.op in LINEAR:
            out.append(module_of(item).rsplit(".", 1)[-1])
    return tuple(dict.fromkeys(out))


def default_targets(graph: Graph) -> tuple[str, ...]:
    """peft's default target modules for the model: the first entry of
    :data:`~symmem.policy.adapters.DEFAULT_TARGETS` whose modules the graph has."""
    known = set(linear_modules(graph))
    for targets in DEFAULT_TARGETS.values():
        if set(targets) <= known:
            return targets
    raise ConfigError("lora_targets", None, f"module names: peft has no default for {graph.name!r}",
                      f"Name the projections to adapt, one of {', '.join(linear_modules(graph))}.")


def prepare(graph: Graph, policy) -> Graph:
    lora = policy.lora
    if lora is None:
        return graph
    known = linear_modules(graph)
    targets = lora.targets or default_targets(graph)
    for t in targets:
        if not any(_matches(n, (t,)) for g in graph.graphs() for n in g.items if hasattr(n, "op")):
            raise ConfigError("lora_targets", t, f"a linear layer of {graph.name!r}: one of {', '.join(known)}",
                              "Name the projections to adapt, e.g. --lora-targets c_attn,c_proj.")
    frozen = graph.with_params(lambda p: replace(p, trainable=False))
    prec = policy.prec
    # float32 adapters on a half model (peft's autocast_adapter_dtype=True), unless kept in its dtype
    upcast = not prec.autocast and prec.compute != "float32" and LORA_DTYPES[policy.lora_dtype].upcast
    adapter = "float32" if upcast else None

    def rewrite(node, sub: Graph) -> bool:
        if not _matches(node, targets):
            return False
        x = node.inputs[0]
        w = node.params[0]
        n_in, n_out = (w.shape[0], w.shape[1]) if node.attr("conv1d") else (w.shape[1], w.shape[0])
        stem = w.name.rsplit(".", 1)[0]
        bnb = node.op != "linear"           # peft's lora.bnb layer around a quantized one
        with sub.scope(**dict(node.attrs)):
            base = sub.add(node.op, x, params=node.params, name=f"{node.name}.base_layer")
        with sub.scope(**{k: v for k, v in node.attrs if k not in ("conv1d", "block")}):
            if bnb:
                base = sub.add("clone", base, name=f"{node.name}.result")
            y = sub.add("to_float32" if upcast else "to_param_dtype", x, name=f"{node.name}.lora_x")
            sub.hold(y, until=node.name)           # forward's rebound local x, until it returns
            sub.hold(x, until=node.name)           # and the caller's argument, until the call returns
            y = sub.add("dropout", y, p=lora.dropout, name=f"{node.name}.lora_dropout")
            a = sub.param(f"{stem}.lora_A.weight", (lora.rank, n_in), dtype=adapter)
            y = sub.add("linear", y, params=(a,), name=f"{node.name}.lora_A")
            b = sub.param(f"{stem}.lora_B.weight", (n_out, lora.rank), dtype=adapter)
            y = sub.add("linear", y, params=(b,), name=f"{node.name}.lora_B")
            y = sub.add("scale", y, name=f"{node.name}.lora_scale")
            if bnb:          # output.to(expected_dtype), then result + output
                y = sub.add("to_compute", y, name=f"{node.name}.lora_out")
                sub.add("add", base, y, name=node.name)
            elif upcast:     # float32 + half is float32; result.to(torch_result_dtype)
                y = sub.add("add", base, y, name=f"{node.name}.lora_sum")
                sub.add("to_compute", y, name=node.name)
            else:
                sub.add("add", base, y, name=node.name)
        return True

    return frozen.rewritten(rewrite)


def apply(plan, graph, policy):
    """Nothing to rewrite in the plan: :func:`prepare` did it in the graph."""
    return plan
