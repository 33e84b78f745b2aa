"""FP8 training as Transformer Engine keeps it (precision ``fp8``). Its kernels need a GPU of
compute capability 8.9 or later, so nothing here runs them: each number is the layout read
from NVIDIA/TransformerEngine's sources (transformer_engine/pytorch/module/linear.py,
quantization.py, cpp_extensions/gemm.py), with the arithmetic beside it."""
import pytest
import sympy as sp

import symmem as sm
from symmem.passes import fp8
from symmem.symbols import B_a, L, b, h, s


def one_linear(n_in, n_out):
    """x (b, s, in) in bfloat16, requiring grad, through one trainable linear layer and a ReLU
    (the graph's output, a head, would stay in bfloat16)."""
    g = sm.Graph("one linear")
    x = g.input("x", (b, s, n_in), dtype="bfloat16", requires_grad=True)
    y = g.add("linear", x, params=(g.param("weight", (n_out, n_in)), g.param("bias", (n_out,))), name="fc")
    g.output(g.add("relu", y, name="relu"))
    return g


def test_te_linear_4096_at_8192_tokens():
    """te.Linear(4096, 4096), N = 8192 tokens, bfloat16 parameters, DelayedScaling, Hopper:
    saved for backward, the input's FP8 transpose 8192*4096 = 33,554,432 + its 4-byte
    scale_inv, and the weight's FP8 data and transpose 2*4096*4096 = 33,554,432 + 4
    (is_first_microbatch None: quantized afresh, saved as wt_save), not the 67,108,864-byte
    bfloat16 input; its scaling state 4*(3 + 2)*(1024 + 1) = 20,500 bytes; the cuBLAS
    workspace 32 MiB + 1024 = 33,555,456 bytes, once."""
    g = one_linear(4096, 4096)
    ev = sm.estimate(g, sm.Policy("fp8", "adamw")).at(b=8, s=1024)
    bf16 = sm.estimate(g, sm.Policy("bf16-master", "adamw")).at(b=8, s=1024)
    relu = 8192 * 4096 * 2              # ReLU's saved output, bfloat16, in both
    assert bf16.bytes["activations"] == 2 * relu       # and the linear's input x itself
    assert ev.bytes["activations"] - relu == 33_554_432 + 4 + 33_554_432 + 4 == 67_108_872
    assert (fp8.META_BYTES, fp8.WORKSPACE_BYTES) == (20_500, 33_555_456)
    assert ev.bytes["buffers"] == 20_500 + 33_555_456
    # weights, gradients bfloat16; master and Adam's two states float32, as bf16-master:
    # (4096*4096 + 4096) * (2 + 2 + 4 + 8)
    n = 4096 * 4096 + 4096
    assert (ev.bytes["params"], ev.bytes["grads"], ev.bytes["master"], ev.bytes["optimizer"]) == \
        (2 * n, 2 * n, 4 * n, 8 * n)


def test_gpt2_saves_fp8_inputs_and_weights():
    """GPT-2 with eager attention: each of the 4 linear layers of a block saves its input in
    FP8 (N*(h + h + h + 4h) bytes) and its weight's data and transpose (2*12h^2), with four
    scale_inv pairs (32 bytes), where bf16-master saved the inputs in bfloat16 (2N*7h): per
    layer 7Nh - 24h^2 - 32 bytes fewer; at b=8, s=1024 (N = 8192), h = 768:
    44,040,192 - 14,155,776 - 32 = 29,884,384, times 12 layers. The output head stays bf16.
    Buffers: 4 scaling states a layer, 48 * 20,500 = 984,000, and the workspace."""
    bf16 = sm.estimate("gpt2", sm.Policy("bf16-master", attention="eager"))
    f8 = sm.estimate("gpt2", sm.Policy("fp8", attention="eager"))
    N = b * s
    per_layer = 7 * N * h * (B_a - 1) - 24 * h**2 - 32      # B_a: bfloat16's 2 bytes
    assert sp.expand(bf16.components["activations"] - f8.components["activations"] - L * per_layer) == 0
    assert bf16.at(b=8, s=1024).bytes["activations"] - f8.at(b=8, s=1024).bytes["activations"] == \
        12 * 29_884_384
    assert f8.at(b=8, s=1024).bytes["buffers"] == 48 * 20_500 + 33_555_456 == 34_539_456
    assert {n.name for g in f8.prepared.graphs() for n in g.items if getattr(n, "op", "") == "linear_fp8"} == \
        {"h/attn.c_attn", "h/attn.c_proj", "h/mlp.c_fc", "h/mlp.c_proj"}


@pytest.mark.parametrize("kwargs,words", [
    ({"precision": "fp8", "device": "cpu"}, "device with --precision fp8 = 'cpu' is not valid: expected cuda"),
    ({"precision": "fp8", "lora": 8}, "precision = 'fp8' is not valid: expected a precision without --lora"),
])
def test_fp8_where_it_is_not_modelled_is_refused(kwargs, words):
    with pytest.raises(sm.errors.ConfigError) as e:
        sm.Policy(**kwargs)
    assert words in str(e.value)
