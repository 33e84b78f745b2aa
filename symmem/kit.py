"""A question's kit: what ``symmem estimate`` (or ``infer``) prints for one model and policy,
as a table or as JSON, with the batch, the sequence and the tokens generated left free, as
plain data that a new question evaluates without sympy.

The first time a table (or JSON, ``--format json``) is printed for a model and a policy, the
command line keeps (under the key of its arguments with those values blanked,
:func:`template`; a format's kit apart from the other's) everything the answer needs: what
it shows that does not depend on the values (:func:`split`: the table's lines, or the JSON
document with the fields of the values blanked, its formulas as text among them); the
components and every candidate of the peak (each timeline point the peak can be at) as
formulas in the free symbols, the model's and the policy's numbers bound (:func:`tree`: sums,
products and powers, and the ceilings and maxima some rules make), and for JSON of inference
each phase's points that can be its largest (``phase_peaks``); the requirements of the
formulas; and, for each candidate that was the peak of a question so far, its roles, where
it is and its formula as sympy printed it (added by the run that first needs it: printing
every candidate would cost the first question a second). Another ``--batch``, ``--seq`` or
``--new-tokens`` then evaluates the formulas with Python integers and fractions, takes the
first largest candidate as :meth:`symmem.engine.Estimate.at` does, and, when that
candidate's lines are kept, prints the same table through the same :func:`render`, or the
same document through ``json.dumps`` (``tests/test_kit.py`` compares both paths' output, byte
for byte); otherwise the sympy path answers and keeps them. Nothing is imported but the
standard library and :mod:`symmem.units`: the answer costs the interpreter and a file read.

A kit is not made (the sympy path answers) for LaTeX, a pipeline (per-stage tables and
``ranks``), b = 1 (derived apart: :attr:`~symmem.engine.Estimate.at_one`), or a formula with
another kind of factor;
a question a kit cannot answer (a requirement broken, a value not a positive integer, a
spelling it does not know) goes the sympy path too, which prints the error. Kits live beside
the stored answers (:mod:`symmem.cache`), as JSON under a checksum, keyed like them by
symmem's code and the installed sympy and numpy; the magic at their head names the kit's
layout, so that a kit of another layout is not read.
"""
from __future__ import annotations

import hashlib
import json
import sys
import textwrap
from fractions import Fraction

from .cache import _answer_path, _write_blob, answer_key, cache_dir
from .units import format_bytes

__all__ = ["FREE", "WIDTH", "template", "load", "answer", "save", "render", "evaluate", "split", "text", "tree",
           "wrap"]

#: the flags whose values a kit leaves free, and their symbols
FREE = {"--batch": "b", "--seq": "s", "--new-tokens": "n_g"}
#: table width, as the command line's
WIDTH = 88
_MAGIC = b"symmem-kit-2\n"


def template(argv: list[str]) -> tuple | None:
    """``(key, values)``: the key of ``argv``'s kit (its arguments with the free flags' values
    blanked) and those values ({symbol name: int}); None where no kit answers (another
    command, a free flag given twice or without a positive integer: the sympy path then says
    what is wrong). Any other spelling is part of the key: a kit is kept only by a run that
    printed a table, so every spelling in its key was one argparse took."""
    if not argv or argv[0] not in ("estimate", "infer"):
        return None
    out, values, i = [argv[0]], {}, 1
    while i < len(argv):
        tok = argv[i]
        name, eq, given = tok.partition("=")
        if name in FREE:
            if not eq:
                if i + 1 >= len(argv):
                    return None
                given, i = argv[i + 1], i + 1
            if not given.isdigit() or int(given) < 1 or FREE[name] in values:
                return None
            values[FREE[name]] = int(given)
            out.append(f"{name}=?")
        else:
            out.append(tok)
        i += 1
    key = answer_key(out)
    return None if key is None else (key, values)


def _path(key: str):
    path = _answer_path(key)
    return None if path is None else path.with_suffix(".kit.json")


def save(argv: list[str], kit: dict) -> None:
    """Keep ``kit`` for the questions ``argv`` stands for (silently nothing where the cache is
    off or no kit answers them)."""
    t = template(argv) if cache_dir() is not None else None
    path = None if t is None else _path(t[0])
    if path is None:
        return
    payload = json.dumps(kit, separators=(",", ":")).encode()
    _write_blob(path, _MAGIC + hashlib.sha256(payload).digest() + t[0].encode() + payload)


def _load(key: str) -> dict | None:
    path = _path(key)
    try:
        blob = path.read_bytes()
    except (OSError, AttributeError):
        return None
    head = len(_MAGIC) + 32 + 64
    digest, stored, payload = blob[len(_MAGIC):len(_MAGIC) + 32], blob[len(_MAGIC) + 32:head], blob[head:]
    if not blob.startswith(_MAGIC) or stored != key.encode() or hashlib.sha256(payload).digest() != digest:
        return None
    try:
        return json.loads(payload)
    except ValueError:
        return None


def load(argv: list[str]) -> dict | None:
    """The kit kept for the questions ``argv`` stands for, or None."""
    t = template(argv) if cache_dir() is not None else None
    return None if t is None else _load(t[0])


def answer(argv: list[str]) -> int | None:
    """Print the answer to ``argv`` (its table or JSON) from its kit and return 0; None where no kit answers."""
    t = template(argv) if cache_dir() is not None else None
    kit = None if t is None else _load(t[0])
    if kit is None:
        return None
    out = text(kit, t[1])
    if out is None:
        return None
    try:
        sys.stdout.write(out + "\n")
        sys.stdout.flush()
    except BrokenPipeError:     # the reader stopped early (`symmem ... | head`): not an error
        sys.stdout = None
    return 0


# ----- evaluation ---------------------------------------------------------------------------
def tree(expr) -> list | None:
    """A byte formula (sympy, its numbers bound) as the kit keeps it, a tree of lists:
    ``["n", int]``, ``["q", p, q]``, ``["s", name]``, ``["+", ...]``, ``["*", ...]``,
    ``["^", base, int]``, ``["ceil", x]``, ``["floor", x]``, ``["max", ...]``, ``["min", ...]``
    (what SDPA's roundings and a few rules' temporaries make); None for anything else. Read
    through sympy's attributes, so that this module imports no sympy."""
    if expr.is_Integer:
        return ["n", int(expr)]
    if expr.is_Rational:
        return ["q", int(expr.p), int(expr.q)]
    if expr.is_Symbol:
        return ["s", expr.name]
    if expr.is_Pow:
        if not expr.exp.is_Integer:
            return None
        base = tree(expr.base)
        return None if base is None else ["^", base, int(expr.exp)]
    op = "+" if expr.is_Add else "*" if expr.is_Mul else _FUNCS.get(type(expr).__name__)
    if op is None:
        return None
    kids = [tree(a) for a in expr.args]
    return None if None in kids else [op, *kids]


_FUNCS = {"ceiling": "ceil", "floor": "floor", "Max": "max", "Min": "min"}


def _value(node, values: dict):
    """The exact value of a kept formula at ``values`` (an int or a Fraction); None when a
    symbol has no value."""
    op = node[0]
    if op == "n":
        return node[1]
    if op == "q":
        return Fraction(node[1], node[2])
    if op == "s":
        return values.get(node[1])
    if op == "^":
        x = _value(node[1], values)
        return None if x is None else (x ** node[2] if node[2] >= 0 else Fraction(1) / x ** -node[2])
    xs = [_value(k, values) for k in node[1:]]
    if None in xs:
        return None
    if op == "+":
        return sum(xs)
    if op == "*":
        out = 1
        for x in xs:
            out *= x
        return out
    if op == "ceil":
        return -(-xs[0] // 1)
    if op == "floor":
        return xs[0] // 1
    return max(xs) if op == "max" else min(xs)


def _ceil(x) -> int:
    return -(-x // 1)


def _broken(req, values: dict) -> bool:
    """Does ``values`` break the kept requirement ``[kind, lhs, rhs]``? (A side left unknown
    is not checked, as :meth:`symmem.requirements.Requirement.broken` does.)"""
    kind, lhs, rhs = req
    lv, rv = _value(lhs, values), _value(rhs, values)
    if lv is None or rv is None:
        return False
    if kind == "divides":
        return lv == 0 or rv % lv != 0
    return lv > rv


#: the table's lines, and the JSON's fields, of the peak's candidate: kept per candidate (the
#: JSON's formula of it, ``formula.peak_at_inputs``, too)
_SEEN = {"table": ("where", "active", "bound"),
         "json": ("peak_phase", "peak_node", "peak_iteration", "peak_where")}
#: the JSON's fields that depend on the values (``inputs`` holds two more: batch, seq)
_VALUED = ("batch_per_step", "bytes", "host_bytes", "new_tokens", "phase_peaks", "peak_breakdown")


def split(shown: dict, fmt: str) -> tuple[dict, dict]:
    """``(static, seen)``: what a kit keeps of a printed table's view (``fmt`` "table") or JSON
    document ("json") for every question, the fields of the values blanked (a dict's keys kept,
    in order), and what it keeps for the peak's candidate."""
    seen = {k: shown[k] for k in _SEEN[fmt]}
    if fmt == "table":
        return {k: v for k, v in shown.items() if k not in (*seen, "values", "bytes", "parts")}, seen
    seen["peak_at_inputs"] = shown["formula"]["peak_at_inputs"]
    static = {k: v if k not in (*seen, *_VALUED) else dict.fromkeys(v) if isinstance(v, dict) else None
              for k, v in shown.items()}
    static["inputs"] = {**shown["inputs"], "batch": None, "seq": None}
    static["formula"] = {**shown["formula"], "peak_at_inputs": None}
    return static, seen


def evaluate(kit: dict, values: dict) -> dict | None:
    """The view :func:`render` prints (the document ``json.dumps`` prints, for a JSON kit), at
    ``values`` ({"b": 8, "s": 1024, ...}); None where the kit does not answer (a value missing
    or b = 1, or a requirement broken: the sympy path then answers or says what is wrong)."""
    if set(values) != set(kit["free"]) or values.get("b") == 1:
        return None
    given, values = values, {**kit["fixed"], **values}       # the decoder's length, part of the key
    if any(_broken(req, values) for req in kit["requirements"]):
        return None
    nums = {k: _value(p, values) for k, p in kit["components"].items()}
    totals = [_value(p, values) for p in kit["totals"]]
    phases = {k: [_value(p, values) for p in ps] for k, ps in kit["phases"].items()}
    if None in (*nums.values(), *totals, *(x for xs in phases.values() for x in xs)):
        return None
    i = max(range(len(totals)), key=lambda j: totals[j])       # the first largest, as Estimate.at
    seen = kit["details"].get(str(i))
    if seen is None:                # a candidate no question had as its peak yet: sympy prints it
        return None
    nums = {**{k: _ceil(v) for k, v in nums.items()}, "peak": _ceil(totals[i])}
    parts = {role: _ceil(_value(p, values)) for role, p in seen["parts"].items()}
    out = {**kit["static"], **{k: seen[k] for k in _SEEN[kit["format"]]}}
    if kit["format"] == "table":
        return {**out, "values": given, "bytes": nums, "parts": parts}
    out["inputs"] = {**out["inputs"], "batch": given["b"], "seq": given.get("s")}
    out["batch_per_step"] = given["b"] * kit["micro_batches"]
    out["bytes"] = {k: nums[k] for k in out["bytes"]}
    if "host_bytes" in out:
        out["host_bytes"] = nums["host"]
    if "new_tokens" in out:
        out["new_tokens"], out["phase_peaks"] = given["n_g"], {k: _ceil(max(xs)) for k, xs in phases.items()}
    out["peak_breakdown"] = {role: x for role, x in parts.items() if role in out["peak_breakdown"]}
    out["formula"] = {**out["formula"], "peak_at_inputs": seen["peak_at_inputs"]}
    return out


def text(kit: dict, values: dict) -> str | None:
    """What the question at ``values`` prints (without the last newline), from ``kit``; None
    where the kit does not answer (:func:`evaluate`)."""
    out = evaluate(kit, values)
    return None if out is None else render(out) if kit["format"] == "table" else json.dumps(out, indent=2)


# ----- the table ----------------------------------------------------------------------------
def wrap(text: str, indent: str = "  ") -> str:
    """``text`` wrapped at the table's width under ``indent`` (formulas break at spaces only)."""
    return textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_on_hyphens=False, break_long_words=False)


def render(v: dict) -> str:
    """The table of ``symmem estimate`` (``infer``) from a plain view: the static lines the kit
    keeps (``title``, ``policy``, ``dims``, ``micro_batches``, ``components``, ``roles``,
    ``candidates``, ``regions``, ``inference``) and the values' (``values``, ``bytes``,
    ``parts``, ``where``, ``active``, ``bound``)."""
    values, nb = v["values"], v["bytes"]
    tokens = f", new tokens n_g = {values['n_g']:,}" if v["inference"] else ""
    tokens += "".join(f", decoder seq s_d = {x:,}" for x in v["decoder"])
    seq = "" if "s" not in values else f", seq s = {values['s']:,}"
    out = [v["title"], v["policy"],
           textwrap.fill(f"inputs: batch b = {values['b']:,}{seq}{tokens}; model {v['dims']}", WIDTH,
                         subsequent_indent="  "),
           ""]
    if v["micro_batches"] > 1:
        out.insert(-1, f"  {v['micro_batches']} micro-batches of b = {values['b']:,}: "
                       f"{values['b'] * v['micro_batches']:,} sequences per optimizer step")
    w = 34
    out += v.get("ranks_lines", [])
    # the columns as wide as their widest value (at least as before), so they never touch
    shown = [*nb.values(), *v["parts"].values()]
    wb = max(18, max(len(f"{x:,}") for x in shown) + 2)
    ws = max(14, max(len(format_bytes(x)) for x in shown) + 2)
    out.append(f"{'component':<{w}}{'bytes':>{wb}}{'size':>{ws}}")
    inference = v["inference"]
    for k in v["components"]:
        x = nb[k]
        if k in ("master", "buffers") and not x or inference and k in ("grads", "master", "optimizer", "activations"):
            continue
        label = "activations (saved for backward)" if k == "activations" else k
        out.append(f"{label:<{w}}{x:>{wb},}{format_bytes(x):>{ws}}")
    out += ["", f"at the peak: {v['where']}",
            f"{'role':<{w}}{'bytes':>{wb}}{'size':>{ws}}{'% of total':>12}"]
    peak = nb["peak"]
    for role in v["roles"]:
        x = v["parts"][role]
        if not x and (role in ("master", "buffers", "cache") and not nb.get(role)
                      or inference and role in ("grads", "master", "optimizer", "activations")):
            continue
        out.append(f"{role:<{w}}{x:>{wb},}{format_bytes(x):>{ws}}{100 * x / peak:>11.1f}%")
    out.append(f"{'peak':<{w}}{peak:>{wb},}{format_bytes(peak):>{ws}}{100.0:>11.1f}%")
    if "host" in nb:          # offloaded: on the host, not in the device's peak
        out.append(f"{'host (offloaded, not in the peak)':<{w}}{nb['host']:>{wb},}{format_bytes(nb['host']):>{ws}}")
    n = v["candidates"]
    out += ["", f"peak formula (the largest at these inputs of the {n} candidates whose max is the peak):",
            wrap(v["active"]),
            "with this model's numbers and the policy's bytes per element:",
            wrap(v["bound"]),
            f"(all {n} candidates: --format json or --format latex)", "",
            *v["regions"]]
    return "\n".join(out)
