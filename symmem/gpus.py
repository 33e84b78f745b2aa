"""How much memory a budget has: GPU capacities, size strings and the reserve.

A training step fits when its peak (``symmem.estimate(...).at(...)``) is at most the
*usable* memory of a :class:`Budget`: the capacity of a device, or a byte budget of
the user's own, minus a reserve for what symmem does not model (the CUDA context,
library workspaces, the caching allocator's fragmentation).

Everything stays a whole number of bytes. Size strings are parsed with a regular
expression and :class:`fractions.Fraction` (never ``eval`` or ``sympify``), so
``"1.5TiB"`` is exactly ``3 * 2**39`` bytes; a fractional byte is rounded down.

>>> parse_bytes("80GiB")
85899345920
>>> gpu("h100-80gb").memory
85045477376
>>> b = budget(gpu="H100-80GB")
>>> b.label
'H100-80GB (79.20 GiB) minus a 10% reserve (7.92 GiB)'
>>> b.usable
76540929639
"""
from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

from .units import format_bytes
from .errors import ConfigError, UnknownName

__all__ = ["as_budget", "parse_bytes", "GPU", "CATALOG", "gpu", "reserve_bytes", "DEFAULT_RESERVE",
           "Budget", "budget"]

# ---------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------

#: Bytes per unit, keyed by the lower-cased unit. Decimal units are powers of 10 (what
#: GPU vendors print on the box), binary units powers of 2 (what PyTorch prints).
_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
    # a bare letter (80G, as Java's -Xmx, Docker and free -h write memory): binary, and the
    # budget's label says so
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50,
}

# A plain decimal number with an optional exponent. The exponent is capped at three
# digits so that a hostile "1e999999999" cannot make Fraction build a gigantic integer.
_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,3})?"
# re.ASCII: \d and \s are ASCII only, so "١٢" (Arabic-Indic digits) is not a number here.
_SIZE_RE = re.compile(rf"^\s*(?P<number>{_NUMBER})\s*(?P<unit>[A-Za-z]*)\s*$", re.ASCII)
_PERCENT_RE = re.compile(rf"^\s*(?P<number>{_NUMBER})\s*%\s*$", re.ASCII)

_SIZE_FORMS = "80GiB, 80GB (10^9 bytes), 80G (read as GiB), 512MiB or a number of bytes"
_RESERVE_FORMS = ("a percentage like 10%, a size like 2GiB or 2GB (10^9 bytes), "
                  "a number of bytes, or 0 for no reserve")
_PERCENT_FIX = "To set aside a fraction of the memory, write a percentage such as '10%'."


def _exact(value) -> Fraction | None:
    """``value`` as an exact Fraction, or None when it is not a finite size-like value.

    Strings go through :data:`_SIZE_RE`; numbers keep their exact value (a float is
    converted exactly, ``40e9`` stays 40,000,000,000). Booleans are not numbers here.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return Fraction(int(value))
    if isinstance(value, (float, Decimal)):
        return Fraction(value) if math.isfinite(value) else None
    if isinstance(value, numbers.Rational):
        return Fraction(value.numerator, value.denominator)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m is None:
            return None
        unit = _UNITS.get(m.group("unit").lower())
        if unit is None:
            return None
        return Fraction(m.group("number")) * unit
    return None


def _size(value, field: str, *, allow_zero: bool) -> int:
    """Whole bytes of ``value`` (rounded down), or a ConfigError naming ``field``."""
    exact = _exact(value)
    if allow_zero:
        if exact is None:
            raise ConfigError(field, value, _RESERVE_FORMS)
        if exact < 0:
            raise ConfigError(field, value, "0 or more bytes", "Use 0 to turn the reserve off.")
        if 0 < exact < 1:
            raise ConfigError(field, value, "a size of at least 1 byte, or 0 for no reserve",
                              _PERCENT_FIX)
        return math.floor(exact)
    if exact is None:
        raise ConfigError(field, value, f"a size like {_SIZE_FORMS}")
    if exact < 1:
        raise ConfigError(field, value, f"a size of at least 1 byte, like {_SIZE_FORMS}")
    return math.floor(exact)


def parse_bytes(value, field: str = "budget") -> int:
    """A size as a whole number of bytes.

    ``value`` is an int of bytes or a string: a number (``"123456"``, ``"40e9"``,
    ``"1.5"``) with an optional unit, any case, with or without a space:
    ``B``, ``KB``, ``MB``, ``GB``, ``TB``, ``PB`` (powers of 10) and ``KiB``, ``MiB``,
    ``GiB``, ``TiB``, ``PiB`` (powers of 2). Decimals are exact (no float is involved
    for strings); a fractional byte is rounded down. Finite floats, Fractions and
    Decimals are accepted as byte counts too. ``field`` names the setting in errors.

    Raises :class:`~symmem.errors.ConfigError` for empty strings, unknown units,
    ``nan``/``inf``, booleans, other types, and sizes below one byte (zero, negative).

    >>> parse_bytes("80GiB")          # 80 * 2**30
    85899345920
    >>> parse_bytes("80 GB")          # 80 * 10**9
    80000000000
    >>> parse_bytes("1.5TiB")         # 3 * 2**39
    1649267441664
    >>> parse_bytes("40e9"), parse_bytes("512mib"), parse_bytes(123456)
    (40000000000, 536870912, 123456)
    >>> parse_bytes("2.5B")           # rounded down
    2
    >>> parse_bytes("80 GiBs")
    Traceback (most recent call last):
    ...
    symmem.errors.ConfigError: budget = '80 GiBs' is not valid: expected a size like 80GiB, 80GB (10^9 bytes), 80G (read as GiB), 512MiB or a number of bytes.
    """
    return _size(value, field, allow_zero=False)


# ---------------------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPU:
    """One accelerator and the memory it makes available.

    ``memory`` is the capacity CUDA (or HIP) reports, ``cudaDeviceProp.totalGlobalMem``,
    the number ``torch.cuda.get_device_properties(i).total_memory`` returns and PyTorch's
    out-of-memory message calls "total capacity". It is less than the marketing size
    (the driver keeps some memory, ECC and page tables take more) and less than
    ``nvidia-smi``'s total, which counts physical memory. It varies by driver version
    by up to a few tenths of a percent; ``source`` says which report the number is from.

    >>> g = gpu("A100-80GB")
    >>> g.memory, g.marketing
    (85100068864, '80 GB HBM2e')
    """

    name: str
    memory: int
    marketing: str
    source: str

    def __post_init__(self):
        if isinstance(self.memory, bool) or not isinstance(self.memory, int) or self.memory < 1:
            raise ConfigError("memory", self.memory, "a positive whole number of bytes")


def _mib(n: int) -> int:
    return n * 2**20


_THAMADA = "thamada/nvidia-smi"

#: The capacities of common training GPUs, what CUDA/HIP reports (see :class:`GPU`).
#: Each ``source`` cites where the number comes from and how it was rounded.
CATALOG: dict[str, GPU] = {g.name: g for g in (
    GPU("A100-40GB", 42_298_834_944, "40 GB HBM2",
        "CUDA deviceQuery on NVIDIA A100-SXM4-40GB, driver 12.2: 'Total amount of global "
        "memory: 40339 MBytes (42298834944 bytes)' (bottlerocket-os/bottlerocket#3873). "
        "Older drivers report 40536 MiB (39.59 GiB); nvidia-smi shows 40960MiB physical."),
    GPU("A100-80GB", 85_100_068_864, "80 GB HBM2e",
        f"CUDA deviceQuery on NVIDIA A100-SXM4-80GB, driver 12.5: '81158 MBytes "
        f"(85100068864 bytes)' ({_THAMADA}, gls/A100SXMx4_deviceQuery.py). Other drivers: "
        "79.15-79.35 GiB in PyTorch OOM messages; nvidia-smi shows 81920MiB physical."),
    GPU("H100-80GB", 85_045_477_376, "80 GB HBM3 (SXM5)",
        f"CUDA deviceQuery on NVIDIA H100 80GB HBM3 (SXM), driver 12.7: '81106 MBytes "
        f"(85045477376 bytes)' ({_THAMADA}, nvsim/H100SXMx8_deviceQuery.py). Other drivers: "
        "79.11 GiB in a PyTorch OOM message (vllm-project/vllm#27508, driver 535), 79.18 GiB "
        "(pytorch-metric-learning GPU benchmarks, CUDA 13.0); nvidia-smi shows 81559MiB."),
    GPU("H200", _mib(143_156), "141 GB HBM3e",
        "torch.cuda.get_device_properties on NVIDIA H200: 'total_memory=143156MB' (MiB, "
        "rounded down; in a public Modal example log whose repository the search index did "
        "not name), converted as 143156 * 2**20, exact to within 1 MiB. PyTorch OOM messages "
        "on H200 give 139.80-139.81 GiB; nvidia-smi shows 143771MiB physical "
        "(NVIDIA/cuda-samples#311)."),
    GPU("B200", _mib(182_631), "180 GB HBM3e",
        "torch.cuda.get_device_properties on NVIDIA B200: 'total_memory=182631MB' (MiB, "
        "rounded down; public benchmark log, repository not named by the search index), "
        "converted as 182631 * 2**20, exact to within 1 MiB; agrees with 'Total Global "
        "Memory: 178.35' GiB from cudaGetDeviceProperties (pytorch/ao#4002) and PyTorch OOM "
        "messages '178.35 GiB total capacity'."),
    GPU("MI300X", 206_141_652_992, "192 GB HBM3",
        "rocm-smi 'VRAM Total Memory (B): 206141652992' on AMD Instinct MI300X "
        "(ROCm/legacy-rocm-build#4750); HIP hipDeviceProp totalGlobalMem gives the same "
        f"196592 MiB ({_THAMADA}, nvsim/MI300X_x4_deviceQuery.py), 191.98 GiB as in PyTorch's "
        "'HIP out of memory' messages; this is 192 GiB less 16 MiB."),
    GPU("L4", 23_570_219_008, "24 GB GDDR6",
        f"CUDA deviceQuery on NVIDIA L4, driver 12.4: '22478 MBytes (23570219008 bytes)' "
        f"({_THAMADA}, gls/L4_deviceQuery.py). nvidia-smi shows 23034MiB physical "
        "(modal-labs/modal-client#2797)."),
    GPU("T4", 15_843_721_216, "16 GB GDDR6",
        "CUDA deviceQuery on Tesla T4, driver 11.0: '15110 MBytes (15843721216 bytes)' "
        "(https://chiemon.github.io/2024/12/25/%E6%98%BE%E5%8D%A1%E4%BF%A1%E6%81%AF.html), "
        "14.76 GiB as in PyTorch OOM messages of that era (rshaojimmy/MADDoG#11). Newer "
        "drivers report about 14.75 GiB (hpcaitech/Open-Sora#697); nvidia-smi 15360MiB."),
    GPU("V100-16GB", 16_945_512_448, "16 GB HBM2",
        "CUDA deviceQuery on Tesla V100-SXM2-16GB: '16160 MBytes (16945512448 bytes)', the "
        "same under drivers 9.0 to 10.2 in several public dumps (repositories not named by "
        "the search index); torch 'total_memory=16160MB' (Ultralytics YOLOv5 logs), OOM "
        "'15.78 GiB total capacity' on a 16 GB V100 (kchengiva/Shift-GCN#34)."),
    GPU("V100-32GB", 34_089_730_048, "32 GB HBM2",
        "CUDA deviceQuery on Tesla V100-SXM2-32GB and V100-PCIE-32GB: '32510 MBytes "
        "(34089730048 bytes)', the same under drivers 10.2 to 11.4 in several public dumps "
        "(repositories not named by the search index); PyTorch OOM messages '31.75 GiB total "
        "capacity' (hiyouga/LlamaFactory#182) and 31.74 GiB on a V100 32GB "
        "(liucongg/ChatGLM-Finetuning#73)."),
    GPU("RTX-3090", 25_327_697_920, "24 GB GDDR6X",
        f"CUDA deviceQuery on NVIDIA GeForce RTX 3090, driver 12.6: '24154 MBytes "
        f"(25327697920 bytes)' ({_THAMADA}, gls/RTX3090_deviceQuery.py). Older drivers: "
        "24268 MiB (torch total_memory=24268MB in the Hugging Face Transformers DeepSpeed "
        "docs); a card that also drives a display has less."),
    GPU("RTX-4090", 25_386_352_640, "24 GB GDDR6X",
        f"CUDA deviceQuery on NVIDIA GeForce RTX 4090, driver 12.4: '24210 MBytes "
        f"(25386352640 bytes)' ({_THAMADA}, gls/RTX4090_deviceQuery.py), 23.64 GiB as in "
        "PyTorch OOM messages (TMElyralab/MuseTalk#76, 3DTopia/Phidias-Diffusion#8). Other "
        "drivers and display use: 23.52-23.99 GiB."),
)}


def _key(name: str) -> str:
    """Case and separators do not matter: ``"rtx 4090"``, ``"RTX_4090"`` -> ``"RTX4090"``."""
    return re.sub(r"[\s_\-]+", "", name).upper()


def _unknown_gpu(name) -> UnknownName:
    return UnknownName("GPU", name, tuple(CATALOG))


def gpu(name) -> GPU:
    """The catalogued GPU called ``name`` (case, spaces, ``-`` and ``_`` do not matter).

    A :class:`GPU` is returned as it is. Unknown names raise
    :class:`~symmem.errors.UnknownName`, which suggests the closest known name.

    >>> gpu("rtx 4090").name
    'RTX-4090'
    >>> gpu("H100")
    Traceback (most recent call last):
    ...
    symmem.errors.UnknownName: unknown GPU 'H100'. Did you mean 'H100-80GB'? Known: A100-40GB, A100-80GB, H100-80GB, H200, B200, MI300X, L4, T4, V100-16GB, V100-32GB, RTX-3090, RTX-4090.
    """
    return _find(name)


def _find(name) -> GPU:
    # budget() has a parameter called gpu, so it calls this rather than gpu().
    if isinstance(name, GPU):
        return name
    if isinstance(name, str):
        wanted = _key(name)
        for known, device in CATALOG.items():
            if _key(known) == wanted:
                return device
    raise _unknown_gpu(name)


# ---------------------------------------------------------------------------------------
# The reserve
# ---------------------------------------------------------------------------------------

DEFAULT_RESERVE = "10%"
"""The memory set aside from every budget unless the user says otherwise: 10%.

A training step needs memory that symmem's formulas do not count. The CUDA context
alone takes about 300-600 MiB per device (more with lazy module loading off);
cuBLAS and cuDNN keep workspaces (tens to hundreds of MiB, more with several
streams); NCCL keeps buffers in distributed runs; and PyTorch's caching allocator
rounds and splits blocks, so reserved memory exceeds allocated memory.
Practitioners report that fragmentation alone wastes from 5% to 23% of memory,
depending on the model and on allocator settings such as
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``. Ten percent is a middle
value, not a bound: symmem states the reserve in every budget's label so the user
sees it, and ``reserve=`` changes it (``"15%"``, ``"2GiB"``, or ``0`` to turn it off).
"""


def reserve_bytes(reserve, capacity: int) -> int:
    """The bytes set aside out of ``capacity`` for what the formulas do not model.

    ``reserve`` is a percentage string of the capacity (``"10%"``, ``"12.5 %"``,
    rounded down to whole bytes), a size (an int of bytes, or a string for
    :func:`parse_bytes` such as ``"2GiB"``), or ``0`` / ``"0"`` for no reserve.

    Raises :class:`~symmem.errors.ConfigError` for negative reserves, percentages
    above 100%, and reserves of the whole capacity or more.

    >>> reserve_bytes("10%", 85_045_477_376)      # floor(85045477376 / 10)
    8504547737
    >>> reserve_bytes("2GiB", 85_045_477_376), reserve_bytes(0, 1000)
    (2147483648, 0)
    >>> reserve_bytes("100%", 1000)
    Traceback (most recent call last):
    ...
    symmem.errors.ConfigError: reserve = '100%' is not valid: expected a reserve smaller than the capacity of 1,000 bytes (1,000 B). It comes to 1,000 bytes, which leaves nothing usable. Lower the reserve or choose a larger budget.
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ConfigError("capacity", capacity, "a positive whole number of bytes")
    m = _PERCENT_RE.match(reserve) if isinstance(reserve, str) else None
    if m is not None:
        percent = Fraction(m.group("number"))
        if not 0 <= percent <= 100:
            raise ConfigError("reserve", reserve, "a percentage from 0% to 100%")
        amount = math.floor(capacity * percent / 100)
    else:
        amount = _size(reserve, "reserve", allow_zero=True)
    if amount >= capacity:
        raise ConfigError(
            "reserve", reserve,
            f"a reserve smaller than the capacity of {capacity:,} bytes ({format_bytes(capacity)})",
            f"It comes to {amount:,} bytes, which leaves nothing usable. "
            "Lower the reserve or choose a larger budget.")
    return amount


def _reserve_text(reserve, amount: int) -> str:
    """``'a 10% reserve (7.92 GiB)'``, ``'a 2.00 GiB reserve'`` or ``'no reserve'``."""
    if amount == 0:
        return "no reserve"
    m = _PERCENT_RE.match(reserve) if isinstance(reserve, str) else None
    if m is not None:
        return f"a {m.group('number')}% reserve ({format_bytes(amount)})"
    return f"a {format_bytes(amount)} reserve"


def _label(source: str, reserve, amount: int) -> str:
    joiner = "with" if amount == 0 else "minus"
    return f"{source} {joiner} {_reserve_text(reserve, amount)}"


# ---------------------------------------------------------------------------------------
# Budgets
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Budget:
    """The memory a training step may use: ``total`` bytes less a ``reserve``.

    ``label`` says in words where the numbers come from, for reports; ``gpu`` is the
    device when the budget is one. Build budgets with :func:`budget`.

    >>> b = Budget(total=1000, reserve=100)
    >>> b.usable, b.label
    (900, '1,000 B minus a 100 B reserve')
    """

    total: int
    reserve: int
    label: str = ""
    gpu: GPU | None = None

    def __post_init__(self):
        if isinstance(self.total, bool) or not isinstance(self.total, int) or self.total < 1:
            raise ConfigError("total", self.total, "a positive whole number of bytes")
        if isinstance(self.reserve, bool) or not isinstance(self.reserve, int) \
                or not 0 <= self.reserve < self.total:
            raise ConfigError("reserve", self.reserve,
                              f"a whole number of bytes, at least 0 and less than total "
                              f"({self.total:,} bytes)")
        if not self.label:
            object.__setattr__(self, "label", _label(format_bytes(self.total), None, self.reserve))

    @property
    def usable(self) -> int:
        """Bytes a training step may use: ``total - reserve``."""
        return self.total - self.reserve


_EXACTLY_ONE = "exactly one of gpu (a GPU name) or bytes (a size like 80GiB)"


def as_budget(value, reserve=None) -> Budget:
    """A :class:`Budget` from a Budget or a size (a byte count or a string): what the solvers
    and plots accept. The one rule of the reserve: a size gets :data:`DEFAULT_RESERVE` (10%)
    unless ``reserve`` is given (``0`` for none); a Budget keeps its own reserve unless
    ``reserve`` is given, which then replaces it (a percentage of the Budget's total).

    >>> as_budget("1GiB").reserve, as_budget("1GiB", reserve="25%").usable
    (107374182, 805306368)
    >>> as_budget(budget(gpu="T4"), reserve=0).label
    'T4 (14.76 GiB) with no reserve'
    """
    if isinstance(value, Budget):
        if reserve is None:
            return value
        amount = reserve_bytes(reserve, value.total)
        source = (f"{value.gpu.name} ({format_bytes(value.total)})" if value.gpu is not None
                  else f"{format_bytes(value.total)} budget")
        return Budget(total=value.total, reserve=amount, label=_label(source, reserve, amount), gpu=value.gpu)
    return budget(bytes=value, reserve=DEFAULT_RESERVE if reserve is None else reserve)


def _how_read(value) -> str:
    """`` ('80G' read as 80 GiB)`` for a size written with a bare unit letter, else ''."""
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    unit = m.group("unit") if m else ""
    return f" ({value.strip()!r} read as {m.group('number')} {unit.upper()}iB)" if len(unit) == 1 \
        and unit.lower() != "b" else ""


def budget(gpu=None, bytes=None, reserve=DEFAULT_RESERVE) -> Budget:
    """The memory budget of a GPU from :data:`CATALOG` or of a byte count, less a reserve.

    Pass exactly one of ``gpu`` (a name for :func:`gpu`, or a :class:`GPU`) and
    ``bytes`` (an int or a size string for :func:`parse_bytes`). ``reserve`` is
    :data:`DEFAULT_RESERVE` (10%) unless given; see :func:`reserve_bytes`.

    >>> b = budget(gpu="A100-80GB")
    >>> b.total, b.reserve, b.usable        # reserve = floor(85100068864 / 10)
    (85100068864, 8510006886, 76590061978)
    >>> budget(bytes="80GiB", reserve="4GiB").label
    '80.00 GiB budget minus a 4.00 GiB reserve'
    >>> budget(gpu="T4", reserve=0).label
    'T4 (14.76 GiB) with no reserve'
    """
    if (gpu is None) == (bytes is None):
        raise ConfigError("budget", {"gpu": gpu, "bytes": bytes}, _EXACTLY_ONE,
                          "Drop one of them." if gpu is not None else
                          "Pass gpu='H100-80GB', for instance, or bytes='80GiB'.")
    if gpu is not None:
        device = _find(gpu)
        total, source = device.memory, f"{device.name} ({format_bytes(device.memory)})"
    else:
        device = None
        total = parse_bytes(bytes, "budget")
        source = f"{format_bytes(total)} budget{_how_read(bytes)}"
    amount = reserve_bytes(reserve, total)
    return Budget(total=total, reserve=amount, label=_label(source, reserve, amount), gpu=device)
