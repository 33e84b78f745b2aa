"""The symbol table: every symbol symmem's formulas use, declared once.

``sympy.Symbol('b')`` and ``sympy.Symbol('b', positive=True)`` are different
symbols, and mixing them silently breaks formulas. Everything in symmem takes its
symbols from here.

Dimensions are positive integers. Bytes per element of a role (weights,
gradients, master weights, optimizer states, activations) are positive
rationals (int4 is 1/2 byte): a precision policy binds them to numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from .errors import UnknownName

__all__ = [
    "SymbolInfo", "TABLE", "symbol", "latex_names",
    "b", "s", "h", "a", "L", "V", "f", "k", "d_h", "d_e", "s_max", "r", "G", "g", "t", "d", "c", "e",
    "E", "K", "s_d", "n_b", "s_w", "H", "W", "C", "P", "n_c", "n_g", "M", "R",
    "B_w", "B_g", "B_m", "B_o", "B_a",
    "DIMENSIONS", "BYTE_SYMBOLS",
]


@dataclass(frozen=True)
class SymbolInfo:
    symbol: sp.Symbol
    latex: str
    meaning: str


def _dim(name: str, latex: str, meaning: str) -> SymbolInfo:
    return SymbolInfo(sp.Symbol(name, positive=True, integer=True), latex, meaning)


def _bytes(name: str, latex: str, meaning: str) -> SymbolInfo:
    return SymbolInfo(sp.Symbol(name, positive=True, rational=True), latex, meaning)


_INFOS = [
    _dim("b", "b", "micro-batch size (sequences per step on one device)"),
    _dim("s", "s", "sequence length (tokens per sequence)"),
    _dim("h", "h", "hidden size"),
    _dim("a", "a", "attention heads"),
    _dim("L", "L", "transformer layers"),
    _dim("V", "V", "vocabulary size"),
    _dim("f", "f", "feed-forward (MLP) width"),
    _dim("k", "k", "key/value heads"),
    _dim("d_h", "d_{h}", "attention head dimension, where a config sets one other than h/a"),
    _dim("d_e", "d_{e}", "embedding width, where a config sets one other than h (OPT's word_embed_proj_dim)"),
    _dim("s_max", r"s_{\max}", "maximum positions (rows of the position embedding)"),
    _dim("r", "r", "LoRA adapter rank"),
    _dim("G", "G", "global batch (sequences per optimizer step, per data-parallel rank)"),
    _dim("g", "g", "gradient-accumulation steps (micro-batches per optimizer step)"),
    _dim("t", "t", "tensor-parallel degree"),
    _dim("d", "d", "data-parallel degree"),
    _dim("c", "c", "context-parallel degree (ranks each sequence is split over)"),
    _dim("e", "e", "expert-parallel degree (ranks the experts are split over)"),
    _dim("E", "E", "experts of a mixture-of-experts layer (num_local_experts)"),
    _dim("K", "K", "experts each token is routed to (top-k)"),
    _dim("s_d", "s_{d}", "decoder (target) sequence length of an encoder-decoder model"),
    _dim("n_b", "n_{b}", "relative-position buckets (T5's relative_attention_num_buckets)"),
    _dim("s_w", "s_{w}", "sliding-window length of attention"),
    _dim("H", "H", "image height in pixels"),
    _dim("W", "W", "image width in pixels"),
    _dim("C", "C", "image channels"),
    _dim("P", "P", "patch size in pixels (a ViT patch is P x P)"),
    _dim("n_c", "n_{c}", "classes of a classification head"),
    _dim("n_g", "n_{g}", "tokens generated after the prompt (inference: the KV cache holds s + n_g positions)"),
    _bytes("B_w", r"B_{w}", "bytes per weight element"),
    _bytes("B_g", r"B_{g}", "bytes per gradient element"),
    _bytes("B_m", r"B_{m}", "bytes per master-weight element"),
    _bytes("B_o", r"B_{o}", "bytes per optimizer-state element"),
    _bytes("B_a", r"B_{a}", "bytes per activation element in the compute dtype"),
    SymbolInfo(sp.Symbol("M", positive=True, integer=True), "M", "memory budget: the device's capacity in bytes"),
    SymbolInfo(sp.Symbol("R", nonnegative=True, integer=True), "R",
               "reserve: bytes set aside for the CUDA context, workspaces and fragmentation"),
]

#: name -> SymbolInfo, in a fixed, documented order.
TABLE: dict[str, SymbolInfo] = {i.symbol.name: i for i in _INFOS}

b, s, h, a, L, V, f, k, d_h, d_e, s_max, r = (
    TABLE[n].symbol for n in ("b", "s", "h", "a", "L", "V", "f", "k", "d_h", "d_e", "s_max", "r"))
G, g, t, d, c, e = (TABLE[n].symbol for n in ("G", "g", "t", "d", "c", "e"))
E, K, s_d, n_b, s_w, H, W, C, P, n_c = (
    TABLE[n].symbol for n in ("E", "K", "s_d", "n_b", "s_w", "H", "W", "C", "P", "n_c"))
n_g = TABLE["n_g"].symbol
B_w, B_g, B_m, B_o, B_a = (TABLE[n].symbol for n in ("B_w", "B_g", "B_m", "B_o", "B_a"))
M, R = TABLE["M"].symbol, TABLE["R"].symbol

DIMENSIONS = (b, s, h, a, L, V, f, k, d_h, d_e, s_max, r, G, g, t, d, c, e, E, K, s_d, n_b, s_w, H, W, C, P, n_c, n_g)
BYTE_SYMBOLS = (B_w, B_g, B_m, B_o, B_a)


def symbol(name: str) -> sp.Symbol:
    """The symbol called ``name``; a clear error for a name symmem does not know."""
    try:
        return TABLE[name].symbol
    except KeyError:
        raise UnknownName("symbol", name, tuple(TABLE)) from None


def latex_names() -> dict[sp.Symbol, str]:
    """Symbol -> LaTeX name, for sympy's ``latex(..., symbol_names=...)``."""
    return {i.symbol: i.latex for i in _INFOS}
