r"""How much of xgrammar's compile an EBNF grammar (a `grammar` structured output) costs, estimated from its text
alone: the mask states of its rules. Pure: no xgrammar (schema_cost.py turns the states into units, as a pattern's).

xgrammar computes a token mask for every position of every rule, once per rule however often it is referenced.
Measured with benchmarks/grammar_compile.py at the 152k-token stand-in vocabulary (benchmarks/results/
grammar-compile-ebnf.md), a position costs as regex_cost.py weighs it: next to nothing for a digit class, about 5 ms
for a class of letters (`[a-z]{128}`: 0.69 s, and as long for 128 classes in a row), three to five times that for a
class of most characters (`[^"]{40}`: 0.73 s); less within about a token's length of the end of a run (`[a-z]{4}`:
7 ms, `[a-z]{16}`: 70 ms). A string literal is one byte string: 20000 characters took 77 ms. A reference costs its
rule once, not per copy or per use, recursive or not: `w{1,100}` with `w ::= [a-z]{1,10} " "` took 73 ms, as `w`
alone. A repetition `x{n,m}` is written as copies of `x` that are references to one rule, except where `x` is one
terminal (a class or a string, also through a group or a rule that holds only it): xgrammar inlines it, so each copy
is a position of its own, up to 128 (past that, a loop with a lookahead: `[a-z]{4000}` costs as `[a-z]{128}`).
Copies of a variable count cost 2.3x (`[a-z]{1,128}`: 1.6 s), past 128 up to 1.6x more (`[a-z]{1,4000}`: 2.3 s).

Copies of a body of variable length are cheap to compile but not to match: each token's mask follows every way to
split the output so far into copies (`([a-z]{1,10}){1,100}`: 72 ms to compile, then 0.2 s for a token's mask;
`(w " "?){1,100}` with `w ::= [a-z]{1,10}`: 1.1 s a mask). So, as regex_cost.py does, a bounded repetition of a body
that holds a variable bounded repetition is refused past MAX_NESTED_REPEAT copies in all, counted through references
(here a rule referenced from a repetition counts per copy). A body that begins with a string whose first character
it matches nowhere else, or ends with one whose last character it matches nowhere else (`"," item`, `item " "`),
splits in one way only, and its copies do not multiply. Not caught: ambiguous copies without a bounded repetition
inside (`(w " "?){1,16}` with `w ::= [a-z]+`: 1.2 s a mask; `([a-z] | [a-z] [a-z]){1,100}`: 0.5 s), whose compile
is cheap.

The reader is lenient: text it cannot read (an unknown character, an unclosed string or group, a rule that is not
defined) gets an estimate of what it did read, and xgrammar gives the real error.
"""

from __future__ import annotations

import functools
import itertools
import re
from typing import Any, NamedTuple

from tidal.worker.engine.regex_cost import MAX_GROUP_DEPTH, MAX_NESTED_REPEAT, class_states

EXPANDED_COPIES = 128  # xgrammar writes at most 128 copies of a repeated terminal; past that, a loop and a lookahead
SHORT_COPIES = 20  # copies within about a token's length of the end cost less: [a-z]{4} took 1.6 ms a copy, {16} 4.4
VARIABLE_COPIES = 2.3  # each copy of a variable count x{n,m}: [a-z]{1,128} took 2.3x [a-z]{128}
PAST_EXPANDED = 1.6  # a variable count past 128: [a-z]{1,4000} took 1.6x [a-z]{1,128}
LITERAL_CHAR_STATES = 0.0008  # a character of a string literal: 20000 took 72 ms, 42k in 256 choices 0.18 s
MAX_RANGES = 64  # a character set of more ranges is taken as any character (it only tells delimiters apart)

_TOKEN = re.compile(
    r"""(?P<space>\s+|\#[^\n]*)
    |(?P<assign>::=)
    |(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
    |(?P<string>"(?:[^"\\]|\\.)*"?)
    |(?P<cls>\[\^?\]?(?:[^\]\\]|\\.)*\]?)
    |(?P<quantifier>\{\s*\d*\s*(?:,\s*\d*\s*)?\}|[*+?])
    |(?P<punct>\(=|[()|])
    |(?P<other>.)""",
    re.VERBOSE | re.DOTALL,
)
_ONE_ESCAPE = r"\\(x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|.)"
_ESCAPE = re.compile(_ONE_ESCAPE, re.DOTALL)
_CLASS_ITEM = re.compile(rf"((?:{_ONE_ESCAPE})|.)(?:-((?:{_ONE_ESCAPE})|[^\\]))?", re.DOTALL)  # a, a-z, \x00-\x1f
_ESCAPED = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0", "b": "\b", "a": "\a", "e": "\x1b"}
_LAST_CHAR = 0x10FFFF

# A set of characters: sorted (first, last) code point ranges, or None for any character.
_Chars = tuple[tuple[int, int], ...] | None


class GrammarCostError(ValueError):
    """A grammar whose compile this module refuses to estimate: a nested repetition past MAX_NESTED_REPEAT copies,
    or groups nested past MAX_GROUP_DEPTH."""


class _Part(NamedTuple):
    states: float  # estimated mask states
    nested: int  # the largest product of the counts of variable bounded repetitions inside (1: none)
    length: int | None  # the length of every string it matches, None where they differ
    single: float | None  # the states of one copy, where it is one terminal that xgrammar inlines into a repetition
    chars: _Chars  # the characters it may match
    # It begins with a string whose first character it matches nowhere else, or ends with one whose last character
    # it matches nowhere else: copies of it split in one way only (a separator, "," item or item " ").
    delimited: bool = False


_EMPTY = _Part(0.0, 1, 0, None, ())
_RECURSIVE = _Part(0.0, 1, None, None, None)  # a reference back into a rule still being read: counted where defined

# The parsed body of a rule: ("lit", text), ("cls", states, chars), ("ref", name), ("seq", [nodes]),
# ("alt", [nodes]), ("rep", node, low, high, source text).
_Node = tuple[Any, ...]


class RuleCost(NamedTuple):
    states: float  # estimated mask states of the rule's own positions
    costliest: str  # the source of its costliest repetition ("" where it has none)


class _Token(NamedTuple):
    kind: str
    text: str
    start: int
    end: int


_NONE = _Token("", "", 0, 0)


def grammar_states(text: str) -> dict[str, RuleCost]:
    """The estimated mask states of each rule of an EBNF grammar (a rule defined twice: the sum). Raises
    GrammarCostError past MAX_NESTED_REPEAT or MAX_GROUP_DEPTH, naming the rule."""
    rules: dict[str, list[_Node]] = {}
    for name, tokens in _split_rules(_tokenize(text)):
        rules.setdefault(name, []).append(_Parser(text, tokens, name).body())
    return _Evaluator(rules).all()


def _tokenize(text: str) -> list[_Token]:
    """The tokens, less blanks, comments and characters the dialect does not have (xgrammar's to refuse)."""
    return [
        _Token(str(match.lastgroup), match.group(), match.start(), match.end())
        for match in _TOKEN.finditer(text)
        if match.lastgroup not in ("space", "other")
    ]


def _split_rules(tokens: list[_Token]) -> list[tuple[str, list[_Token]]]:
    """(name, body tokens) per `name ::= body`; what comes before the first rule is dropped."""
    starts = [i for i in range(len(tokens) - 1) if tokens[i].kind == "name" and tokens[i + 1].kind == "assign"] + [
        len(tokens)
    ]
    return [(tokens[start].text, tokens[start + 2 : end]) for start, end in itertools.pairwise(starts)]


class _Parser:
    def __init__(self, source: str, tokens: list[_Token], rule: str) -> None:
        self.source = source
        self.tokens = tokens
        self.rule = rule
        self.pos = 0
        self.depth = 0  # the groups open at pos

    def body(self) -> _Node:
        nodes = [self._alternation()]
        while self.pos < len(self.tokens):  # an unbalanced ")" ends _alternation early: read on
            self.pos += 1
            nodes.append(self._alternation())
        return ("seq", nodes)

    def _alternation(self) -> _Node:
        branches = [self._sequence()]
        while self._peek().text == "|":
            self.pos += 1
            branches.append(self._sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def _sequence(self) -> _Node:
        nodes = []
        while self.pos < len(self.tokens) and self.tokens[self.pos].text not in ("|", ")"):
            start = self.tokens[self.pos].start
            atom = self._atom()
            if atom is not None:
                nodes.append(self._repeat(atom, start))
        return ("seq", nodes)

    def _atom(self) -> _Node | None:
        kind, text = self.tokens[self.pos].kind, self.tokens[self.pos].text
        self.pos += 1
        if kind == "string":
            return ("lit", _unescape(text[1:-1] if text.endswith('"') and len(text) > 1 else text[1:]))
        if kind == "cls":
            return ("cls", *_class(text[1:-1] if text.endswith("]") and len(text) > 1 else text[1:]))
        if kind == "name":
            return ("ref", text)
        if kind == "punct" and text in ("(", "(="):
            if self.depth >= MAX_GROUP_DEPTH:
                raise GrammarCostError(
                    f"the rule {self.rule}: groups nested {self.depth + 1} deep, at most {MAX_GROUP_DEPTH} are read"
                )
            self.depth += 1
            inner = self._alternation()
            self.depth -= 1
            self.pos += 1  # the ")"
            return inner
        return None  # a quantifier with nothing before it, or the "::=" of a rule misread: xgrammar says what

    def _repeat(self, atom: _Node, start: int) -> _Node:
        """`atom` (its source from `start`) with the quantifier after it, if any (xgrammar takes one: a second is
        skipped, as an error)."""
        if self._peek().kind != "quantifier":
            return atom
        text = self.tokens[self.pos].text
        source = self.source[start : self.tokens[self.pos].end]
        self.pos += 1
        if text in ("*", "+", "?"):
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[text]
        else:
            first, comma, second = text[1:-1].replace(" ", "").partition(",")
            low = _count(first) if first else 0
            high = (_count(second) if second else None) if comma else low
        return ("rep", atom, low, high, source if len(source) <= 60 else source[:59] + "…")

    def _peek(self) -> _Token:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else _NONE


class _Evaluator:
    """Each rule's part, once: references are resolved in dependency order with an explicit stack (a chain of
    thousands of rules must not exhaust Python's), and one back into a rule still being resolved is _RECURSIVE."""

    def __init__(self, rules: dict[str, list[_Node]]) -> None:
        self.rules = rules
        self.parts: dict[str, _Part] = {}
        self.costliest: dict[str, tuple[float, str]] = {}
        self.rule = ""

    def all(self) -> dict[str, RuleCost]:
        for name in self.rules:
            self._resolve(name)
        return {
            name: RuleCost(part.states, self.costliest.get(name, (0.0, ""))[1]) for name, part in self.parts.items()
        }

    def _resolve(self, root: str) -> None:
        if root in self.parts:
            return
        open_rules = {root}
        stack = [(root, iter(_references(("alt", self.rules[root]))))]
        while stack:
            name, pending = stack[-1]
            child = next((ref for ref in pending if ref in self.rules and ref not in self.parts), None)
            if child is not None and child not in open_rules:
                open_rules.add(child)
                stack.append((child, iter(_references(("alt", self.rules[child])))))
                continue
            if child is not None:  # a cycle: its reference reads as _RECURSIVE
                continue
            stack.pop()
            open_rules.discard(name)
            self.rule = name
            bodies = [self._part(body) for body in self.rules[name]]
            self.parts[name] = bodies[0] if len(bodies) == 1 else _alternation(bodies)

    def _part(self, node: _Node) -> _Part:
        kind = node[0]
        if kind == "lit":
            states = LITERAL_CHAR_STATES * len(node[1])
            return _Part(states, 1, len(node[1]), states, _text_chars(node[1]))
        if kind == "cls":
            return _Part(node[1], 1, 1, node[1], node[2])
        if kind == "ref":
            return self.parts.get(node[1], _RECURSIVE if node[1] in self.rules else _EMPTY)._replace(states=0.0)
        if kind == "alt":
            return _alternation([self._part(branch) for branch in node[1]])
        if kind == "seq":
            parts = [self._part(child) for child in node[1]]
            if not parts:
                return _EMPTY
            states = _sequence_states(node[1], parts)
            if len(parts) == 1:  # a copy in a repetition still costs `single`: _repeat weighs its copies
                return parts[0]._replace(states=states)
            lengths = [part.length for part in parts]
            return _Part(
                states,
                max((part.nested for part in parts), default=1),
                None if None in lengths else sum(length for length in lengths if length is not None),
                None,
                _union(*(part.chars for part in parts)),
                _delimited(node[1], parts),
            )
        part = self._repeat(self._part(node[1]), node[2], node[3], node[4])
        if part.states > self.costliest.get(self.rule, (0.0, ""))[0]:
            self.costliest[self.rule] = (part.states, node[4])
        return part

    def _repeat(self, body: _Part, low: int, high: int | None, text: str) -> _Part:
        # The body's own positions, where they are not inlined per copy: references to one rule.
        once = body.states if body.single is None else 0.0
        if high is None:  # *, +, {n,}: the n mandatory copies, then one loop (x+ is written x x*)
            copies = _copies(min(max(low, 1), EXPANDED_COPIES)) + (1 if low >= 1 else 0)
            return _Part(once + (body.single or 0.0) * copies, body.nested, None, None, body.chars)
        count = max(low, high)
        length = None if body.length is None or low != high else body.length * low
        if count <= 1:  # ?, {0,1}, {1}
            single = body.single if low == high == 1 else None
            return _Part(body.states, body.nested, length, single, body.chars, body.delimited and low == high)
        ambiguous = (body.length is None or low != high) and not body.delimited
        nested = count * body.nested if ambiguous else body.nested
        if body.nested > 1 and nested > MAX_NESTED_REPEAT:
            raise GrammarCostError(
                f"the rule {self.rule}: the repetition {text} of a repetition of variable length makes {nested} "
                f"nested copies, at most {MAX_NESTED_REPEAT} are allowed (the output's mask at each step follows "
                "every way to split it into copies)"
            )
        if body.single is None:
            return _Part(once, nested, length, None, body.chars)
        copies = _copies(min(count, EXPANDED_COPIES))
        if low != high:
            copies *= VARIABLE_COPIES * (PAST_EXPANDED if count > EXPANDED_COPIES else 1.0)
        return _Part(body.single * copies, nested, length, None, body.chars)


def _sequence_states(nodes: list[_Node], parts: list[_Part]) -> float:
    """A sequence's states: a run of classes in a row costs as copies of a repetition do (fewer where it is short)."""
    states, run, run_states = 0.0, 0, 0.0
    for node, part in zip([*nodes, ("end",)], [*parts, _EMPTY], strict=True):
        if node[0] == "cls":
            run, run_states = run + 1, run_states + part.states
            continue
        if run:
            states += run_states * _copies(run) / run
            run, run_states = 0, 0.0
        states += part.states
    return states


def _copies(count: int) -> float:
    """The states of `count` copies of a terminal, at a copy's weight: fewer where a repetition is short."""
    return count * min(1.0, (count + 4) / (SHORT_COPIES + 4))


def _count(digits: str) -> int:
    """A repetition's count; past 9 digits 10**9, as costly, and int() refuses past 4300 digits."""
    return int(digits) if len(digits) <= 9 else 10**9


def _alternation(parts: list[_Part]) -> _Part:
    lengths = {part.length for part in parts}
    return _Part(
        sum(part.states for part in parts),
        max(part.nested for part in parts),
        lengths.pop() if len(lengths) == 1 else None,
        None,
        _union(*(part.chars for part in parts)),
    )


def _delimited(nodes: list[_Node], parts: list[_Part]) -> bool:
    """Whether a sequence begins with a string whose first character the rest never matches, or ends with one whose
    last character the rest never matches."""
    first, last = nodes[0], nodes[-1]
    if first[0] == "lit" and first[1]:
        rest = _union(_text_chars(first[1][1:]), *(part.chars for part in parts[1:]))
        if not _holds(rest, ord(first[1][0])):
            return True
    if last[0] == "lit" and last[1]:
        rest = _union(_text_chars(last[1][:-1]), *(part.chars for part in parts[:-1]))
        if not _holds(rest, ord(last[1][-1])):
            return True
    return False


def _unescape(text: str) -> str:
    """A string literal's or a class's text with its escapes read (a backslash and n, x41, u00e9, a quote)."""

    def one(match: re.Match[str]) -> str:
        escaped = match.group(1)
        if escaped[0] in "xuU" and len(escaped) > 1:
            return chr(min(int(escaped[1:], 16), _LAST_CHAR))
        return _ESCAPED.get(escaped, escaped)

    return _ESCAPE.sub(one, text)


def _text_chars(text: str) -> _Chars:
    points = sorted({ord(char) for char in text})
    return tuple((point, point) for point in points) if len(points) <= MAX_RANGES else None


@functools.lru_cache(maxsize=1024)
def _class(held: str) -> tuple[float, _Chars]:
    """A class's states at a position, and the characters it matches, from its text between the brackets."""
    return class_states(held), _class_chars(held)


def _class_chars(held: str) -> _Chars:
    """The characters a class matches, from its text between the brackets."""
    negated = held.startswith("^")
    ranges = []
    for item in _CLASS_ITEM.finditer(held[negated:]):
        first, last = item.group(1), item.group(3) or item.group(1)
        begin, end = _unescape(first), _unescape(last)
        if len(begin) != 1 or len(end) != 1:
            return None
        ranges.append((ord(begin), max(ord(begin), ord(end))))
    ranges.sort()
    if negated:
        complement, start = [], 0
        for low, high in ranges:
            if low > start:
                complement.append((start, low - 1))
            start = max(start, high + 1)
        if start <= _LAST_CHAR:
            complement.append((start, _LAST_CHAR))
        ranges = complement
    return tuple(ranges) if len(ranges) <= MAX_RANGES else None


def _union(*sets: _Chars) -> _Chars:
    ranges: list[tuple[int, int]] = []
    for chars in sets:
        if chars is None:
            return None
        ranges.extend(chars)
    return tuple(ranges) if len(ranges) <= MAX_RANGES else None


def _holds(chars: _Chars, point: int) -> bool:
    return chars is None or any(low <= point <= high for low, high in chars)


def _references(node: _Node) -> list[str]:
    """The rules `node` references, in order (iteratively: a body's groups are nested at most MAX_GROUP_DEPTH)."""
    found, stack = [], [node]
    while stack:
        current = stack.pop()
        if current[0] == "ref":
            found.append(current[1])
        elif current[0] in ("seq", "alt"):
            stack.extend(reversed(current[1]))
        elif current[0] == "rep":
            stack.append(current[1])
    return found
