r"""How much of xgrammar's compile a regex (a `regex` structured output, a JSON schema's `pattern`) costs, estimated
from its text alone: the states its repetitions expand to. Pure: no xgrammar (schema_cost.py turns it into units).

xgrammar writes a repetition `x{n,m}` as up to max(n, m) copies of `x` (a JSON pattern natively above 128, but then
at a cost quadratic in the count: `[a-z]{4000}` took 0.7 s), and computes a token mask for every position of every
copy. What a position costs depends on how many tokens may go on from it (at a 49k vocabulary, measured with
benchmarks/grammar_compile.py): next to nothing for a literal or a digit (`(ab){100}`: 3 ms, `\d{20}`: 0.2 ms),
about 1 ms for a class of letters (`[a-z]{128}`: 118 ms, `\w{20}`: 24 ms), 4-5 ms for a class that takes blanks or
most characters (`.{20}`: 108 ms, `[^"]{20}`: 80 ms, `.{1,128}`: 1.3 s); copies of a variable count cost more
(`[a-z]{1,128}`: 250 ms as a regex). Copies of a body of variable length (`([a-z]{1,4}){1,4}`, `(\w+ ){1,20}`) are
ambiguous: many are live at once, and the masks cost several times more (57 ms and 157 ms), growing with the product
of the counts faster than it (`([a-z]{1,8}){1,8}`: 0.85 s; `([a-z]{1,10}){1,100}`: past 20 s). So the estimate
counts copies, weighted by what they hold, and refuses nested variable repetitions past a small product.

The parser is lenient: a pattern it cannot read (unbalanced, unknown syntax) gets an estimate of what it did read, and
xgrammar gives the real error.
"""

from __future__ import annotations

import re
from typing import NamedTuple

MAX_GROUP_DEPTH = 64  # the parser recurses per group: far below Python's recursion limit, and no real pattern nests so
MAX_NESTED_REPEAT = 16  # the product of nested variable counts: ([a-z]{1,4}){1,4} took 57 ms, {1,8}{1,8} 0.85 s
LITERAL_STATES = 0.1  # a literal character or a digit class: few tokens begin with one
CLASS_STATES = 1.0  # a class of letters, \w, \S
BROAD_STATES = 5.0  # `.`, a negated class, \s \W \D, or a class that holds a blank: most tokens may go on
VARIABLE = 1.5  # the copies of a variable count, x{n,m}
AMBIGUITY = 6.0  # the copies of a body of variable length: measured 2-6x of what the copies alone predict

_DIGITS = re.compile(r"(?:\\d|[0-9]-[0-9]|[0-9])+")
_BROAD = re.compile(r"^\^| |\\[sWD]")  # in a class's text


class RegexCostError(ValueError):
    """A regex whose compile this module refuses to estimate: a nested repetition past MAX_NESTED_REPEAT, or groups
    nested past MAX_GROUP_DEPTH."""


class _Part(NamedTuple):
    states: float  # estimated mask states
    nested: int  # the largest product of the counts of variable bounded repetitions inside (1: none)
    variable: bool  # matches strings of more than one length (copies of it would be ambiguous)


def regex_states(pattern: str) -> float:
    """The estimated number of mask states of `pattern`'s compile. Raises RegexCostError past MAX_NESTED_REPEAT or
    MAX_GROUP_DEPTH."""
    parser = _Parser(pattern)
    states = 0.0
    while parser.pos < len(pattern):  # an unbalanced ")" ends _alternation early: read on
        states += parser.alternation().states
        parser.pos += 1
    return states


def class_states(held: str) -> float:
    """The states of one position of a character class, from what it holds (the text between its brackets)."""
    if _BROAD.search(held):
        return BROAD_STATES
    return LITERAL_STATES if _DIGITS.fullmatch(held) else CLASS_STATES


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.text = pattern
        self.pos = 0
        self.depth = 0  # the groups open at pos

    def alternation(self) -> _Part:
        """Branches up to an unmatched ")" or the end: each is compiled, so their states add up."""
        states, nested, variable = 0.0, 1, False
        while True:
            branch = self._sequence()
            states, nested, variable = states + branch.states, max(nested, branch.nested), variable or branch.variable
            if self.pos < len(self.text) and self.text[self.pos] == "|":
                self.pos += 1
                continue
            return _Part(states, nested, variable)

    def _sequence(self) -> _Part:
        states, nested, variable = 0.0, 1, False
        while self.pos < len(self.text) and self.text[self.pos] not in "|)":
            atom = self._atom()
            if atom is None:
                continue
            part = self._repeat(atom)
            states, nested, variable = states + part.states, max(nested, part.nested), variable or part.variable
        return _Part(states, nested, variable)

    def _atom(self) -> _Part | None:
        text, char = self.text, self.text[self.pos]
        self.pos += 1
        if char in "^$":
            return None  # anchors match no character
        if char == "\\":
            escaped = text[self.pos : self.pos + 1]
            self.pos += 1
            if escaped in ("s", "W", "D"):
                return _Part(BROAD_STATES, 1, False)
            return _Part(CLASS_STATES if escaped.isalpha() and escaped != "d" else LITERAL_STATES, 1, False)
        if char == "[":
            return _Part(class_states(self._skip_class()), 1, False)
        if char == ".":
            return _Part(BROAD_STATES, 1, False)
        if char == "(":
            if self.depth >= MAX_GROUP_DEPTH:
                raise RegexCostError(f"groups nested {self.depth + 1} deep, at most {MAX_GROUP_DEPTH} are compiled")
            self._skip_group_kind()
            self.depth += 1
            inner = self.alternation()
            self.depth -= 1
            self.pos += 1  # the ")"
            return inner
        return _Part(LITERAL_STATES, 1, False)

    def _skip_group_kind(self) -> None:
        """Past the `?:`, `?=`, `?!`, `?<=`, `?<!` or `?<name>` of a group: its body counts as any group's."""
        text = self.text
        if not text.startswith("?", self.pos):
            return
        self.pos += 1
        if text.startswith(("<=", "<!"), self.pos):
            self.pos += 2
        elif text.startswith("<", self.pos):
            end = text.find(">", self.pos)
            self.pos = len(text) if end < 0 else end + 1
        elif self.pos < len(text):
            self.pos += 1

    def _skip_class(self) -> str:
        """Past a character class; returns what it holds."""
        text, start = self.text, self.pos
        if text.startswith("^", self.pos):
            self.pos += 1
        if text.startswith("]", self.pos):  # a "]" first is a literal
            self.pos += 1
        while self.pos < len(text) and text[self.pos] != "]":
            self.pos += 2 if text[self.pos] == "\\" else 1
        self.pos += 1
        return text[start : self.pos - 1]

    def _repeat(self, atom: _Part) -> _Part:
        """`atom` with the quantifier after it, if any."""
        start = self.pos
        bounds = self._quantifier()
        if bounds is None:
            return atom
        low, high = bounds
        if high is None:  # *, +, {n,}: the n mandatory copies, then one loop
            return _Part(atom.states * max(low, 1), atom.nested, True)
        count = max(low, high)
        variable = atom.variable or low != high
        if count <= 1:  # ?, {0,1}, {1}
            return _Part(atom.states, atom.nested, variable)
        nested = count * atom.nested if variable else atom.nested
        if atom.nested > 1 and nested > MAX_NESTED_REPEAT:
            raise RegexCostError(
                f"the repetition {self.text[start : self.pos]} of a repetition of variable length makes {nested} "
                f"nested copies, at most {MAX_NESTED_REPEAT} are compiled"
            )
        weight = AMBIGUITY if atom.variable else VARIABLE if low != high else 1.0
        return _Part(atom.states * count * weight, nested, variable)

    def _quantifier(self) -> tuple[int, int | None] | None:
        text = self.text
        if self.pos >= len(text):
            return None
        char = text[self.pos]
        if char in "*+?":
            self.pos += 1
            bounds: tuple[int, int | None] = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
        elif char == "{":
            end = text.find("}", self.pos)
            low, comma, high = text[self.pos + 1 : end].partition(",")
            if end < 0 or not low.isdigit() or not (high.isdigit() or high == ""):
                return None  # a literal "{"
            self.pos = end + 1
            bounds = (int(low), int(high) if high else (None if comma else int(low)))
        else:
            return None
        if self.pos < len(text) and text[self.pos] in "?+":  # lazy or possessive: the same states
            self.pos += 1
        return bounds
