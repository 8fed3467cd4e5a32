"""Answer extraction and scoring for math: the one place that reads an answer out of a completion, used
by the training rewards (``qerl.train.rewards``), the held-out accuracy of ``qerl.train.run`` and evaluation
(``eval``), so that a model is trained against the same reading it is judged by.

Three readings (``READINGS``), one per kind of gold answer:

* ``numeric`` (GSM8K, arithmetic): the marker spans below, reduced to a number, compared exactly.
* ``math`` (BigMath, MATH500/AIME/AMC): first what the reference's BigMath reward read, math-verify's
  LaTeX extraction over the *whole* completion with ``\\boxed`` tried first and no anchor-less
  matches (the reference's prompt and reward code); when that finds nothing, the marker spans. The fallback is ours: the
  BigMath prompt asks for ``<answer>`` tags, and the reference scored a bare ``<answer>3</answer>`` 0.
* ``dapo`` (DAPO-Math): the reference's ``dapo_score`` reading: the last ``Answer: X`` line in the
  last 300 characters, normalised as Minerva/DAPO do (``normalize_final_answer``), exact string match.

The reference scored GSM8K by comparing only the *first character* of the extracted answer and
gold (the reference's eval script, bug (b) there), which inflates accuracy and crashes on an empty extraction. Here a
completion's answer is located by the marker a model was trained or is likely to use, reduced to a
number (GSM8K) or a LaTeX expression (MATH/AIME/AMC), and compared by value: exact rational
equality for numbers, math-verify for anything symbolic.

Extraction tries marker styles in priority order and, for each, looks at the *last* occurrence
(models restate and correct themselves; the final statement wins). A style whose last occurrence
holds nothing answer-like (e.g. the ``<answer>...</answer>`` skeleton echoed from the system
prompt) falls through to the next style.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from math_verify import LatexExtractionConfig, LatexNormalizationConfig
from math_verify import parse as mv_parse
from math_verify import verify as mv_verify

#: The readings ``judge`` knows (see the module docstring).
READINGS = ("numeric", "math", "dapo")

_TAG_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL | re.IGNORECASE)
# GSM8K's "#### 72"; a markdown heading ("#### Step 1: ...") is not an answer marker.
_HASHES = re.compile(r"####(?![ \t]*[A-Za-z#])[ \t]*([^\n]*)")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# "The answer is 18.", "Final answer: $18", "answer = 18"; the span stops at the end of the line and is
# later cut at the end of its first sentence so that trailing chatter ("... Hope this helps with 2 ...")
# does not leak numbers into it.
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*([^\n]*)", re.IGNORECASE)
_SENTENCE_END = re.compile(r"\.(?:\s|$)")
# A number not glued to a preceding word/number: "-5", "1,234.50", "0.75", ".5", "3/4".
# The sign counts only when it does not follow a digit or word ("20-5" is 20 and 5, not -5).
_NUMBER = re.compile(r"(?<![\w.,])(-?)((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:\s*/\s*(\d+)(?![\d.]))?")
# LaTeX decoration that carries no value; removing it lets "\$1,234" or "18\,\text{dollars}" be read as numbers.
_LATEX_NOISE = re.compile(
    r"(?<!\\)\\[,;:!]\s*|\\(?:left|right|displaystyle)\b|\\text(?:bf|rm)?\s*\{([^{}]*)\}|\\mathrm\s*\{([^{}]*)\}"
)
# One number and nothing else but a sign, $ or %: only such spans may be compared as numbers in
# competition maths ("3, 5, 7" is a list, not 7).
_SINGLE_NUMBER = re.compile(r"\s*\$?\s*-?\$?\s*(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?\s*%?\s*")
_LATEX_FRAC = re.compile(r"(-?)\\[dt]?frac\s*\{\s*(-?\d+)\s*\}\s*\{\s*(\d+)\s*\}")
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2014": "-"})


@dataclass(frozen=True)
class Extraction:
    """The answer found in a completion: ``text`` as normalised for display/JSONL, ``value`` when it is a
    plain number (compared exactly), ``method`` = which marker style produced it."""

    text: str
    value: Fraction | None
    method: str


def unbox(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None when there is none or it is unclosed."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def _clean(span: str) -> str:
    """Strip LaTeX decoration, markdown emphasis and math delimiters around an answer span."""
    span = span.translate(_MINUS_SIGNS)
    inner = unbox(span)
    if inner is not None:
        span = inner
    span = _LATEX_NOISE.sub(lambda m: m.group(1) or m.group(2) or "", span)
    span = span.replace("\\$", "$").replace("\\%", "%").replace("{,}", ",")
    span = re.sub(r"^(?:\s|\*|:|\$|\\\(|\\\[)+|(?:\s|\*|\.|\$|\\\)|\\\])+$", "", span)
    return span.strip()


def to_number(text: str) -> Fraction | None:
    """The value of the *last* number in ``text`` (commas, $, %, units and trailing ``.0`` ignored;
    ``a/b`` and ``\\frac{a}{b}`` read as fractions), or None when it holds no number."""
    text = _LATEX_FRAC.sub(lambda m: f"{m.group(1)}{m.group(2)}/{m.group(3)}", text.translate(_MINUS_SIGNS))
    matches = list(_NUMBER.finditer(text))
    if not matches:
        return None
    sign, digits, denominator = matches[-1].groups()
    value = Fraction(digits.replace(",", ""))
    if denominator is not None:
        if int(denominator) == 0:
            return None
        value /= int(denominator)
    return -value if sign else value


def format_number(value: Fraction) -> str:
    """Canonical text of a number: ``18``, ``-2.5``, ``1/3`` (terminating decimals as decimals)."""
    if value.denominator == 1:
        return str(value.numerator)
    d = value.denominator
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    if d == 1:
        return f"{float(value):.12g}"
    return f"{value.numerator}/{value.denominator}"


def _is_symbolic(span: str) -> bool:
    """True when the span is maths that a number regex would misread (``\\sqrt{2}``, ``2^{10}``, ``3\\pi``);
    integer fractions ``\\frac{a}{b}`` are plain numbers."""
    return bool(re.search(r"\\[a-zA-Z]+|\^", _LATEX_FRAC.sub("", span)))


def _candidate_spans(completion: str) -> list[tuple[str, str]]:
    """(method, raw span) for the last occurrence of each marker style, in priority order."""
    spans: list[tuple[str, str]] = []
    tags = _TAG_ANSWER.findall(completion)
    if tags:
        spans.append(("tags", tags[-1]))
    hashes = _HASHES.findall(completion)
    if hashes:
        spans.append(("####", hashes[-1]))
    boxed = unbox(completion)
    if boxed is not None:
        spans.append(("boxed", boxed))
    said = _ANSWER_IS.findall(completion)
    if said:
        spans.append(("answer-is", _SENTENCE_END.split(said[-1], maxsplit=1)[0]))
    return spans


def extract_answer(completion: str, numeric: bool = True) -> Extraction | None:
    """Find the final answer in a completion, or None when it states none.

    ``numeric=True`` (GSM8K) reduces a span to its last number unless it is symbolic; as a last
    resort it takes the last number anywhere in the completion. ``numeric=False`` (competition maths)
    keeps the cleaned span as LaTeX and has no last-number fallback: there, a stray number is far
    more likely to be an intermediate result than the answer, and math-verify's LaTeX reading of the
    whole completion (the reference's BigMath reward) comes before the marker spans.
    """
    if not numeric:
        latex = _latex_answer(completion)
        if latex is not None:
            value = to_number(latex) if _SINGLE_NUMBER.fullmatch(latex) else None
            return Extraction(format_number(value) if value is not None else latex, value, "latex")
    for method, raw in _candidate_spans(completion):
        span = _clean(raw)
        if not span or not re.search(r"[\w\\]", span):
            continue
        if numeric and "=" in span:  # "5 + 3 = 8", "x = 5": the value is what the statement ends on
            span = span.rsplit("=", 1)[1].strip() or span
        if numeric and not _is_symbolic(span):
            value = to_number(span)
            if value is not None:
                return Extraction(format_number(value), value, method)
            continue
        value = to_number(span) if _SINGLE_NUMBER.fullmatch(span) else None
        return Extraction(format_number(value) if value is not None else span, value, method)
    if numeric:
        value = to_number(completion)
        if value is not None:
            return Extraction(format_number(value), value, "last-number")
    return None


#: The reference's BigMath extraction (the reference's prompt and reward code): LaTeX only, ``\\boxed`` first (every boxed
#: expression of the completion), no match without an anchor, basic LaTeX and units normalised.
#: (Its ``equations=True`` is what math-verify >= 0.9 does by itself and has been deprecated there.)
_REFERENCE_LATEX = [
    LatexExtractionConfig(
        normalization_config=LatexNormalizationConfig(
            basic_latex=True, units=True, malformed_operators=False, nits=False, boxed="all"
        ),
        boxed_match_priority=0,
        try_extract_without_anchor=False,
    )
]


def _latex_answer(completion: str) -> str | None:
    """The answer math-verify's anchored LaTeX extraction finds in the whole completion (as the text it
    matched), or None; a completion math-verify cannot handle counts as having none."""
    try:
        parsed = mv_parse(completion, extraction_config=_REFERENCE_LATEX, extraction_mode="first_match")
    except Exception:  # math-verify parses untrusted model text; a failure means "found nothing"
        return None
    text = str(parsed[-1]).strip() if parsed else ""
    return text or None


def gsm8k_gold(answer: str) -> str:
    """The gold number of a GSM8K ``answer`` field (the text after ``####``), or ValueError."""
    text = answer.split("####")[-1] if "####" in answer else answer
    value = to_number(text)
    if value is None or ("####" not in answer and not _SINGLE_NUMBER.fullmatch(answer)):
        raise ValueError(f"answer has no '#### <number>' gold: {answer[-80:]!r}")
    return format_number(value)


def math_gold_parses(gold: str) -> bool:
    """Whether math-verify can read a competition-maths gold at all (the BigMath reward skips rows it cannot)."""
    try:
        return bool(mv_parse(f"\\boxed{{{gold}}}"))
    except Exception:  # as in _symbolic_equal: a gold math-verify chokes on is one it cannot read
        return False


def _symbolic_equal(gold: str, predicted: str) -> bool:
    """math-verify equivalence; both sides are boxed so that bare LaTeX (``p - q``, ``\\text{(C)}``) parses."""
    try:
        gold_parsed = mv_parse(f"\\boxed{{{gold}}}")
        pred_parsed = mv_parse(f"\\boxed{{{predicted}}}")
        return bool(gold_parsed and pred_parsed and mv_verify(gold_parsed, pred_parsed))
    except Exception:  # math-verify parses untrusted model text; any failure means "not shown equal"
        return False


def is_correct(extraction: Extraction | None, gold: str) -> bool:
    """Whether an extracted answer equals the gold: exactly for two numbers, by math-verify otherwise."""
    if extraction is None:
        return False
    gold_value = to_number(gold) if _SINGLE_NUMBER.fullmatch(gold) else None
    if extraction.value is not None and gold_value is not None:
        return extraction.value == gold_value
    return _symbolic_equal(gold, extraction.text)


def score(completion: str, gold: str, numeric: bool = True) -> tuple[Extraction | None, bool]:
    """Extract the answer from ``completion`` and judge it against ``gold``."""
    extraction = extract_answer(completion, numeric=numeric)
    return extraction, is_correct(extraction, gold)


# --- the DAPO reading ---------------------------------------------------------------------------------
# The reference's DAPO-Math/MiroMind reward (the reference's prompt and reward code) normalises both sides the way Minerva's
# MATH evaluation did and compares the strings: these tables and steps give the same strings.

_DAPO_TAIL_CHARS = 300  # only the end of a completion is read
_DAPO_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)
#: Literal replacements, in order (after them no space is left).
_MINERVA_REPLACE = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
#: Units, filler words and LaTeX decoration deleted wherever they occur, in order.
_MINERVA_DELETE = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
#: Regex rewrites, in order: keep the first $...$ span; unwrap \text/\textbf/\overline/\boxed; spell out
#: the shorthand \fracab as \frac{a}{b} and \sqrta as \sqrt{a}.
_MINERVA_REWRITE = (
    (re.compile(r".*?\$(.*?)\$.*"), r"$\1$"),  # per line, as the reference's pattern
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),
    (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"),
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),
)


def normalize_final_answer(answer: str) -> str:
    """A final answer as the reference's DAPO reward compares it: the part after the last ``=``, units and
    spaces removed, ``\\text``/``\\boxed`` unwrapped, ``\\fracab`` spelled ``\\frac{a}{b}``, ``$`` dropped,
    thousands commas removed from integers (``"x = 5"`` -> ``5``, ``"10 dollars"`` -> ``10``)."""
    s = answer.split("=")[-1]
    for old, new in _MINERVA_REPLACE:
        s = s.replace(old, new)
    for word in _MINERVA_DELETE:
        s = s.replace(word, "")
    for pattern, repl in _MINERVA_REWRITE:
        s = pattern.sub(repl, s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def dapo_answer(completion: str) -> str | None:
    """The normalised text of the last ``Answer: X`` line in the completion's last 300 characters, or None."""
    found = _DAPO_ANSWER_LINE.findall(completion[-_DAPO_TAIL_CHARS:])
    return normalize_final_answer(found[-1]) if found else None


def judge(completion: str, gold: str, reading: str) -> bool:
    """Whether ``completion`` answers ``gold`` under one of ``READINGS``: what the rewards, the held-out
    accuracy and evaluation all call. ``numeric`` golds may be a bare number or a GSM8K solution ending in
    ``#### N``; a gold that is not one raises ValueError."""
    if reading == "numeric":
        return score(completion, gsm8k_gold(gold), numeric=True)[1]
    if reading == "math":
        return score(completion, gold, numeric=False)[1]
    if reading == "dapo":
        return dapo_answer(completion) == normalize_final_answer(gold)
    raise ValueError(f"unknown answer reading {reading!r}; expected one of {READINGS}")
