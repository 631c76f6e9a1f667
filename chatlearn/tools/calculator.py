"""A calculator tool: arithmetic over a whitelist of AST nodes, bounded so no expression can hang or blow up.

Allowed: int and float literals, + - * / // % **, unary + and -, parentheses. Anything else (names, calls,
attributes, strings, comparisons, ...) is refused. Bounds: the expression's length, an exponent's size, and
every intermediate result's magnitude (checked before a power is computed, so ``9**9**9`` is refused at once).
Errors come back as observation text starting with ``Error:``; nothing raises.
"""

import ast
import math
import operator

MAX_LENGTH = 500
MAX_EXPONENT = 1000
MAX_MAGNITUDE = 10**100

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    pass


def _check(value: int | float) -> int | float:
    if isinstance(value, complex):
        raise CalculatorError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"a result is larger than {MAX_MAGNITUDE:.0e}")
    return value


def _power(base: int | float, exp: int | float) -> int | float:
    if abs(exp) > MAX_EXPONENT:
        raise CalculatorError(f"the exponent {exp} is larger than {MAX_EXPONENT}")
    if abs(base) > 1 and exp > 0 and exp * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise CalculatorError(f"a result is larger than {MAX_MAGNITUDE:.0e}")
    if base == 0 and exp < 0:
        raise CalculatorError("division by zero")
    return base**exp


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check(_power(left, right))
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise CalculatorError("division by zero")
        return _check(BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return _check(UNARY[type(node.op)](_eval(node.operand)))
    what = type(node).__name__
    if isinstance(node, ast.Constant):
        what = f"the literal {node.value!r}"
    elif isinstance(node, ast.BinOp | ast.UnaryOp):
        what = f"the operator {type(node.op).__name__}"
    raise CalculatorError(f"{what} is not allowed (only numbers, + - * / // % **, and parentheses)")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; raises CalculatorError for anything refused."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"the expression is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise CalculatorError(f"not a valid expression ({e.msg if isinstance(e, SyntaxError) else e})") from e
    return _eval(tree)


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


def calculate(expression: str) -> str:
    """The observation text: the value, or ``Error: ...`` saying what was wrong."""
    try:
        return format_number(evaluate(expression))
    except CalculatorError as e:
        return f"Error: {e}"
    except (OverflowError, RecursionError, MemoryError) as e:
        return f"Error: the expression could not be computed ({type(e).__name__})"
