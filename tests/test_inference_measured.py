"""Inference against Hugging Face's own causal LMs (Llama, Qwen2, Mistral, GPT-2, GPT-NeoX,
OPT) on the CPU: the prefill of a prompt and one decoding step with transformers'
``DynamicCache`` (or ``StaticCache``, or ``QuantizedCache`` in fp8 or with quanto at 4 and 2
bits), under ``torch.no_grad`` (random weights, small configs, no download). Each case checks,
to the byte, the peak of the prefill, the peak of the decoding step and the KV cache after it,
measured by :func:`symmem.measure.generation` (live storages after every operator)."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem as sm  # noqa: E402
from symmem.measure import generation, inference_pass, param_bytes  # noqa: E402

transformers.logging.set_verbosity_error()

# (b, s, h, f, a, k, L, V)
POINTS = [
    (2, 8, 32, 64, 4, 2, 2, 100),       # grouped-query attention
    (3, 12, 64, 128, 4, 4, 3, 50),      # multi-head, three layers
    (1, 16, 32, 64, 4, 1, 2, 100),      # b = 1, multi-query
]

CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
}


def hf_model(family, point, attention):
    b, s, h, f, a, k, L, V = point
    torch.manual_seed(0)
    if family == "gpt_neox":    # multi-head, a quarter of each head rotated, parallel residual: k unused
        cfg = transformers.GPTNeoXConfig(hidden_size=h, intermediate_size=f, num_attention_heads=a,
                                         num_hidden_layers=L, vocab_size=V, max_position_embeddings=64,
                                         rotary_pct=0.25, attn_implementation=attention)
        return cfg, transformers.GPTNeoXForCausalLM(cfg).eval()
    if family == "gpt2":        # multi-head, its own MLP width (4h): k and f unused
        cfg = transformers.GPT2Config(n_embd=h, n_head=a, n_layer=L, vocab_size=V, n_positions=64,
                                      attn_implementation=attention)
        return cfg, transformers.GPT2LMHeadModel(cfg).eval()
    if family.startswith("opt"):  # multi-head, a ReLU MLP f wide: k unused. "opt": layer norms before each
        # residual; "opt-post": after (do_layer_norm_before=False); "opt-350m": after, and embeddings half as
        # wide as the layers, projected in and out (word_embed_proj_dim), as OPT 350m
        cfg = transformers.OPTConfig(hidden_size=h, ffn_dim=f, num_attention_heads=a, num_hidden_layers=L,
                                     vocab_size=V, max_position_embeddings=64, do_layer_norm_before=family == "opt",
                                     word_embed_proj_dim=h // 2 if family == "opt-350m" else h,
                                     attn_implementation=attention)
        return cfg, transformers.OPTForCausalLM(cfg).eval()
    extra = {}
    if family.startswith("qwen2-"):     # use_sliding_window (a window of 32): "qwen2-sliding" every layer,
        # "qwen2-mixed" all but the first (max_window_layers 1)
        extra = dict(use_sliding_window=True, sliding_window=32, max_window_layers=int(family == "qwen2-mixed"))
    config_class, model_class = CLASSES[family.split("-")[0]]
    cfg = config_class(hidden_size=h, intermediate_size=f, num_attention_heads=a, num_key_value_heads=k,
                       num_hidden_layers=L, vocab_size=V, max_position_embeddings=64, attn_implementation=attention,
                       bos_token_id=0, eos_token_id=0, pad_token_id=None, **extra)
    return cfg, model_class(cfg).eval()


def assert_generation_exact(est, model, precision, b, s, n_g, V):
    """The prefill's and the decoding step's peaks, each phase's own maximum over the estimate's
    timeline, and the cache, to the byte; generated with the estimate's cache and logits (a
    static cache of its max_cache_len, s + n_g by default, as generate sizes it)."""
    pol = est.policy
    if b == 1:                  # b = 1 reshapes some copies into views (Estimate.at_one)
        est = est.at_one
    ids = torch.randint(0, V, (b, s))
    length = (pol.max_cache_len or s + n_g) if pol.cache == "static" else None
    prefill, decode, cached = generation(model, ids, n_g, cache=pol.cache, max_cache_len=length, logits=pol.logits,
                                         autocast=torch.bfloat16 if precision == "bf16-mixed" else None,
                                         residual_length=pol.residual_length, q_group_size=pol.q_group_size)
    subs = est._subs({"b": b, "s": s, "n_g": n_g})
    predicted = {step: max(int(p.total.xreplace(subs)) for p in est.timeline if p.phase == step)
                 for step in ("prefill", "decode")}
    ev = est.at(b=b, s=s, n_g=n_g)
    assert (predicted, ev.bytes["cache"]) == ({"prefill": prefill.peak, "decode": decode.peak}, cached)
    assert ev.peak == max(prefill.peak, decode.peak)
    assert ev.peak_point.phase == ("prefill" if prefill.peak >= decode.peak else "decode")


CASES = [
    ("llama", POINTS[0], "eager", "fp32", 1),
    ("llama", POINTS[0], "sdpa", "bf16-mixed", 3),
    ("llama", POINTS[1], "eager", "bf16", 4),
    ("llama", POINTS[2], "eager", "fp32", 5),
    ("qwen2", POINTS[0], "sdpa", "fp32", 3),
    ("qwen2", POINTS[2], "eager", "bf16-mixed", 2),
    ("mistral", POINTS[1], "sdpa", "bf16", 2),
    # Qwen2's sliding layers cache in DynamicSlidingWindowLayer, its full ones in DynamicLayer;
    # eager's two masks (full and the window's) are (b, 1, q, s + n_g) each
    ("qwen2-sliding", POINTS[0], "eager", "fp32", 3),
    ("qwen2-sliding", POINTS[2], "sdpa", "bf16-mixed", 2),
    ("qwen2-mixed", POINTS[1], "eager", "bf16", 4),
    ("qwen2-mixed", POINTS[0], "sdpa", "fp32", 3),
    ("qwen2-mixed", POINTS[2], "eager", "bf16-mixed", 5),
    ("gpt2", POINTS[0], "eager", "fp32", 3),       # dropout 0.1 in training, off in eval
    ("gpt2", POINTS[2], "sdpa", "bf16-mixed", 2),
    # the attention's and the MLP's arguments (the layer norms' outputs) live until each returns
    ("gpt_neox", POINTS[0], "eager", "fp32", 3),
    ("gpt_neox", POINTS[0], "sdpa", "bf16-mixed", 2),
    # GPTNeoXLayer's `attn_output, _ = self.attention(...)`: the attention weights (float32
    # under autocast: the rotated query is) live in `_` until the layer returns, past the MLP
    ("gpt_neox", POINTS[1], "eager", "bf16-mixed", 2),
    # OPT's decoder, called without an attention_mask, makes a float32 mask of ones and int64
    # positions over every position seen, (b, s + n_g) in the decoding step, until it returns;
    # the layer norm before fc1 goes when fc1 returns (the local is rebound); the layer keeps
    # the attention weights until it returns, past the post-norm's final layer norm
    ("opt", POINTS[0], "eager", "fp32", 3),
    ("opt", POINTS[1], "sdpa", "bf16-mixed", 2),
    ("opt", POINTS[1], "eager", "bf16", 4),
    ("opt-post", POINTS[0], "sdpa", "fp32", 3),
    ("opt-post", POINTS[1], "eager", "bf16-mixed", 2),
    ("opt-post", POINTS[2], "eager", "fp32", 5),
    ("opt-350m", POINTS[2], "sdpa", "bf16-mixed", 2),
]


def model_and_estimate(family, point, attention, precision, **policy):
    """The Hugging Face model (in bfloat16 for ``precision`` bf16) and symmem's inference
    estimate of its config under ``precision`` and ``policy``, on the CPU."""
    cfg, model = hf_model(family, point, attention)
    if precision == "bf16":
        model.to(torch.bfloat16)
    graph = sm.models.from_hf_config({**cfg.to_dict(), "attn_implementation": cfg._attn_implementation})
    return model, sm.estimate(graph, sm.Policy(precision, device="cpu", mode="inference", **policy))


@pytest.mark.parametrize("family,point,attention,precision,n_g", CASES,
                         ids=[f"{fam}-b{p[0]}-s{p[1]}-k{p[5]}-{at}-{pr}-n{n}" for fam, p, at, pr, n in CASES])
def test_generation_exact(family, point, attention, precision, n_g):
    b, s, h, f, a, k, L, V = point
    model, est = model_and_estimate(family, point, attention, precision)
    ev = est.at(b=b, s=s, n_g=n_g)
    assert ev.bytes["params"] == param_bytes(model)
    assert (ev.bytes["grads"], ev.bytes["optimizer"], ev.bytes["master"], ev.bytes["activations"]) == (0, 0, 0, 0)
    assert_generation_exact(est, model, precision, b, s, n_g, V)


# (family, point, attention, precision, n_g, max_cache_len: None for s + n_g, as generate sets
# it, the prefill's logits)
STATIC = [
    ("llama", POINTS[0], "eager", "fp32", 3, None, "all"),
    ("llama", POINTS[0], "sdpa", "fp32", 3, None, "last"),        # the decoding step's boolean mask, its float copy
    ("llama", POINTS[1], "eager", "bf16", 2, 20, "last"),          # 6 positions preallocated beyond s + n_g
    ("llama", POINTS[2], "sdpa", "bf16-mixed", 2, None, "all"),    # b = 1, multi-query
    ("qwen2", POINTS[0], "sdpa", "bf16-mixed", 2, 16, "last"),
    # the counter a tensor: OPT's decoding step's `past_seen_tokens + q` is an 8-byte int64
    ("opt", POINTS[1], "eager", "fp32", 3, None, "last"),
    ("opt-post", POINTS[1], "sdpa", "bf16-mixed", 2, 20, "all"),
    ("opt", POINTS[1], "sdpa", "bf16", 2, None, "last"),
]


@pytest.mark.parametrize("family,point,attention,precision,n_g,max_len,logits", STATIC,
                         ids=[f"{fam}-b{p[0]}-s{p[1]}-k{p[5]}-{at}-{pr}-n{n}-T{t}-{lg}"
                              for fam, p, at, pr, n, t, lg in STATIC])
def test_static_cache_exact(family, point, attention, precision, n_g, max_len, logits):
    """transformers' StaticCache: the whole (b, k, T, d) keys and values allocated at the
    prefill's first update of each layer, written in place by the decoding step; attention
    over all T = max_cache_len positions (s + n_g by default)."""
    b, s, h, f, a, k, L, V = point
    model, est = model_and_estimate(family, point, attention, precision, cache="static", max_cache_len=max_len,
                                    logits=logits)
    T = max_len or s + n_g
    # keys and values of T positions in each layer, and each layer's 8-byte counter; under
    # autocast Llama's keys are float32 (rotated by float32 cos and sin), the values bfloat16;
    # OPT's keys are not rotated (bfloat16)
    B_k, B_v = {"fp32": (4, 4), "bf16": (2, 2), "bf16-mixed": (2 if family.startswith("opt") else 4, 2)}[precision]
    assert est.at(b=b, s=s, n_g=n_g).bytes["cache"] == L * b * k * T * (h // a) * (B_k + B_v) + 8 * L
    assert_generation_exact(est, model, precision, b, s, n_g, V)


# (family, point, attention, precision, n_g); no autocast, which cannot concatenate fp8 tensors
FP8 = [
    ("llama", POINTS[0], "eager", "fp32", 3),
    ("llama", POINTS[1], "eager", "bf16", 2),
    ("llama", POINTS[2], "sdpa", "fp32", 2),        # b = 1, multi-query
    # the prefill's one kv head repeated as a view: the eager scores' peak in bfloat16
    ("llama", POINTS[2], "eager", "bf16", 2),
    ("qwen2", POINTS[1], "sdpa", "bf16", 3),
    ("gpt2", POINTS[0], "eager", "fp32", 2),
    ("gpt_neox", POINTS[0], "sdpa", "bf16", 3),
    ("opt", POINTS[1], "eager", "fp32", 2),
]


@pytest.mark.parametrize("family,point,attention,precision,n_g", FP8,
                         ids=[f"{fam}-b{p[0]}-s{p[1]}-k{p[5]}-{at}-{pr}-n{n}" for fam, p, at, pr, n in FP8])
def test_fp8_cache_exact(family, point, attention, precision, n_g):
    """transformers' QuantizedCache(backend="fp8"): keys and values calibrated and quantized at
    the prefill, appended in fp8 by the decoding step, which dequantizes the whole cache for
    attention. Peaks of both steps and the cache, to the byte."""
    b, s, h, f, a, k, L, V = point
    model, est = model_and_estimate(family, point, attention, precision, cache="fp8")
    kv = a if family in ("gpt2", "gpt_neox", "opt") else k      # multi-head families: k unused
    # 1 byte an element of the keys and the values of s + n_g positions, and each tensor's
    # float32 scale: e.g. llama b2 s8 n3, 2 kv heads of 8 in 2 layers: 2*2*2*11*8*2 + 4*4 = 1,424
    assert est.at(b=b, s=s, n_g=n_g).bytes["cache"] == 2 * L * b * kv * (s + n_g) * (h // a) + 8 * L
    assert_generation_exact(est, model, precision, b, s, n_g, V)


def quanto_cache_bytes(b, s, kv, d, L, Bs, n_g, bits, group, residual_length):
    """A quanto cache after decoding step n_g, counted as optimum-quanto lays it out: each
    layer's keys and values (their dtypes' bytes ``Bs``) quantized over T positions, (b kv T d /
    g) groups of g codes packed 8 / bits a byte along the groups (ceil(groups · bits / 8) · g
    bytes), a scale and a shift a group in the states' B bytes; the residual of the r positions
    since in B bytes an element. T + r = s + n_g, r = n_g mod residual_length (the flush empties
    it)."""
    r = n_g % residual_length
    groups = b * kv * (s + n_g - r) * d // group
    return L * sum(-(-groups * bits // 8) * group + 2 * groups * B + b * kv * r * d * B for B in Bs)


# (family, point, attention, precision, n_g, bits): residual_length 3, q_group_size 8; steps 1
# and 4 find an empty residual, 2 one position, 3 two (the flush: 3 positions reached)
QUANTO = [
    ("llama", POINTS[0], "eager", "fp32", 3, 4),
    ("llama", POINTS[0], "sdpa", "bf16", 2, 2),
    ("llama", POINTS[0], "sdpa", "fp32", 4, 2),
    ("llama", POINTS[0], "eager", "bf16-mixed", 3, 4),      # float32 keys, bfloat16 values
    ("llama", POINTS[1], "eager", "bf16", 3, 2),
    ("llama", POINTS[2], "eager", "bf16", 3, 4),     # b = 1, multi-query; 19 groups: the packing rounds up
    ("qwen2", POINTS[1], "sdpa", "fp32", 1, 4),
    ("qwen2", POINTS[1], "sdpa", "bf16-mixed", 2, 2),
    ("gpt2", POINTS[0], "eager", "fp32", 2, 4),
    ("gpt2", POINTS[0], "sdpa", "bf16-mixed", 3, 4),
    ("gpt_neox", POINTS[0], "sdpa", "bf16", 3, 2),
    ("opt", POINTS[1], "sdpa", "bf16", 3, 4),
]


@pytest.mark.parametrize("family,point,attention,precision,n_g,bits", QUANTO,
                         ids=[f"{fam}-b{p[0]}-s{p[1]}-k{p[5]}-{at}-{pr}-n{n}-int{q}"
                              for fam, p, at, pr, n, q in QUANTO])
def test_quanto_cache_exact(family, point, attention, precision, n_g, bits):
    """transformers' QuantizedCache(backend="quanto"): keys and values quantized at the prefill,
    each decoding step dequantizing them and appending its position to the residual, or
    re-quantizing everything once the residual reaches residual_length (the flush). Peaks of
    both steps and the cache, to the byte, the step's residual position from n_g."""
    pytest.importorskip("optimum.quanto")
    b, s, h, f, a, k, L, V = point
    model, est = model_and_estimate(family, point, attention, precision, cache=f"quanto-int{bits}",
                                    residual_length=3, q_group_size=8, residual_position=(n_g - 1) % 3)
    kv = a if family in ("gpt2", "gpt_neox", "opt") else k      # multi-head families: k unused
    # under autocast Llama's and Qwen2's keys are float32 (rotated by float32 cos and sin)
    Bs = {"fp32": (4, 4), "bf16": (2, 2), "bf16-mixed": (4 if family in ("llama", "qwen2") else 2, 2)}[precision]
    assert est.at(b=b, s=s, n_g=n_g).bytes["cache"] == quanto_cache_bytes(b, s, kv, h // a, L, Bs, n_g, bits, 8, 3)
    assert_generation_exact(est, model, precision, b, s, n_g, V)


def test_quanto_cache_bytes():
    """The count above by hand. Llama b2 s8 n3 (the flush), 2 kv heads of 8 in 2 layers, fp32,
    int4: 2*2*11*8 / 8 = 44 groups, 22 packed rows of 8 codes (176 bytes), 2*44*4 = 352 bytes
    of scales and shifts: 528 a tensor, 2,112 in all. b1 s16 n3, one kv head, bf16, int4:
    1*1*19*8 / 8 = 19 groups, ceil(19 / 2) = 10 packed rows (80 bytes) and 2*19*2 = 76: 156 a
    tensor, 624 in all. Step 2 of the first: the prompt's 8 positions quantized (32 groups: 128
    + 256 bytes), the two generated since in the residual (2*2*2*8*4 = 256): 640 a tensor,
    2,560; under bf16 autocast (float32 keys, bfloat16 values) the values' 128 + 128 + 128 =
    384: 2 * (640 + 384) = 2,048."""
    assert quanto_cache_bytes(2, 8, 2, 8, 2, (4, 4), 3, 4, 8, 3) == 2_112
    assert quanto_cache_bytes(1, 16, 1, 8, 2, (2, 2), 3, 4, 8, 3) == 624
    assert quanto_cache_bytes(2, 8, 2, 8, 2, (4, 4), 2, 4, 8, 3) == 2_560
    assert quanto_cache_bytes(2, 8, 2, 8, 2, (4, 2), 2, 4, 8, 3) == 2_048


# a vocabulary large enough for the prefill's logits to be its peak: (b, s, h, f, a, k, L, V)
WIDE = (2, 16, 32, 64, 4, 2, 2, 1000)


@pytest.mark.parametrize("family,attention,precision", [("llama", "eager", "bf16-mixed"), ("gpt2", "sdpa", "fp32")])
def test_logits_to_keep(family, attention, precision):
    """generate's logits_to_keep=1 against every position's logits: the prefill's and the
    decoding step's peaks measured both ways, exact."""
    b, s, h, f, a, k, L, V = WIDE
    cfg, model = hf_model(family, WIDE, attention)
    graph = sm.models.from_hf_config({**cfg.to_dict(), "attn_implementation": cfg._attn_implementation})
    peaks = {}
    for logits in ("last", "all"):
        est = sm.estimate(graph, sm.Policy(precision, device="cpu", mode="inference", logits=logits))
        assert_generation_exact(est, model, precision, b, s, 1, V)
        peaks[logits] = est.at(b=b, s=s, n_g=1).peak
    # both measured exact above; the last position's logits make the prefill smaller
    assert peaks["last"] < peaks["all"]


def test_inference_pass_without_tensors():
    """A module with no parameters or buffers and no extra tensors: nothing registered before
    the call (3 float32 elements = 12 bytes made by it, still referenced at the end)."""
    report, out = inference_pass(torch.nn.Identity(), lambda: torch.ones(3))
    assert (report.at_start, report.peak, report.at_end) == (0, 12, 12)
