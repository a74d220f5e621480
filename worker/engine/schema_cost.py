"""An admission bound on what a structured output costs to compile, checked on its text before anything compiles.

xgrammar's compile of a JSON schema against the vocabulary runs on a shared pool of two threads and cannot be
cancelled; the 64 KiB cap on the text does not bound it (a 42 KB schema of 1500 optional properties took 12 s, a
55-character pattern over 20 s). This module walks the schema and adds up an estimate in cost units, and refuses,
with the JSON pointer of the part at fault (a regex: regex_cost.py; an EBNF grammar: ebnf_cost.py, naming the rule):
  - past COST_BUDGET units in all;
  - an object with more than MAX_OPTIONAL_PROPERTIES optional properties (their cost is quadratic: any subset may
    appear, in order);
  - subschemas nested more than MAX_DEPTH deep (cubic: 64 levels took 33 ms at 49k tokens, 128 took 0.2 s, 200 0.8 s);
  - a pattern with nested repetitions past regex_cost.MAX_NESTED_REPEAT copies.

A unit is about a millisecond of one core at a 152k-token vocabulary: SmolLM2's 49k tokens padded with synthetic
ones shaped like a byte-level BPE's (benchmarks/perf/grammar_vocab.py), the weights read off the table that
benchmarks/grammar_compile.py prints (xgrammar 0.2.9, best of 3 runs). What a state costs grows with the tokens that
may go on from it: at 49k tokens the states that admit free text (a pattern, a format, a property name) cost a
fifth to a tenth of this, the literal ones (property keys, numbers) a third to all of it. The check does not know
the model's vocabulary, so it takes the largest common one; a model with a small vocabulary is refused some schemas
it could afford. The budget: the worst admitted schemas measured 0.2-0.25 s at 152k tokens (0.05-0.2 s at 49k),
leaving room for a busier or slower core, and the estimate over-counts what it does not model (unreferenced $defs,
interleaved required properties, cheap character classes) rather than under-count.

Pure: no xgrammar, no torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from tidal.worker.engine.ebnf_cost import GrammarCostError, RuleCost, grammar_states
from tidal.worker.engine.regex_cost import RegexCostError, regex_states

COST_BUDGET = 400.0
MAX_DEPTH = 32
MAX_OPTIONAL_PROPERTIES = 200  # one object alone: 0.004 * 200**2 = 160 units; 78 ms measured (any-valued: ~2x)

# Weights, in units (about a millisecond at 152k tokens each; in brackets what 49k tokens took).
BASE = 15.0  # the JSON rules every schema shares: {"type": "object"} compiles in 17 ms (5 ms)
NODE = 0.05  # any subschema, times (1 + (depth / 8) ** 2): 32 nested objects took 22 ms (10 ms), 64 48 ms
PROPERTY = 0.1  # a listed property (its key is a literal): 1800 required ones took 0.25 s (0.2 s)
OPTIONAL_RUN = 0.004  # times the square of each run of optional properties: 200 took 78 ms (60 ms), 500 0.4 s
# An object that admits properties it does not list (additionalProperties true or a schema, or strict false) must
# tell its listed names from other strings: xgrammar builds a rule per distinct prefix of the names, each as costly
# as free text: 35 ms (9-19 ms). 30 properties of 20 characters (about 570 prefixes) took past 12 s (3.5-6.7 s).
NAME_PREFIX = 36.0
BOUNDS = 1.2  # minimum/maximum, min/maxLength, min/maxItems: 100 integer ranges took 0.13 s (85 ms)
LITERAL_CHAR = 0.003  # a character of an enum or const value: a const of 20000 took 78 ms (50 ms)
# email: 11 took 0.87 s (0.2 s); uri as costly; hostname about a third; date-time, uuid, ... next to nothing.
FORMATS = {"email": 80.0, "idn-email": 80.0, "uri": 80.0, "uri-reference": 80.0, "iri-reference": 80.0}
FORMATS |= {"hostname": 35.0, "idn-hostname": 35.0, "ipv6": 10.0}
OTHER_FORMAT = 1.0
# A pattern, plus PATTERN_STATE per state regex_cost.py estimates: [a-z]{40} took 0.22 s, [a-z]{128} 0.7 s (0.12 s),
# (\w+ ){1,20} 0.68 s.
PATTERN = 2.0
PATTERN_STATE = 6.0
REGEX = 1.5  # a regex structured output, against the same pattern in a schema
# An EBNF grammar (ebnf_cost.py): GRAMMAR, plus GRAMMAR_STATE per state of its rules, as a pattern's: a copy of
# [a-z]{128} took 5.4 ms as a grammar's rule, 5.5 ms in a pattern.
GRAMMAR = 2.0
GRAMMAR_STATE = PATTERN_STATE

_BOUNDS = frozenset(
    ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "minItems", "maxItems")
)
_SUBSCHEMA = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames")
_SUBSCHEMA_LISTS = ("prefixItems", "items", "anyOf", "oneOf", "allOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class CompileCostError(ValueError):
    """A structured output past the admission bound: refused before it compiles."""


def check_json_schema(text: str, strict: bool) -> None:
    """Refuse (CompileCostError) a JSON schema, as JSON text, past the bound; text that is not JSON is left to
    xgrammar, which says why."""
    tally = _Tally()
    tally.add(BASE, "the JSON rules")
    tally.walk_root(_loads(text), "#", strict)
    tally.check("the json schema")


def check_structural_tag(text: str) -> None:
    """The JSON schemas in a structural tag (forced tool calls) together; xgrammar compiles them strictly, into one
    grammar that shares the JSON rules (40 tools of 4 properties compiled in 17 ms at 49k tokens)."""
    tally = _Tally()
    tally.add(BASE, "the JSON rules")
    for index, schema in enumerate(_tag_schemas(_loads(text))):
        tally.walk_root(schema, f"parameters {index + 1}#", strict=True)
    tally.check("the tools' parameters")


def check_regex(pattern: str) -> None:
    """A regex structured output: its variable repetitions measured about 1.5x a pattern's inside a JSON string
    ([a-z]{1,128}: 250 ms against 156 ms at 49k tokens), where xgrammar knows what may follow."""
    tally = _Tally()
    tally.add(REGEX * regex_cost(pattern), "the regex")
    tally.check("the regex")


def check_grammar(text: str) -> None:
    """An EBNF grammar: its rules' states, each rule counted once however often it is referenced."""
    rules = _grammar_rules(text)
    costs = {name: GRAMMAR_STATE * rule.states for name, rule in rules.items()}
    tally = _Tally()
    tally.add(GRAMMAR, "the grammar's base")
    if costs and max(costs.values()) * 2 >= sum(costs.values()):
        for name, cost in costs.items():
            costliest = rules[name].costliest
            tally.add(cost, f"the rule {name}" + (f", at {costliest}" if costliest else ""))
    else:  # spread over many rules: none of them is the one to name
        tally.add(sum(costs.values()), f"its {len(costs)} rules together (none holds half of it)")
    tally.check("the grammar")


def grammar_cost(text: str) -> float:
    """The estimate, in units, of an EBNF grammar; raises CompileCostError past a limit other than the budget."""
    return GRAMMAR + GRAMMAR_STATE * sum(rule.states for rule in _grammar_rules(text).values())


def _grammar_rules(text: str) -> dict[str, RuleCost]:
    try:
        return grammar_states(text)
    except GrammarCostError as exc:
        raise CompileCostError(f"the grammar: {exc}") from None


def json_schema_cost(schema: Any, strict: bool) -> float:
    """The estimate, in units, of a parsed schema; raises CompileCostError past a limit other than the budget."""
    tally = _Tally()
    tally.add(BASE, "the JSON rules")
    tally.walk_root(schema, "#", strict)
    return tally.total


def regex_cost(pattern: str, where: str = "the regex") -> float:
    """The estimate, in units, of a regex's own rules; raises CompileCostError past its nesting limit."""
    try:
        return PATTERN + PATTERN_STATE * regex_states(pattern)
    except RegexCostError as exc:
        raise CompileCostError(f"{where}: {exc}") from None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
    except RecursionError:
        raise CompileCostError("it is nested too deeply") from None


def _tag_schemas(tag: Any) -> Iterator[Any]:
    if isinstance(tag, dict):
        if tag.get("type") == "json_schema" and "json_schema" in tag:
            yield tag["json_schema"]
            return
        for value in tag.values():
            yield from _tag_schemas(value)
    elif isinstance(tag, list):
        for value in tag:
            yield from _tag_schemas(value)


def _pointer(base: str, *keys: object) -> str:
    """RFC 6901's JSON pointer, cut short past 200 characters (it only names a place in a message)."""
    pointer = base + "".join("/" + str(key).replace("~", "~0").replace("/", "~1") for key in keys)
    return pointer if len(pointer) <= 200 else pointer[:199] + "…"


class _Tally:
    """The estimate so far, and the parts it came from (to name the costliest)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.parts: dict[str, float] = {}

    def add(self, cost: float, part: str) -> None:
        self.total += cost
        self.parts[part] = self.parts.get(part, 0.0) + cost

    def check(self, what: str) -> None:
        if self.total <= COST_BUDGET:
            return
        part, cost = max(self.parts.items(), key=lambda item: item[1])
        raise CompileCostError(
            f"{what} would take too long to compile: its estimated cost is {self.total:.0f} units (about a "
            f"millisecond each at a 152k-token vocabulary), at most {COST_BUDGET:.0f} are compiled; the costliest "
            f"part is {part} ({cost:.0f})"
        )

    def walk_root(self, schema: Any, pointer: str, strict: bool) -> None:
        """One schema's own rules; the JSON rules (BASE) its grammar shares with any others are the caller's."""
        self._walk(schema, pointer, 0, strict)

    def _walk(self, schema: Any, pointer: str, depth: int, strict: bool) -> None:
        if not isinstance(schema, dict):
            return  # true, false, or not a schema: xgrammar's to judge
        if depth > MAX_DEPTH:
            raise CompileCostError(f"{pointer}: subschemas nested {depth} deep, at most {MAX_DEPTH} are compiled")
        self.add(NODE * (1 + (depth / 8) ** 2), "the subschemas' structure")
        self._object(schema, pointer, strict)
        self._scalars(schema, pointer)
        for key, child in _children(schema):
            self._walk(child, _pointer(pointer, *key), depth + 1, strict)

    def _object(self, schema: dict[str, Any], pointer: str, strict: bool) -> None:
        properties = schema.get("properties")
        names = list(properties) if isinstance(properties, dict) else []
        if not names:
            return  # a map (additionalProperties alone) is free text's shared rules
        required = schema.get("required")
        required = set(required) if isinstance(required, list) and all(isinstance(r, str) for r in required) else set()
        optional = [name not in required for name in names]
        if sum(optional) > MAX_OPTIONAL_PROPERTIES:
            raise CompileCostError(
                f"properties of {pointer}: {sum(optional)} optional properties, at most {MAX_OPTIONAL_PROPERTIES} "
                "are compiled (list more of them in required)"
            )
        self.add(PROPERTY * len(names) + OPTIONAL_RUN * _sum_of_squared_runs(optional), f"properties of {pointer}")
        extra = schema.get("additionalProperties")
        if extra is True or isinstance(extra, dict) or (extra is None and not strict):
            self.add(
                NAME_PREFIX * _num_prefixes(names),
                f"the property names of {pointer}, which it must tell from the unlisted properties it allows "
                "(strict false or additionalProperties; additionalProperties false avoids this)",
            )

    def _scalars(self, schema: dict[str, Any], pointer: str) -> None:
        fmt = schema.get("format")
        if isinstance(fmt, str):
            self.add(FORMATS.get(fmt, OTHER_FORMAT), f"the format {fmt} of {pointer}")
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            where = f"the pattern of {pointer}"
            self.add(regex_cost(pattern, where), where)
        if any(key in schema for key in _BOUNDS):
            self.add(BOUNDS, "the subschemas' structure")
        for key in ("enum", "const"):
            if key in schema:
                self.add(LITERAL_CHAR * len(json.dumps(schema[key])), f"the {key} of {pointer}")


def _num_prefixes(names: list[str]) -> int:
    """How many distinct prefixes (the empty one and the names themselves included) `names` have: the nodes of
    their trie, counted in linear time (each name adds what it does not share with its predecessor in order)."""
    count, previous = 1, ""
    for name in sorted(set(names)):
        shared = next((i for i, (a, b) in enumerate(zip(name, previous, strict=False)) if a != b), None)
        count += len(name) - (min(len(name), len(previous)) if shared is None else shared)
        previous = name
    return count


def _sum_of_squared_runs(optional: list[bool]) -> int:
    """The sum of run² over the runs of consecutive optional properties: each is a chain of rules in which any of
    the rest may come next."""
    total = run = 0
    for is_optional in optional:
        run = run + 1 if is_optional else 0
        total += 2 * run - 1 if is_optional else 0  # (run)² - (run - 1)²
    return total


def _children(schema: dict[str, Any]) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    for key in _SUBSCHEMA:
        if isinstance(schema.get(key), dict):
            yield (key,), schema[key]
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for index, child in enumerate(schema[key]):
                yield (key, index), child
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, child in schema[key].items():
                yield (key, name), child
