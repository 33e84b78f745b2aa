"""Attention around a sliding window and grouped-query copies, against Hugging Face's own
models on the CPU: Mistral's SDPA from the window on (the boolean mask transformers
materialises and SDPA's float copy of it), and eager multi-head attention, where
``repeat_kv`` returns k and v themselves. Bytes saved for backward, the training step's peak,
its phase and every phase's maximum, to the byte.
"""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem as sm  # noqa: E402
from symmem.errors import ConfigError  # noqa: E402
from helpers import assert_hf_step_exact  # noqa: E402
from test_llama_measured import graph_of, hf_llama  # noqa: E402

transformers.logging.set_verbosity_error()

W = 8       # the sliding window


def hf_mistral(k, dropout=0.0, h=32, f=64, a=4, L=2, V=100, window=W):
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(hidden_size=h, intermediate_size=f, num_attention_heads=a, num_key_value_heads=k,
                                     num_hidden_layers=L, vocab_size=V, attn_implementation="sdpa", use_cache=False,
                                     sliding_window=window, attention_dropout=dropout, bos_token_id=0,
                                     eos_token_id=0, pad_token_id=None)
    model = transformers.MistralForCausalLM(cfg)
    model.train()
    return cfg, model


CASES = [
    # b, s, kv heads, precision, dropout (0: CPU flash; > 0: the math kernel), optimizer
    (2, W - 1, 2, "fp32", 0.0, "sgd"),          # below the window: is_causal, no mask, enable_gqa
    (2, W, 2, "fp32", 0.0, "adamw"),            # from the window on: the mask, k and v repeated
    (2, W + 3, 2, "bf16", 0.0, "sgd"),
    (2, W, 4, "bf16-mixed", 0.0, "sgd"),        # multi-head: nothing repeated
    (1, W, 2, "fp32", 0.0, "sgd"),              # b = 1
    (2, W + 3, 4, "bf16-mixed", 0.1, "sgd"),    # the math kernel: the float mask added in place
    (2, W + 3, 2, "bf16", 0.1, "adamw"),
]


@pytest.mark.parametrize("b,s,k,precision,dropout,opt", CASES,
                         ids=[f"b{c[0]}-s{c[1]}-k{c[2]}-{c[3]}-p{c[4]}-{c[5]}" for c in CASES])
def test_mistral_sdpa_around_the_window_exact(b, s, k, precision, dropout, opt):
    """s = W - 1, W and W + 3 with SDPA: one estimate, whose ``at`` uses the region of s."""
    cfg, model = hf_mistral(k, dropout)
    if precision == "bf16":
        model.to(torch.bfloat16)
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, opt, "cpu", "for-loop"))
    part = est.past_window if s >= W else est
    assert (part is est) == (s < W)
    if b == 1:
        part = part.at_one
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    assert est.at(b=b, s=s).bytes == part.at(b=b, s=s).bytes
    assert_hf_step_exact(part, model, ids, precision, opt, b, s)


def test_mistral_sdpa_past_the_window_inside_attention_exact():
    """A long sequence, a narrow MLP and a tiny vocabulary, so that the peaks sit in the
    layers' attention: the window's masks and the repeated k and v decide them."""
    cfg, model = hf_mistral(2, h=32, f=16, a=4, V=8, window=40)
    b, s = 2, 48
    est = sm.estimate(graph_of(cfg), sm.Policy("fp32", "sgd", "cpu", "for-loop"))
    ids = torch.randint(0, 8, (b, s))
    assert_hf_step_exact(est.past_window, model, ids, "fp32", "sgd", b, s)


def test_each_region_requires_its_side_of_the_window():
    """Below the window the formulas need s <= W - 1, past it W <= s; ``at`` picks the region
    by itself, and the two differ, from s = W on, by the masks and the copies."""
    cfg, _ = hf_mistral(2)
    est = sm.estimate(graph_of(cfg), sm.Policy("fp32", "sgd", "cpu"))
    past = est.past_window
    assert past is not est and past.past_window is past
    with pytest.raises(ConfigError) as e:
        est.check(est._subs({"b": 2}) | {sm.symbols.s: 8})
    assert "sliding window (8)" in str(e.value) and "past_window" in str(e.value)
    with pytest.raises(ConfigError) as e:
        past.at(b=2, s=7)
    assert "at least 8" in str(e.value)
    # eager attention: the same mask either way, one region
    eager = sm.estimate(graph_of(cfg), sm.Policy("fp32", "sgd", "cpu", attention="eager"))
    assert eager.past_window is eager


def test_cuda_past_the_window_runs_mem_efficient():
    """Derived, not measured (no GPU here): on CUDA SDPA's flash kernel takes no mask, so from
    the window on PyTorch runs the mem-efficient kernel, which keeps the float mask padded to a
    multiple of 16 columns. Mistral 7B, bf16 autocast, b = 2, s = 4096 = its window: the saved
    bytes grow, per layer, by the (2, 1, s, s) bfloat16 mask (2 * 4096^2 * 2 = 67,108,864) and
    the k and v repeated from 8 to 32 heads (2 * 2 * 4096 * 128 * 24 * 2 = 100,663,296), and
    lose flash's 24-byte RNG state (the log-sum-exp rows, 32 * ceiling(4096/32) = 4096, are the
    same): 32 * (67,108,864 + 100,663,296 - 24) = 5,368,708,352 bytes. At s = 4100 the mask
    keeps 4112 columns and the log-sum-exp 4128 rows."""
    est = sm.estimate("mistral-7b", sm.Policy("bf16-mixed", "adamw", "cuda"))
    assert est.kernels == ("flash",) and est.past_window.kernels == ("mem-efficient",)

    def below(seq):        # the formula of s < window, evaluated past it
        return est.components["activations"].xreplace(est._subs({"b": 2})).subs(sm.symbols.s, seq)
    assert est.at(b=2, s=4096).bytes["activations"] - below(4096) == 32 * (67_108_864 + 100_663_296 - 24)
    extra = 2 * 4100 * 4112 * 2 + 2 * 2 * 4100 * 128 * 24 * 2 - 24 + 2 * 32 * (4128 - 4100) * 4
    assert est.at(b=2, s=4100).bytes["activations"] - below(4100) == 32 * extra


# ----------------------------------------------------------------------------- repeat_kv, k = a

def test_llama_multi_head_eager_exact():
    """k = a: transformers' repeat_kv returns k and v themselves (no copy), so the layer's
    forward holds no repeated k: with a long sequence and a narrow MLP the forward's maximum
    sits in the last layer's attention and is 2 * 4 * 64 * 8 * 4 = 16,384 bytes below what a
    copy of k would give."""
    point = (2, 64, 32, 16, 4, 4, 2, 8)
    b, s, h, f, a, k, L, V = point
    cfg, model = hf_llama(point, "eager")
    est = sm.estimate(graph_of(cfg), sm.Policy("fp32", "sgd", "cpu", "for-loop"))
    ids = torch.randint(0, V, (b, s))
    assert_hf_step_exact(est, model, ids, "fp32", "sgd", b, s)


def test_repeat_kv_cases_are_requirements():
    """The formulas of a multi-head model hold for k = a only, those of a grouped-query model
    for k < a: evaluating one at the other's k names the case."""
    base = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": 100, "attn_implementation": "eager"}
    mha = sm.estimate(sm.models.from_hf_config({**base, "num_key_value_heads": 4}), sm.Policy("fp32", "sgd", "cpu"))
    with pytest.raises(ConfigError) as e:
        mha.at(b=2, s=8, k=2)
    assert "multi-head attention (k = a)" in str(e.value)
    gqa = sm.estimate(sm.models.from_hf_config({**base, "num_key_value_heads": 2}), sm.Policy("fp32", "sgd", "cpu"))
    with pytest.raises(ConfigError) as e:
        gqa.at(b=2, s=8, k=4)
    assert "grouped-query attention (k < a)" in str(e.value)
    assert any(sm.symbols.k in t.free_symbols for t in gqa.totals)      # the formulas stay in k


def test_cli_reports_the_region_of_its_sequence(capsys, tmp_path):
    """``symmem estimate`` names the kernel and gives the bytes of the region its --seq is in."""
    import json
    from symmem.cli import main
    cfg = {"model_type": "mistral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "sliding_window": W}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    est = sm.estimate(sm.models.from_hf_config(cfg), sm.Policy("bf16-mixed", "adamw", "cuda"))
    for seq, kernel in ((W - 1, "flash"), (W, "mem-efficient")):
        assert main(["estimate", "--config", str(path), "--seq", str(seq), "--batch", "2", "--precision",
                     "bf16-mixed", "--device", "cuda", "--format", "json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["inputs"]["attention_kernels"] == [kernel]
        assert out["bytes"]["peak"] == est.at(b=2, s=seq).peak
