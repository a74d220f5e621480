"""EBNF grammars people send (xgrammar's dialect), shared by the grammar-cost tests and benchmarks/grammar_compile.py:
the estimate must admit them, and the benchmark times them."""

JSON_GRAMMAR = r"""
root ::= value
value ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ws (member ("," ws member)*)? "}"
member ::= string ws ":" ws value ws
array ::= "[" ws (value ws ("," ws value ws)*)? "]"
string ::= "\"" ([^"\\\x00-\x1f] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}))* "\""
number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
ws ::= [ \t\n]*  # comments are skipped
"""
ARITHMETIC_GRAMMAR = """
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")" | "-" factor
number ::= [0-9]+ ("." [0-9]+)?
"""
# Up to 16 tags of up to 16 letters: the separator keeps the copies apart (150 ms at 152k tokens).
TAGS_GRAMMAR = 'root ::= tag ("," tag){0,15}\ntag ::= [a-z]{1,16}'
