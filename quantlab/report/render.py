r"""Reports for reviewers: report.md (a pull-request comment) and report.html (self-contained, plots inline).

Jinja2 renders both. HTML autoescapes every value. Markdown strings go through |md, which escapes only what
could act where the value lands, so report.md reads as written in a terminal or a CI log (`>=`, `2.13.0`, `Q&A`)
and a model name or generated text can neither run a script nor add a heading, link, image or table cell to a
pull-request comment: a string that could open raw HTML (`<` before a letter, `/`, `!` or `?`, an entity) is
HTML-escaped whole; Markdown punctuation that acts anywhere in a line is backslash-escaped; what acts only at a
line's start (a heading, a list, a quote) is escaped there; line breaks are folded. Paths and commands go through
|shell (quoted as bash reads them, hostile characters as $'\xNN' escapes) and |code (a code span, or escaped text
when a code span could not hold the value safely): no raw HTML from a name reaches any Markdown file.
"""
from __future__ import annotations

import html
import logging
import re
from pathlib import Path

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from quantlab.artifacts import write_text_atomic
from quantlab.gate.metrics import METRICS
from quantlab.report.documents import TABLE_METRICS, fmt, numerics_note

log = logging.getLogger("quantlab")


# what acts anywhere in a line: escapes, code spans, emphasis, links and images, table cells, strikethrough,
# autolinks; an underscore only where it can open or close emphasis (not between letters or digits: int8_sq)
_MD_SPECIAL = re.compile(r"([\\`*{}\[\]|~])|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")
# what acts only at a line's start (CommonMark): a quote (>), an ATX heading (1-6 #, then a blank or the end), a
# bullet (+ or -, then a blank or the end), a thematic break or setext underline (--- ===), an ordered list
# (1-9 digits, . or ), then a blank or the end). "2.13.0", "-0.5", "#3" or "=x" start no block and stay as written.
_MD_LINE_START = re.compile(r"^(\s*)(>|#(?=#{0,5}(?:\s|$))|[+\-=](?=\s|$|[+\-=])|\d{1,9}(?=[.)](?:\s|$)))")
# what could open raw HTML, an autolink or a character reference: < before a letter, /, ! or ? (a tag, a comment,
# a declaration, <http:...>), an entity or numeric reference, and a < or & that ends the value (the template's
# next character could complete it). A string holding one is HTML-escaped whole; in any other, <, > and & cannot
# act in Markdown (a <= 1.1, kl > 0.5, Q&A) and stay as written.
_HTML_OPENING = re.compile(r"<(?:[A-Za-z/!?]|$)|&(?:[A-Za-z][A-Za-z0-9]{0,31};|#[0-9]{1,7};|#[xX][0-9a-fA-F]{1,6};|$)")


def md_escape(value) -> str:
    """Any string made safe for one Markdown line or table cell, escaped only where a character could act:
    HTML-escaped whole when it could open a tag, an autolink or an entity (no tag or entity survives), every
    character that acts anywhere in a line backslash-escaped, what acts only at a line's start escaped there, control
    characters and line breaks folded into spaces. What cannot act stays as written (int8_sq, smollm2-135m,
    top1_agreement >= 0.8, torch 2.13.0, Q&A)."""
    text = "" if value is None else str(value)
    text = "".join(" " if (ord(ch) < 32 or ch in "\u2028\u2029\x7f") else ch for ch in text)
    if _HTML_OPENING.search(text):
        text = html.escape(text, quote=False)
    text = _MD_SPECIAL.sub(lambda m: "\\" + m.group(0), text)
    return _MD_LINE_START.sub(lambda m: m.group(1) + "\\" + m.group(2) if not m.group(2).isdigit()
                              else m.group(1) + m.group(2) + "\\", text, count=1)


_SHELL_SAFE = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")
_SHELL_PLAIN = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_@%+=:,./- ~#*?[]{}()!^;")


def _plain(ch: str) -> bool:
    return ch in _SHELL_PLAIN or (ord(ch) > 127 and ch.isprintable() and ch not in "\u2028\u2029")


def shell_quote(value) -> str:
    r"""One argument for a command shown in a report, as bash reads it back: bare when safe, in single quotes when
    only quotes are needed, else ANSI-C quoted ($'...') with every other character as a \xNN byte escape, so
    the text itself holds no <, >, &, backtick, | or line break (nothing a Markdown or HTML reader could act on)
    and pasting it still runs the same command."""
    text = "" if value is None else str(value)
    if text and _SHELL_SAFE.match(text):
        return text
    if all(_plain(ch) for ch in text):
        return "'" + text + "'"
    return "$'" + "".join(ch if _plain(ch) else "".join(f"\\x{b:02x}" for b in ch.encode("utf-8"))
                          for ch in text) + "'"


def code_span(value) -> str:
    """A Markdown code span of value, or, when it holds what a code span cannot show safely everywhere (HTML
    brackets, &, |, backticks, line breaks), the value as escaped text (md_escape), which renders the same
    characters."""
    text = "" if value is None else str(value)
    if text and not re.search(r"[<>&|`\x00-\x1f\x7f\u2028\u2029]", text):
        return f"`{text}`"
    return md_escape(text)


def fence_escape(value) -> str:
    """A string for the inside of a ``` block: one line, no backtick that could close the fence."""
    text = "" if value is None else str(value)
    return "".join(" " if ord(ch) < 32 else ch for ch in text).replace("`", "\u02cb")


def environment() -> Environment:
    """The Jinja2 environment of every report: HTML autoescaped, Markdown through |md, numbers through |num."""
    env = Environment(loader=PackageLoader("quantlab.report", "templates"),
                      autoescape=select_autoescape(enabled_extensions=("html.j2",), default_for_string=True),
                      undefined=StrictUndefined, trim_blocks=False, lstrip_blocks=False)
    env.filters["num"] = fmt
    env.filters["md"] = md_escape
    env.filters["fence"] = fence_escape
    env.filters["shell"] = shell_quote
    env.filters["code"] = code_span
    return env


def context(doc: dict, plots: list[tuple[str, str | None]] = ()) -> dict:
    """What the run templates read from metrics.json (and the plots)."""
    gate = doc["gate"]
    return {"run": doc["run"], "gate": gate, "metrics": doc["metrics"], "provenance": doc["provenance"],
            "failed": [c for c in gate["checks"] if not c["passed"]], "baseline": gate.get("baseline"),
            "design": gate.get("design"), "behaviour": doc.get("behaviour"), "buckets": doc.get("buckets"),
            "attribution": doc.get("attribution"), "generation": doc.get("generation"), "speed": doc.get("speed"),
            "table_metrics": TABLE_METRICS, "definitions": {k: v.definition for k, v in METRICS.items()},
            "argv": " ".join(shell_quote(a) for a in doc["provenance"].get("argv", [])), "plots": list(plots),
            "numerics_note": numerics_note(doc)}


def write_run_reports(run_dir: Path, doc: dict, kl_values, weight_rows: list[dict]) -> dict:
    """report.md and report.html of an evaluated run; returns metrics.json's weight_error section. weight_rows: the
    checkpoint audit's per-layer rows (module, format, cosine, sqnr_db, gain, fold), the one place the weight
    error of an export is computed ([] when the run has no audited checkpoint)."""
    from quantlab.report import plots

    figures = [("Perplexity per window", plots.ppl_per_window(doc["windows"])),
               ("Top-1 agreement and KL along the window", plots.along_position(doc["positions"])),
               ("Distribution of per-position KL", plots.kl_histogram(kl_values)),
               ("Weight SQNR per linear layer, by depth and role", plots.weight_sqnr(weight_rows))]
    env = environment()
    ctx = context(doc, figures)
    write_text_atomic(run_dir / "report.md", env.get_template("report.md.j2").render(ctx))
    write_text_atomic(run_dir / "report.html", env.get_template("report.html.j2").render(ctx))
    worst = sorted(weight_rows, key=lambda r: r["sqnr_db"])[:5]
    return {"weight_sqnr_worst": worst, "weight_sqnr_layers": len(weight_rows)}
