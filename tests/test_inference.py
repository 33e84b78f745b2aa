"""Inference mode (``Policy(mode="inference")``, ``symmem infer``): the formulas by hand, the
command line and the errors. The measured cases are in ``tests/test_inference_measured.py``."""
import json

import pytest
import sympy as sp

import symmem as sm
from symmem.cli import main
from symmem.errors import ConfigError, UnknownName
from symmem.symbols import B_a, L, a, b, h, k, n_g, s

# a small Llama with grouped-query attention: h = 64, f = 128, a = 4, k = 2, L = 2, V = 100
LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=2, vocab_size=100)


def estimate(precision="bf16", **config):
    graph = sm.models.from_hf_config({**LLAMA, **config})
    return sm.estimate(graph, sm.Policy(precision, device="cpu", mode="inference"))


@pytest.fixture(scope="module")
def est():
    return estimate()


def test_cache_formula(est):
    """The KV cache after the decoding step: 2 L b k (s + n_g) d bytes per element, d = h/a."""
    assert sp.expand(est.components["cache"] - 2 * L * b * k * (s + n_g) * (h / a) * B_a) == 0
    # 2 (keys, values) * 2 layers * b 3 * k 2 * (10 + 5) positions * d 16 * 2 bytes = 11,520
    assert est.at(b=3, s=10, n_g=5).bytes["cache"] == 2 * 2 * 3 * 2 * 15 * 16 * 2 == 11_520


def test_nothing_of_training():
    """No gradients, master copy, optimizer state or saved activations; the weights as training
    stores them (float32 under autocast)."""
    inf = estimate("bf16-mixed")
    ev = inf.at(b=2, s=8, n_g=3)
    none = ("grads", "master", "optimizer", "activations")
    assert {c: ev.bytes[c] for c in none} == dict.fromkeys(none, 0)
    training = sm.estimate(sm.models.from_hf_config(LLAMA), sm.Policy("bf16-mixed", device="cpu"))
    assert ev.bytes["params"] == training.at(b=2, s=8).bytes["params"]
    assert {p.phase for p in inf.timeline} == {"prefill", "decode"}


def test_peak_is_the_larger_step(est):
    subs = est._subs({"b": 2, "s": 8, "n_g": 3})
    steps = {ph: max(int(p.total.xreplace(subs)) for p in est.timeline if p.phase == ph)
             for ph in ("prefill", "decode")}
    assert est.at(b=2, s=8, n_g=3).peak == max(steps.values())
    # a short prompt, a long generation: the decoding step beside its cache of s + n_g positions
    assert est.at(b=2, s=2, n_g=4000).peak_point.phase == "decode"
    # a long prompt, few new tokens: the prefill (its logits over every position)
    assert est.at(b=2, s=512, n_g=1).peak_point.phase == "prefill"


def test_decode_grows_with_new_tokens(est):
    # each new position adds 2 L b k d B_a = 2 * 2 * 2 * 2 * 16 * 2 = 256 bytes to the cache
    grow = est.at(b=2, s=8, n_g=2001).peak - est.at(b=2, s=8, n_g=2000).peak
    assert grow >= 256


def test_max_batch_in_inference(est):
    from symmem.solve import max_batch
    sol = max_batch(est, "1MiB", s=64, n_g=64)
    usable = sol.total - sol.reserve
    assert est.at(b=sol.value, s=64, n_g=64).peak <= usable < est.at(b=sol.value + 1, s=64, n_g=64).peak


def test_training_unchanged():
    """A training policy has no cache component and its own phases."""
    train = sm.estimate(sm.models.from_hf_config(LLAMA), sm.Policy(device="cpu"))
    assert "cache" not in train.components
    assert {p.phase for p in train.timeline} == {"forward", "backward", "optimizer"}


@pytest.mark.parametrize("kwargs,key", [
    (dict(recompute="full"), "recompute with --mode inference"),
    (dict(accumulate=2), "accumulate with --mode inference"),
    (dict(lora=8), "lora with --mode inference"),
])
def test_training_techniques_refused(kwargs, key):
    with pytest.raises(ConfigError) as err:
        sm.Policy(mode="inference", **kwargs)
    assert err.value.field == key
    assert "Leave --" in str(err.value)


def test_unknown_mode_and_cache():
    with pytest.raises(UnknownName):
        sm.Policy(mode="serving")
    with pytest.raises(UnknownName):
        sm.Policy(mode="inference", cache="paged")
    with pytest.raises(ConfigError) as err:    # QuantizedCache: not modelled, with the reason
        sm.Policy(mode="inference", cache="quantized")
    assert err.value.field == "cache" and "HQQ backend" in str(err.value) and "--cache quanto-int4" in str(err.value)


def test_fp8_cache():
    """QuantizedCache(backend="fp8"): 1 byte an element and a 4-byte scale per tensor. Llama-2-7b
    after s + n_g positions: 2 * 32 layers * 32 kv heads * 128 = 262,144 bytes a position and
    sequence, 256 bytes of scales; half the bf16 dynamic cache's 524,288 bytes a position."""
    fp8 = sm.estimate("llama-2-7b", sm.Policy("bf16", mode="inference", cache="fp8")).at(b=4, s=1000, n_g=24)
    dyn = sm.estimate("llama-2-7b", sm.Policy("bf16", mode="inference")).at(b=4, s=1000, n_g=24)
    assert fp8.bytes["cache"] == 262_144 * 4 * 1024 + 256
    assert dyn.bytes["cache"] == 524_288 * 4 * 1024
    assert fp8.peak < dyn.peak


@pytest.mark.parametrize("model,precision,words", [
    ("llama-2-7b", "bf16-mixed", ["--precision bf16-mixed (autocast)", "at::autocast::prioritize"]),
    ("mistral-7b", "bf16", ["sliding window (4096)", "--cache dynamic"])])
def test_fp8_cache_refusals(model, precision, words):
    """What transformers itself cannot run: fp8 tensors concatenated under autocast, and a
    QuantizedCache over sliding-window layers."""
    with pytest.raises(ConfigError) as err:
        sm.estimate(model, sm.Policy(precision, mode="inference", cache="fp8"))
    assert err.value.field == "cache" and all(w in str(err.value) for w in words)


def test_quanto_cache():
    """QuantizedCache(backend="quanto"), transformers' defaults (residual_length 128,
    q_group_size 64). Llama-2-7b in bf16, b = 4, s = 1000, each layer's keys and values
    quantized in 4*32*T*128 / 64 = 256 T groups, packed 2 (int4) or 4 (int2) a byte, and a
    2-byte scale and shift a group. The flush (n_g = 128): T = 1128, 288,768 groups: 144,384 *
    64 packed bytes + 4 * 288,768 = 10,395,648 a tensor, * 64 tensors = 665,321,472. The step
    n_g = 1: T = 1000, 256,000 groups (8,192,000 + 1,024,000 bytes) and one position in the
    residual (4*32*128*2 = 32,768): 9,248,768 a tensor, 591,921,152; int2: 64,000 packed rows,
    329,777,152. The dynamic cache of 1001 positions: 524,288 * 4 * 1001."""
    model = "llama-2-7b"
    flush = sm.estimate(model, sm.Policy("bf16", mode="inference", cache="quanto-int4")).at(b=4, s=1000, n_g=128)
    assert flush.bytes["cache"] == 665_321_472
    first = {bits: sm.estimate(model, sm.Policy("bf16", mode="inference", cache=f"quanto-int{bits}",
                                                residual_position=0)).at(b=4, s=1000, n_g=1)
             for bits in (4, 2)}
    assert (first[4].bytes["cache"], first[2].bytes["cache"]) == (591_921_152, 329_777_152)
    dyn = sm.estimate(model, sm.Policy("bf16", mode="inference")).at(b=4, s=1000, n_g=1)
    assert dyn.bytes["cache"] == 524_288 * 4 * 1001
    assert first[2].peak < first[4].peak < dyn.peak


@pytest.mark.parametrize("kwargs,words", [
    (dict(model="mistral-7b"), ["cache", "sliding window (4096)", "--cache dynamic"]),
    (dict(residual_position=128), ["residual_position", "from 0 to residual_length - 1 = 127"]),
    (dict(residual_length=0), ["residual_length", "a whole number >= 1", "default, 128"]),
    (dict(cache="dynamic", q_group_size=32), ["q_group_size", "a quanto cache", "--cache quanto-int4"]),
])
def test_quanto_cache_refusals(kwargs, words):
    """Not modelled: sliding-window layers (QuantizedCache refuses them); a residual position
    outside the residual; the quanto options without a quanto cache."""
    model, precision = kwargs.pop("model", "llama-2-7b"), kwargs.pop("precision", "bf16")
    kwargs = {"cache": "quanto-int4", **kwargs}
    with pytest.raises(ConfigError) as err:
        sm.estimate(model, sm.Policy(precision, mode="inference", **kwargs))
    assert err.value.field == words[0] and all(w in str(err.value) for w in words[1:])


@pytest.mark.parametrize("group,n_g,words", [
    (64, 100, ["n_g = 100", "at least 128", "--residual-position (n_g - 1) mod 128"]),
    (64, 200, ["n_g - 128 = 72", "a multiple of 128"]),
    (3, 128, ["= 4096000", "a multiple of 3", "q_group_size divides"]),
])
def test_quanto_cache_steps(group, n_g, words):
    """The formulas hold for the decoding steps of the residual position they were derived for
    (the flush by default: n_g = 128, 256, ...) and where q_group_size divides what is quantized
    (kv heads x positions x head_dim: the prompt's 32 * 1000 * 128 is not a multiple of 3)."""
    est = sm.estimate("llama-2-7b", sm.Policy("bf16", mode="inference", cache="quanto-int4", q_group_size=group))
    with pytest.raises(ConfigError) as err:
        est.at(b=1, s=1000, n_g=n_g)
    assert all(w in str(err.value) for w in words)


def test_quanto_cache_one_group():
    """A tensor of one group (the small Llama's 2 kv heads x 16 at b = 1, s = 1, q_group_size
    32) is refused: optimum-quanto then keeps a scale and shift per element. Two positions make
    two groups."""
    est = sm.estimate(sm.models.from_hf_config(LLAMA), sm.Policy("fp32", device="cpu", mode="inference",
                                                                 cache="quanto-int4", q_group_size=32))
    with pytest.raises(ConfigError) as err:
        est.at(b=1, s=1, n_g=128)
    assert "expected at least 64" in str(err.value) and "two groups or more" in str(err.value)
    assert est.at(b=1, s=2, n_g=128).bytes["cache"] > 0


def test_quanto_cache_solve_for_n_g():
    """``solve`` for n_g answers the decoding steps the formulas hold for: with residual
    position P and residual_length R, n_g = P + 1 + R k (llama-3-8b, bf16, b = 8, s = 4096, an
    H100-80GB less 10%: the flush steps, multiples of 128, and P = 5)."""
    from symmem.gpus import budget
    from symmem.solve import solve
    answers = {}
    for position in (127, 5):
        est = sm.estimate("llama-3-8b", sm.Policy("bf16", mode="inference", cache="quanto-int4",
                                                  residual_position=position))
        sol = solve(est, "n_g", budget("H100-80GB"), b=8, s=4096)
        assert (sol.value - 1) % 128 == position
        assert est.at(b=8, s=4096, n_g=sol.value).peak <= sol.usable < est.at(b=8, s=4096, n_g=sol.value + 128).peak
        answers[position] = sol.value
    assert answers == {127: 155_904, 5: 163_590}


QWEN2_MIXED = {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}


@pytest.mark.parametrize("config", [{"model_type": "mistral", "sliding_window": 16}, QWEN2_MIXED],
                         ids=["mistral", "qwen2-mixed"])
def test_sliding_window_requirement(config):
    """Mistral's DynamicSlidingWindowLayer (and that of Qwen2's sliding layers) keeps every
    position below its window only."""
    graph = sm.models.from_hf_config({**LLAMA, **config})
    inf = sm.estimate(graph, sm.Policy("bf16", device="cpu", mode="inference"))
    inf.at(b=2, s=8, n_g=7)          # 15 positions cached: below the window of 16
    with pytest.raises(ConfigError) as err:
        inf.at(b=2, s=8, n_g=8)
    assert "sliding window (16)" in str(err.value)


def test_positions_bound_the_generation():
    """GPT-2's learned positions bound the prompt and what it generates: s + n_g <= s_max."""
    graph = sm.models.from_hf_config(dict(model_type="gpt2", n_embd=32, n_head=4, n_layer=2, vocab_size=100,
                                          n_positions=64))
    inf = sm.estimate(graph, sm.Policy("fp32", device="cpu", mode="inference"))
    inf.at(b=1, s=60, n_g=4)
    with pytest.raises(ConfigError) as err:
        inf.at(b=1, s=60, n_g=5)
    assert "n_positions" in str(err.value)


def run(capsys, *argv):
    code = main([str(x) for x in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_infer_json(capsys, tmp_path, est):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA))
    code, out, _ = run(capsys, "infer", "--config", cfg, "--batch", 3, "--seq", 10, "--new-tokens", 5,
                       "--precision", "bf16", "--device", "cpu", "--format", "json")
    assert code == 0
    j = json.loads(out)
    assert j["bytes"]["cache"] == 11_520          # as in test_cache_formula
    assert j["new_tokens"] == 5 and j["inputs"]["mode"] == "inference" and j["inputs"]["cache"] == "dynamic"
    assert j["bytes"]["peak"] == max(j["phase_peaks"].values()) == est.at(b=3, s=10, n_g=5).peak


def test_cli_infer_table(capsys):
    code, out, _ = run(capsys, "infer", "--model", "llama-3-8b", "--batch", 8, "--seq", 4096, "--new-tokens", 1024,
                       "--precision", "bf16")
    assert code == 0
    # 2 * 32 layers * b 8 * k 8 * (4096 + 1024) * d 128 * 2 bytes = 5,368,709,120 (5 GiB)
    assert "5,368,709,120" in out and out.startswith("symmem infer")
    table = out.split("at the peak")[0]
    assert not any(line.startswith(("grads", "optimizer", "master", "activations")) for line in table.splitlines())


def test_cli_max_batch_inference(capsys):
    code, out, _ = run(capsys, "max-batch", "--model", "llama-3-8b", "--seq", 4096, "--new-tokens", 1024,
                       "--mode", "inference", "--precision", "bf16", "--gpu", "H100-80GB", "--format", "json")
    assert code == 0, out
    j = json.loads(out)
    assert j["max_batch"] >= 1
    inf = sm.estimate(sm.models.preset("llama-3-8b"), sm.Policy("bf16", mode="inference"))
    n = j["max_batch"]
    assert inf.at(b=n, s=4096, n_g=1024).peak <= j["usable_bytes"] < inf.at(b=n + 1, s=4096, n_g=1024).peak


def test_unchecked_families_refused():
    """Mixtral is not measured in inference: refused, naming the operators."""
    graph = sm.models.from_hf_config(dict(model_type="mixtral", hidden_size=32, intermediate_size=64,
                                          num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                          vocab_size=100, num_local_experts=8, num_experts_per_tok=2))
    with pytest.raises(ConfigError) as err:
        sm.estimate(graph, sm.Policy(device="cpu", mode="inference"))
    assert "grouped_mm" in str(err.value) and "--mode training" in str(err.value)


# a small OPT: h = 32, f = 64, a = 4, L = 2, V = 100
OPT = dict(model_type="opt", hidden_size=32, ffn_dim=64, num_attention_heads=4, num_hidden_layers=2,
           vocab_size=100, word_embed_proj_dim=32, max_position_embeddings=64)


def test_opt_positions_over_every_position_seen():
    """OPT's decoder, called without an attention_mask, makes its positions over all s + n_g
    positions seen even for one new token: torch.ones(b, s + n_g) float32, then at the .long()
    its cumsum and ``cumsum * mask - 1`` (float32, scratch) and the int64 ids."""
    est = sm.estimate(sm.models.from_hf_config(OPT), sm.Policy("fp32", device="cpu", mode="inference"))
    at = {p.node: p.total for p in est.timeline if p.phase == "decode"}
    assert sp.expand(at["position_ids"] - at["embed_tokens"] - 20 * b * (s + n_g)) == 0
    # (4 + 4 + 4 + 8) bytes * b 2 * (8 + 3) positions = 440 (measured: 256 bytes live after the
    # step's embedding, 696 after the .long())
    subs = est._subs({"b": 2, "s": 8, "n_g": 3})
    assert int((at["position_ids"] - at["embed_tokens"]).xreplace(subs)) == 440


def static(precision="bf16", max_cache_len=None, **kw):
    graph = sm.models.from_hf_config({**LLAMA, **kw.pop("config", {})})
    return sm.estimate(graph, sm.Policy(precision, device="cpu", mode="inference", cache="static",
                                        max_cache_len=max_cache_len, **kw))


def test_static_cache_formula():
    """A StaticCache preallocates max_cache_len = s + n_g positions (generate's default) and
    each layer's 8-byte counter: 2 L b k (s + n_g) d B_a + 8 L, as the dynamic cache's after
    the decoding step, plus the counters."""
    est = static()
    assert sp.expand(est.components["cache"] - 2 * L * b * k * (s + n_g) * (h / a) * B_a - 8 * L) == 0
    # 2 * 2 layers * b 3 * k 2 * 15 positions * d 16 * 2 bytes + 8 * 2 = 11,520 + 16
    assert est.at(b=3, s=10, n_g=5).bytes["cache"] == 11_536


def test_static_cache_fixed_length():
    """A fixed max_cache_len: the cache no longer grows with n_g, and s + n_g must fit in it."""
    est = static(max_cache_len=64)
    # 2 * 2 * b 3 * k 2 * 64 * 16 * 2 + 16 = 49,168 whatever s and n_g
    assert est.at(b=3, s=10, n_g=5).bytes["cache"] == est.at(b=3, s=20, n_g=44).bytes["cache"] == 49_168
    # the decoding step writes in place: its peak does not depend on n_g either
    assert est.at(b=3, s=10, n_g=5).peak == est.at(b=3, s=10, n_g=50).peak
    with pytest.raises(ConfigError) as err:
        est.at(b=3, s=20, n_g=45)
    assert "max_cache_len" in str(err.value)


def test_static_decode_is_flat_dynamic_grows():
    """The static cache exists whole before the decoding step; the dynamic one holds two
    copies of a layer's keys while torch.cat makes the longer one."""
    dyn, sta = estimate(), static()
    assert sta.at(b=2, s=8, n_g=3).bytes["cache"] == dyn.at(b=2, s=8, n_g=3).bytes["cache"] + 16


@pytest.mark.parametrize("kwargs,field,words", [
    (dict(max_cache_len=0), "max_cache_len", "a whole number of positions >= 1"),
    (dict(max_cache_len="64"), "max_cache_len", "a whole number of positions >= 1"),
])
def test_static_cache_bad_length(kwargs, field, words):
    with pytest.raises(ConfigError) as err:
        sm.Policy(mode="inference", cache="static", **kwargs)
    assert err.value.field == field and words in str(err.value)


def test_max_cache_len_needs_static():
    with pytest.raises(ConfigError) as err:
        sm.Policy(mode="inference", max_cache_len=64)
    assert "--cache static" in str(err.value)
    with pytest.raises(ConfigError) as err:
        sm.Policy(cache="static")
    assert "--mode inference" in str(err.value)


def test_static_cache_refusals():
    """A sliding window (StaticSlidingWindowLayer) and SDPA on CUDA are not modelled."""
    for config in ({"model_type": "mistral", "sliding_window": 16}, QWEN2_MIXED):
        with pytest.raises(ConfigError) as err:
            static(config=config)
        assert "StaticSlidingWindowLayer" in str(err.value) and "--cache dynamic" in str(err.value)
    graph = sm.models.from_hf_config(LLAMA)
    with pytest.raises(ConfigError) as err:
        sm.estimate(graph, sm.Policy("bf16", device="cuda", mode="inference", cache="static", attention="sdpa"))
    assert "--attention eager" in str(err.value)
    sm.estimate(graph, sm.Policy("bf16", device="cuda", mode="inference", cache="static", attention="eager"))


def test_cli_infer_static(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA))
    code, out, _ = run(capsys, "infer", "--config", cfg, "--batch", 3, "--seq", 10, "--new-tokens", 5,
                       "--precision", "bf16", "--device", "cpu", "--format", "json", "--cache", "static",
                       "--max-cache-len", 64)
    assert code == 0, out
    j = json.loads(out)
    assert j["bytes"]["cache"] == 49_168          # as in test_static_cache_fixed_length
    assert (j["inputs"]["cache"], j["inputs"]["max_cache_len"]) == ("static", 64)


def test_regions_in_inference(est):
    """Estimate.regions in inference: n_g a value by keyword, else an error naming it."""
    with pytest.raises(ConfigError) as err:
        est.regions(b_max=64, points=5)
    assert "n_g" in str(err.value) and "regions(..., n_g=...)" in str(err.value)
    regions = est.regions(b_max=64, points=5, n_g=16)
    assert {r.point.phase for r in regions} <= {"prefill", "decode"}
    assert sum(r.share for r in regions) == pytest.approx(1)
    # each region's winner is the largest candidate at a grid point inside it
    for r in regions:
        at = est._subs({"b": r.b[0], "s": r.s[0], "n_g": 16})
        assert int(r.point.total.xreplace(at)) == max(int(t.xreplace(at)) for t in est.totals)


def test_describe_inference():
    """The inference policy in words: nothing of gradients, optimizer states or scalers."""
    for precision in ("fp32", "bf16", "bf16-mixed", "fp16-mixed"):
        text = sm.Policy(precision, mode="inference").describe()
        assert not any(w in text for w in ("gradient", "optimizer", "GradScaler")), text
    assert "static, max_cache_len 64 KV cache" in sm.Policy(mode="inference", cache="static",
                                                              max_cache_len=64).describe()


def test_logits_last_by_default():
    """generate's logits_to_keep=1: the prefill's output head makes (b, 1, V) logits; with
    logits="all" it makes (b, s, V). With a vocabulary of 4,096 the prefill's peak is at its
    logits, (s - 1) b V B_a bytes fewer with the last position's only."""
    graph = sm.models.from_hf_config({**LLAMA, "vocab_size": 4096})
    last, full = (sm.estimate(graph, sm.Policy("bf16", device="cpu", mode="inference", logits=lg))
                  for lg in ("last", "all"))
    assert "prefill's logits: last position" in last.policy.describe()
    at = dict(b=2, s=64, n_g=1)
    assert last.at(**at).bytes["cache"] == full.at(**at).bytes["cache"]
    assert full.at(**at).peak_point.node == "lm_head"
    assert last.at(**at).peak < full.at(**at).peak

    def head(est):             # the prefill's moment at its output head
        (p,) = [p for p in est.timeline if p.phase == "prefill" and p.node == "lm_head"]
        return int(p.total.xreplace(est._subs(at)))
    # 63 positions fewer: 63 * b 2 * V 4096 * 2 bytes = 1,032,192
    assert head(full) - head(last) == 63 * 2 * 4096 * 2 == 1_032_192
    with pytest.raises(ConfigError) as err:
        sm.Policy(logits="all")
    assert "--mode inference" in str(err.value)
    with pytest.raises(UnknownName):
        sm.Policy(mode="inference", logits="first")
