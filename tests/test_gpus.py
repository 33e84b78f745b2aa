"""symmem.gpus: sizes, the GPU catalog, the reserve and budgets, pinned with hand arithmetic."""
import ast
import re
from decimal import Decimal
from fractions import Fraction

import pytest

from symmem import gpus
from symmem.errors import ConfigError, SymmemError, UnknownName
from symmem.gpus import (CATALOG, DEFAULT_RESERVE, GPU, Budget, budget, gpu, parse_bytes,
                         reserve_bytes)

SIZE = "80GiB, 80GB (10^9 bytes), 80G (read as GiB), 512MiB or a number of bytes"
KNOWN = ("A100-40GB, A100-80GB, H100-80GB, H200, B200, MI300X, L4, T4, V100-16GB, V100-32GB, "
         "RTX-3090, RTX-4090")


def exact(message: str) -> str:
    """A regex that matches ``message`` and nothing else."""
    return f"^{re.escape(message)}$"


# --- parse_bytes --------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("80GiB", 85_899_345_920),        # 80 * 2**30 = 85_899_345_920
    ("80 GiB", 85_899_345_920),
    ("80gib", 85_899_345_920),        # units ignore case
    ("80GB", 80_000_000_000),         # 80 * 10**9
    ("80 gb", 80_000_000_000),
    ("1.5TiB", 1_649_267_441_664),    # 1.5 * 2**40 = 3 * 2**39 = 1_649_267_441_664
    ("512MiB", 536_870_912),          # 512 * 2**20 = 2**29
    ("40e9", 40_000_000_000),
    ("123456", 123_456),
    ("2KB", 2_000), ("2KiB", 2_048), ("3MB", 3_000_000), ("1TB", 10**12),
    ("1PB", 10**15), ("1PiB", 2**50),
    ("7B", 7), (" 7 b ", 7),
    (".5KiB", 512),                   # 0.5 * 1024
    ("5.", 5),
    ("1e3GB", 10**12),                # 1e3 * 1e9
    ("+4GiB", 4 * 2**30),
    ("0.1GB", 100_000_000),           # exact: Fraction("0.1") * 10**9, no float error
    ("1.0000000001GB", 1_000_000_000),  # 1e9 + 0.1 byte, rounded down
    ("2.5B", 2),                      # a fractional byte is rounded down
    ("1.9999B", 1),
])
def test_parse_bytes_strings(text, expected):
    assert parse_bytes(text) == expected
    assert type(parse_bytes(text)) is int


def test_parse_bytes_is_exact_where_floats_are_not():
    # 8.2 GB is 8_200_000_000 bytes; the float product 8.2 * 1e9 = 8199999999.999999
    # would round down to 8_199_999_999.
    assert parse_bytes("8.2GB") == 8_200_000_000
    # 1.1 TiB = 1.1 * 2**40 = 1_209_462_790_553.6 -> 1_209_462_790_553
    assert parse_bytes("1.1TiB") == 1_209_462_790_553
    # 123456789.123456789 GB = 123_456_789_123_456_789 bytes exactly (a float keeps ~16 digits)
    assert parse_bytes("123456789.123456789GB") == 123_456_789_123_456_789


@pytest.mark.parametrize("value,expected", [
    (123_456, 123_456),
    (40e9, 40_000_000_000),           # a float that is a whole number
    (2.9, 2),                         # rounded down
    (Fraction(7, 2), 3),
    (Decimal("2.9"), 2),
])
def test_parse_bytes_numbers(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value", [
    "80 GiBs", "", "   ", "nan", "inf", "-inf", "80 gigabytes", "1/2", "80 x",
    "80_000", "1,000", "0x10", "GiB", "80 GiB 2", "١٢", "1e9999",
    True, False, None, [80], {"GiB": 80}, float("nan"), float("inf"), Decimal("NaN"),
])
def test_parse_bytes_rejects_what_is_not_a_size(value):
    with pytest.raises(ConfigError, match=exact(
            f"budget = {value!r} is not valid: expected a size like {SIZE}.")) as e:
        parse_bytes(value)
    assert e.value.field == "budget" and e.value.value is value


def test_parse_bytes_message_for_a_misspelled_unit_word_for_word():
    with pytest.raises(ConfigError) as e:
        parse_bytes("80 GiBs")
    assert str(e.value) == ("budget = '80 GiBs' is not valid: expected a size like 80GiB, "
                            "80GB (10^9 bytes), 80G (read as GiB), 512MiB or a number of bytes.")


def test_a_bare_unit_letter_is_binary_and_the_label_says_so():
    """80G is 80 GiB (as Java's -Xmx, Docker and free -h mean it); the budget says how it
    read the size, since 80G could also mean 80 GB."""
    assert parse_bytes("80G") == parse_bytes("80 g") == 80 * 2**30
    assert parse_bytes("512M") == 512 * 2**20 and parse_bytes("2T") == 2 * 2**40
    assert budget(bytes="80G", reserve=0).label == "80.00 GiB budget ('80G' read as 80 GiB) with no reserve"
    assert "read as" not in budget(bytes="80GB", reserve=0).label


@pytest.mark.parametrize("value", [0, -1, -80, "0", "-5GB", "0GiB", "0.5", "0.9B", 0.5,
                                   Fraction(1, 3), "-0.0"])
def test_parse_bytes_needs_at_least_one_byte(value):
    with pytest.raises(ConfigError, match=exact(
            f"budget = {value!r} is not valid: expected a size of at least 1 byte, like {SIZE}.")):
        parse_bytes(value)


def test_parse_bytes_names_the_field():
    with pytest.raises(ConfigError, match=exact(
            f"memory = 'lots' is not valid: expected a size like {SIZE}.")):
        parse_bytes("lots", "memory")


def test_no_eval_or_sympify_on_user_strings():
    tree = ast.parse(open(gpus.__file__, encoding="utf-8").read())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not names & {"eval", "exec", "sympify", "S", "parse_expr", "literal_eval"}
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names} | {n.module for n in ast.walk(tree)
                                     if isinstance(n, ast.ImportFrom) and n.module}
    assert not any("sympy" in m or m == "ast" for m in imported)
    # an expression is not a size, even a harmless one
    with pytest.raises(ConfigError):
        parse_bytes("2**30")
    with pytest.raises(ConfigError):
        parse_bytes("__import__('os')")


# --- the catalog --------------------------------------------------------------------------

# Hand-checked: each deviceQuery line prints round(bytes / 2**20) MBytes next to the bytes.
PINNED = {
    "A100-40GB": 42_298_834_944,    # 40339 MBytes; 42_298_834_944 / 2**20 = 40_339.31
    "A100-80GB": 85_100_068_864,    # 81158 MBytes; / 2**20 = 81_157.75
    "H100-80GB": 85_045_477_376,    # 81106 MBytes; / 2**20 = 81_105.69
    "H200": 150_109_945_856,        # 143156 MiB * 1_048_576
    "B200": 191_502_483_456,        # 182631 MiB * 1_048_576
    "MI300X": 206_141_652_992,      # 192 * 2**30 - 16 * 2**20 = 206_158_430_208 - 16_777_216
    "L4": 23_570_219_008,           # 22478 MBytes; / 2**20 = 22_478.31
    "T4": 15_843_721_216,           # 15110 MBytes; / 2**20 = 15_109.75
    "V100-16GB": 16_945_512_448,    # 16160 MBytes; / 2**20 = 16_160.50
    "V100-32GB": 34_089_730_048,    # 32510 MBytes; / 2**20 = 32_510.50
    "RTX-3090": 25_327_697_920,     # 24154 MBytes; / 2**20 = 24_154.38
    "RTX-4090": 25_386_352_640,     # 24210 MBytes; / 2**20 = 24_210.31
}


def test_catalog_pins_every_capacity():
    assert {name: g.memory for name, g in CATALOG.items()} == PINNED
    assert 143_156 * 2**20 == PINNED["H200"] and 182_631 * 2**20 == PINNED["B200"]
    assert 196_592 * 2**20 == PINNED["MI300X"]


@pytest.mark.parametrize("name", list(PINNED))
def test_catalog_entries_are_consistent(name):
    g = CATALOG[name]
    assert isinstance(g, GPU) and g.name == name and type(g.memory) is int
    # what CUDA reports is below the marketing size in binary units and above 85% of it
    marketed_gb = int(re.match(r"(\d+) GB", g.marketing).group(1))
    assert 0.85 * marketed_gb * 10**9 < g.memory < marketed_gb * 2**30
    # every number says where it comes from
    assert len(g.source) > 40 and re.search(r"#\d+|https://|\.py", g.source)
    assert "not found" not in g.source


def test_catalog_sources_cite_what_they_use():
    assert "bottlerocket-os/bottlerocket#3873" in CATALOG["A100-40GB"].source
    assert "42298834944" in CATALOG["A100-40GB"].source
    assert "thamada/nvidia-smi" in CATALOG["H100-80GB"].source
    assert "85045477376" in CATALOG["H100-80GB"].source
    assert "ROCm/legacy-rocm-build#4750" in CATALOG["MI300X"].source
    assert "pytorch/ao#4002" in CATALOG["B200"].source
    assert "143156" in CATALOG["H200"].source


def test_gpu_is_frozen_and_checks_memory():
    g = CATALOG["T4"]
    with pytest.raises(AttributeError):
        g.memory = 1
    with pytest.raises(ConfigError, match=exact(
            "memory = 0 is not valid: expected a positive whole number of bytes.")):
        GPU("X", 0, "", "")
    with pytest.raises(ConfigError):
        GPU("X", 1.5e10, "", "")


@pytest.mark.parametrize("name,canonical", [
    ("H100-80GB", "H100-80GB"), ("h100-80gb", "H100-80GB"), ("H100-80gb", "H100-80GB"),
    ("mi300x", "MI300X"), ("rtx-4090", "RTX-4090"), ("RTX 4090", "RTX-4090"),
    ("rtx_3090", "RTX-3090"), ("RTX3090", "RTX-3090"), ("v100-32GB", "V100-32GB"),
    (" l4 ", "L4"), ("t4", "T4"), ("b200", "B200"), ("a100 40gb", "A100-40GB"),
])
def test_lookup_ignores_case_and_separators(name, canonical):
    assert gpu(name) is CATALOG[canonical]


def test_a_gpu_object_passes_through():
    custom = GPU("MyCard", 10 * 2**30, "10 GB", "measured")
    assert gpu(custom) is custom


@pytest.mark.parametrize("name,suggestion", [
    ("H100", "H100-80GB"),          # a prefix of a known name
    ("h100", "H100-80GB"),          # ... in lower case
    ("a100", "A100-40GB"),          # the first of the names it starts
    ("mi300", "MI300X"),
    ("H100-80G", "H100-80GB"),
    ("rtx4080", "RTX-4090"),        # the closest by spelling
    ("RTX-4900", "RTX-4090"),
    ("V100-23GB", "V100-32GB"),
])
def test_unknown_gpus_suggest_the_closest(name, suggestion):
    with pytest.raises(UnknownName, match=exact(
            f"unknown GPU {name!r}. Did you mean {suggestion!r}? Known: {KNOWN}.")) as e:
        gpu(name)
    assert e.value.kind == "GPU" and e.value.name == name and e.value.known == tuple(CATALOG)


@pytest.mark.parametrize("name", ["gpt", "", 5, None])
def test_unknown_gpus_without_a_close_name(name):
    with pytest.raises(UnknownName, match=exact(f"unknown GPU {name!r}. Known: {KNOWN}.")):
        gpu(name)


# --- reserve_bytes ------------------------------------------------------------------------

def test_percent_reserve_arithmetic():
    assert DEFAULT_RESERVE == "10%"
    assert reserve_bytes("10%", 1_000) == 100
    assert reserve_bytes("10%", 1_009) == 100             # 100.9 -> 100
    assert reserve_bytes("12.5%", 1_000) == 125
    assert reserve_bytes(" 12.5 % ", 1_000) == 125
    assert reserve_bytes("33.3%", 1_000) == 333           # float 33.3 / 100 * 1000 = 332.99999999999994
    assert reserve_bytes("0.1%", 1_000) == 1
    assert reserve_bytes("0.05%", 1_000) == 0             # 0.5 byte -> 0
    # H100: 85_045_477_376 / 10 = 8_504_547_737.6 -> 8_504_547_737
    assert reserve_bytes("10%", PINNED["H100-80GB"]) == 8_504_547_737
    # MI300X: 206_141_652_992 * 7.5 / 100 = 15_460_623_974.4 -> 15_460_623_974
    assert reserve_bytes("7.5%", PINNED["MI300X"]) == 15_460_623_974
    assert reserve_bytes("99.9999%", 1_000) == 999        # 999.999 -> 999


def test_size_and_zero_reserves():
    cap = PINNED["A100-80GB"]
    assert reserve_bytes("2GiB", cap) == 2_147_483_648    # 2 * 2**30
    assert reserve_bytes("2GB", cap) == 2_000_000_000
    assert reserve_bytes(512 * 2**20, cap) == 536_870_912
    assert reserve_bytes(1.5, cap) == 1                   # rounded down
    for off in (0, "0", "0%", "0GB", " 0 "):
        assert reserve_bytes(off, cap) == 0


@pytest.mark.parametrize("value", ["-5%", "150%", "100.0001%", "-0.5%"])
def test_percentages_must_be_0_to_100(value):
    with pytest.raises(ConfigError, match=exact(
            f"reserve = {value!r} is not valid: expected a percentage from 0% to 100%.")):
        reserve_bytes(value, 1_000)


@pytest.mark.parametrize("value", [-1, "-1", "-2GiB", -0.5])
def test_negative_reserves(value):
    with pytest.raises(ConfigError, match=exact(
            f"reserve = {value!r} is not valid: expected 0 or more bytes. "
            "Use 0 to turn the reserve off.")):
        reserve_bytes(value, 1_000)


@pytest.mark.parametrize("value", [0.1, "0.5", Fraction(1, 2)])
def test_fractions_of_a_byte_point_to_percentages(value):
    with pytest.raises(ConfigError, match=exact(
            f"reserve = {value!r} is not valid: expected a size of at least 1 byte, or 0 for "
            "no reserve. To set aside a fraction of the memory, write a percentage such as "
            "'10%'.")):
        reserve_bytes(value, 1_000)


@pytest.mark.parametrize("value", ["lots", "10 %%", "%", "10 percent", True, None, [10]])
def test_reserves_that_are_not_sizes(value):
    with pytest.raises(ConfigError, match=exact(
            f"reserve = {value!r} is not valid: expected a percentage like 10%, a size like "
            "2GiB or 2GB (10^9 bytes), a number of bytes, or 0 for no reserve.")):
        reserve_bytes(value, 1_000)


@pytest.mark.parametrize("value,amount", [("100%", 1_000), (1_000, 1_000), ("1KiB", 1_024),
                                          ("2GiB", 2_147_483_648)])
def test_reserve_must_leave_something(value, amount):
    with pytest.raises(ConfigError, match=exact(
            f"reserve = {value!r} is not valid: expected a reserve smaller than the capacity of "
            f"1,000 bytes (1,000 B). It comes to {amount:,} bytes, which leaves nothing usable. "
            "Lower the reserve or choose a larger budget.")):
        reserve_bytes(value, 1_000)
    assert reserve_bytes(999, 1_000) == 999                # one byte left is allowed


@pytest.mark.parametrize("capacity", [0, -1, True, 1.0, "80GiB", None])
def test_capacity_must_be_positive_int(capacity):
    with pytest.raises(ConfigError, match=exact(
            f"capacity = {capacity!r} is not valid: expected a positive whole number of bytes.")):
        reserve_bytes("10%", capacity)


# --- Budget and budget() ------------------------------------------------------------------

def test_budget_of_a_gpu_with_the_default_reserve():
    b = budget(gpu="H100-80GB")
    # total 85_045_477_376; reserve floor(total / 10) = 8_504_547_737;
    # usable 85_045_477_376 - 8_504_547_737 = 76_540_929_639
    assert (b.total, b.reserve, b.usable) == (85_045_477_376, 8_504_547_737, 76_540_929_639)
    # 85_045_477_376 / 2**30 = 79.2049 GiB; 8_504_547_737 / 2**30 = 7.9205 GiB
    assert b.label == "H100-80GB (79.20 GiB) minus a 10% reserve (7.92 GiB)"
    assert b.gpu is CATALOG["H100-80GB"]
    assert budget(gpu="h100 80gb") == b                    # names ignore case


def test_budget_of_bytes():
    b = budget(bytes="80GiB")
    # 85_899_345_920 - 8_589_934_592 = 77_309_411_328 (= 72 GiB)
    assert (b.total, b.reserve, b.usable) == (85_899_345_920, 8_589_934_592, 72 * 2**30)
    assert b.label == "80.00 GiB budget minus a 10% reserve (8.00 GiB)"
    assert b.gpu is None
    assert budget(bytes=85_899_345_920) == b


def test_budget_reserve_choices():
    b = budget(gpu="T4", reserve=0)
    assert (b.total, b.reserve, b.usable) == (15_843_721_216, 0, 15_843_721_216)
    assert b.label == "T4 (14.76 GiB) with no reserve"
    b = budget(gpu="A100-40GB", reserve="2GiB")
    # 42_298_834_944 - 2_147_483_648 = 40_151_351_296
    assert b.usable == 40_151_351_296
    assert b.label == "A100-40GB (39.39 GiB) minus a 2.00 GiB reserve"
    b = budget(gpu="MI300X", reserve="12.5%")
    # 206_141_652_992 / 8 = 25_767_706_624 exactly
    assert (b.reserve, b.usable) == (25_767_706_624, 180_373_946_368)
    assert b.label == "MI300X (191.98 GiB) minus a 12.5% reserve (24.00 GiB)"


def test_budget_needs_exactly_one_source():
    with pytest.raises(ConfigError, match=exact(
            "budget = {'gpu': 'H100-80GB', 'bytes': '80GiB'} is not valid: expected exactly one "
            "of gpu (a GPU name) or bytes (a size like 80GiB). Drop one of them.")):
        budget(gpu="H100-80GB", bytes="80GiB")
    with pytest.raises(ConfigError, match=exact(
            "budget = {'gpu': None, 'bytes': None} is not valid: expected exactly one of gpu "
            "(a GPU name) or bytes (a size like 80GiB). Pass gpu='H100-80GB', for instance, or "
            "bytes='80GiB'.")):
        budget()


def test_budget_passes_on_errors():
    with pytest.raises(ConfigError, match=exact(
            f"budget = '80 GiBs' is not valid: expected a size like {SIZE}.")):
        budget(bytes="80 GiBs")
    with pytest.raises(UnknownName, match="Did you mean 'H100-80GB'"):
        budget(gpu="H100")
    with pytest.raises(ConfigError, match=exact(
            "reserve = '150%' is not valid: expected a percentage from 0% to 100%.")):
        budget(bytes="80GiB", reserve="150%")


def test_budget_reserve_larger_than_the_gpu():
    # L4: 23_570_219_008 bytes; 24GB = 24_000_000_000 > capacity
    with pytest.raises(ConfigError, match=exact(
            "reserve = '24GB' is not valid: expected a reserve smaller than the capacity of "
            "23,570,219,008 bytes (21.95 GiB). It comes to 24,000,000,000 bytes, which leaves "
            "nothing usable. Lower the reserve or choose a larger budget.")):
        budget(gpu="L4", reserve="24GB")


def test_budget_dataclass():
    b = Budget(total=1_000, reserve=100)
    assert b.usable == 900 and b.label == "1,000 B minus a 100 B reserve" and b.gpu is None
    assert Budget(total=2**30, reserve=0).label == "1.00 GiB with no reserve"
    assert Budget(total=10, reserve=1, label="mine").label == "mine"
    with pytest.raises(AttributeError):
        b.total = 5
    with pytest.raises(ConfigError, match=exact(
            "reserve = 10 is not valid: expected a whole number of bytes, at least 0 and less "
            "than total (10 bytes).")):
        Budget(total=10, reserve=10)
    with pytest.raises(ConfigError, match=exact(
            "total = 0 is not valid: expected a positive whole number of bytes.")):
        Budget(total=0, reserve=0)
    with pytest.raises(ConfigError):
        Budget(total=10, reserve=-1)
    with pytest.raises(ConfigError):
        Budget(total=10.0, reserve=1)


def test_errors_are_symmem_errors():
    for call in (lambda: parse_bytes("x"), lambda: gpu("x"), lambda: reserve_bytes("x", 1),
                 lambda: budget()):
        with pytest.raises(SymmemError):
            call()


def test_public_names():
    assert set(gpus.__all__) == {"parse_bytes", "GPU", "CATALOG", "gpu", "reserve_bytes",
                                 "DEFAULT_RESERVE", "Budget", "budget", "as_budget"}
    for name in gpus.__all__:
        assert getattr(gpus, name) is not None
    for fn in (parse_bytes, gpu, reserve_bytes, budget, GPU, Budget, gpus.as_budget):
        assert ">>> " in fn.__doc__


def test_as_budget():
    # 1 GiB = 1,073,741,824 bytes; 25% of it = 268,435,456 reserved
    assert gpus.as_budget("1GiB", reserve="25%").usable == 1_073_741_824 - 268_435_456
    h100 = budget(gpu="H100-80GB")
    assert gpus.as_budget(h100) is h100
    five = gpus.as_budget(h100, reserve="5%")        # a reserve given replaces the Budget's own
    assert (five.total, five.reserve) == (h100.total, h100.total * 5 // 100) and five.gpu is h100.gpu
    assert five.label.endswith("minus a 5% reserve (3.96 GiB)") and five.label.startswith("H100-80GB")
    assert gpus.as_budget("1GiB").reserve == 1_073_741_824 // 10         # a size: the default 10%
