"""Parsing what a model wrote: whatever the text, the rewards get an answer, never an exception
(tests/test_reward_properties.py feeds them thousands of hostile completions).

Python's parser and ``literal_eval`` fail in more ways than ``SyntaxError`` on hostile text: nesting past the
recursion limit raises ``RecursionError`` (~3000 chained ``-``), the parser's own stack ``MemoryError`` (~3000
``lambda:``), a null byte ``ValueError``, and a huge literal ``OverflowError`` further on.
"""

from __future__ import annotations

import ast

UNPARSABLE = (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError)


def parse_python(code: str, mode: str = "exec") -> ast.AST | None:
    """``ast.parse(code, mode=mode)``, or None when the text is not Python this parser can hold."""
    try:
        return ast.parse(code, mode=mode)
    except UNPARSABLE:
        return None


def compile_error(code: str, name: str = "<completion>") -> BaseException | None:
    """The error ``compile`` raises for ``code`` (None when it compiles)."""
    try:
        compile(code, name, "exec")
    except UNPARSABLE as exc:
        return exc
    return None
