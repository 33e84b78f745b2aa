"""The CUDA column, measured: Hugging Face's GPT-2 trained for real on a GPU beside symmem's
formulas with ``device="cuda"``.

Run on a machine with a CUDA GPU, from the repository's root (no install needed)::

    python benchmarks/cuda_check.py

For each case it prints the bytes saved for backward and the training step's peak: symmem's
prediction, the live storages symmem.measure tracks on the GPU (the same count the suite
makes on the CPU), their difference, and torch.cuda.max_memory_allocated for scale (it adds
the caching allocator's rounding and cuBLAS workspaces, which symmem does not model).
CUDA differs from the CPU in what is checked here: 1-byte dropout masks, float32 layer-norm
statistics, autocast's CUDA lists (layer_norm, softmax, log_softmax and pow in float32),
Adam's step counters on the host, foreach optimizers, Python numbers saved on the host,
and SDPA's CUDA kernels (flash, mem-efficient, cuDNN: the one PyTorch picks on this GPU is
found by a probe and named to symmem, which prints it), bitsandbytes' 8-bit Adam (one
in-place kernel per tensor) and, where bitsandbytes and peft are installed, QLoRA (NF4
layers under peft's adapters) and LLM.int8() layers (MatMul8bitLt) under them, the dispatch tracker's peak beside symmem's: a difference is
what bitsandbytes' custom ops allocate inside, which max_alloc shows).
Exit status 1 when a difference is not zero.
"""
from __future__ import annotations

import sys
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402

import symmem as sm  # noqa: E402
from symmem.measure import saved_bytes, training_step  # noqa: E402

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()

# (b, s, h, a, L, V, n_positions, activation)
POINTS = [(2, 16, 32, 4, 2, 100, 32, "gelu_new"), (4, 64, 64, 4, 3, 500, 64, "gelu_new"),
          (8, 128, 128, 8, 2, 1000, 128, "gelu"), (16, 128, 128, 8, 2, 1000, 128, "gelu")]
CASES = [  # point, precision, optimizer, implementation, recompute, accumulate[, attention]
    (0, "fp32", "adamw", "auto", "none", 1, "sdpa"),
    (1, "bf16-mixed", "adamw", "auto", "none", 1, "sdpa"),
    (2, "fp16-mixed", "sgd", "auto", "none", 1, "sdpa"),
    (1, "bf16-mixed", "adamw", "auto", "full", 1, "sdpa"),
    (0, "fp32", "adamw", "auto", "none", 1),
    (0, "bf16-mixed", "adamw", "auto", "none", 1),
    (1, "fp32", "sgd", "auto", "none", 1),
    (1, "bf16-mixed", "adamw", "fused", "none", 1),
    (2, "bf16-mixed", "adam", "auto", "none", 1),
    (2, "fp16-mixed", "sgd-momentum", "auto", "none", 1),
    (1, "fp32", "adamw", "auto", "full", 1),
    (1, "bf16-mixed", "adamw", "auto", "full", 1),
    (1, "bf16-mixed", "sgd", "auto", "full,reentrant", 1),
    (2, "bf16-mixed", "adamw", "auto", "selective", 1),
    (1, "bf16-mixed", "adamw", "auto", "none", 2),
    (1, "fp32", "sgd", "auto", "full", 3),
    (1, "bf16-mixed", "adam8bit", "for-loop", "none", 1, "sdpa"),   # bitsandbytes' in-place CUDA kernel
]
#: QLoRA (bitsandbytes' NF4 layers, peft's adapters; bf16 model): point, rank, targets, format;
#: 2048 tokens, above the 1536 rows below which bitsandbytes may pick its fused CUDA kernel.
#: int8 is LLM.int8() (MatMul8bitLt, threshold 6: random weights make no outlier column).
QLORA = [(3, 8, ("c_attn", "c_proj", "c_fc"), "int4"), (3, 16, ("c_attn",), "int4"),
         (3, 8, ("c_attn", "c_proj", "c_fc"), "int8")]


from transformers.models.gpt2 import modeling_gpt2  # noqa: E402

EAGER_CORE = modeling_gpt2.eager_attention_forward


def model_for(point, recompute, attention="eager"):
    b, s, h, a, L, V, P, act = point
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=h, n_head=a, n_layer=L, vocab_size=V, n_positions=P,
                                  activation_function=act, attn_implementation=attention, use_cache=False,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).cuda().train()
    base, _, variant = recompute.partition(",")
    modeling_gpt2.eager_attention_forward = EAGER_CORE      # undo an earlier case's selective patch
    if base == "full":
        kwargs = {"use_reentrant": variant == "reentrant"}
        enable = getattr(model, "activation_checkpointing_enable", None)   # transformers 5.24's name
        if enable is not None:
            enable(kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    elif base == "selective":
        core = EAGER_CORE

        def checkpointed_core(module, q, k, v, mask, **kwargs):
            return torch.utils.checkpoint.checkpoint(lambda q, k, v, m: core(module, q, k, v, m, **kwargs),
                                                     q, k, v, mask, use_reentrant=False)
        modeling_gpt2.eager_attention_forward = checkpointed_core
    return cfg, model


def optimizer_for(name, impl, params):
    if name == "adam8bit":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params)
    kw = {} if impl == "auto" else {"foreach": impl == "foreach", "fused": impl == "fused"}
    if name in ("adam", "adamw"):
        return (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(params, **kw)
    kw.pop("fused", None)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9 if name == "sgd-momentum" else 0.0, **kw)


BACKENDS = {"ScaledDotProductFlashAttentionBackward0": "flash",
            "ScaledDotProductEfficientAttentionBackward0": "mem-efficient",
            "ScaledDotProductCudnnAttentionBackward0": "cudnn"}


def sdpa_backend(point, half):
    """The kernel scaled_dot_product_attention runs on this GPU for GPT-2's call (is_causal,
    dropout 0.1, q, k, v views of one projection): read off the autograd node it makes."""
    b, s, h, a = point[:4]
    x = torch.randn(b, s, 3 * h, device="cuda", dtype=half or torch.float32, requires_grad=True)
    q, k, v = (t.view(b, s, a, h // a).transpose(1, 2) for t in x.split(h, dim=2))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
    return BACKENDS.get(out.grad_fn.name(), "math")


def run(case):
    i, precision, opt, impl, recompute, k, attention = (*case, "eager")[:7]
    point = POINTS[i]
    b, s, h, a, L, V, P, act = point
    half = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)
    cfg, model = model_for(point, recompute, attention)
    kernel = sdpa_backend(point, half) if attention == "sdpa" else attention
    graph = sm.models.from_hf_config({**cfg.to_dict(), "attn_implementation": attention})
    est = sm.estimate(graph, sm.Policy(precision, opt, "cuda", impl, recompute=recompute, accumulate=k,
                                       attention=kernel))
    ev = est.at(b=b, s=s)
    ids = torch.randint(0, V, (b, s), device="cuda")

    def loss():
        with torch.autocast("cuda", dtype=half or torch.float32, enabled=half is not None):
            return model(ids, labels=ids).loss
    saved = saved_bytes(loss, exclude=model)
    cuda_saved = sum(e.storage_nbytes for e in saved.entries if e.counted and e.device.startswith("cuda"))
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16-mixed" else None   # as the precision says
    report = training_step(model, lambda m: loss(), optimizer_for(opt, impl, model.parameters()), extra=(ids,),
                           accumulate=k, scaler=scaler)
    return ev, cuda_saved, report, "+".join(est.kernels)


def qlora_model(point, rank, targets, fmt="int4"):
    """GPT-2 in bfloat16, its block projections bitsandbytes' Linear4bit (NF4, double
    quantization, Conv1D's weight transposed as transformers quantizes one) or Linear8bitLt
    (``fmt`` int8), peft's adapters on ``targets``; with the quantization state's tensors,
    which are not parameters."""
    import bitsandbytes as bnb
    import peft
    b, s, h, a, L, V, P, act = point
    cfg, model = model_for(point, "none", "sdpa")
    model.to(torch.bfloat16)
    states = []
    for block in model.transformer.h:
        for part, name in (("attn", "c_attn"), ("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_proj")):
            conv = getattr(getattr(block, part), name)
            w = conv.weight.detach().t().contiguous()
            if fmt == "int8":
                lin = bnb.nn.Linear8bitLt(w.shape[1], w.shape[0], bias=True, has_fp16_weights=False,
                                          threshold=6.0)
                lin.weight = bnb.nn.Int8Params(w.cpu(), requires_grad=False, has_fp16_weights=False).cuda()
                lin.bias = torch.nn.Parameter(conv.bias.detach().clone())
                setattr(getattr(block, part), name, lin)
                states.append(lin.weight.SCB)
                continue
            lin = bnb.nn.Linear4bit(w.shape[1], w.shape[0], bias=True, compute_dtype=torch.bfloat16,
                                    compress_statistics=True, quant_type="nf4")
            lin.weight = bnb.nn.Params4bit(w.cpu(), requires_grad=False, blocksize=64, compress_statistics=True,
                                           quant_type="nf4", module=lin).cuda()
            lin.bias = torch.nn.Parameter(conv.bias.detach().clone())
            setattr(getattr(block, part), name, lin)
            qs = lin.weight.quant_state
            states += [qs.absmax, qs.code, qs.offset, qs.state2.absmax, qs.state2.code]
    model.is_loaded_in_4bit = fmt == "int4"
    model.is_loaded_in_8bit = fmt == "int8"
    config = peft.LoraConfig(r=rank, lora_alpha=16, target_modules=list(targets), lora_dropout=0.0)
    return cfg, peft.get_peft_model(model, config), states


def run_qlora(case):
    """bitsandbytes' 4-bit forward is one custom op (gemm_4bit: above 1536 rows of input, its
    dequantize-then-F.linear fallback), whose allocations the live-storage tracker would not
    see inside: the op calls the fallback itself here (what runs at these sizes), so that each
    allocation is seen, and the tracker's peak is compared with symmem's."""
    from bitsandbytes.backends.cuda import ops as cuda_ops

    class Gemm4bit:
        default = staticmethod(cuda_ops._dequant_linear_fallback)
    torch.ops.bitsandbytes.gemm_4bit = Gemm4bit
    i, rank, targets, fmt = case
    point = POINTS[i]
    b, s, h, a, L, V, P, act = point
    cfg, model, states = qlora_model(point, rank, targets, fmt)
    graph = sm.models.from_hf_config({**cfg.to_dict(), "attn_implementation": "sdpa"})
    kernel = sdpa_backend(point, torch.bfloat16)
    est = sm.estimate(graph, sm.Policy("bf16", "adamw", "cuda", "foreach", attention=kernel, lora=rank,
                                       lora_targets=",".join(targets), quantize=fmt))
    ev = est.at(b=b, s=s)
    ids = torch.randint(0, V, (b, s), device="cuda")
    trainable = [p for p in model.parameters() if p.requires_grad]
    report = training_step(model, lambda m: m(ids, labels=ids).loss, torch.optim.AdamW(trainable),
                           extra=(ids, states))
    return ev, report, "+".join(est.kernels)


def main() -> int:
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'case':<52}{'saved':>10}{'diff':>7}{'peak':>11}{'diff':>8}{'max_alloc':>11}  where")
    bad = 0
    for case in CASES:
        name = f"P{case[0]} {case[1]} {case[2]}[{case[3]}] rc={case[4]} K={case[5]} {(*case, 'eager')[6]}"
        try:
            ev, saved, report, kernels = run(case)
        except Exception:            # report and go on: one broken case must not hide the rest
            bad += 1
            print(f"{name:<52}ERROR\n{traceback.format_exc(limit=3)}")
            continue
        ds, dp = ev.bytes["activations"] - saved, ev.peak - report.peak
        bad += ds != 0 or dp != 0
        print(f"{name:<52}{saved:>10,}{ds:>7,}{report.peak:>11,}{dp:>8,}{report.cuda_max_allocated:>11,}  "
              f"[{kernels}] {ev.peak_point.where} | {report.peak_phase} {report.peak_op}")
    try:
        import bitsandbytes  # noqa: F401
        import peft  # noqa: F401
    except ImportError:
        print("QLoRA cases skipped: pip install bitsandbytes peft")
    else:
        for case in QLORA:
            name = f"P{case[0]} bf16 LoRA {case[3]} r={case[1]} {'+'.join(case[2])}"
            try:
                ev, report, kernels = run_qlora(case)
            except Exception:
                bad += 1
                print(f"{name:<52}ERROR\n{traceback.format_exc(limit=3)}")
                continue
            dp = ev.peak - report.peak
            bad += dp != 0
            print(f"{name:<52}{'':>10}{'':>7}{report.peak:>11,}{dp:>8,}{report.cuda_max_allocated:>11,}  "
                  f"[{kernels}] {ev.peak_point.where} | {report.peak_phase} {report.peak_op}")
    print("all exact" if not bad else f"{bad} case(s) differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
