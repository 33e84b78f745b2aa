"""The ``symmem`` command line.

    symmem estimate --model gpt2 --batch 8 --seq 1024 --precision bf16-mixed --optimizer adamw
    symmem estimate --config examples/gpt2-medium/config.json --batch 8 --seq 1024 --format json
    symmem models

``main(argv)`` returns the exit status: 0 ok, 1 when symmem rejected an input (an
unknown name, a bad config.json: the message says what and how to fix it), 2 for
bad usage (argparse's own errors, such as a missing option or ``--batch 0``).
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import functools
import json
import sys
import textwrap

import sympy as sp

from . import __version__, models
from .printing import format_bytes
from . import cache, kit, symbols
from .kit import WIDTH, wrap
from .cache import cached_estimate
from .engine import COMPONENTS, canonical
from .errors import ConfigError, SymmemError
from .graph import Node
from .gpus import CATALOG, DEFAULT_RESERVE, budget as make_budget
from .printing import latex as render_latex_expr
from .policy import PARTS, Parallel, Policy
from .policy.inference import QUANTO_BITS
from .policy.parallel import DEGREES
from .plan import ROLES

__all__ = ["main", "build_parser"]

FORMATS = ("table", "json", "latex")

SWEEP_EPILOG = """\
examples:
  symmem sweep --model gpt2 --batch 1:64 --seq 256,512,1024 --precision bf16-mixed > gpt2.csv
  symmem sweep --model gpt3-175b --batch 1:1000 --seq 128:2048:128 --progress > big.csv

exit status: 0 success; 1 an input was rejected; 2 bad usage.
"""

SOLVE_EPILOG = """\
examples:
  symmem max-batch --model gpt2 --seq 1024 --precision bf16-mixed --gpu H100-80GB
  symmem max-batch --model gpt2-xl --seq 1024 --budget 80GiB --reserve 2GiB --format json
  symmem solve --model gpt2 --for s --max --batch 8 --gpu A100-40GB
  symmem solve --model gpt2 --for L --batch 8 --seq 1024 --budget 24GB --reserve 0

The answer comes with its proof (the peak at the answer fits the usable budget, the
peak one step past it does not), the boundary formula and the candidate that binds.

exit status: 0 success; 1 nothing fits (the message shows the breakdown at the
smallest value) or an input was rejected; 2 bad usage.
"""

EPILOG = """\
examples:
  symmem estimate --model gpt2 --batch 8 --seq 1024 --precision bf16-mixed --optimizer adamw
  symmem estimate --config examples/gpt2-medium/config.json --batch 4 --seq 1024 \\
      --precision fp32 --optimizer sgd --format json
  symmem estimate --model gpt2-xl --batch 1 --seq 1024 --format latex > peak.tex
  symmem models

exit status:
  0  success
  1  symmem rejected an input (unknown model, precision or optimizer name, a
     config.json that is missing, not valid JSON or not a valid model, a --seq
     longer than the model's positions); the message says what and how to fix it
  2  bad usage (a missing or malformed option, e.g. --batch 0 or --batch abc)
"""


# --------------------------------------------------------------------------- parser

def positive_int(text: str) -> int:
    """argparse ``type=``: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer (a whole number >= 1, e.g. 8), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer (a whole number >= 1, e.g. 8), got {value}")
    return value


def _model_options(p):
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="NAME",
                     help="a preset, by name or Hugging Face id, any case (e.g. gpt2, "
                          "openai-community/gpt2-medium); symmem models lists them")
    src.add_argument("--config", metavar="PATH",
                     help="a local Hugging Face config.json, or the folder holding one "
                          "(nothing is downloaded)")
    _tie_option(p)
    _policy_options(p)


#: what ``--share`` can share: a config field set true, or the model's repeated block
SHARE = {"qkv": "one projection for the query, key and value (the model's shared_qkv)",
         "layers": "one set of weights for every layer, as ALBERT does (Graph.with_shared_layers)"}


def _share(value: str) -> tuple:
    parts = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [p for p in parts if p not in SHARE]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"expected {' and/or '.join(SHARE)}, comma-separated, got {value!r}")
    return parts


def _tie_option(p):
    p.add_argument("--tie", action=argparse.BooleanOptionalAction, default=None,
                   help="tie the output layer to the token embedding (--tie) or give it its own weight "
                        "(--no-tie), whatever the model's tie_word_embeddings says (default: the model's)")
    p.add_argument("--share", type=_share, default=None, metavar="WHAT",
                   help="share weights: " + "; ".join(f"{k}: {v}" for k, v in SHARE.items())
                        + " (comma-separated)")


#: The policy parts given as whole numbers.
INT_FIELDS = ("accumulate", "max_cache_len", "residual_length", "q_group_size", "residual_position")


def _policy_options(p):
    """One option per policy part (symmem.policy.PARTS), its names listed from the part's
    registry. Names are checked by Policy (exit 1, with a "did you mean" hint), not by
    argparse choices."""
    for part in PARTS:
        names = f": {' | '.join(part.registry.names())}" if part.registry is not None else ""
        p.add_argument(part.option, dest=part.field, metavar=part.metavar, default=part.default,
                       type=int if part.field in INT_FIELDS else str,
                       help=f"{part.help}{names} (default: {part.default})".replace("%", "%%"))
    _parallel_options(p)


#: The parallel layout's options (symmem.policy.Parallel): option, field, type, help.
PARALLEL_OPTIONS = (
    ("--dp", "dp", str, "D", "data-parallel ranks: a number, or d to keep the degree a symbol"),
    ("--zero", "zero", int, "Z", "DeepSpeed ZeRO stage 0-3 (1: optimizer states sharded, 2: + gradients, "
                                 "3: + parameters)"),
    ("--fsdp", "fsdp", str, "NAME", "FSDP sharding: full | grad-op | hybrid (not with --zero)"),
    ("--shard-size", "shard_size", int, "N", "ranks of one shard group under --fsdp hybrid (default 8)"),
    ("--reduce-dtype", "reduce_dtype", str, "DTYPE", "fp32 | bf16 | fp16: what FSDP's mixed precision (a *-master "
                                                     "precision under --fsdp) reduces gradients in (default fp32)"),
    ("--offload", "offload", str, "NAME", "none | optimizer | params | both: what lives on the host"),
    ("--reduce-bucket", "reduce_bucket", int, "N", "DeepSpeed's reduce_bucket_size in elements (default 5e8)"),
    ("--prefetch", "prefetch", int, "N", "units gathered ahead under ZeRO-3/FSDP (default 1)"),
    ("--tp", "tp", str, "T", "tensor-parallel degree (Megatron: the layers and the vocabulary split over T ranks; a number, or t)"),
    ("--sp", "sp", None, None, "sequence parallelism beside --tp (norms, dropouts and residuals split along the sequence)"),
    ("--pp", "pp", str, "P", "pipeline stages (the layers split over P ranks, the embedding on the first, "
                             "the output layer on the last; each stage reported)"),
    ("--schedule", "schedule", str, "NAME", "pipeline schedule: gpipe | 1f1b | interleaved (default 1f1b)"),
    ("--virtual-stages", "virtual_stages", int, "V", "chunks of layers per rank under --schedule interleaved"),
    ("--microbatches", "microbatches", int, "M", "micro-batches of b per optimizer step under --pp "
                                                 "(default 1)"),
    ("--cp", "cp", str, "C", "context-parallel degree (torch's ring attention: each sequence split over C "
                             "ranks, 2C | seq; a number, or c)"),
    ("--ep", "ep", str, "E", "expert-parallel degree (transformers' AllToAllEP: a mixture of experts' E experts split "
                             "over E ranks; a number, or e)"),
    ("--ep-load", "ep_load", str, "NAME", "routing over the expert-parallel ranks: balanced (default) | worst "
                                          "(every pair on one rank's experts)"),
)


def _parallel_options(p):
    """The degrees of the parallel layout, one option each; together they make a Parallel."""
    g = p.add_argument_group("parallel layout (symmem.Parallel; per-rank memory)")
    for option, field, kind, metavar, text in PARALLEL_OPTIONS:
        if kind is None:
            g.add_argument(option, dest=f"par_{field}", action="store_true", default=None, help=text)
        else:
            g.add_argument(option, dest=f"par_{field}", type=kind, metavar=metavar, default=None, help=text)


def _budget_options(p):
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--gpu", metavar="NAME", help="a GPU of the catalog (symmem gpus)")
    where.add_argument("--budget", metavar="SIZE", help="bytes, or a size: 80GiB, 80GB (10^9 bytes)")
    p.add_argument("--reserve", metavar="SIZE", default=DEFAULT_RESERVE,
                   help="set aside for the CUDA context, workspaces and fragmentation: bytes, a "
                        "size (2GiB) or a percentage of the budget (10%%); 0 turns it off "
                        "(default: %(default)s)")
    p.add_argument("--format", default="table", choices=("table", "json"),
                   help="table (for people) or json (for scripts) (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="symmem",
        description="The GPU memory of a training step as closed-form formulas.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    est = sub.add_parser(
        "estimate", help="memory of one training step: components, peak and its formula",
        description="Derive the memory of one training step (forward, backward, optimizer\n"
                    "step) as formulas, and evaluate them at --batch and --seq.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_options(est)
    est.add_argument("--batch", type=positive_int, required=True, metavar="B",
                     help="micro-batch size b (sequences per step on one device)")
    est.add_argument("--seq", type=positive_int, metavar="S",
                     help="sequence length s (tokens per sequence); every model but the image ones needs it")
    _decoder_seq_option(est)
    est.add_argument("--format", default="table", choices=FORMATS,
                     help="table (for people), json (for scripts), latex (default: %(default)s)")
    est.set_defaults(func=cmd_estimate)

    inf = sub.add_parser(
        "infer", help="memory of generation with a KV cache: prefill and one decoding step",
        description="Derive the memory of text generation under torch.no_grad with a KV cache\n"
                    "(the weights, the cache of s + n_g positions, the prefill of the prompt\n"
                    "and one decoding step) as formulas, and evaluate them at --batch, --seq\n"
                    "and --new-tokens.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_options(inf)
    inf.add_argument("--batch", type=positive_int, required=True, metavar="B", help="sequences generated at once b")
    inf.add_argument("--seq", type=positive_int, required=True, metavar="S", help="prompt length s (tokens)")
    inf.add_argument("--new-tokens", type=positive_int, required=True, metavar="N",
                     help="tokens generated n_g (the cache then holds s + n_g positions)")
    inf.add_argument("--format", default="table", choices=FORMATS,
                     help="table (for people), json (for scripts), latex (default: %(default)s)")
    inf.set_defaults(func=cmd_infer)

    mb = sub.add_parser(
        "max-batch", help="the largest micro-batch that fits a GPU or a budget",
        description="The largest micro-batch b whose training-step peak fits the budget\n"
                    "minus the reserve, with its proof, the boundary formula and the\n"
                    "breakdown at the answer.",
        epilog=SOLVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_options(mb)
    mb.add_argument("--seq", type=positive_int, metavar="S",
                    help="sequence length s (tokens per sequence); every model but the image ones needs it")
    mb.add_argument("--new-tokens", type=positive_int, metavar="N",
                    help="with --mode inference: tokens generated n_g")
    _decoder_seq_option(mb)
    _budget_options(mb)
    mb.set_defaults(func=cmd_max_batch)

    sv = sub.add_parser(
        "solve", help="the largest (or smallest) value of any symbol that fits",
        description="The largest value of a symbol memory grows with (--max: b, s, L, h)\n"
                    "or the smallest of one it falls with (--min), every other symbol fixed.",
        epilog=SOLVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_options(sv)
    sv.add_argument("--for", dest="symbol", required=True, metavar="SYMBOL",
                    help="the symbol to solve for (b, s, L, h, ...)")
    way = sv.add_mutually_exclusive_group()
    way.add_argument("--max", dest="direction", action="store_const", const="max",
                     help="the largest value that fits (the default)")
    way.add_argument("--min", dest="direction", action="store_const", const="min",
                     help="the smallest value that fits")
    sv.add_argument("--batch", type=positive_int, metavar="B", help="fix b")
    sv.add_argument("--seq", type=positive_int, metavar="S", help="fix s")
    sv.add_argument("--new-tokens", type=positive_int, metavar="N", help="fix n_g (--mode inference)")
    _decoder_seq_option(sv)
    sv.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="fix any other symbol, e.g. --set L=48 (repeatable)")
    _budget_options(sv)
    sv.set_defaults(func=cmd_solve, direction="max")

    lst = sub.add_parser("models", help="list the model families and their presets",
                         description="List the model families (the Hugging Face model_type each\n"
                                     "reads with --config) and their presets (what --model accepts,\n"
                                     "by name or Hugging Face id), with exact parameter counts.",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    lst.add_argument("--format", default="table", choices=("table", "json"),
                     help="(default: %(default)s)")
    lst.set_defaults(func=cmd_models)
    pol = sub.add_parser("policies", help="list the policy parts and the names each accepts",
                         description="List every part of a training policy (the options\n"
                                     "estimate, max-batch, solve, sweep and report take), with the\n"
                                     "names each accepts and what they mean.",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    pol.add_argument("--format", default="table", choices=("table", "json"), help="(default: %(default)s)")
    pol.set_defaults(func=cmd_policies)
    gp = sub.add_parser("gpus", help="list the GPU catalog",
                        description="List the GPUs --gpu accepts, with the capacity each reports.")
    gp.add_argument("--format", default="table", choices=("table", "json"), help="(default: %(default)s)")
    gp.set_defaults(func=cmd_gpus)

    sw = sub.add_parser(
        "sweep", help="every component and the peak over a grid of batches and sequence lengths",
        description="Evaluate the compiled formulas at every (b, s) of a grid, exactly, and\n"
                    "print one row per point (CSV or JSON). A progress bar shows on long sweeps.",
        epilog=SWEEP_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_options(sw)
    sw.add_argument("--batch", required=True, metavar="VALUES",
                    help="b values: a list (1,2,4,8) or a range FIRST:LAST[:STEP], inclusive (1:64)")
    sw.add_argument("--seq", required=True, metavar="VALUES", help="s values, as for --batch")
    sw.add_argument("--format", default="csv", choices=("csv", "json"), help="(default: %(default)s)")
    bar = sw.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_const", const=True,
                     help="always show the progress bar (on stderr)")
    bar.add_argument("--no-progress", dest="progress", action="store_const", const=False,
                     help="never show it (by default it shows when stderr is a terminal)")
    sw.set_defaults(func=cmd_sweep, progress=None)
    ft = sub.add_parser(
        "fit", help="the smallest cluster that fits: layouts, fewest GPUs first",
        description="Every layout symmem models that trains the model on the GPU (or budget)\n"
                    "at --seq and --global-batch: GPU counts 1, 2, 4, ... --max-gpus; tensor\n"
                    "parallelism with sequence parallelism (tp 1-8), 1F1B pipelines of 2, 4, ...\n"
                    "--max-pp stages (interleaved over 2, 4, ... --max-v chunks a rank), context\n"
                    "parallelism over 2, 4, ... --max-cp ranks, expert parallelism over 2, 4, ...\n"
                    "--max-ep ranks, DDP, ZeRO 1-3 or FSDP over the rest; no, selective or full\n"
                    "recomputation; the largest micro-batch that fits, the rest accumulated (or run\n"
                    "through the pipeline). Fewest GPUs first, then the lowest peak.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ft.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="NAME", help="a preset, by name or Hugging Face id")
    src.add_argument("--config", metavar="PATH", help="a local Hugging Face config.json, or its folder")
    ft.add_argument("--seq", type=positive_int, required=True, metavar="S", help="sequence length s")
    ft.add_argument("--global-batch", type=positive_int, required=True, metavar="B",
                    help="sequences per optimizer step, over all data-parallel ranks")
    ft.add_argument("--max-gpus", type=positive_int, default=64, metavar="N",
                    help="the most GPUs to try (default: %(default)s)")
    ft.add_argument("--max-pp", type=positive_int, default=8, metavar="P",
                    help="the most pipeline stages to try; 1: no pipeline (default: %(default)s)")
    ft.add_argument("--max-cp", type=positive_int, default=1, metavar="C",
                    help="the most context-parallel ranks to try (2, 4, ... with 2C | seq: torch's ring "
                         "attention for long sequences); 1: none (default: %(default)s)")
    ft.add_argument("--max-v", type=positive_int, default=1, metavar="V",
                    help="the most chunks a rank of an interleaved pipeline to try (2, 4, ...: Megatron's "
                         "virtual stages); 1: 1F1B only (default: %(default)s)")
    ft.add_argument("--max-ep", type=positive_int, default=1, metavar="E",
                    help="the most expert-parallel ranks to try (2, 4, ... dividing the experts and dp, "
                         "beside DDP or FSDP full shard); 1: none (default: %(default)s)")
    ft.add_argument("--precision", default="bf16-mixed", metavar="NAME", help="(default: %(default)s)")
    ft.add_argument("--optimizer", default="adamw", metavar="NAME", help="(default: %(default)s)")
    ft.add_argument("--device", default="cuda", metavar="NAME", help="(default: %(default)s)")
    _budget_options(ft)
    ft.set_defaults(func=cmd_fit)
    _add_report_commands(sub)
    return parser


def cmd_fit(args) -> int:
    from .fit import fit, table
    graph = _graph(args)
    bud = make_budget(gpu=args.gpu, bytes=args.budget, reserve=args.reserve)
    layouts = fit(graph, bud, args.seq, args.global_batch, precision=args.precision, optimizer=args.optimizer,
                  device=args.device, max_gpus=args.max_gpus, max_pp=args.max_pp, max_cp=args.max_cp,
                  max_ep=args.max_ep, max_v=args.max_v, derive=cached_estimate)
    if args.format == "json":
        print(json.dumps({"model": graph.name, "budget": bud.label, "usable": bud.usable, "seq": args.seq,
                          "global_batch": args.global_batch, "layouts": [x.as_dict() for x in layouts]},
                         indent=2))
        return 0
    print(f"symmem fit: {graph.name}, s = {args.seq:,}, global batch {args.global_batch:,}, "
          f"{args.precision}, {args.optimizer}")
    print(f"budget: {bud.label}")
    if not layouts:
        print(f"no layout of up to {args.max_gpus} GPUs fits: raise --max-gpus, or lower --seq")
        return 1
    print(table(layouts))
    return 0


def _negative_values(argv: list[str]) -> list[str]:
    """``--budget -5GB`` -> ``--budget=-5GB``: argparse takes a value that starts with "-"
    (but is not a plain number) for an option and says "expected one argument"; joined,
    the value reaches symmem's own check, which names it."""
    out: list[str] = []
    for tok in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and len(tok) > 1 \
                and tok[0] == "-" and (tok[1].isdigit() or tok[1] == "."):
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (argparse exits 2 itself on bad usage)."""
    raw = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(_negative_values(raw))
    args.argv = raw                  # what a kit of this question is kept under (symmem.kit)
    try:
        status = args.func(args)
        cache.store()
        return status
    except SymmemError as e:
        print(f"symmem: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:     # the reader stopped early (`symmem ... | head`): not an error
        sys.stdout = None
        return 0


# --------------------------------------------------------------------------- estimate

@functools.lru_cache(maxsize=8)
def _preset_estimate(name: str, policy: Policy):
    """Derivations of presets are reused when ``main`` runs several times in one process (and
    across processes through the cache on disk, :mod:`symmem.cache`)."""
    return cached_estimate(models.preset(name), policy)


def _policy(args) -> Policy:
    fields = {part.field: getattr(args, part.field) for part in PARTS}
    given = {f: getattr(args, f"par_{f}") for _, f, *_ in PARALLEL_OPTIONS
             if getattr(args, f"par_{f}", None) is not None}
    if given:
        if str(fields["parallel"]).lower() != "none":
            raise ConfigError("--parallel", fields["parallel"], "none when --dp, --zero, --fsdp, ... are given",
                              "Give the layout one way: --parallel dp=8,zero=3 or --dp 8 --zero 3.")
        fields["parallel"] = Parallel(**given)
    return Policy(**fields)


def policy_inputs(policy: Policy) -> dict:
    """The policy as JSON ``inputs`` print it: every part by name, and the implementation
    PyTorch would pick for ``auto``."""
    out = {part.field: getattr(policy, part.field) for part in PARTS}
    out["recompute"] = str(policy.recompute)
    out["parallel"] = str(policy.parallel)
    rank = policy.lora.rank if policy.lora else None
    out["lora"] = rank if rank is None or isinstance(rank, int) else str(rank)      # 8, or "r"
    out["lora_targets"] = list(policy.lora_targets) if policy.lora_targets else None
    out["quantize_skip"] = list(policy.quantize_skip) if policy.quantize_skip else None
    out["implementation_resolved"] = policy.impl
    if policy.mode != "inference":      # the KV cache's kind means nothing to a training step
        del out["cache"], out["logits"]
    if policy.cache != "static":        # nor a static cache's length to another cache
        del out["max_cache_len"]
    if policy.cache not in QUANTO_BITS:     # nor a quanto cache's residual to another
        del out["residual_length"], out["q_group_size"], out["residual_position"]
    return out


def _load(args, policy: Policy):
    """The estimate of the model ``args`` names (``--tie/--no-tie`` applied), once the model
    has accepted ``--seq``."""
    tie, share = getattr(args, "tie", None), getattr(args, "share", None) or ()
    if args.model is not None and tie is None and not share:
        return _preset_estimate(args.model, policy)
    return cached_estimate(_graph(args), policy)


def _graph(args):
    """The graph of the model ``args`` names: a preset or a config.json, with ``--tie`` and
    ``--share`` where the command has them."""
    tie, share = getattr(args, "tie", None), getattr(args, "share", None) or ()
    try:
        fam, cfg = models.preset_config(args.model) if args.model is not None else models.hf_config(args.config)
    except OSError as e:          # unreadable file: say so, no traceback
        raise ConfigError("config", args.config, "a readable config.json", str(e)) from None
    if tie is not None:
        if not hasattr(cfg, "tie_word_embeddings"):
            raise ConfigError("--tie" if tie else "--no-tie", tie, "a model whose config has tie_word_embeddings",
                              f"The {fam.name} family has no tied output layer to choose.")
        cfg = replace(cfg, tie_word_embeddings=tie)
    if "qkv" in share:
        if not hasattr(cfg, "shared_qkv"):
            raise ConfigError("--share", "qkv", "a model whose query, key and value come from one projection",
                              f"The {fam.name} family has no shared_qkv to set.")
        cfg = replace(cfg, shared_qkv=True)
    graph = fam.build(cfg)
    if "layers" in share:
        blocks = [rep.name for rep in graph.layer_blocks()]
        if len(blocks) != 1:
            raise ConfigError("--share", "layers", "a model with one repeated block",
                              f"{graph.name!r} has {len(blocks)}: share them in Python with "
                              "graph.with_shared_layers(name).")
        graph = graph.with_shared_layers(blocks[0])
    return graph


def _number(v):
    v = sp.sympify(v)
    return int(v) if v.is_Integer else str(v)


def _report(args, policy: Policy) -> dict:
    """What ``args.format`` prints, computed once: the formulas as text (the peak's candidates,
    its LaTeX, each component) for JSON alone, the regions for JSON and the table."""
    est = _load(args, policy)
    est = est._region({"s": args.seq})     # past a sliding window: that region (kernels, formulas)
    bindings = est.bindings
    inference = policy.mode == "inference"
    seq = {} if args.seq is None else {"s": args.seq}      # image models have no s
    try:
        ev = est.at(b=args.batch, **seq, **_decoder(args), **({"n_g": args.new_tokens} if inference else {}))
    except ConfigError as e:
        if e.field != "values" or not isinstance(e.value, list):
            raise
        from .symbols import TABLE
        meanings = "; ".join(f"{n}: {TABLE[n].meaning}" for n in e.value if n in TABLE)
        raise _missing(e.value, f"the formulas of {est.graph.name} use {', '.join(e.value)} ({meanings})",
                       args) from None
    point = ev.peak_point
    active = canonical(point.total)
    regions = () if inference or args.format == "latex" else est.regions(**_decoder(args))  # no n_g axis
    r = {
        "est": est, "ev": ev, "active": active, "regions": regions,
        "json": {
            "symmem_version": __version__,
            "inputs": {"model": est.graph.name, "config": args.config, "batch": args.batch,
                       "seq": args.seq, **_decoder(args), "tie": getattr(args, "tie", None),
                       "share": list(getattr(args, "share", None) or ()), **policy_inputs(est.policy),
                       "attention_kernels": list(est.kernels)},
            "batch_per_step": args.batch * policy.micro_batches,   # b*K sequences per optimizer step
            "bindings": {str(k): _number(v) for k, v in bindings.items()},
            "parameters": _parameters(est),
            "bytes": {k: ev.bytes[k] for k in (*COMPONENTS, *(("cache",) if inference else ()), "peak")},
            **({"host_bytes": ev.bytes["host"]} if "host" in ev.bytes else {}),
            **({"new_tokens": args.new_tokens, "phase_peaks": _phase_peaks(est, ev)} if inference else {}),
            "peak_phase": point.phase,
            "peak_node": point.node,
            "peak_iteration": point.iteration or None,
            "peak_where": point.where,
            "peak_breakdown": {role: v for role, v in ev.peak_parts.items() if role != "cache" or inference},
            **_ranks(est, ev, args),
        },
    }
    if args.format == "json":       # the formulas as text: the JSON's alone, and the slowest to print
        r["json"]["peak_regions"] = [{"where": reg.point.where, "share": round(reg.share, 4), "b": list(reg.b),
                                      "s": list(reg.s) if reg.s else None, "bs": list(reg.bs),
                                      "formula": str(canonical(reg.point.total))} for reg in regions]
        r["json"]["components"] = {k: str(v) for k, v in est.components.items()}
        r["json"]["formula"] = {"peak": str(est.peak), "latex": render_latex_expr(est.peak),
                                "peak_candidates": len(est.peak.args), "peak_at_inputs": str(active),
                                "candidates": [str(c) for c in est.candidates]}
    return r


def _phase_peaks(est, ev) -> dict:
    """Each phase's own largest moment at the evaluation's values (prefill, decode)."""
    subs = est._subs(ev.values)
    return {phase: max(int(sp.ceiling(p.total.xreplace(subs))) for p in points)
            for phase, points in est.phase_points().items()}


def cmd_infer(args) -> int:
    """``symmem infer``: ``estimate`` in inference mode, at --new-tokens as well."""
    args.mode = "inference"
    return cmd_estimate(args)


def cmd_estimate(args) -> int:
    policy = _policy(args)
    if policy.mode == "inference" and not hasattr(args, "new_tokens"):
        raise ConfigError("mode", "inference", "training for symmem estimate",
                          "Use symmem infer (the same options, and --new-tokens N for the decoding step).")
    r = _report(args, policy)
    if args.format == "latex":
        print(render_latex(args, policy, r))
        return 0
    if args.format == "json":
        shown = r["json"]
        print(json.dumps(shown, indent=2))
    else:
        shown = table_view(args, policy, r)
        print(kit.render(shown))
    if cache.cache_dir() is not None:
        built = make_kit(args, shown, r, kit.load(args.argv))
        if built is not None:
            kit.save(args.argv, built)
    return 0


def _policy_line(est) -> str:
    """``policy: ...`` wrapped at spaces only ("for-loop", "micro-batches" stay whole)."""
    return textwrap.fill(f"policy: {est.describe()}", WIDTH, subsequent_indent="  ", break_on_hyphens=False)


def _free_values(args) -> dict:
    """The values of the question a kit leaves free (:data:`symmem.kit.FREE`): b, s and n_g
    where the command has them."""
    return {"b": args.batch, **({} if args.seq is None else {"s": args.seq}),
            **({} if getattr(args, "new_tokens", None) is None else {"n_g": args.new_tokens})}


def table_view(args, policy: Policy, r: dict) -> dict:
    """What the table shows, as plain data: the lines that do not depend on the values
    (kept in a :mod:`symmem.kit`) and the values' bytes, roles and formulas."""
    est, ev, j = r["est"], r["ev"], r["json"]
    source = f"config {args.config}" if args.config else "preset"
    if j["inputs"].get("tie") is not None:          # what --tie/--no-tie and --share changed
        source += "; tied output layer" if j["inputs"]["tie"] else "; own output layer"
    if j["inputs"].get("share"):
        source += f"; shared: {', '.join(j['inputs']['share'])}"
    degrees = {sym.name for sym in DEGREES.values() if sym is not None}   # the policy line names the layout
    dims = ", ".join(f"{k} = {v:,}" if isinstance(v, int) else f"{k} = {v}"
                     for k, v in j["bindings"].items() if not k.startswith("B_") and k not in degrees)
    inference = policy.mode == "inference"
    w = 34
    ranks = []
    if "ranks" in j:
        ranks = [f"{'pipeline stage':<{w}}{'params':>14}{'activations':>14}{'peak':>14}  peak during",
                 *(f"{str(x['stage']) + (' (most loaded)' if x['stage'] == j['most_loaded'] else ''):<{w}}"
                   f"{format_bytes(x['bytes']['params']):>14}{format_bytes(x['bytes']['activations']):>14}"
                   f"{format_bytes(x['bytes']['peak']):>14}  {x['peak_where'].split(': ', 1)[1]}"
                   for x in j["ranks"]),
                 "", f"the most loaded stage, {j['most_loaded']}:"]
    regions = r["regions"]
    head = [f"where each candidate is the peak (b up to 65,536{', s up to s_max' if regions[0].s else ''}, "
            "a log grid):"] if regions else []
    return {
        "title": f"symmem {'infer' if inference else 'estimate'}: {est.graph.name} ({source}), "
                 f"{j['parameters']:,} parameters",
        "policy": _policy_line(est), "dims": dims, "decoder": list(_decoder(args).values()),
        "micro_batches": policy.micro_batches, "inference": inference,
        "components": [*COMPONENTS, *(("cache",) if inference else ())], "roles": list(ROLES),
        "candidates": len(est.candidates), "regions": head + [wrap(str(reg)) for reg in regions],
        "ranks_lines": ranks, "values": _free_values(args), "bytes": dict(ev.bytes), "parts": dict(ev.peak_parts),
        "where": ev.peak_point.where, "active": str(r["active"]),
        "bound": str(canonical(r["active"].xreplace(est.bindings))),
    }


def make_kit(args, shown: dict, r: dict, old: dict | None = None) -> dict | None:
    """The :mod:`symmem.kit` of this answer, a table's ``shown`` view or JSON document
    (``old``, the one kept so far, with this answer's candidate added): what it shows that
    does not depend on the values (:func:`symmem.kit.split`); the components, the requirements
    and every candidate of the peak as formulas in the free values (:func:`symmem.kit.tree`),
    for JSON of inference each phase's too; and, for the candidates that were the peak of a
    question so far, what the answer shows of them (their roles, where, their formula: sympy
    prints it, so each is added when first needed). None where a kit does not answer (a
    pipeline's stages, b = 1, a factor a tree cannot hold)."""
    est, ev = r["est"], r["ev"]
    if est.ranks or args.batch == 1:
        return None
    free = set(_free_values(args))
    compiled = est.compiled(free={symbols.symbol(k) for k in free})
    i = next(j for j, p in enumerate(est.points) if p is ev.peak_point)
    reqs = []
    for req in est.requirements:
        sides = [kit.tree(sp.expand(sp.sympify(x).xreplace(compiled.bindings))) for x in (req.lhs, req.rhs)]
        if req.kind not in ("at most", "divides") or None in sides:
            return None
        reqs.append([req.kind, *sides])
    static, seen = kit.split(shown, args.format)
    phases = est.phase_points() if "phase_peaks" in shown else {}
    new = {"free": sorted(free), "fixed": _decoder(args), "format": args.format, "static": static,
           "micro_batches": est.policy.micro_batches, "requirements": reqs,
           "components": {k: kit.tree(f.expr) for k, f in compiled.components.items()},
           "totals": [kit.tree(f.expr) for f in compiled.totals],
           "phases": {k: [kit.tree(sp.expand(p.total.xreplace(compiled.bindings))) for p in ps]
                      for k, ps in phases.items()},
           "details": {}}
    # the lines kept so far belong to the same formulas (another region of a sliding window's
    # model, asked under the same key, starts afresh)
    if old is None or any(old.get(k) != new[k] for k in new if k != "details"):
        old = new
    parts = {role: kit.tree(f.expr) for role, f in compiled.parts(i)}
    trees = (*old["components"].values(), *old["totals"], *(t for ts in old["phases"].values() for t in ts))
    if None in (*trees, *parts.values()) or set(parts) != set(ROLES):
        return None
    old["details"][str(i)] = {"parts": parts, **seen}
    return old


def _parameters(est) -> int:
    """The model's parameters (adapters included), each once: every stage's under a pipeline."""
    if not est.ranks:
        return int(est.prepared.param_count().xreplace(est.bindings))
    whole, layers = {}, sp.Integer(0)       # a tied output layer's copy on the last stage once
    for g in (r.prepared for r in est.ranks):
        outside = {q.name for item in g.items if isinstance(item, Node) for q in item.params}
        for q, m in g.params():
            if q.name in outside:
                whole[q.name] = q.numel
            else:
                layers += q.numel * m
    return int((layers + sum(whole.values(), sp.Integer(0))).xreplace(est.bindings))


def _ranks(est, ev, args) -> dict:
    """Under pipeline parallelism, each stage's bytes and peak (``ranks``) and the most loaded
    one's index (``most_loaded``; ``bytes`` are its)."""
    if not est.ranks:
        return {}
    values = {"b": args.batch, **({} if args.seq is None else {"s": args.seq}), **_decoder(args)}
    ranks = []
    for i, rank in enumerate(est.ranks):
        e = rank.at(**values)
        ranks.append({"stage": i, "bytes": {k: e.bytes[k] for k in (*COMPONENTS, "peak")},
                      "peak_phase": e.peak_point.phase, "peak_where": e.peak_point.where})
    return {"ranks": ranks, "most_loaded": int(ev.peak_point.rank)}


def render_latex(args, policy: Policy, r: dict) -> str:
    est, ev = r["est"], r["ev"]
    bind = ", ".join(f"{k} = {v}" for k, v in r["json"]["bindings"].items())

    def tex(e):
        return render_latex_expr(e)

    out = [f"% symmem estimate: {est.graph.name}; b = {args.batch}" + ("" if args.seq is None else f", s = {args.seq}"),
           *textwrap.wrap(f"policy: {est.describe()}", WIDTH, initial_indent="% ",
                          subsequent_indent="%   "),
           f"% bindings: {bind}",
           f"% peak = {ev.peak:,} bytes ({format_bytes(ev.peak)}) during {ev.peak_point.where}",
           r"\begin{aligned}"]
    rows = [(k, v) for k, v in est.components.items() if not (k in ("master", "buffers") and v == 0)]
    for i, (k, v) in enumerate(rows):
        end = r" \\" if i < len(rows) - 1 else ""
        out.append(rf"\mathrm{{{k}}} &= {tex(v)}{end}  % {ev.bytes[k]:,} bytes")
    out += [r"\end{aligned}", "",
            f"% the peak: the max over {len(est.points)} candidate points of the step",
            r"\begin{aligned}"]
    for i, p in enumerate(est.points):
        head = r"\mathrm{peak} = \max\bigl(\, " if i == 0 else ""
        end = r" \,\bigr)" if i == len(est.points) - 1 else r", \\"
        out.append(rf"{head}& {tex(canonical(p.total))}{end}  % {p.where}")
    out.append(r"\end{aligned}")
    return "\n".join(out)


# --------------------------------------------------------------------------- solve

def _decoder_seq_option(parser) -> None:
    parser.add_argument("--decoder-seq", type=positive_int, metavar="S_D",
                        help="decoder (target) length s_d of an encoder-decoder model (T5's labels)")


def _decoder(args) -> dict:
    """``{"s_d": --decoder-seq}`` where it was given."""
    return {"s_d": args.decoder_seq} if getattr(args, "decoder_seq", None) is not None else {}


def _fixed(args) -> dict:
    fixed = {}
    if getattr(args, "batch", None) is not None:
        fixed["b"] = args.batch
    if getattr(args, "seq", None) is not None:
        fixed["s"] = args.seq
    if getattr(args, "new_tokens", None) is not None:
        fixed["n_g"] = args.new_tokens
    fixed.update(_decoder(args))
    for item in getattr(args, "set", []):
        name, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit() or int(value) < 1:
            raise ConfigError("--set", item, "NAME=VALUE with a positive integer value, e.g. L=48")
        fixed[name.strip()] = int(value)
    return fixed


def _solution_json(sol, bud, est) -> dict:
    key = "max_batch" if sol.symbol == "b" and sol.direction == "max" else "value"
    return {
        "symmem_version": __version__,
        "model": est.graph.name, "policy": est.describe(),
        "symbol": sol.symbol, "direction": sol.direction, "fixed": sol.fixed,
        key: sol.value,
        "budget": bud.label,
        "budget_bytes": bud.total, "reserve_bytes": bud.reserve, "usable_bytes": bud.usable,
        "bytes_at_max": sol.at_value.bytes,
        "bytes_past_max": sol.past_value.bytes if sol.past_value is not None else None,
        **({"host_bytes": sol.at_value.bytes["host"]} if "host" in sol.at_value.bytes else {}),
        "peak_where_at_max": sol.at_value.peak_point.where,
        "boundary": None if sol.boundary is None else {
            "formula": str(sol.boundary), "latex": render_latex_expr(sol.boundary),
            "with_numbers": str(sol.boundary_numeric)},
        "binding": {"where": sol.binding.where, "phase": sol.binding.phase,
                    "node": sol.binding.node, "formula": str(canonical(sol.binding.total))},
        "limited_by_model": sol.limit,
    }


#: The option that fixes a symbol; any other is fixed with solve's --set NAME=VALUE, or by the
#: model's config.
SHELL_FLAGS = {"b": "--batch B", "s": "--seq S", "s_d": "--decoder-seq S_D", "d": "--dp D", "t": "--tp T",
               "c": "--cp C", "e": "--ep E", "n_g": "--new-tokens N", "r": "--lora R (a number)"}


def _missing(names: list, why: str, args, settable: bool = False) -> ConfigError:
    """The library names missing keyword arguments (s=...): say it with the shell's flags and
    what ``args`` gave them (``--lora r``: the rank left a symbol); ``settable``: the command
    has ``--set``, otherwise a symbol without a flag is the model's, fixed in its config."""
    def flag(n):
        return SHELL_FLAGS.get(n) or (f"--set {n}=VALUE" if settable else f"a --config whose values fix {n}")
    flags = [flag(n) for n in names]
    first = flags[0].split()[0] if flags[0].startswith("--") else names[0]
    given = getattr(args, first.lstrip("-").replace("-", "_"), None)
    return ConfigError(first, given, f"a value: {why}", f"Pass {' and '.join(flags)}.")


def _run_solve(args, symbol: str, direction: str, fixed: dict) -> int:
    from .errors import Infeasible
    from .solve import solve
    policy = _policy(args)
    est = _load(args, policy)
    bud = make_budget(gpu=args.gpu, bytes=args.budget, reserve=args.reserve)
    try:
        sol = solve(est, symbol, bud, direction=direction, **fixed)
    except ConfigError as e:
        if e.field != "values" or not isinstance(e.value, list):
            raise
        raise _missing(e.value, f"solving for {symbol} needs {', '.join(e.value)} fixed", args,
                       settable=hasattr(args, "set")) from None
    except Infeasible as e:
        if args.format == "json":
            print(json.dumps({"symbol": symbol, "direction": direction, "fixed": fixed,
                              ("max_batch" if symbol == "b" and direction == "max" else "value"): None,
                              "budget": bud.label, "budget_bytes": bud.total,
                              "reserve_bytes": bud.reserve, "usable_bytes": bud.usable,
                              "needed_bytes": e.needed, "error": str(e).splitlines()[0]}, indent=2))
        raise
    if args.format == "json":
        print(json.dumps(_solution_json(sol, bud, est), indent=2))
        return 0
    out = [f"symmem {args.command}: {est.graph.name}" + "".join(f"{'; ' if i == 0 else ', '}{k} = {v:,}"
                                                            for i, (k, v) in enumerate(fixed.items())),
           _policy_line(est),
           f"budget: {bud.label}", "",
           str(sol), "", f"breakdown at {symbol} = {sol.value:,}:", sol.at_value.table()]
    if sol.boundary_numeric is not None:
        out.insert(-3, wrap(f"with this model's numbers: {symbol} = {sol.boundary_numeric}"))
    print("\n".join(out))
    return 0


def cmd_max_batch(args) -> int:
    return _run_solve(args, "b", "max", _fixed(args))


def cmd_solve(args) -> int:
    return _run_solve(args, args.symbol, args.direction, _fixed(args))


def _values(text: str, flag: str):
    """``"1,2,8"`` -> a list, ``"1:64"`` / ``"1:64:2"`` (inclusive) -> a ``range`` (never
    written out: a range of 10^9 values costs nothing until the sweep reaches it); positive
    integers either way."""
    try:
        if ":" in text:
            parts = [int(p) for p in text.split(":")]
            if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] < 1):
                raise ValueError
            values = range(parts[0], parts[1] + 1, parts[2] if len(parts) == 3 else 1)
        else:
            values = [int(p) for p in text.split(",")]
    except ValueError:
        values = []
    if not len(values) or min(values[0], values[-1]) < 1 or (isinstance(values, list) and min(values) < 1):
        raise ConfigError(flag, text, "positive integers: a list like 1,2,8 or a range like 1:64 or 1:64:2")
    return values


def _largest(values) -> int:
    return values[-1] if isinstance(values, range) else max(values)


def _take(values, index):
    """``values[index]`` for an array of indices, a range computed rather than stored."""
    import numpy as np
    if isinstance(values, range):
        return values.start + values.step * index
    return np.asarray(values, dtype=np.int64)[index]


class Progress:
    """A one-line progress bar on stderr: ``[#####-----] 50% 500,000/1,000,000 points``."""

    def __init__(self, total: int, enabled: bool, width: int = 30):
        self.total, self.enabled, self.width, self.done = total, enabled, width, 0

    def advance(self, n: int) -> None:
        self.done += n
        if self.enabled:
            filled = self.width * self.done // self.total
            sys.stderr.write(f"\r[{'#' * filled}{'-' * (self.width - filled)}] "
                             f"{100 * self.done // self.total:3d}% {self.done:,}/{self.total:,} points")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


SWEEP_CHUNK = 100_000


def cmd_sweep(args) -> int:
    est = _load(args, _policy(args))
    bs, ss = _values(args.batch, "--batch"), _values(args.seq, "--seq")
    est.at(b=_largest(bs), s=_largest(ss))   # the model's limits (e.g. s <= s_max), checked once
    names = (*COMPONENTS, "peak")
    fns = {n: est.evaluator("b", "s", component=n) for n in names}
    total = len(bs) * len(ss)
    enabled = args.progress if args.progress is not None else (sys.stderr.isatty() and total > SWEEP_CHUNK)
    try:
        _sweep_rows(bs, ss, fns, ("b", "s", *names), Progress(total, enabled), args.format, sys.stdout)
    except BrokenPipeError:     # the reader stopped early (| head): not an error
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _sweep_rows(bs, ss, fns, header, bar, fmt, out) -> None:
    """Row i is (bs[i // len(ss)], ss[i % len(ss)]) and its bytes; SWEEP_CHUNK rows at a
    time, written as they are computed, so memory stays bounded however large the grid."""
    import numpy as np
    total = len(bs) * len(ss)
    out.write("[" if fmt == "json" else ",".join(header) + "\n")
    for start in range(0, total, SWEEP_CHUNK):
        index = np.arange(start, min(start + SWEEP_CHUNK, total), dtype=np.int64)
        b_part, s_part = _take(bs, index // len(ss)), _take(ss, index % len(ss))
        columns = [b_part, s_part] + [np.broadcast_to(fns[n](b=b_part, s=s_part), b_part.shape) for n in header[2:]]
        rows = zip(*(c.tolist() for c in columns))
        if fmt == "json":
            text = ",".join(json.dumps(dict(zip(header, map(int, row)))) for row in rows)
            out.write(("," if start else "") + text)
        else:
            out.write("".join(",".join(str(int(v)) for v in row) + "\n" for row in rows))
        bar.advance(index.size)
    if fmt == "json":
        out.write("]\n")


def _policy_entries(part) -> list[tuple[str, str]]:
    from .policy import RECOMPUTE
    if part.field == "recompute":
        return [(m.syntax, m.description) for m in RECOMPUTE.values()]
    if part.registry is not None:
        return [(e.name, e.description) for e in part.registry.values()]
    return {"accumulate": [("K", "a whole number >= 1 (1: no gradient accumulation)")],
            "parallel": [("none", "one device"),
                         ("KEY=VALUE,...", "the fields of symmem.Parallel: dp, zero, fsdp, shard_size, offload, "
                                           "reduce_bucket, prefetch, tp, sp, pp, schedule, virtual_stages, "
                                           "microbatches, cp, ep, ep_load")],
            "lora": [("none", "no adapters: every weight trained"),
                     ("R", "a rank >= 1: adapters A (R x in) and B (out x R) beside each target"),
                     ("r", "the rank as the symbol r, which stays in the formulas")],
            "lora_targets": [("NAMES", "module names, comma-separated (c_attn, c_proj, c_fc, lm_head for GPT-2)")],
            "quantize_skip": [("NAMES", "module names (c_proj, attn: every linear layer in the module)"),
                              ("first:N, last:N", "the first or last N layers of the repeated block")],
            "keep_fp32": [("NAMES", "module names (lm_head, attn: every operator of the module)"),
                          ("first:N, last:N", "the first or last N layers of the repeated block")],
            "max_cache_len": [("N", "positions a static cache preallocates (default: s + n_g)")],
            "residual_length": [("N", "a quanto cache's positions kept unquantized (default: 128)")],
            "q_group_size": [("G", "a quanto cache's elements per scale and shift, dividing kv heads x positions x "
                                   "head_dim of what it quantizes (default: 64)")],
            "residual_position": [("P", "0 to residual_length - 1: the decoding step n_g with n_g - 1 ≡ P "
                                        "(mod residual_length); default residual_length - 1, the flush")],
            }[part.field]


def cmd_policies(args) -> int:
    """Each policy part: its option and default, then its names with their meaning."""
    if args.format == "json":
        print(json.dumps({"parts": [
            {"field": part.field, "option": part.option, "default": str(part.default), "help": part.help,
             "names": [{"name": n, "description": d} for n, d in _policy_entries(part)]}
            for part in PARTS]}, indent=2))
        return 0
    for part in PARTS:
        print(textwrap.fill(f"{part.option} {part.metavar}  (default: {part.default}): {part.help}", WIDTH,
                            subsequent_indent="    ", break_on_hyphens=False))
        entries = _policy_entries(part)
        width = max(len(n) for n, _ in entries) + 4
        for name, text in entries:
            print(textwrap.fill(text, WIDTH, initial_indent=f"  {name:<{width}}",
                                subsequent_indent=" " * (width + 2), break_on_hyphens=False))
        print()
    return 0


def cmd_gpus(args) -> int:
    if args.format == "json":
        print(json.dumps({"gpus": [{"name": g.name, "memory_bytes": g.memory, "marketing": g.marketing,
                                    "source": g.source} for g in CATALOG.values()]}, indent=2))
        return 0
    print(f"{'name':<12}{'bytes':>18}{'GiB':>9}  marketing")
    for g in CATALOG.values():
        print(f"{g.name:<12}{g.memory:>18,}{g.memory / 2**30:>9.2f}  {g.marketing}")
    return 0


# --------------------------------------------------------------------------- models

MODEL_COLUMNS = (("parameters", "parameters"), ("L", "layers"), ("h", "hidden"), ("a", "heads"),
                 ("V", "vocab"), ("s_max", "positions"))


def cmd_models(args) -> int:
    """Families, then their presets: exact parameter count, L, h, a, V, s_max, Hugging Face id."""
    rows = models.summaries()
    if args.format == "json":
        out = [{"name": fam.name, "description": fam.description, "model_types": list(fam.model_types),
                "presets": [{k: v for k, v in vars(r).items() if k != "family"}
                            for r in rows if r.family == fam.name]}
               for fam in models.families()]
        print(json.dumps({"families": out}, indent=2))
        return 0
    print("Presets for --model (by name or Hugging Face id); model_type: what --config reads.")
    print("L layers, h hidden size, a heads, V vocabulary, s_max positions.")
    for fam in models.families():
        print()
        print(textwrap.fill(f"{fam.name}: {fam.description}", WIDTH, subsequent_indent="  "))
        print(f"  model_type: {', '.join(fam.model_types)}")
        table = [("preset", *(head for head, _ in MODEL_COLUMNS), "Hugging Face id")]
        table += [(r.name, *("-" if getattr(r, attr) is None else f"{getattr(r, attr):,}"
                             for _, attr in MODEL_COLUMNS), r.hf_id or "-")
                  for r in rows if r.family == fam.name]
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
        for row in table:
            count, *sizes = (c.rjust(w) for c, w in zip(row[1:-1], widths[1:]))
            line = f"  {row[0].ljust(widths[0])}  {count}  {' '.join(sizes)}"
            if len(line) + 2 + len(row[-1]) <= WIDTH:
                print(f"{line}  {row[-1]}")
            else:                              # the id on a line of its own, under the name
                print(line)
                print(f"    {row[-1]}")
    return 0


# --------------------------------------------------------------------------- report, formula

REPORT_EPILOG = """\
examples:
  symmem report gpt2 --batch 8 --seq 1024 --precision bf16-mixed --gpu H100-80GB \\
      --format latex -o gpt2.tex && pdflatex gpt2.tex
  symmem report examples/gpt2-medium --batch 4 --budget 40GiB --format html -o report.html
  symmem report --config examples/tiny-gpt2/config.json --format markdown > REPORT.md
  symmem report --model gpt2-medium --batch 2 --seq 512 --recompute full

The model is --model NAME, --config PATH, or one MODEL-OR-CONFIG: a path when a file or
folder of that name exists (a Hugging Face config.json, or the folder holding one: the
report names the model after the folder), else a preset name (symmem models).

exit status: 0 success; 1 an input was rejected (unknown model, component, GPU; a
config or output file that cannot be read or written); 2 bad usage (e.g. an unknown
--format).
"""

FORMULA_EPILOG = """\
examples:
  symmem formula --model gpt2 --precision bf16-mixed --component activations --format latex
  symmem formula --config examples/tiny-gpt2 --component peak --format sympy

--format sympy prints what sympy.sympify reads back; --format latex prints one line that
sympy's LaTeX parser reads back.

exit status: 0 success; 1 an input was rejected (unknown model or component); 2 bad usage.
"""

FORMULA_COMPONENTS = ("peak",) + COMPONENTS


def _add_report_commands(sub) -> None:
    """Register ``report`` and ``formula``."""
    from .render import FORMATS as REPORT_FORMATS
    rp = sub.add_parser(
        "report", help="a report of the formulas and numbers: LaTeX, Markdown or HTML",
        description="Write a report of one training step's memory: the model and policy,\n"
                    "a glossary of the symbols, each component's formula, the peak and where\n"
                    "it is, exact bytes at --batch and --seq, the largest micro-batch that\n"
                    "fits --gpu or --budget, and where each term comes from.",
        epilog=REPORT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    rp.add_argument("source", metavar="MODEL-OR-CONFIG", nargs="?",
                    help=f"a preset ({', '.join(models.PRESETS)}) or the path of a config.json "
                         "or of a folder holding one (or use --model / --config)")
    rp.add_argument("--model", metavar="NAME", help="a preset, by name or Hugging Face id")
    rp.add_argument("--config", metavar="PATH", help="a local config.json, or the folder holding one")
    _tie_option(rp)
    rp.add_argument("--batch", type=positive_int, default=1, metavar="B",
                    help="micro-batch size b for the numbers (default: %(default)s)")
    rp.add_argument("--seq", type=positive_int, metavar="S",
                    help="sequence length s for the numbers (default: the model's maximum, s_max)")
    _policy_options(rp)
    where = rp.add_mutually_exclusive_group()
    where.add_argument("--gpu", metavar="NAME",
                       help="add the largest micro-batch that fits this GPU (symmem gpus)")
    where.add_argument("--budget", metavar="SIZE",
                       help="add the largest micro-batch that fits this many bytes (80GiB, 80GB)")
    rp.add_argument("--reserve", metavar="SIZE", default=DEFAULT_RESERVE,
                    help="set aside from --gpu or --budget: bytes, a size or a percentage "
                         "(default: %(default)s)")
    rp.add_argument("--format", default="markdown", choices=tuple(REPORT_FORMATS),
                    help="latex (a standalone document for pdflatex), markdown, html (one "
                         "self-contained page, math in MathML) (default: %(default)s)")
    rp.add_argument("--title", metavar="TEXT", help="the report's title")
    rp.add_argument("-o", "--output", metavar="FILE", help="write here (default: standard output)")
    rp.set_defaults(func=cmd_report, usage=rp)       # usage: for errors argparse cannot see

    fm = sub.add_parser(
        "formula", help="one formula: the peak or a component, as LaTeX or sympy",
        description="Print one formula of the training step: the peak (a max over the\n"
                    "moments that can be the largest) or a component, in symbols.",
        epilog=FORMULA_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_options(fm)
    fm.add_argument("--component", default="peak", metavar="NAME",
                    help=f"{' | '.join(FORMULA_COMPONENTS)} (default: %(default)s)")
    fm.add_argument("--all", action="store_true",
                    help="the peak as the max of every candidate (by default: of those that are the "
                         "largest somewhere on b <= 65,536, s <= s_max, listed on stderr)")
    fm.add_argument("--format", default="latex", choices=("latex", "sympy"),
                    help="latex (one line, parses back) or sympy (str(expr), for "
                         "sympy.sympify) (default: %(default)s)")
    fm.set_defaults(func=cmd_formula)


def _report_source(args) -> None:
    """``args.source`` becomes ``args.config`` (an existing file or folder, or a name that
    looks like a path) or ``args.model`` (a preset name)."""
    from pathlib import Path
    src = args.source
    given = [f for f in ("--model", "--config") if getattr(args, f[2:]) is not None]
    if src is None:
        if len(given) != 1:
            args.usage.error("name the model once: MODEL-OR-CONFIG, --model NAME or --config PATH"
                             + (f" (got {' and '.join(given)})" if given else ""))
        return
    if given:
        args.usage.error(f"name the model once: MODEL-OR-CONFIG {src!r} and {given[0]} were both given")
    looks_like_path = "/" in src or "\\" in src or src.endswith(".json") or src.startswith(".")
    if Path(src).exists():
        args.model, args.config = None, src
    elif looks_like_path:
        raise ConfigError("MODEL-OR-CONFIG", src,
                          f"a preset ({', '.join(models.PRESETS)}) or an existing config.json "
                          "or folder holding one", "No such file or folder was found.")
    else:
        args.model, args.config = src, None


def _report_answer(est, args, seq):
    """``(budget, solution)`` for the report: with --gpu or --budget, the Budget (less
    --reserve) and what max_batch gives at ``seq``, a Solution or the Infeasible it raised
    (the report says that nothing fits); else ``(None, None)``."""
    from .errors import Infeasible
    from .gpus import budget as make_budget
    from .solve import max_batch
    if args.gpu is None and args.budget is None:
        return None, None
    bud = make_budget(gpu=args.gpu, bytes=args.budget, reserve=args.reserve)
    try:
        return bud, max_batch(est, bud, **({} if seq is None else {"s": seq}))
    except Infeasible as e:
        return bud, e


def cmd_report(args) -> int:
    from .render import render
    _report_source(args)
    policy = _policy(args)
    est = _load(args, policy)
    seq = args.seq
    if seq is None and est.regions()[0].s is not None:     # an image model's formulas have no s
        from .symbols import s_max
        seq = est.bindings.get(s_max)
        if seq is None:
            raise ConfigError("--seq", None, "a sequence length: this model has no maximum to "
                              "default to", "Pass --seq S.")
        seq = int(seq)
    bud, sol = _report_answer(est, args, seq)
    text = render(est, args.format, b=args.batch, s=seq, solution=sol, budget=bud,
                  title=args.title)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as e:
        raise ConfigError("--output", args.output, "a file that can be written",
                          e.strerror or str(e)) from None
    print(f"symmem: wrote {args.output} ({args.format}, {len(text.encode('utf-8')):,} bytes)",
          file=sys.stderr)
    return 0


def cmd_formula(args) -> int:
    from .printing import latex
    policy = _policy(args)
    est = _load(args, policy)
    expr = est.formula(args.component)
    if est.at_one is not est:       # the case split: b = 1 on stderr, the formula on stdout
        note = "symmem: for b >= 2 (at b = 1 reshapes and slices past the batch are views: estimate, " \
               "max-batch and solve use the step derived for it)"
        cases = est.cases(args.component) if args.component != "peak" else expr
        if isinstance(cases, sp.Piecewise):
            one = cases.args[0][0]
            note += f"; at b = 1: {latex(one) if args.format == 'latex' else one}"
        print(note, file=sys.stderr)
    if args.component == "peak" and not args.all:
        regions = est.regions()
        expr = sp.Max(*(canonical(r.point.total) for r in regions), evaluate=False) if len(regions) > 1 \
            else canonical(regions[0].point.total)
        print(f"symmem: the {len(regions)} of {len(est.points)} candidates of the peak that bind somewhere "
              f"on b <= 65,536{'' if regions[0].s is None else ', s <= s_max'} (--all: every one):", file=sys.stderr)
        for r in regions:
            print(f"  {r}", file=sys.stderr)
    print(latex(expr) if args.format == "latex" else str(expr))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
