"""The GPU check: Hugging Face models at real sizes trained on one CUDA GPU, beside symmem's
CUDA prediction.

    make gpu-check                     # on a CUDA machine: writes gpu_check.json
    python benchmarks/gpu_check.py --json out.json [--only gpt2]
    python benchmarks/gpu_check.py --device cpu --sizes tiny   # the same code on the CPU, tiny models

Cases: GPT-2 small (124M) and medium (355M), a Llama-shaped model of 1.1B parameters
(TinyLlama's shape: h = 2048, 22 layers, 32 heads, 4 key/value heads) and T5-base (SDPA's
mem-efficient kernel with the position bias and its gradient, derived); eager and SDPA attention;
fp32, bf16 autocast and pure bf16; AdamW for-loop, foreach and fused; with and without full
recomputation. Per case it prints and writes symmem's prediction (bytes saved for backward, the
training step's peak and its phase) beside what the step did: the bytes saved for backward and
the peak of live storages that ``symmem.measure`` tracks (symmem's own count, which must agree
to the byte) and ``torch.cuda.max_memory_allocated`` (which adds the caching allocator's
rounding of each block to 512 bytes and cuBLAS's workspaces, which symmem does not model; its
difference is reported, not judged). SDPA's kernel is the one PyTorch picks on this GPU, read
off the autograd node of the model's own call, and named to symmem. Then text generation
(GPT-2 and the 1.1B Llama; dynamic, static, fp8 and quanto KV caches): the prefill's and the decoding
step's peaks and the cache (``symmem.measure.generation``) beside symmem's inference estimate.

Exit status 1 when symmem and the tracked step differ on a case. About 3 minutes on an H100.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402

import symmem as sm  # noqa: E402
from symmem.measure import generation, saved_bytes, training_step  # noqa: E402

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()

#: model name -> (transformers config class, its keyword arguments, b, s), at each size; the
#: model class is CLASSES[config class]
MODELS = {
    "real": {
        "gpt2": ("GPT2Config", dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024), 8, 1024),
        "gpt2-medium": ("GPT2Config", dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257,
                                           n_positions=1024), 4, 1024),
        "llama-1.1b": ("LlamaConfig", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                           num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                                           max_position_embeddings=2048), 4, 1024),
        "t5-base": ("T5Config", dict(d_model=768, d_ff=3072, num_heads=12, d_kv=64, num_layers=12,
                                     vocab_size=32128, decoder_start_token_id=0), 8, 512),
    },
    "tiny": {
        "gpt2": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=32), 2, 16),
        "gpt2-medium": ("GPT2Config", dict(n_embd=64, n_layer=3, n_head=4, vocab_size=100, n_positions=32), 2, 16),
        "llama-1.1b": ("LlamaConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                           max_position_embeddings=32), 2, 16),
        "t5-base": ("T5Config", dict(d_model=32, d_ff=64, num_heads=4, d_kv=8, num_layers=2, vocab_size=100,
                                     decoder_start_token_id=0), 2, 16),
    },
}
#: T5's labels (the decoder's length s_d): a quarter of the inputs' (a multiple of 16)
DECODER = {"T5Config": 4}

#: model, attention, precision, AdamW implementation, recompute
CLASSES = {"GPT2Config": "GPT2LMHeadModel", "LlamaConfig": "LlamaForCausalLM",
           "T5Config": "T5ForConditionalGeneration"}

CASES = [
    ("gpt2", "eager", "fp32", "for-loop", "none"),
    ("gpt2", "sdpa", "fp32", "foreach", "none"),
    ("gpt2", "sdpa", "bf16-mixed", "fused", "none"),
    ("gpt2", "eager", "bf16-mixed", "foreach", "full"),
    ("gpt2", "sdpa", "bf16", "foreach", "none"),
    ("gpt2-medium", "sdpa", "bf16-mixed", "foreach", "none"),
    ("gpt2-medium", "eager", "bf16-mixed", "for-loop", "full"),
    ("llama-1.1b", "sdpa", "bf16-mixed", "fused", "none"),
    ("llama-1.1b", "eager", "bf16-mixed", "foreach", "none"),
    ("llama-1.1b", "sdpa", "bf16", "foreach", "none"),
    ("llama-1.1b", "sdpa", "bf16-mixed", "foreach", "full"),
    ("llama-1.1b", "sdpa", "fp32", "foreach", "none"),
    # SDPA on CUDA: mem-efficient with the position bias as attn_bias and its gradient
    ("t5-base", "sdpa", "fp32", "foreach", "none"),
    ("t5-base", "sdpa", "bf16-mixed", "foreach", "none"),
    ("t5-base", "sdpa", "bf16", "foreach", "none"),
    ("t5-base", "sdpa", "fp32", "for-loop", "full"),
    ("t5-base", "eager", "bf16-mixed", "fused", "none"),
]

#: generation: model, attention, precision, KV cache (transformers' DynamicCache, StaticCache
#: of s + n_g positions, QuantizedCache in fp8 or with quanto, its defaults: residual_length 128,
#: q_group_size 64), the new tokens n_g; the prompt is the model's s
INFERENCE_CASES = [
    ("gpt2", "sdpa", "bf16-mixed", "dynamic", 8),
    ("llama-1.1b", "sdpa", "bf16", "dynamic", 8),
    ("llama-1.1b", "eager", "bf16", "static", 8),
    ("llama-1.1b", "sdpa", "bf16", "fp8", 8),
    ("llama-1.1b", "sdpa", "bf16", "quanto-int4", 8),       # an ordinary step: 7 positions in the residual
    ("llama-1.1b", "sdpa", "bf16", "quanto-int2", 128),     # the flush
    ("llama-1.1b", "sdpa", "fp32", "dynamic", 8),
]

BACKENDS = {"ScaledDotProductFlashAttentionBackward0": "flash",
            "ScaledDotProductEfficientAttentionBackward0": "mem-efficient",
            "ScaledDotProductCudnnAttentionBackward0": "cudnn",
            "ScaledDotProductFlashAttentionForCpuBackward0": "flash"}


def build(name, size, attention, precision, recompute, device):
    cls, kw, b, s = MODELS[size][name]
    torch.manual_seed(0)
    cfg = getattr(transformers, cls)(**kw, attn_implementation=attention, use_cache=False)
    with torch.device(device):                   # initialised in place: a 1B model in seconds
        model = getattr(transformers, CLASSES[cls])(cfg)
    model.train()
    if precision == "bf16":
        model.to(torch.bfloat16)
    if recompute == "full":
        enable = getattr(model, "activation_checkpointing_enable", None)   # transformers 5.24's name
        if enable is not None:
            enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return cfg, model, b, s


def sdpa_kernel(loss):
    """The kernels scaled_dot_product_attention ran in one forward, read off the autograd nodes
    of its outputs (the model's own call: its shapes, dtypes, mask and dropout)."""
    f = torch.nn.functional
    seen, original = set(), f.scaled_dot_product_attention

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.add(BACKENDS.get(out.grad_fn.name(), "math") if out.grad_fn is not None else "none")
        return out
    f.scaled_dot_product_attention = spy
    try:
        loss()
    finally:
        f.scaled_dot_product_attention = original
    if len(seen) != 1:
        raise RuntimeError(f"SDPA ran {sorted(seen) or 'no'} kernels in one forward; symmem takes one")
    return seen.pop()


def run(case, size, device):
    name, attention, precision, impl, recompute = case
    cfg, model, b, s = build(name, size, attention, precision, recompute, device)
    ids = torch.randint(0, cfg.vocab_size, (b, s), device=device)
    s_d = s // DECODER.get(type(cfg).__name__, 1)
    labels = torch.randint(0, cfg.vocab_size, (b, s_d), device=device) if s_d != s else ids

    def loss():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            return model(input_ids=ids, labels=labels).loss
    kernel = sdpa_kernel(loss) if attention == "sdpa" else attention
    graph = sm.models.from_hf_config({**cfg.to_dict(), "attn_implementation": attention})
    est = sm.estimate(graph, sm.Policy(precision, "adamw", device, impl, recompute=recompute, attention=kernel))
    ev = est.at(b=b, s=s, **({"s_d": s_d} if s_d != s else {}))
    saved = saved_bytes(loss, exclude=model)
    on_device = sum(e.storage_nbytes for e in saved.entries if e.counted and e.device.startswith(device))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    opt = torch.optim.AdamW(model.parameters(), foreach=impl == "foreach", fused=impl == "fused")
    report = training_step(model, lambda m: loss(), opt, extra=(ids, labels))
    return {"model": name, "b": b, "s": s, "attention": attention, "kernel": "+".join(est.kernels),
            "precision": precision, "implementation": impl, "recompute": recompute,
            "parameters": sum(p.numel() for p in model.parameters()),
            "saved_predicted": ev.bytes["activations"], "saved_measured": on_device,
            "peak_predicted": ev.peak, "peak_measured": report.peak,
            "phase_predicted": ev.peak_point.phase, "phase_measured": report.peak_phase,
            "max_memory_allocated": report.cuda_max_allocated, "where": ev.peak_point.where}


def run_inference(case, size, device):
    """One generation case: the prefill of a (b, s) prompt and the decoding step that brings the
    cache to s + n_g positions (symmem.measure.generation), beside symmem's inference estimate."""
    name, attention, precision, cache, n_g = case
    cfg, model, b, s = build(name, size, attention, "bf16" if precision == "bf16" else "fp32", "none", device)
    model.eval()
    ids = torch.randint(0, cfg.vocab_size, (b, s), device=device)
    prefill, decode, cached = generation(model, ids, n_g, cache=cache, max_cache_len=s + n_g if cache == "static" else None,
                                         autocast=torch.bfloat16 if precision == "bf16-mixed" else None)
    graph = sm.models.from_hf_config({**cfg.to_dict(), "attn_implementation": attention})
    quanto = {"residual_position": (n_g - 1) % 128} if cache.startswith("quanto") else {}   # the step n_g
    est = sm.estimate(graph, sm.Policy(precision, device=device, mode="inference", cache=cache, attention=attention,
                                       **quanto))
    ev = est.at(b=b, s=s, n_g=n_g)
    subs = est._subs({"b": b, "s": s, "n_g": n_g})
    predicted = {step: max(int(p.total.xreplace(subs)) for p in est.timeline if p.phase == step)
                 for step in ("prefill", "decode")}
    return {"model": name, "b": b, "s": s, "n_g": n_g, "attention": attention, "precision": precision,
            "cache": cache, "prefill_predicted": predicted["prefill"], "prefill_measured": prefill.peak,
            "decode_predicted": predicted["decode"], "decode_measured": decode.peak,
            "cache_predicted": ev.bytes["cache"], "cache_measured": cached,
            "max_memory_allocated": max(x for x in (prefill.cuda_max_allocated, decode.cuda_max_allocated)
                                        if x is not None) if device == "cuda" else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--sizes", default=None, choices=tuple(MODELS), help="real on CUDA, tiny on the CPU by default")
    p.add_argument("--only", default=None, help="run the cases of this model only")
    p.add_argument("--json", default="gpu_check.json", help="where the table is written")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; run it on a machine with one (or --device cpu for the tiny models)")
        return 2
    size = args.sizes or ("real" if args.device == "cuda" else "tiny")
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, symmem {sm.__version__}, {where}")
    print(f"{'case':<44}{'saved':>15}{'diff':>6}{'peak':>17}{'diff':>6}{'max_alloc':>17}{'diff':>12}  phase")
    rows, bad, start = [], 0, time.perf_counter()
    for case in CASES:
        if args.only and case[0] != args.only:
            continue
        label = " ".join(case)
        try:
            row = run(case, size, args.device)
        except Exception:            # report and go on: one broken case must not hide the rest
            bad += 1
            print(f"{label:<44}ERROR\n{traceback.format_exc(limit=4)}")
            rows.append({"case": label, "error": traceback.format_exc(limit=4)})
            continue
        ds, dp = row["saved_predicted"] - row["saved_measured"], row["peak_predicted"] - row["peak_measured"]
        ok = ds == 0 and dp == 0 and row["phase_predicted"] == row["phase_measured"]
        bad += not ok
        alloc = row["max_memory_allocated"]
        da = "" if alloc is None else f"{alloc - row['peak_predicted']:,}"
        print(f"{label:<44}{row['saved_measured']:>15,}{ds:>6,}{row['peak_measured']:>17,}{dp:>6,}"
              f"{'' if alloc is None else f'{alloc:,}':>17}{da:>12}  {row['phase_measured']} [{row['kernel']}]")
        rows.append({"case": label, **row, "exact": ok})
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{'generation':<44}{'prefill':>15}{'diff':>6}{'decode':>17}{'diff':>6}{'cache':>15}{'diff':>6}"
          f"{'max_alloc':>17}")
    generated = []
    for case in INFERENCE_CASES:
        if args.only and case[0] != args.only:
            continue
        label = " ".join(map(str, case))
        try:
            row = run_inference(case, size, args.device)
        except Exception:
            bad += 1
            print(f"{label:<44}ERROR\n{traceback.format_exc(limit=4)}")
            generated.append({"case": label, "error": traceback.format_exc(limit=4)})
            continue
        diffs = [row[f"{k}_predicted"] - row[f"{k}_measured"] for k in ("prefill", "decode", "cache")]
        bad += any(diffs)
        alloc = row["max_memory_allocated"]
        print(f"{label:<44}{row['prefill_measured']:>15,}{diffs[0]:>6,}{row['decode_measured']:>17,}{diffs[1]:>6,}"
              f"{row['cache_measured']:>15,}{diffs[2]:>6,}{'' if alloc is None else f'{alloc:,}':>17}")
        generated.append({"case": label, **row, "exact": not any(diffs)})
        if args.device == "cuda":
            torch.cuda.empty_cache()
    Path(args.json).write_text(json.dumps({"device": where, "torch": torch.__version__,
                                           "transformers": transformers.__version__, "sizes": size,
                                           "seconds": round(time.perf_counter() - start, 1), "cases": rows,
                                           "generation": generated},
                                          indent=1) + "\n")
    print(("all exact" if not bad else f"{bad} case(s) differ") + f"; table in {args.json}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
