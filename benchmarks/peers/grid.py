"""The grid both peer benchmarks run, and one function per tool that answers for a case.

A case is a Hugging Face causal LM built from a config (random weights, no download) of
one of the families symmem supports, trained for one step on the CPU in float32 or under
bfloat16 autocast, with eager or SDPA attention, with SGD or AdamW (the for-loop
implementations, as the suite runs them). Four answers per case, each as bytes of
weights, gradients, optimizer states, activations and the step's peak:

* ``measured``: what PyTorch did, through ``symmem.measure`` (parameter storages; the
  gradients' and the optimizer state's storages after the step; the bytes autograd saved
  for backward; the peak of live storages over the step, the second of two);
* ``symmem``: ``sm.estimate(graph, Policy(precision, optimizer, "cpu"))`` at (b, s);
* ``llm_analysis``: ``LLMAnalysis.training`` of llm-analysis 0.2.2 with the mapping below;
* ``memtracker``: PyTorch's ``MemTracker`` over the same step, with real tensors or
  under ``FakeTensorMode``.

How each column is read off MemTracker (it has no "saved for backward" notion; these are
its own categories at the moment where they are whole): weights = its ``Parameter``
bytes; activations = its ``Activation`` bytes right after the forward (the loss is all
that is left of the output, so this is what the forward keeps for backward, plus the
loss); gradients = ``Gradient`` after backward; optimizer states = ``Optstate`` after the
step; peak = the ``Total`` of its peak snapshot. As for ``training_step``, a warm-up
step runs first (the optimizer makes its state there) and the tracked step starts with
the gradients set to None; the model, the optimizer and the batch are given to
``track_external`` (so the token ids, which the embedding saves for backward, are its
``Other``, not its ``Activation``). Under ``FakeTensorMode`` the traced program is not
quite the real one: transformers cannot look at a fake mask's values, so where the real
run calls SDPA with ``is_causal=True`` and no mask, the fake run materialises a float
``(b, 1, s, s)`` mask and passes it (seen in the dispatched ``attn_mask``).

llm-analysis 0.2.2, mapped from the same Hugging Face config (its ModelConfig,
DtypeConfig, GPUConfig; each choice meant to give it the best inputs its API has):

* ``hidden_dim``, ``n_head``, ``num_key_value_heads``, ``num_layers``, ``vocab_size``,
  ``max_seq_len`` from the config; ``ffn_embed_dim`` the MLP's width, except for SwiGLU
  (Llama, Qwen2, Mistral: three matrices where llm-analysis has two) where it is
  ``1.5 * intermediate_size``, the iso-parameter width its own Llama configs use (4h for
  Llama 7B's 11008): its parameter count of the MLP is then right. (It requires the width
  to be a multiple of ``hidden_dim``: the grid's widths are.)
* fp32: ``w32a32e32``. bf16 autocast: ``w16a16e16`` with fp32 master weights
  (``master_weights_dtype_bytes=4``), ``layernorm_dtype_bytes=4`` in both (autocast runs
  layer norms and the residual stream in float32).
* Optimizer: llm-analysis prices its optimizer state as ``other_op_bytes +
  master_weights_dtype_bytes`` a parameter and gradients as
  ``master_weights_dtype_bytes``. bf16 autocast: ``other_op_bytes`` = 8 for AdamW (two
  fp32 moments), 0 for SGD (no momentum: no state). fp32 keeps no master copy, and the
  only way its API says so is ``other_op_bytes`` = state bytes - 4 (AdamW 4, SGD -4): its
  optimizer states are then exactly 8 and 0 bytes a parameter, and gradients 4.
* Columns: under autocast the fp32 parameters are the master copy llm-analysis counts in
  its optimizer states, so its weights column is its (16-bit) weights plus that master
  copy, and its optimizer column the rest (``other_op_bytes``); in fp32 its columns are
  its own. The peak is its total, weights + gradients + optimizer states + activations
  (it has no timeline).
* ``flash_attn``: True where the kernel keeps no s^2 tensor (SDPA's flash kernel on the
  CPU, which PyTorch picks without dropout); False for eager attention and for SDPA with
  dropout (GPT-2's 0.1: the math fallback). ``softmax_dropout``: the model's attention
  dropout > 0. ``mlp_gated_linear_units``: SwiGLU families (llm-analysis reads it only at
  b = 1 and only with ``mlp_recompute_gelu``: no effect here, passed for the record).
* What it cannot express (reported as is, not corrected): an untied output head (it
  counts V*h once), position embeddings, biases, the attention-output dropout it always
  assumes (1 byte a token a channel), residual dropouts, rotary tables, the causal mask,
  the loss's own tensors beyond the logits.
* fp32: llm-analysis 0.2.2's latency model asserts 4, 8 or 16 bits, and ``training()``
  computes latency after memory; for fp32 the instance's ``get_TFLOPS_per_gpu`` returns
  the placeholder GPU's fp16 peak so that ``training()`` completes. It feeds latency only.
* ``GPUConfig``: a placeholder with a large memory (1 TB) so that it never caps the batch;
  its bandwidths and FLOPS only feed latency, not memory.
"""
from __future__ import annotations

import contextlib
import io
import logging
import warnings
from dataclasses import dataclass

import torch
import transformers

__all__ = ["Case", "GRID", "FULL_GRID", "FAMILIES", "build", "measured", "symmem_answer", "llm_analysis_answer",
           "memtracker_answer", "COLUMNS"]

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()

COLUMNS = ("weights", "grads", "optimizer", "activations", "peak")

#: family -> (transformers config class, model class, its keyword arguments); b, s per family
FAMILIES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(n_embd=128, n_head=4, n_layer=2, vocab_size=1000, n_positions=128), 4, 64),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                   num_hidden_layers=3, vocab_size=1000, max_position_embeddings=128), 2, 128),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                   num_hidden_layers=2, vocab_size=1000, max_position_embeddings=128), 4, 64),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=1,
                     num_hidden_layers=2, vocab_size=1000, max_position_embeddings=128, sliding_window=4096),
                2, 128),
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(hidden_size=128, ffn_dim=512, num_attention_heads=4, num_hidden_layers=2, vocab_size=1000,
                 max_position_embeddings=128, pad_token_id=1, bos_token_id=2, eos_token_id=2), 4, 64),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                 dict(hidden_size=128, intermediate_size=512, num_attention_heads=4, num_hidden_layers=2,
                      vocab_size=1000, max_position_embeddings=128), 2, 128),
}
GATED = {"llama", "qwen2", "mistral"}


@dataclass(frozen=True)
class Case:
    family: str
    attention: str      # "eager" | "sdpa"
    precision: str      # "fp32" | "bf16-mixed" (bfloat16 autocast, fp32 weights)
    optimizer: str      # "sgd" | "adamw"

    @property
    def b(self) -> int:
        return FAMILIES[self.family][3]

    @property
    def s(self) -> int:
        return FAMILIES[self.family][4]

    @property
    def label(self) -> str:
        return f"{self.family} {self.attention} {self.precision} {self.optimizer}"


#: every combination: 6 families x 2 attentions x 2 precisions x 2 optimizers = 48 cases
FULL_GRID = tuple(Case(f, at, pr, o) for f in FAMILIES for at in ("eager", "sdpa")
                  for pr in ("fp32", "bf16-mixed") for o in ("sgd", "adamw"))
#: the default: per family, attention x precision in full and the optimizer alternating
#: (a half fraction: 24 cases; each family meets every value of each axis, and every pair
#: of values of any two axes occurs)
GRID = tuple(c for c in FULL_GRID
             if (c.attention == "sdpa") ^ (c.precision == "fp32") ^ (c.optimizer == "adamw"))


def hf_config(case: Case, **changes):
    cls, _, kw, _, _ = FAMILIES[case.family]
    common = dict(attn_implementation=case.attention, use_cache=False)
    if case.family not in ("opt",):
        common.update(bos_token_id=0, eos_token_id=0)
    if case.family in GATED:
        common["pad_token_id"] = None
    return getattr(transformers, cls)(**{**kw, **common, **changes})


def build(case: Case, **changes):
    """The config and the model in training mode (seeded: the same weights each time)."""
    cfg = hf_config(case, **changes)
    torch.manual_seed(0)
    model = getattr(transformers, FAMILIES[case.family][1])(cfg)
    model.train()
    return cfg, model


def make_optimizer(case: Case, params):
    if case.optimizer == "adamw":
        return torch.optim.AdamW(params, foreach=False)
    return torch.optim.SGD(params, lr=0.1, foreach=False)


def loss_fn(case: Case, ids):
    def fwd(model):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.precision == "bf16-mixed"):
            return model(ids, labels=ids).loss
    return fwd


def batch(case: Case, V: int) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, V, (case.b, case.s))


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            st = t.untyped_storage()
            seen[(st.data_ptr(), st.nbytes())] = st.nbytes()
    return sum(seen.values())


# ----------------------------------------------------------------------------- measured


def measured(case: Case) -> dict:
    from symmem.measure import param_bytes, saved_bytes, training_step

    cfg, model = build(case)
    ids = batch(case, cfg.vocab_size)
    fwd = loss_fn(case, ids)
    act = saved_bytes(lambda: fwd(model), exclude=model).total
    opt = make_optimizer(case, model.parameters())
    report = training_step(model, fwd, opt, extra=(ids,))
    grads = _storage_bytes(p.grad for p in model.parameters())
    states = _storage_bytes(t for st in opt.state.values() for t in st.values())
    return dict(weights=param_bytes(model), grads=grads, optimizer=states, activations=act,
                peak=report.peak, phase=report.peak_phase)


# ----------------------------------------------------------------------------- symmem


def symmem_graph(cfg):
    """symmem's graph of the config, as config.json would carry it (``to_dict()`` leaves
    out the attention implementation the model was built with)."""
    import symmem as sm  # here, not above: speed.py times each tool's own import
    return sm.models.from_hf_config({**cfg.to_dict(), "attn_implementation": cfg._attn_implementation})


def symmem_answer(case: Case, cfg=None) -> dict:
    import symmem as sm
    cfg = cfg if cfg is not None else hf_config(case)
    est = sm.estimate(symmem_graph(cfg), sm.Policy(case.precision, case.optimizer, "cpu", "for-loop"))
    ev = est.at(b=case.b, s=case.s)
    by = ev.bytes
    return dict(weights=by["params"] + by["master"], grads=by["grads"], optimizer=by["optimizer"],
                activations=by["activations"], peak=ev.peak, phase=ev.peak_point.phase)


# ----------------------------------------------------------------------------- llm-analysis


def _dropout(case: Case, cfg) -> float:
    return float(getattr(cfg, "attn_pdrop", None) or getattr(cfg, "attention_dropout", 0.0) or 0.0)


def _ffn(case: Case, cfg) -> int:
    if case.family == "gpt2":
        return cfg.n_inner or 4 * cfg.n_embd
    if case.family == "opt":
        return cfg.ffn_dim
    if case.family in GATED:
        return 3 * cfg.intermediate_size // 2        # iso-parameter width of a SwiGLU MLP
    return cfg.intermediate_size


def llm_analysis_inputs(case: Case, cfg) -> dict:
    """The keyword arguments of ``LLMAnalysis`` and of its ``training`` for a case (see the
    module's docstring for each choice)."""
    from llm_analysis.analysis import LLMAnalysis  # noqa: F401  (import checked here)
    from llm_analysis.config import DtypeConfig, GPUConfig, ModelConfig

    model = ModelConfig(name=case.family, num_layers=cfg.num_hidden_layers, n_head=cfg.num_attention_heads,
                        hidden_dim=cfg.hidden_size, vocab_size=cfg.vocab_size,
                        max_seq_len=cfg.max_position_embeddings,
                        num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                        ffn_embed_dim=_ffn(case, cfg), model_type=case.family)
    bits = 32 if case.precision == "fp32" else 16
    dtype = DtypeConfig(name=f"w{bits}a{bits}e{bits}", weight_bits=bits, activation_bits=bits, embedding_bits=bits)
    gpu = GPUConfig(name="placeholder-1TB", mem_per_GPU_in_GB=1000, hbm_bandwidth_in_GB_per_sec=1000,
                    intra_node_bandwidth_in_GB_per_sec=300, intra_node_min_message_latency=8e-6,
                    peak_fp16_TFLOPS=100)
    state = 8 if case.optimizer == "adamw" else 0
    dropout = _dropout(case, cfg)
    training = dict(batch_size_per_gpu=case.b, gradient_accumulation_steps=1, seq_len=case.s,
                    layernorm_dtype_bytes=4, master_weights_dtype_bytes=4,
                    other_op_bytes=state if case.precision != "fp32" else state - 4,
                    flash_attn=case.attention == "sdpa" and dropout == 0.0,
                    softmax_dropout=dropout > 0.0, mlp_gated_linear_units=case.family in GATED)
    return dict(model_config=model, gpu_config=gpu, dtype_config=dtype), training


def llm_analysis_answer(case: Case, cfg=None) -> dict:
    from llm_analysis.analysis import LLMAnalysis
    cfg = cfg if cfg is not None else hf_config(case)
    init, training = llm_analysis_inputs(case, cfg)
    logging.getLogger("__name__").setLevel(logging.ERROR)   # llm-analysis's logger is named "__name__"
    analysis = LLMAnalysis(**init)
    if case.precision == "fp32":
        # 0.2.2's latency model refuses 32-bit dtypes (get_TFLOPS_per_gpu asserts 4, 8 or
        # 16 bits), and training() computes latency after memory: the fp16 peak stands in.
        # Latency only; no memory number reads it.
        analysis.get_TFLOPS_per_gpu = lambda: init["gpu_config"].peak_fp16_TFLOPS
    with contextlib.redirect_stdout(io.StringIO()):
        out = analysis.training(**training)
    weights, opt = out["weight_memory_per_gpu"], out["optimizer_state_memory_per_gpu"]
    if case.precision != "fp32":           # the fp32 master copy is the autocast run's weights
        master = 4 * analysis.total_num_params
        weights, opt = weights + master, opt - master
    return dict(weights=weights, grads=out["gradient_memory_per_gpu"], optimizer=opt,
                activations=out["activation_memory_per_gpu"],
                peak=out["(weight+op_state+grad+act)_memory_per_gpu"], phase="-")


# ----------------------------------------------------------------------------- MemTracker


def memtracker_answer(case: Case, fake: bool, cfg=None) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    cfg = cfg if cfg is not None else hf_config(case)
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        torch.manual_seed(0)
        model = getattr(transformers, FAMILIES[case.family][1])(cfg)
        model.train()
        ids = torch.randint(0, cfg.vocab_size, (case.b, case.s))
        opt = make_optimizer(case, model.parameters())
        fwd = loss_fn(case, ids)
        fwd(model).backward()                  # warm-up: the optimizer makes its state
        opt.step()
        opt.zero_grad(set_to_none=True)
        mt = MemTracker()
        mt.track_external(model, opt, ids)
        with mt:
            dev = torch.device("cpu")
            loss = fwd(model)
            act = mt.get_tracker_snapshot("current")[dev]
            loss.backward()
            del loss
            grad = mt.get_tracker_snapshot("current")[dev]
            opt.step()
            after = mt.get_tracker_snapshot("current")[dev]
        peak = mt.get_tracker_snapshot("peak")[dev]
    return dict(weights=after.get("Parameter", 0), grads=grad.get("Gradient", 0),
                optimizer=after.get("Optstate", 0), activations=act.get("Activation", 0),
                peak=peak["Total"], phase="-")
