"""The admission bound on an EBNF grammar's compile (engine/ebnf_cost.py, through schema_cost.py): what it refuses,
what its message names, and that grammars people send pass. Pure: no xgrammar (benchmarks/grammar_compile.py
measures the compiles these numbers stand for)."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from tidal.worker.engine import schema_cost
from tidal.worker.engine.regex_cost import MAX_GROUP_DEPTH, MAX_NESTED_REPEAT
from tidal.worker.engine.schema_cost import COST_BUDGET, CompileCostError
from tidal.worker.engine.structured_output import StructuredOutput
from tidal.worker.testing.sample_grammars import ARITHMETIC_GRAMMAR as ARITHMETIC
from tidal.worker.testing.sample_grammars import JSON_GRAMMAR
from tidal.worker.testing.sample_grammars import TAGS_GRAMMAR as TAGS

CHOICES = "root ::= " + " | ".join(f'"{city}"' for city in ("yes", "no", "maybe", "Amsterdam", "São Paulo", 'a\\"b'))
DATE_AND_CODE = 'root ::= [0-9]{4} "-" [0-9]{2} "-" [0-9]{2} " " [A-Z]{2} "-" [0-9]{1,16}'

ORDINARY = [JSON_GRAMMAR, ARITHMETIC, CHOICES, TAGS, DATE_AND_CODE]

# (grammar, what the refusal names). At 152k tokens [a-z]{4000} took 0.7 s, [^"]{1,4000} many seconds; the nested
# repetitions compile in 70 ms but then take 0.2-1.2 s for each token's mask.
COSTLY = [
    ("root ::= [a-z]{4000}", "the costliest part is the rule root, at [a-z]{4000}"),
    ("root ::= ([a-z]{1,10}){1,100}", "the repetition ([a-z]{1,10}){1,100} of a repetition of variable length makes "
     "1000 nested copies, at most 16 are allowed"),
    # Through a referenced rule: one terminal is inlined per copy; a variable one nests.
    ('root ::= "<" w{1,4000} ">"\nw ::= [^"]', "the costliest part is the rule root, at w{1,4000}"),
    ('root ::= (w " "?){1,100}\nw ::= [a-z]{1,10}', "the rule root: the repetition (w \" \"?){1,100} of a repetition "
     "of variable length makes 1000 nested copies"),
]  # fmt: skip


@pytest.mark.parametrize(("grammar", "message"), COSTLY)
def test_a_costly_grammar_is_refused_before_it_compiles(grammar, message):
    """An EBNF grammar is estimated where a regex and a schema are: the spec refuses it, so nothing is queued on the
    compiler's pool (its compile could not be stopped)."""
    with pytest.raises(ValidationError, match=re.escape(message)):
        StructuredOutput(kind="grammar", text=grammar)


@pytest.mark.parametrize("grammar", ORDINARY)
def test_grammars_people_send_pass(grammar):
    assert StructuredOutput(kind="grammar", text=grammar).text == grammar
    assert schema_cost.grammar_cost(grammar) < COST_BUDGET * (0.5 if grammar != TAGS else 1)


def test_a_reference_costs_its_rule_once():
    """xgrammar compiles a rule once however often it is referenced, recursion included: the copies of a repetition
    of a rule are references to it (`w{1,100}` with `w ::= [a-z]{1,10} " "` took 73 ms, as `w` alone)."""
    cost = schema_cost.grammar_cost
    body = '[a-z]{1,10} " "'
    assert cost(f"root ::= w{{1,100}}\nw ::= {body}") == pytest.approx(cost(f"root ::= {body}"), abs=1)
    assert cost(f"root ::= w w w w w w w w\nw ::= {body}") == pytest.approx(cost(f"root ::= {body}"), abs=1)
    # One terminal, though, is inlined into the repetition, and each copy is a position of its own.
    assert cost("root ::= w{100}\nw ::= [a-z]") == pytest.approx(cost("root ::= [a-z]{100}"), abs=7)
    assert cost("root ::= w{100}\nw ::= [a-z]") > 40 * cost("root ::= w\nw ::= [a-z]")


def test_costs_add_up_over_rules_and_are_named_together_when_spread():
    rules = [f"r{i} ::= [a-z{chr(65 + i)}]{{1,16}}" for i in range(10)]
    grammar = "root ::= " + " | ".join(f"r{i}" for i in range(10)) + "\n" + "\n".join(rules)
    with pytest.raises(CompileCostError, match=r"the grammar would take too long .* its 11 rules together"):
        schema_cost.check_grammar(grammar)  # 10 of 184 units; 1.5 s measured
    schema_cost.check_grammar("root ::= r0 | r1\n" + "\n".join(rules[:2]))


def test_a_separator_keeps_copies_of_a_variable_body_apart():
    """Nested copies are refused because each token's mask follows every way to split the output into them; a
    string first or last, whose character the rest never matches, splits it in one way only."""
    schema_cost.check_grammar('root ::= ("," [0-9]{1,16}){0,100}')
    schema_cost.check_grammar('root ::= ([a-z]{1,10} " "){1,100}')
    schema_cost.check_grammar('root ::= (w ";"){1,100}\nw ::= [^;]{1,4}')
    nested = f"makes 1600 nested copies, at most {MAX_NESTED_REPEAT}"
    with pytest.raises(CompileCostError, match=nested):
        schema_cost.check_grammar('root ::= (","? [0-9]{1,16}){0,100}')  # the separator is optional
    with pytest.raises(CompileCostError, match="makes 1000 nested copies"):
        schema_cost.check_grammar('root ::= ("a" [a-z]{1,10}){1,100}')  # "a" is a letter too
    with pytest.raises(CompileCostError, match="makes 1000 nested copies"):
        schema_cost.check_grammar('root ::= (w " "){1,100}\nw ::= [a-z ]{1,10}')


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= "(" root ")" | "x"',
        'root ::= a\na ::= b "x"\nb ::= a | "y"',
        "root ::= root",
        'root ::= value\nvalue ::= "[" (value ("," value){0,8})? "]" | [0-9]{1,3}',
    ],
)
def test_recursion_is_read_once(grammar):
    assert schema_cost.grammar_cost(grammar) < 100


def test_a_long_chain_of_rules_is_read_without_recursing():
    chain = "\n".join(f'r{i} ::= r{i + 1} "x"' for i in range(5000))
    assert schema_cost.grammar_cost("root ::= r0\n" + chain + '\nr5000 ::= "end"') < 100


def test_a_nested_repetition_is_found_through_a_chain_of_rules():
    chain = "\n".join(f"r{i} ::= r{i + 1}" for i in range(200))
    with pytest.raises(CompileCostError, match=r"the rule root: the repetition r0\{1,100\} .* makes 1000 nested"):
        schema_cost.check_grammar(f"root ::= r0{{1,100}}\n{chain}\nr200 ::= [a-z]{{1,10}}")


@pytest.mark.parametrize(
    "grammar",
    [
        "",
        "root ::=",
        "root ::= (",
        'root ::= "unclosed',
        "root ::= [abc",
        "root ::= [",
        "root ::= a{",
        'root ::= "a"{,3}',
        'root ::= "a"**',
        "::= x",
        "root ::= x)",
        "root ::= 'single quotes'",
        'root ::= "\\u00e9\\x41\\U0001F600" [\\u0100-\\uFFFF]',
        "root ::= [a-z]{99999999999999999999999}",
        "root ::= [a-z]{1," + "9" * 5000 + "}",
        'root ::= TagDispatch(("<a>", x), stop_eos=true)\nx ::= "b"',
        'root ::= "a" (= "b")',
    ],
)
def test_the_grammar_reader_never_fails_on_what_xgrammar_judges(grammar):
    assert schema_cost.grammar_cost(grammar) >= 0


def test_groups_nested_past_the_limit_are_refused_not_overflowed():
    schema_cost.check_grammar("root ::= " + "(" * MAX_GROUP_DEPTH + '"a"' + ")" * MAX_GROUP_DEPTH)
    message = f"groups nested {MAX_GROUP_DEPTH + 1} deep, at most {MAX_GROUP_DEPTH}"
    with pytest.raises(ValidationError, match=re.escape(f"the grammar: the rule root: {message}")):
        StructuredOutput(kind="grammar", text="root ::= " + "(" * 3000 + '"a"' + ")" * 3000)
