"""The CUDA column's bytes saved for backward, against PyTorch's own meta functions.

The suite's machine has no GPU, so each model is built by transformers on PyTorch's meta
device and its training forward run as CUDA runs it (:func:`helpers.saved_as_cuda_on_meta`:
SDPA's fused kernels through their aten ops, whose meta functions and autograd formulas are
PyTorch's; dropout as ``native_dropout``). What autograd saves is then PyTorch's answer for
CUDA, not a copy of symmem's derivation, and symmem's ``device="cuda"`` estimate must equal it:
exactly for eager, flash and cuDNN, and less 16 bytes per mem-efficient call (its philox seed
and offset are host tensors on CUDA, device tensors on meta). The peak cannot be measured so
(the meta device allocates nothing); ``benchmarks/gpu_check.py`` measures it on a GPU.
"""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem as sm  # noqa: E402
from helpers import saved_as_cuda_on_meta  # noqa: E402

transformers.logging.set_verbosity_error()

B, S, V = 2, 16, 100
COMMON = dict(num_hidden_layers=2, vocab_size=V, max_position_embeddings=32, use_cache=False)
MODELS = {
    "gpt2": lambda: (transformers.GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=V, n_positions=32,
                                             use_cache=False), transformers.GPT2LMHeadModel),
    # grouped-query attention (SDPA's enable_gqa), attention dropout
    "llama": lambda: (transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                               num_key_value_heads=2, attention_dropout=0.1, **COMMON),
                      transformers.LlamaForCausalLM),
    "qwen2": lambda: (transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                               num_key_value_heads=2, **COMMON), transformers.Qwen2ForCausalLM),
    # a quarter of each head rotated: a contiguous q, whose flash output is not sequence-major
    "gpt_neox": lambda: (transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                                    rotary_pct=0.25, **COMMON), transformers.GPTNeoXForCausalLM),
    "opt": lambda: (transformers.OPTConfig(hidden_size=64, ffn_dim=96, num_attention_heads=4, **COMMON),
                    transformers.OPTForCausalLM),
    # a window beyond the sequence (SDPA: is_causal, no mask)
    "mistral": lambda: (transformers.MistralConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                                   num_key_value_heads=2, sliding_window=64, **COMMON),
                        transformers.MistralForCausalLM),
    # the experts through torch._grouped_mm; its meta function takes bfloat16 only (CUDA's own
    # kernel falls back to a loop of mm for float32), so only bfloat16 models are run
    "mixtral": lambda: (transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                                   num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                                   sliding_window=None, **COMMON), transformers.MixtralForCausalLM),
    # the experts through torch.bmm of gathered weights: float32 too
    "mixtral_batched_mm": lambda: (transformers.MixtralConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=None, experts_implementation="batched_mm", **COMMON),
        transformers.MixtralForCausalLM),
}

#: BERT's masked-LM model, called with token types and labels of its own (as a tokenizer and a
#: collator hand them)
BERT = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_hidden_layers=2, vocab_size=V,
            max_position_embeddings=32)
#: ViT: (b, 3, 32, 32) images in 8 x 8 patches, a class token, 10 classes
VIT = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_hidden_layers=2, image_size=32,
           patch_size=8, num_labels=10)

CASES = [
    # family, precision, attention (the kernel symmem derives for it on CUDA), recompute
    ("gpt2", "fp32", "sdpa", "none"),          # mem-efficient (flash takes no float32)
    ("gpt2", "bf16", "sdpa", "none"),          # flash
    ("gpt2", "fp32", "eager", "none"),         # dropout's bool mask, CUDA's
    ("llama", "bf16", "sdpa", "none"),
    ("llama", "fp32", "sdpa", "none"),
    ("llama", "bf16", "cudnn", "none"),        # what H100s with a recent cuDNN pick first
    ("llama", "bf16", "sdpa", "full"),         # transformers' activation checkpointing
    ("qwen2", "bf16", "sdpa", "none"),
    ("gpt_neox", "bf16", "sdpa", "none"),
    ("gpt_neox", "fp32", "eager", "none"),
    ("opt", "fp32", "sdpa", "none"),
    ("opt", "bf16", "eager", "none"),
    ("mistral", "fp32", "sdpa", "none"),
    ("mixtral", "bf16", "sdpa", "none"),
    ("mixtral", "bf16", "eager", "none"),
    ("mixtral_batched_mm", "fp32", "sdpa", "none"),
    ("mixtral_batched_mm", "bf16", "eager", "none"),
    ("bert", "fp32", "sdpa", "none"),         # mem-efficient
    ("bert", "bf16", "sdpa", "none"),         # flash
    ("bert", "fp32", "eager", "none"),
    ("vit", "fp32", "sdpa", "none"),
    ("vit", "bf16", "sdpa", "none"),
    ("vit", "bf16", "eager", "none"),
]


@pytest.mark.parametrize("family,precision,attention,recompute", CASES, ids=["-".join(c) for c in CASES])
def test_cuda_saved_bytes_equal_pytorch_meta(family, precision, attention, recompute):
    if family == "vit":
        cfg, cls = transformers.ViTConfig(**VIT), transformers.ViTForImageClassification
    elif family == "bert":
        cfg, cls = transformers.BertConfig(**BERT), transformers.BertForMaskedLM
    else:
        cfg, cls = MODELS[family]()
    cfg._attn_implementation = "eager" if attention == "eager" else "sdpa"
    keys = {"attn_implementation": cfg._attn_implementation, "experts_implementation": cfg._experts_implementation}
    est = sm.estimate(sm.models.from_hf_config({**cfg.to_dict(), **keys}),
                      sm.Policy(precision, "adamw", "cuda", attention=attention, recompute=recompute))
    (kernel,) = est.kernels
    with torch.device("meta"):
        model = cls(cfg)
    model.train()
    if precision == "bf16":
        model.to(torch.bfloat16)
    if recompute == "full":
        model.activation_checkpointing_enable({"use_reentrant": False})
    host = 16 * cfg.num_hidden_layers if kernel == "mem-efficient" else 0
    if family == "vit":
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        pixels = torch.randn(B, 3, 32, 32, device="meta", dtype=dtype)
        labels = torch.randint(0, 10, (B,), device="meta")
        measured = saved_as_cuda_on_meta(model, lambda m: m(pixel_values=pixels, labels=labels), kernel)
        assert est.at(b=B).bytes["activations"] == measured - host
        return
    ids = torch.randint(0, V, (B, S), device="meta")
    if family == "bert":
        types, labels = torch.randint(0, 2, (B, S), device="meta"), torch.randint(0, V, (B, S), device="meta")
        measured = saved_as_cuda_on_meta(model, lambda m: m(ids, token_type_ids=types, labels=labels), kernel)
    else:
        measured = saved_as_cuda_on_meta(model, lambda m: m(ids, labels=ids), kernel)
    assert est.at(b=B, s=S).bytes["activations"] == measured - host
