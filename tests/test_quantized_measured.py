"""QLoRA against bitsandbytes and peft on the CPU: Hugging Face's GPT-2 with its block
projections replaced by bitsandbytes' ``Linear4bit`` (NF4, double quantization, as
transformers' ``load_in_4bit`` makes them) and peft's adapters on top, trained one step:
parameters and their quantization state, the peak, its phase and every phase's maximum, to
the byte; the 4-bit layout against bitsandbytes' own tensors at several shapes.

bitsandbytes runs its forward as one custom op (``gemm_4bit``: dequantize the scales and the
weight, then ``F.linear``), whose allocations the dispatch tracker of ``symmem.measure``
cannot see inside. On the CPU that op *is* bitsandbytes' Python default kernel
(``backends/default/ops.py``, ``_gemm_4bit_default_impl``), so the tests call that kernel
directly: the same operations, each of them visible to the tracker.
"""
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

import sympy as sp  # noqa: E402

import symmem as sm  # noqa: E402
from symmem.measure import param_bytes, training_step  # noqa: E402
from symmem.policy.quantize import int4_bytes, int8_bytes  # noqa: E402
from helpers import assert_step_exact  # noqa: E402
from test_gpt2_measured import POINTS, graph_of, hf_model, optimizer  # noqa: E402

from bitsandbytes.backends.default import ops as bnb_default  # noqa: E402

transformers.logging.set_verbosity_error()
pytestmark = [pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
              # layers kept out of the 4 bits are Conv1D, whose adapters peft turns fan_in_fan_out on for
              pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to False:UserWarning")]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PROJECTIONS = (("attn", "c_attn"), ("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_proj"))


@pytest.fixture(autouse=True)
def gemm_4bit_visible(monkeypatch):
    """MatMul4Bit's forward calls bitsandbytes' default kernel itself (what the CPU runs)."""
    class Gemm4bit:
        default = staticmethod(bnb_default._gemm_4bit_default_impl)
    monkeypatch.setattr(torch.ops.bitsandbytes, "gemm_4bit", Gemm4bit)


def int4_linear(weight, bias, dtype):
    """``bnb.nn.Linear4bit`` holding ``weight`` (out, in), quantized on the CPU as transformers
    quantizes a checkpoint's weight (``Params4bit(...).to(device)``)."""
    out_f, in_f = weight.shape
    lin = bnb.nn.Linear4bit(in_f, out_f, bias=bias is not None, compute_dtype=dtype,
                            compress_statistics=True, quant_type="nf4")
    lin.weight = bnb.nn.Params4bit(weight.detach().clone(), requires_grad=False, blocksize=64,
                                   compress_statistics=True, quant_type="nf4", module=lin).to("cpu")
    if bias is not None:
        lin.bias = torch.nn.Parameter(bias.detach().clone())
    return lin


def int8_linear(weight, bias, dtype):
    """``bnb.nn.Linear8bitLt`` (``has_fp16_weights=False``, transformers' ``llm_int8_threshold``
    6.0) holding ``weight`` (out, in), quantized on the CPU (``Int8Params(...).to(device)``)."""
    out_f, in_f = weight.shape
    lin = bnb.nn.Linear8bitLt(in_f, out_f, bias=bias is not None, has_fp16_weights=False, threshold=6.0)
    lin.weight = bnb.nn.Int8Params(weight.detach().clone(), requires_grad=False,
                                   has_fp16_weights=False).to("cpu")
    if bias is not None:
        lin.bias = torch.nn.Parameter(bias.detach().clone())
    return lin


def quant_state_tensors(module):
    """Every quantization-state tensor of the 4-bit layers: the 8-bit scales, the codes, the
    offset, the nested float32 scales (not parameters or buffers of the module)."""
    out = []
    for m in module.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            qs = m.weight.quant_state
            out += [qs.absmax, qs.code, qs.offset, qs.state2.absmax, qs.state2.code]
        elif isinstance(m, bnb.nn.Linear8bitLt):        # the float32 scale per output row
            out.append(m.weight.SCB if m.weight.SCB is not None else m.state.SCB)
    return out


def storage_bytes(tensors):
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def qlora_model(point, precision, rank, targets, bits=4, skip=()):
    """GPT-2 in ``precision``, its block projections in 4 (or 8) bits (Conv1D's (in, out)
    weight transposed, as transformers quantizes one) but those ``skip`` keeps (module names,
    ``first:N``, ``last:N``), then ``get_peft_model``."""
    b, s, h, a, L, V, P, act = point
    cfg, model = hf_model(h, a, L, V, P, act)
    dtype = DTYPES[precision]
    model.to(dtype)
    kept = set()
    for item in (i for i in skip if ":" in i):
        kind, k = item.split(":")
        kept |= set(range(int(k)) if kind == "first" else range(L - int(k), L))
    for i, block in enumerate(model.transformer.h):
        if i in kept:
            continue
        for part, name in PROJECTIONS:
            if name in skip:
                continue
            conv = getattr(getattr(block, part), name)
            make = int4_linear if bits == 4 else int8_linear
            setattr(getattr(block, part), name, make(conv.weight.t(), conv.bias, dtype))
    # what peft asks before it wraps bitsandbytes' layers
    model.is_loaded_in_4bit, model.is_loaded_in_8bit = bits == 4, bits == 8
    config = peft.LoraConfig(r=rank, lora_alpha=16, target_modules=list(targets), lora_dropout=0.0)
    return cfg, peft.get_peft_model(model, config)


CASES = [  # point, precision, rank, targets, optimizer
    (POINTS[0], "fp32", 4, ("c_attn",), "adamw"),
    (POINTS[1], "bf16", 8, ("c_attn", "c_proj", "c_fc"), "adamw"),
    (POINTS[2], "fp16", 2, ("c_fc",), "sgd"),
    (POINTS[3], "bf16", 4, ("c_attn", "c_proj"), "adam"),
    # a small vocabulary and wide layers: the peaks of forward and backward at the 4-bit layers
    ((2, 8, 128, 4, 2, 20, 16, "gelu_new"), "fp32", 4, ("c_attn", "c_fc"), "adamw"),
    ((2, 8, 128, 4, 2, 20, 16, "gelu_new"), "bf16", 8, ("c_proj",), "sgd"),
]
SKIP_CASES = [  # point, precision, rank, targets, optimizer, quantize_skip
    (POINTS[1], "bf16", 4, ("c_attn", "c_fc"), "adamw", ("first:1",)),
    ((2, 8, 128, 4, 3, 20, 16, "gelu_new"), "fp32", 4, ("c_attn",), "sgd", ("last:1", "c_fc")),
    ((2, 8, 128, 4, 4, 20, 16, "gelu_new"), "bf16", 2, ("c_proj",), "adamw", ("first:1", "last:2")),
]


def check_step(point, precision, rank, targets, opt, bits=4, skip=()):
    """GPT-2 with its projections in ``bits`` (but ``skip``) and LoRA adapters, against symmem:
    the parameters with every quantization constant, then the training step to the byte."""
    b, s, h, a, L, V, P, act = point
    cfg, model = qlora_model(point, precision, rank, targets, bits=bits, skip=skip)
    est = sm.estimate(graph_of(cfg), sm.Policy(precision, opt, "cpu", attention="eager", lora=rank,
                                               lora_targets=",".join(targets), quantize=f"int{bits}",
                                               quantize_skip=",".join(skip) or None))
    ids = torch.randint(0, V, (b, s))
    fwd = lambda m: m(ids, labels=ids).loss  # noqa: E731
    if bits == 8:
        fwd(model)                           # the first forward moves CB and SCB into the layer's state
    states = quant_state_tensors(model)
    assert est.at(b=b, s=s).bytes["params"] == param_bytes(model) + storage_bytes(states)
    trainable = [p for p in model.parameters() if p.requires_grad]
    report = training_step(model, fwd, optimizer(opt, "for-loop", trainable), extra=(ids, states))
    assert_step_exact(est, report, b, s)
    return states


@pytest.mark.parametrize("point,precision,rank,targets,opt", CASES,
                         ids=[f"b{p[0]}-s{p[1]}-h{p[2]}-{pr}-r{r}-{'+'.join(t)}-{o}" for p, pr, r, t, o in CASES])
def test_qlora_exact(point, precision, rank, targets, opt):
    states = check_step(point, precision, rank, targets, opt)
    assert len(states) == 5 * 4 * point[4]          # five constants per 4-bit layer, four layers a block


@pytest.mark.parametrize("point,precision,rank,targets,opt,skip", SKIP_CASES,
                         ids=[f"h{p[2]}-L{p[4]}-{pr}-{'+'.join(sk)}" for p, pr, r, t, o, sk in SKIP_CASES])
def test_qlora_with_layers_kept_exact(point, precision, rank, targets, opt, skip):
    """The seed's "full precision for key layers, 4 bits elsewhere": the first or last layers,
    or a module, kept in the model's dtype (plain LoRA there, peft's lora.bnb elsewhere)."""
    check_step(point, precision, rank, targets, opt, skip=skip)


INT8_CASES = [  # point, precision, rank, targets, optimizer
    (POINTS[0], "fp32", 4, ("c_attn",), "adamw"),
    (POINTS[2], "bf16", 8, ("c_attn", "c_fc"), "sgd"),
    ((2, 8, 128, 4, 2, 20, 16, "gelu_new"), "fp32", 4, ("c_fc", "c_proj"), "adamw"),
    ((2, 8, 128, 4, 2, 20, 16, "gelu_new"), "bf16", 2, ("c_attn",), "adam"),
]


@pytest.mark.parametrize("point,precision,rank,targets,opt", INT8_CASES,
                         ids=[f"b{p[0]}-s{p[1]}-h{p[2]}-{pr}-r{r}-{'+'.join(t)}-{o}"
                              for p, pr, r, t, o in INT8_CASES])
def test_int8_lora_exact(point, precision, rank, targets, opt):
    """LoRA over LLM.int8() weights, bitsandbytes' CPU path (``MatMul8bitFp``)."""
    check_step(point, precision, rank, targets, opt, bits=8)


@pytest.mark.parametrize("shape", [(128, 64), (300, 100), (96, 32), (7, 9)])
def test_int4_layout_against_bitsandbytes(shape):
    """The packed weight and every quantization constant, for shapes whose element count is
    and is not a multiple of the blocks: (300, 100) has ceil(30000/64) = 469 scales, and
    ceil(469/256) = 2 nested ones: 15000 + 469 + 8 + 1092 = 16569 bytes."""
    lin = int4_linear(torch.randn(*shape), None, torch.float32)
    measured = storage_bytes([lin.weight.data] + quant_state_tensors(lin))
    assert measured == int4_bytes(sp.Integer(shape[0]), sp.Integer(shape[1]))
    assert int4_bytes(sp.Integer(300), sp.Integer(100)) == 16569


@pytest.mark.parametrize("shape", [(128, 64), (300, 100), (7, 9)])
def test_int8_layout_against_bitsandbytes(shape):
    """LLM.int8(): the int8 weight and a float32 scale per output row: (300, 100) is
    30000 + 1200 = 31200 bytes."""
    lin = int8_linear(torch.randn(*shape), None, torch.float32)
    measured = storage_bytes([lin.weight.data] + quant_state_tensors(lin))
    assert measured == int8_bytes(sp.Integer(shape[0]), sp.Integer(shape[1]))
    assert int8_bytes(sp.Integer(300), sp.Integer(100)) == 31200


@pytest.mark.parametrize("n_in,n_out,dtype,fwd,bwd", [
    # N = 8*512 = 4096 rows, bfloat16, 1024 -> 3072 (a QKV projection). Quantizing: A.to(float16)
    # 2*4096*1024 = 8,388,608, row scales 4*4096 = 16,384, int8 rows 4,194,304, A.abs() 8,388,608,
    # the outlier mask 4,194,304: 25,182,208, less the output (4096*3072*2 = 25,165,824) that does
    # not exist yet: 16,384. The product beside the output: int8 rows 4,194,304 + scales 16,384 +
    # int32 4*4096*3072 = 50,331,648 + float16 2*4096*3072 = 25,165,824: 79,708,160, the larger.
    # Backward: the weight dequantized to bfloat16, 3072*1024*2 = 6,291,456.
    (1024, 3072, "bfloat16", 79_708_160, 6_291_456),
    # 4096 -> 1024 (an MLP's down projection): quantizing 33,554,432 + 16,384 + 16,777,216 +
    # 33,554,432 + 16,777,216 = 100,679,680, less the output 4096*1024*2 = 8,388,608: 92,291,072;
    # the product 16,777,216 + 16,384 + 16,777,216 + 8,388,608 = 41,959,424. Quantizing is larger.
    (4096, 1024, "bfloat16", 92_291_072, 8_388_608),
    # the same in float16: no copy to float16, none back: 67,125,248 - 8,388,608 = 58,736,640
    # against 16,777,216 + 16,384 + 16,777,216 = 33,570,816
    (4096, 1024, "float16", 58_736_640, 8_388_608),
])
def test_int8_on_cuda_arithmetic(n_in, n_out, dtype, fwd, bwd):
    """LLM.int8() on CUDA (``MatMul8bitLt``, read from bitsandbytes 0.50.2's sources: no GPU
    runs here): the scratch of one frozen layer, x (8, 512, in) requiring grad; no outlier
    columns (k = 0)."""
    from symmem.rules import Ctx, DType, TensorInfo, get_rule
    from symmem.symbols import B_a
    g = sm.Graph("one int8 linear")
    x = g.input("x", (8, 512, n_in), dtype=dtype, requires_grad=True)
    g.add("linear_int8", x, params=(g.param("weight", (n_out, n_in), trainable=False),), name="fc")
    node = g.items[-1]
    act = DType("compute", B_a, 2)
    ctx = Ctx(autocast=False, device="cuda", act=act, act_name=dtype)
    fp = get_rule("linear_int8")(node, [TensorInfo((8, 512, n_in), act, requires_grad=True)], ctx)
    assert (fp.fwd_temp.subs(B_a, 2), fp.bwd_temp.subs(B_a, 2)) == (fwd, bwd)
    assert [sv.ref for sv in fp.saved] == ["in0"]           # ctx keeps the input, no copy


def test_int8_on_cuda_needs_four_divided_features():
    """cuBLASLt's int8 product takes in % 4 == 0 (bitsandbytes falls back to float32 otherwise):
    a requirement of the formula; GPT-2's h and 4h are multiples of 4 once h is."""
    est = sm.estimate("gpt2", sm.Policy("bf16", "adamw", quantize="int8", lora=8))
    assert [(r.lhs, r.rhs) for r in est.requirements if "cuBLASLt" in r.reason] == [(4, sm.symbols.h)]


def test_the_output_head_stays_unquantized():
    """transformers keeps lm_head (tied to wte) in the model's dtype: only the blocks' 4·L
    projections are 4-bit, each with its 1092 bytes of per-layer constants."""
    g = sm.estimate("gpt2", sm.Policy("bf16", "adamw", quantize="int4", lora=8)).prepared
    q = [p for p, _ in g.params() if p.dtype == "int4"]
    assert sorted(p.name for p in q) == ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                                         "mlp.c_proj.weight"]
    assert all(not p.trainable for p in q)
    assert dict((p.name, p.shape) for p in q)["attn.c_attn.weight"] == (3 * sm.symbols.h, sm.symbols.h)


def test_qlora_on_a_24_gb_card_is_one_command(capsys):
    """"Can I fine-tune GPT-2 XL with QLoRA on a 24 GB card?": one command, the largest batch,
    beside LoRA over the bfloat16 weights."""
    from symmem.cli import main
    args = ["max-batch", "--model", "gpt2-xl", "--seq", "1024", "--precision", "bf16", "--lora", "16",
            "--lora-targets", "c_attn,c_proj,c_fc", "--gpu", "RTX-4090", "--format", "json"]
    assert main(args + ["--quantize", "int4"]) == 0
    qlora = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    lora = json.loads(capsys.readouterr().out)
    assert qlora["max_batch"] >= lora["max_batch"] >= 1
    assert "int4 (QLoRA's NF4" in qlora["policy"]


@pytest.mark.parametrize("kwargs,words", [
    ({"quantize": "int4"}, "quantize = 'int4' is not valid: expected a quantized model with LoRA adapters "
                           "(--lora R). A quantized model trains adapters only"),
    ({"quantize": "int4", "lora": 8, "precision": "bf16-mixed"},
     "precision with --quantize = 'bf16-mixed' is not valid: expected fp32, bf16 or fp16"),
    ({"quantize": "int4", "lora": 8, "precision": "bf16-master"}, "expected fp32, bf16 or fp16"),
    ({"quantize": "int3", "lora": 8}, "unknown quantization 'int3'"),
    ({"quantize_skip": "c_proj"}, "quantize_skip = 'c_proj' is not valid: expected layers to keep out of "
                                  "--quantize"),
    ({"quantize": "int4", "lora": 8, "quantize_skip": "middle:2"}, "expected first:N or last:N with N >= 1"),
    ({"quantize": "int4", "lora": 8, "quantize_skip": "last:0"}, "expected first:N or last:N with N >= 1"),
    ({"quantize": "int4", "lora": 8, "quantize_skip": "c_proj, "}, "quantize_skip = 'c_proj, ' is not valid"),
])
def test_bad_quantize_input_is_refused(kwargs, words):
    with pytest.raises(sm.errors.SymmemError) as e:
        sm.Policy(**kwargs)
    assert words in str(e.value)


@pytest.mark.parametrize("skip,words", [
    ("q_proj", "quantize_skip = 'q_proj' is not valid: expected a linear layer of 'gpt2': one of "
               "attn.c_attn, attn.c_proj, lm_head, mlp.c_fc, mlp.c_proj"),
    ("last:13", "quantize_skip = 'last:13' is not valid: expected at most the 12 layers of block 'h'"),
])
def test_a_skip_the_model_lacks_is_refused(skip, words):
    with pytest.raises(sm.errors.ConfigError) as e:
        sm.estimate("gpt2", sm.Policy("bf16", quantize="int4", lora=8, quantize_skip=skip))
    assert words in str(e.value)
