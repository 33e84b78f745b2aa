"""Bad input gets a SymmemError whose message names the field, the value and what fits."""
import json

import pytest

import symmem as sm
from symmem.errors import ConfigError, ShapeError, SymmemError, UnknownName
from symmem.symbols import b, h, s

GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100,
        "n_positions": 32}


def test_hidden_size_not_divisible_by_heads():
    with pytest.raises(ConfigError) as e:
        sm.models.from_hf_config({**GPT2, "n_embd": 4096, "n_head": 30})
    assert e.value.field == "n_embd" and e.value.value == 4096
    assert str(e.value) == ("n_embd = 4096 is not valid: expected a multiple of the number of attention "
                            "heads n_head (30). Change n_embd or n_head so that n_embd / n_head is an integer.")


@pytest.mark.parametrize("key,value", [("n_layer", 0), ("n_head", -2), ("vocab_size", 3.5),
                                       ("n_embd", "768"), ("n_positions", True)])
def test_sizes_must_be_positive_integers(key, value):
    with pytest.raises(ConfigError, match=f"^{key} = {value!r} is not valid: expected a positive integer.$"):
        sm.models.from_hf_config({**GPT2, key: value})


def test_missing_key_and_model_type():
    cfg = dict(GPT2)
    del cfg["vocab_size"]
    with pytest.raises(ConfigError, match=r"vocab_size = None .*\(the key is missing from the config\). Missing keys: vocab_size."):
        sm.models.from_hf_config(cfg)
    with pytest.raises(ConfigError, match='model_type = None .* Add "model_type" to the config'):
        sm.models.from_hf_config({k: v for k, v in GPT2.items() if k != "model_type"})
    with pytest.raises(UnknownName, match="unknown model_type 'rwkv'. Known: bert, gpt2, gpt_neox, llama, mistral, mixtral, opt, qwen2, resnet, t5, vit."):
        sm.models.from_hf_config({**GPT2, "model_type": "rwkv"})


def test_hugging_face_generic_names_are_accepted():
    g = sm.models.from_hf_config({"model_type": "gpt2", "hidden_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "vocab_size": 100,
                                  "max_position_embeddings": 32})
    assert g.bindings[h] == 64


def test_config_files(tmp_path):
    with pytest.raises(ConfigError, match="a local config.json file or a folder holding one"):
        sm.models.from_hf_config(tmp_path / "nope.json")
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "gpt2", ')
    with pytest.raises(ConfigError, match=r"expected valid JSON \(Expecting property name"):
        sm.models.from_hf_config(bad)
    bad.write_text(json.dumps(GPT2))
    assert sm.models.from_hf_config(tmp_path).bindings[h] == 64   # the folder works too


def test_unknown_names_suggest_the_closest():
    with pytest.raises(UnknownName, match="unknown model 'gpt-2'. Did you mean 'gpt2'?"):
        sm.models.preset("gpt-2")
    with pytest.raises(UnknownName, match="unknown precision 'bf16-mix'. Did you mean 'bf16-mixed'?"):
        sm.Policy(precision="bf16-mix")
    with pytest.raises(UnknownName, match="unknown optimizer 'adamm'. Did you mean 'adam'?"):
        sm.Policy(optimizer="adamm")
    with pytest.raises(UnknownName, match="unknown device 'tpu'. Did you mean 'cpu'. Known: cuda, cpu."):
        sm.Policy(device="tpu")
    with pytest.raises(UnknownName, match="unknown activation_function 'swish'"):
        sm.models.from_hf_config({**GPT2, "activation_function": "swish"})
    with pytest.raises(UnknownName, match="unknown op 'conv3d'"):
        sm.Graph("g").add("conv3d")
    with pytest.raises(UnknownName, match="unknown symbol 'q'"):
        sm.estimate(sm.models.from_hf_config(GPT2)).at(b=1, q=3)


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "8"])
def test_evaluation_values(value):
    est = sm.estimate(sm.models.from_hf_config(GPT2))
    with pytest.raises(ConfigError, match=f"^b = {value!r} is not valid: expected a positive integer.$"):
        est.at(b=value, s=8)


def test_missing_value_names_the_symbol():
    est = sm.estimate(sm.models.from_hf_config(GPT2))
    with pytest.raises(ConfigError, match=r"values = \['s'\] .* Pass them, e.g. .at\(s=...\)."):
        est.at(b=2)


def test_shape_errors_name_the_node():
    g = sm.Graph("g", {h: 8})
    x = g.input("x", (b, s, h), dtype="float32", requires_grad=True)
    w = g.param("w", (4, 3))
    with pytest.raises(ShapeError, match="shape mismatch at node 'lin': got .* expected a last dimension of 3"):
        g.add("linear", x, params=(w,), name="lin")
    with pytest.raises(ConfigError, match="input of node 'relu_1' = 'nope' is not valid: expected the name of a value"):
        g.add("relu", "nope")


def test_every_error_is_a_symmem_error():
    for cls in (ConfigError, UnknownName, ShapeError):
        assert issubclass(cls, SymmemError)


def test_sequence_longer_than_positions():
    est = sm.estimate(sm.models.from_hf_config(GPT2))
    with pytest.raises(ConfigError, match="^s = 33 is not valid: expected at most s_max = 32: the sequence "
                                          "length cannot exceed n_positions"):
        est.at(b=1, s=33)
    assert est.at(b=1, s=32).peak > 0


def test_non_utf8_config(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(ConfigError, match="expected a UTF-8 text file"):
        sm.models.from_hf_config(tmp_path)
