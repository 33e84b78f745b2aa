"""Presentation: every formula, number and text symmem shows goes through here.

Read it in this order:

1. **LaTeX.** :class:`LatexPrinter` extends sympy's LaTeX printer through the printer
   protocol (``_print_<Class>``, never string surgery): symmem's symbol names (``B_{a}``,
   ``s_{\\max}``) and sums in the canonical order (terms with ``L`` first, then ``b``,
   then ``s``, then the rest). Its *export* form (the default of :func:`latex`) is one
   line that sympy's LaTeX parser reads back into the same expression: a bracketed factor
   is written ``{\\left(…\\right)}`` so that ``L (…)`` is not read as a function ``L``
   applied to ``(…)``, each ``\\max`` argument is braced so that ``4, 123`` is not read
   as the number 4,123, and ``d`` is ``{d}`` so that ``d h`` is not read as a
   differential. Its *display* form (``display=True``, and :func:`latex_rows`,
   :func:`latex_max_rows`, :func:`latex_parts`) is for documents: ``\\bigl(…\\bigr)``
   brackets, long sums broken over lines of an ``aligned`` block, ``\\max`` with one
   candidate per line.
2. **MathML.** :class:`MathMLPrinter` writes presentation MathML (``<math
   display="block">``, which browsers render natively) in the same term order, ``max``
   as a one-column table: :func:`mathml`, :func:`mathml_max`, :func:`mathml_parts`.
3. **Escaping** of text a user supplies (a model name taken from a folder name, a
   title): :func:`tex_escape`, :func:`html_escape`, :func:`md_escape`, and
   :func:`rst_tex`, :func:`rst_html`, :func:`rst_md` for docstring text with
   ````code```` spans.
4. **Numbers and tables**: :func:`format_bytes` (``'19.62 GiB'``), :func:`tex_number`
   (``21{,}071{,}077{,}892``), :func:`values_text` and :func:`tex_values` (``b = 8,
   s = 1024``), :func:`html_table`.

The reports (:mod:`symmem.render`), the Jupyter displays of an estimate, an evaluation
and a solution, and the command line's LaTeX all print with these functions. This module
imports no part of symmem that computes (only the symbol table and the byte units), so
any module may import it.
"""
from __future__ import annotations

import re
import unicodedata

import markupsafe
import sympy as sp
from sympy.printing.latex import LatexPrinter as _SympyLatexPrinter
from sympy.printing.mathml import MathMLPresentationPrinter as _SympyMathMLPrinter
from sympy.printing.precedence import precedence_traditional
from sympy.simplify import fraction

from .symbols import L, b, latex_names, s, symbol
from .units import format_bytes

__all__ = ["LatexPrinter", "MathMLPrinter", "WIDTH", "latex", "latex_rows", "latex_max_rows",
           "latex_parts", "mathml", "mathml_max", "mathml_parts", "tex_escape", "html_escape",
           "md_escape", "rst_tex", "rst_html", "rst_md", "format_bytes", "tex_number",
           "values_text", "tex_values", "html_table"]


#: About how many characters of typeset math fit one display line of the LaTeX report.
WIDTH = 90

_BREAK = "\x00"     # a place where a display line may break (before `` + term``)
_ARG = "\x01"       # between the candidates of a displayed max: one per row


def _group(term) -> int:
    """Terms with L first, then b, then s, then the rest (the canonical form's order)."""
    free = term.free_symbols
    return 0 if L in free else 1 if b in free else 2 if s in free else 3


# ----------------------------------------------------------------------------------- LaTeX

class LatexPrinter(_SympyLatexPrinter):
    """sympy's LaTeX printer with symmem's symbol names and term order.

    Settings, besides sympy's: ``group`` (True: sums in the order L, b, s, rest; False:
    sympy's order) and ``display`` (False: the one-line export form that parses back;
    True: the typeset form, ``\\bigl(…\\bigr)`` brackets; :func:`latex_rows` breaks it
    into lines at the break points this printer marks)."""

    printmethod = "_symmem_latex"
    _default_settings = {**_SympyLatexPrinter._default_settings, "group": True, "display": False}

    def __init__(self, settings=None):
        settings = dict(settings or {})
        settings["symbol_names"] = {**latex_names(), **settings.get("symbol_names", {})}
        super().__init__(settings)
        self._breakable = [True]

    # Break points are allowed only in sums reached through sums, products (inside their
    # \bigl(...\bigr) brackets) and the top-level max: never inside a fraction, a root, a
    # power or a \left...\right pair, where TeX cannot break a line.
    def _print(self, expr, **kwargs):
        if isinstance(expr, (sp.Add, sp.Mul, sp.Max)):
            return super()._print(expr, **kwargs)
        self._breakable.append(False)
        try:
            return super()._print(expr, **kwargs)
        finally:
            self._breakable.pop()

    def doprint(self, expr) -> str:
        return self._raw(expr).replace(_BREAK, "").replace(_ARG, ", ")

    def _raw(self, expr) -> str:
        """The printed text with its break points (for :func:`_pack`)."""
        return super().doprint(expr)

    def _nobreak(self, expr) -> str:
        self._breakable.append(False)
        try:
            return self._print(expr)
        finally:
            self._breakable.pop()

    def _print_Symbol(self, expr, style="plain"):
        tex = super()._print_Symbol(expr, style=style)
        # sympy's LaTeX parser reads "d h" as the differential dh: export {d} h
        return "{d}" if tex == "d" and not self._settings["display"] else tex

    def _add_parens(self, s) -> str:
        if self._settings["display"]:
            return r"\bigl(%s\bigr)" % s
        return r"{\left(%s\right)}" % s

    _add_parens_lspace = _add_parens

    def parenthesize(self, item, level, is_neg=False, strict=False) -> str:
        prec = precedence_traditional(item)
        if (is_neg and strict) or prec < level or (not strict and prec <= level):
            return self._add_parens(self._print(item))
        return self._print(item)

    def _print_Add(self, expr, order=None):
        terms = list(self._as_ordered_terms(expr, order=order))
        if self._settings["group"]:
            terms.sort(key=_group)          # stable: sympy's order within each group
        sep = _BREAK if self._settings["display"] and self._breakable[-1] else ""
        tex = ""
        for i, term in enumerate(terms):
            if i:
                if term.could_extract_minus_sign():
                    tex += sep + " - "
                    term = -term
                else:
                    tex += sep + " + "
            t = self._print(term)
            if self._needs_add_brackets(term):
                t = self._add_parens(t)
            tex += t
        return tex

    def _print_Mul(self, expr):
        sign = ""
        if expr.could_extract_minus_sign():
            pos = -expr
            if not pos.is_Mul:
                t = self._print(pos)
                return "- " + (self._add_parens(t) if pos.is_Add else t)
            expr, sign = pos, "- "
        numer, denom = fraction(expr, exact=True)
        if denom == 1:
            return sign + self._product(expr)
        self._breakable.append(False)
        try:
            return sign + r"\frac{%s}{%s}" % (self._product(numer), self._product(denom))
        finally:
            self._breakable.pop()

    def _product(self, expr) -> str:
        """A product without a denominator: a rational coefficient, then the factors in
        sympy's order; sums in brackets (breakable in display form)."""
        if not expr.is_Mul:
            return self._print(expr)
        factors = list(expr.as_ordered_factors()) if self.order not in ("old", "none") \
            else list(expr.args)
        out, prev_number = [], False
        for i, f in enumerate(factors):
            if f.is_Rational:
                if f == 1:
                    continue
                t = self._print(f)
                out.append((r"\cdot " if prev_number else "") + t)
                prev_number = True
                continue
            if self._needs_mul_brackets(f, first=(i == 0), last=(i == len(factors) - 1)):
                t = self._add_parens(self._print(f) if f.is_Add else self._nobreak(f))
            else:
                t = self._print(f)
            out.append((r"\cdot " if prev_number and t[:1].isdigit() else "") + t)
            prev_number = False
        return " ".join(out) if out else "1"

    def _print_Max(self, expr, exp=None):
        if self._settings["display"] and self._breakable[-1] and exp is None:
            args = [self._print(a) for a in expr.args]
            return r"\max\bigl(" + _ARG.join(args) + r"\bigr)"
        args = ["{%s}" % self._nobreak(a) for a in expr.args]
        tex = r"\max\left(%s\right)" % ", ".join(args)
        return tex if exp is None else r"%s^{%s}" % (tex, exp)

    def _print_Min(self, expr, exp=None):
        args = ["{%s}" % self._nobreak(a) for a in expr.args]
        tex = r"\min\left(%s\right)" % ", ".join(args)
        return tex if exp is None else r"%s^{%s}" % (tex, exp)


def _printer(group: bool, display: bool) -> LatexPrinter:
    return LatexPrinter({"group": group, "display": display})


def latex(expr, *, group: bool = True, display: bool = False, lhs: str | None = None,
          width: int = WIDTH) -> str:
    """``expr`` in LaTeX with symmem's names, sums in the order L, b, s (``group=True``).

    ``display=False`` (the default) gives one line that
    ``sympy.parsing.latex.parse_latex`` reads back into an equal expression.
    ``display=True`` gives an ``aligned`` block for a document: long sums broken over
    lines (about ``width`` characters each), ``\\max`` with one candidate per line;
    ``lhs`` (LaTeX) is written before the ``=``."""
    if not display:
        tex = _printer(group, False).doprint(sp.sympify(expr))
        return tex if lhs is None else f"{lhs} = {tex}"
    rows = latex_rows(expr, group=group, lhs=lhs, width=width)
    return "\\begin{aligned}\n" + " \\\\\n".join(rows) + "\n\\end{aligned}"


def latex_rows(expr, *, group: bool = True, lhs: str | None = None, width: int = WIDTH) -> list[str]:
    """The rows of ``expr``'s display form, each with one ``&`` (for ``aligned`` or
    ``align*``): a sum broken at ``+``/``-`` into lines of about ``width`` characters, a
    ``\\max`` with one candidate per row (the candidates in ``expr.args`` order)."""
    tex = _printer(group, True)._raw(sp.sympify(expr))
    return _layout(tex, lhs, width)


def latex_max_rows(candidates, *, lhs: str | None = None, labels=None, group: bool = True,
                   width: int = WIDTH) -> list[str]:
    """``\\max`` of ``candidates`` in the order given (a ``sympy.Max`` sorts its
    arguments), one candidate per row, each broken into lines of about ``width``;
    ``labels`` (one per candidate) are written as TeX comments before their rows."""
    p = _printer(group, True)
    texs = [p._raw(sp.sympify(c)) for c in candidates]
    return _max_rows(texs, "" if lhs is None else f"{lhs} = ", width, labels)


def _max_rows(texs: list[str], head: str, width: int, labels=None) -> list[str]:
    rows, avail = [], width - _width(head + r"\max\bigl(\,") - 3
    for i, cand in enumerate(texs):
        lines = _pack(cand, avail)
        lines[-1] += r",\," if i < len(texs) - 1 else r"\,\bigr)"
        first = head + r"\max\bigl(\, & " if i == 0 else "& "
        if labels is not None:
            first = "% " + " ".join(str(labels[i]).split()) + "\n" + first
        rows.append(first + lines[0])
        rows += [r"& \quad " + line for line in lines[1:]]
    return rows


def _layout(tex: str, lhs: str | None, width: int) -> list[str]:
    head = "" if lhs is None else f"{lhs} "
    if tex.startswith(r"\max\bigl(") and _ARG in tex:
        body = tex[len(r"\max\bigl("):-len(r"\bigr)")]
        return _max_rows(body.split(_ARG), head + ("= " if lhs is not None else ""), width)
    eq = "&= " if lhs is not None else "& "
    lines = _pack(tex, width - _width(head) - 4)
    return [head + eq + lines[0]] + [r"& \quad " + line for line in lines[1:]]


def _pack(tex: str, width: int) -> list[str]:
    """Greedy lines of the chunks between break points, each about ``width`` wide."""
    chunks = tex.replace(_ARG, ", ").split(_BREAK)
    lines = [chunks[0]]
    for c in chunks[1:]:
        if _width(lines[-1]) + _width(c) > width and _width(lines[-1]) > 0:
            lines.append(c.lstrip())
        else:
            lines[-1] += c
    if len(lines) > 1 and _width(lines[-1]) < 6 and _width(lines[-2] + lines[-1]) <= width + 4:
        lines[-2:] = [lines[-2] + " " + lines[-1]]     # no widow such as "+ 4" alone
    return [line.strip() for line in lines]


_CMD = re.compile(r"\\([a-zA-Z]+|.)|[{}\s]")
_CMD_WIDTH = {"max": 3, "min": 3, "quad": 2, ",": 0, "left": 0, "right": 0, "bigl": 1, "bigr": 1,
              "mathrm": 0, "text": 0, "frac": 0, "underbrace": 0, "begin": 0, "end": 0}


def _width(tex: str) -> float:
    """Roughly how many characters wide ``tex`` typesets (calibrated on pdflatex at 10pt:
    about 4.7pt a unit, at most 5.1): letters and digits 1, commands as in
    :data:`_CMD_WIDTH` (others 1), scripts 0.7, binary operators and ``=`` 2.5."""
    plain = _CMD.sub(lambda m: "" if m.group(1) is None else "x" * round(
        _CMD_WIDTH.get(m.group(1), 1)), tex)
    scripts = sum(len(x) for x in re.findall(r"[_^]\{([^{}]*)\}", tex))
    ops = plain.count("+") + plain.count("-") + plain.count("=")
    return len(plain) - 0.3 * scripts + 1.5 * ops


def latex_parts(parts, *, underbrace: bool = True, display: bool = True, width: int = WIDTH) -> str:
    """``[(role, expr), …]`` as a sum of parts (zero parts left out), each
    ``\\underbrace{…}_{\\text{role}}`` (``underbrace=True``) or bracketed.
    ``display=True`` gives an ``aligned`` block, one part per row (a long part broken over
    lines of about ``width``); ``display=False`` one line, which without underbraces parses
    back to the sum."""
    parts = [(role, e) for role, e in parts if sp.expand(e) != 0]
    if not display:
        p = _printer(True, False)
        if underbrace:
            return " + ".join(r"\underbrace{%s}_{\text{%s}}" % (p.doprint(e), role)
                              for role, e in parts)
        return " + ".join(r"{\left(%s\right)}" % p.doprint(e) for _, e in parts)
    rows = []
    for i, (role, e) in enumerate(parts):
        lines = _pack(_printer(True, True)._raw(e), width - 10)
        body = lines[0] if len(lines) == 1 else \
            "\\begin{aligned}[t] & " + " \\\\ & \\quad ".join(lines) + " \\end{aligned}"
        body = (r"\underbrace{%s}_{\text{%s}}" % (body, role)) if underbrace \
            else (r"\bigl(%s\bigr)" % body)
        rows.append(("& " if i == 0 else "& + ") + body)
    return "\\begin{aligned}\n" + " \\\\\n".join(rows) + "\n\\end{aligned}"


# ---------------------------------------------------------------------------------- MathML

class MathMLPrinter(_SympyMathMLPrinter):
    """sympy's presentation-MathML printer with symmem's term order (L, b, s, rest) and
    ``max`` of many candidates as a one-column table (one candidate per row)."""

    printmethod = "_symmem_mathml"
    _default_settings = {**_SympyMathMLPrinter._default_settings, "group": True}

    def _as_ordered_terms(self, expr, order=None):
        terms = list(super()._as_ordered_terms(expr, order=order))
        if self._settings["group"]:
            terms.sort(key=_group)
        return terms

    def _mo(self, text):
        mo = self.dom.createElement("mo")
        mo.appendChild(self.dom.createTextNode(text))
        return mo

    def _print_Max(self, expr):
        return self._max(expr.args)

    def _max(self, args):
        mrow = self.dom.createElement("mrow")
        mi = self.dom.createElement("mi")
        mi.appendChild(self.dom.createTextNode("max"))
        mrow.appendChild(mi)
        mrow.appendChild(self._mo("("))
        if len(args) > 2:
            table = self.dom.createElement("mtable")
            table.setAttribute("columnalign", "left")
            for i, arg in enumerate(args):
                tr, td = self.dom.createElement("mtr"), self.dom.createElement("mtd")
                cell = self.dom.createElement("mrow")
                cell.appendChild(self._print(arg))
                cell.appendChild(self._mo("," if i < len(args) - 1 else ")"))
                td.appendChild(cell)
                tr.appendChild(td)
                table.appendChild(tr)
            mrow.appendChild(table)
            return mrow
        for i, arg in enumerate(args):
            if i:
                mrow.appendChild(self._mo(","))
            mrow.appendChild(self._print(arg))
        mrow.appendChild(self._mo(")"))
        return mrow


def _math(body: str, lhs, display: bool) -> str:
    if lhs is not None:
        left = f"<mi>{html_escape(lhs)}</mi>" if isinstance(lhs, str) else \
            MathMLPrinter().doprint(sp.sympify(lhs))
        body = f"<mrow>{left}<mo>=</mo>{body}</mrow>"
    return f'<math display="{"block" if display else "inline"}">{body}</math>'


def mathml(expr, *, lhs: str | None = None, display: bool = True, group: bool = True) -> str:
    """``expr`` as ``<math display="block">…</math>`` (``display=False``: inline), in
    presentation MathML; ``lhs`` (plain text, escaped here, or a sympy expression) is
    written before ``=``."""
    return _math(MathMLPrinter({"group": group}).doprint(sp.sympify(expr)), lhs, display)


def mathml_max(candidates, *, lhs: str | None = None, group: bool = True) -> str:
    """``max`` of ``candidates`` in the order given, one per row of a table."""
    p = MathMLPrinter({"group": group})
    node = p._max([sp.sympify(c) for c in candidates])
    return _math(node.toxml().encode("ascii", "xmlcharrefreplace").decode(), lhs, True)


def mathml_parts(parts) -> str:
    """``[(role, expr), …]`` as a sum of parts (zero parts left out), one per row, each
    labelled with its role (a table rather than :func:`latex_parts`' underbraces: browsers
    stretch an underbrace only with a math font installed)."""
    p = MathMLPrinter({"group": True})
    rows = []
    for i, (role, e) in enumerate(p for p in parts if sp.expand(p[1]) != 0):
        plus = "<mo>+</mo>" if i else "<mphantom><mo>+</mo></mphantom>"
        rows.append("<mtr><mtd><mtext>%s</mtext></mtd><mtd><mrow>%s%s</mrow></mtd></mtr>"
                    % (html_escape(role), plus, p.doprint(e)))
    return ('<math display="block"><mtable columnalign="right left">%s</mtable></math>'
            % "".join(rows))


# -------------------------------------------------------------------------------- escaping

_TEX = {"\\": r"\textbackslash{}", "{": r"\{", "}": r"\}", "$": r"\$", "&": r"\&", "#": r"\#",
        "^": r"\textasciicircum{}", "_": r"\_", "~": r"\textasciitilde{}", "%": r"\%",
        "<": r"\textless{}", ">": r"\textgreater{}", "|": r"\textbar{}"}
_ACCENTS = {"\u0300": "`", "\u0301": "'", "\u0302": "^", "\u0303": "~", "\u0308": '"',
            "\u0327": "c", "\u030a": "r", "\u030c": "v"}


def tex_escape(text) -> str:
    """``text`` as LaTeX text that prints it literally: ``\\ { } $ & # ^ _ ~ % < > |``
    escaped; accented Latin letters as accent commands; other non-ASCII characters as
    ``[U+XXXX]`` (pdfLaTeX has no glyph for them); control characters as spaces."""
    out = []
    for ch in str(text):
        if ch in _TEX:
            out.append(_TEX[ch])
        elif " " <= ch <= "~":
            out.append(ch)
        elif ch in "\t\n\r" or unicodedata.category(ch).startswith("C"):
            out.append(" ")
        elif ch == "ß":
            out.append(r"\ss{}")
        else:
            base, *marks = unicodedata.normalize("NFD", ch)
            if base.isascii() and base.isalpha() and len(marks) == 1 and marks[0] in _ACCENTS:
                out.append("\\%s{%s}" % (_ACCENTS[marks[0]], base))
            else:
                out.append(f"[U+{ord(ch):04X}]")
    return "".join(out)


def html_escape(text) -> str:
    """``text`` for HTML text and attribute values (markupsafe: ``& < > " '``)."""
    return str(markupsafe.escape(str(text)))


_MD = re.compile(r"([\\`*_\[\]|~$])")


def md_escape(text) -> str:
    """``text`` for Markdown, inside a line: the inline markup characters
    (``\\ ` * _ [ ] | ~ $``) backslash-escaped, ``& < >`` as HTML entities (a Markdown
    renderer passes raw HTML through)."""
    return _MD.sub(r"\\\1", html_escape(text).replace("&#39;", "'").replace("&#34;", '"'))


def _rst_parts(text: str):
    """Split a docstring's text at ````code```` spans: [(text, is_code), …]."""
    parts = re.split(r"``(.+?)``", text)
    return [(p, i % 2 == 1) for i, p in enumerate(parts) if p]


def rst_tex(text) -> str:
    """Docstring text for LaTeX: ````code```` spans in ``\\texttt``, all of it escaped."""
    return "".join(r"\texttt{%s}" % tex_escape(p) if code else tex_escape(p)
                   for p, code in _rst_parts(str(text)))


def rst_html(text) -> str:
    """Docstring text for HTML: ````code```` spans in ``<code>``, all of it escaped."""
    return "".join(f"<code>{html_escape(p)}</code>" if code else html_escape(p)
                   for p, code in _rst_parts(str(text)))


def rst_md(text) -> str:
    """Docstring text for Markdown: ````code```` spans in backticks, the rest escaped."""
    return "".join("`%s`" % p.replace("`", "'").replace("|", "\\|") if code else md_escape(p)
                   for p, code in _rst_parts(str(text)))


# ---------------------------------------------------------------------- numbers and tables

def tex_number(n) -> str:
    """A number in math mode: ``76{,}540{,}929{,}639`` (no space after the commas); a
    fraction or a formula as :func:`latex` writes it."""
    v = sp.sympify(n)
    return f"{int(v):,}".replace(",", "{,}") if v.is_Integer else latex(v)


def values_text(values: dict) -> str:
    """``{"b": 8, "s": 1024}`` -> ``'b = 8, s = 1024'`` (plain text: escape it for HTML)."""
    return ", ".join(f"{k} = {v}" for k, v in values.items())


def tex_values(values: dict) -> str:
    """``{"b": 8, "s_max": 1024}`` -> ``'b = 8, s_{\\max} = 1024'``: each name (a symbol of
    the table or its name) as its LaTeX name, each value as written."""
    names = latex_names()
    return ", ".join(f"{names.get(symbol(k) if isinstance(k, str) else k, k)} = {v}"
                     for k, v in values.items())


def html_table(header, rows, right=(), indent=None) -> str:
    """An HTML table; cells are already HTML (escape user text first with
    :func:`html_escape`; the header is escaped here). Columns whose index is in ``right``
    are right-aligned (numbers); no header row when ``header`` is empty. ``indent`` (one
    nesting depth per row, e.g. a repeated block's body at 1) indents each row's first
    cell by ``0.5 + 1.5 * depth`` em."""
    def cell(tag, i, c, depth=None):
        style = "text-align:right" if i in right else "text-align:left"
        if depth is not None:
            style += f";padding-left:{0.5 + 1.5 * depth}em"
        return f"<{tag} style='{style}'>{c}</{tag}>"
    head = "".join(cell("th", i, html_escape(h)) for i, h in enumerate(header or ()))
    head = f"<thead><tr>{head}</tr></thead>" if head else ""
    depths = list(indent) if indent is not None else [None] * len(rows)
    body = "".join("<tr>" + "".join(cell("td", i, c, d if i == 0 else None)
                                    for i, c in enumerate(r)) + "</tr>"
                   for r, d in zip(rows, depths))
    return f"<table>{head}<tbody>{body}</tbody></table>"
