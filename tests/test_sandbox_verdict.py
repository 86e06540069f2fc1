"""The sandbox's verdict cannot be forged by the program (comlrl_lightning.envs.sandbox).

These attacks need no kernel layer: the tests run in a trusted evaluator and only plain data comes back from
the program, so every forging program below scores a pass ratio of 0 wherever the suite runs. Each program
answers the test wrongly (``f(1)`` should be 2) and tries one way to make the test pass anyway.
"""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

import pytest

from comlrl_lightning.envs import coding as C
from comlrl_lightning.envs.sandbox import Job, run_many, run_tests

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sandbox relies on Linux/POSIX")

FAST = {"timeout_per_test": 2.0, "timeout_total": 20.0}
TESTS = ["assert f(1) == 2", "assert f(1) == 2, 'message'", "assert not (f(1) != 2)", "assert [f(1)] == [2]"]

# Reach the sandbox's own objects by walking the stack from the program (the frame that runs it is the server's).
SERVER = """
import sys
_frame = sys._getframe()
while _frame is not None and type(_frame.f_locals.get("self")).__name__ != "Server":
    _frame = _frame.f_back
SERVER = _frame.f_locals["self"] if _frame is not None else None
"""
# ... and switch its audit hook off by setting the hook's own re-entrancy flag (the review's attack): what the
# program does after this is stopped by the kernel layers or not at all.
GUARD_OFF = SERVER + "SERVER.guard['busy'] = True\n"

FORGERS = {
    "builtins_replaced": "import builtins\nbuiltins.AssertionError = type('AssertionError', (Exception,), {})\n"
    "builtins.exec = lambda *a, **k: None\nbuiltins.compile = lambda *a, **k: None\n"
    "builtins.isinstance = lambda *a: True\nbuiltins.len = lambda *a: 0\n"
    "def f(x):\n    return 0",
    "serialiser_patched": 'import json\njson.dumps = lambda *a, **k: \'["ok", ["i", "2"], null]\'\n'
    "json.loads = lambda *a, **k: ['ok', ['i', '2'], None]\ndef f(x):\n    return 0",
    "runner_patched": SERVER + "SERVER.answer = lambda line: ['ok', ['i', '2'], None]\n"
    "type(SERVER).answer = lambda self, line: ['ok', ['i', '2'], None]\n"
    "def f(x):\n    return 0",
    "frame_to_reporter": SERVER + "SERVER.send(['ready', None, True, {}])\n"
    "for _ in range(10):\n    SERVER.send(['ok', ['i', '2'], None])\n"
    "def f(x):\n    return 0",
    "fake_lines_on_every_fd": "import os, json\n"
    "lines = [json.dumps(m) + '\\n' for m in ({'phase': 'test', 'i': i, 'error': None} "
    'for i in range(5))] + [\'["ok", ["i", "2"], null]\\n\'] * 5\n'
    "for fd in range(64):\n    for line in lines:\n        try:\n"
    "            os.write(fd, line.encode())\n        except OSError:\n            pass\n"
    "def f(x):\n    return 0",
    "always_equal": "class Yes:\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n"
    "    def __hash__(self): return 0\n    def __bool__(self): return True\n"
    "def f(x):\n    return Yes()",
    "class_claims_int": "class Two:\n    __class__ = int\n    def __eq__(self, other): return True\n"
    "def f(x):\n    return Two()",
    "str_subclass": "class S(str):\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n"
    "    __hash__ = str.__hash__\ndef f(x):\n    return S('nope')",
    "int_subclass": "class I(int):\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n"
    "    __hash__ = int.__hash__\ndef f(x):\n    return I(0)",
    "list_subclass": "class L(list):\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n"
    "def f(x):\n    return L()",
    "exit_from_call": "import sys\ndef f(x):\n    sys.exit(0)",
    "base_exception_from_call": "class Stop(BaseException):\n    pass\ndef f(x):\n    raise Stop()",
    "os_exit_from_call": "import os\ndef f(x):\n    os._exit(0)",
    "close_channel": "import os\ndef f(x):\n    os.close(4)\n    os.close(3)\n    return 0",
    "huge_int": "def f(x):\n    return 10 ** 20000",
    "deep_nesting": "def f(x):\n    v = 2\n    for _ in range(100000):\n        v = [v]\n    return v",
    "self_reference": "def f(x):\n    v = [2]\n    v.append(v)\n    return v",
}


@pytest.mark.parametrize("name", sorted(FORGERS))
def test_forging_program_scores_zero(name):
    r = run_tests(FORGERS[name], TESTS, **FAST)
    assert r.total == len(TESTS) and r.passed == 0, (name, r)


def test_honest_program_passes_the_same_tests():  # the tests above can pass
    r = run_tests("def f(x):\n    return 2 * x", TESTS, **FAST)
    assert r.passed == len(TESTS), r


def test_expected_values_are_not_in_the_sandbox():
    """The expected value is a fresh random token that only the test holds: a program reading all of its own
    memory, every other process's memory it can open (the test's own evaluator process is in the job's PID
    namespace, or shares the sandbox's uid without namespaces), every environment and command line and every
    file it can see does not find it (in the old in-process design this program found it in its own memory). The
    same program finds a token the program holds."""
    token = "tok" + secrets.token_hex(16)
    seeker = (
        GUARD_OFF
        + """
import ctypes, os, re
PATTERN = re.compile(rb"tok[0-9a-f]{32}")
def f(x):
    found = []
    for line in open("/proc/self/maps").read().splitlines():  # its own memory, page by readable page
        span, perms, *rest = line.split()
        if "r" not in perms or (rest and rest[-1].startswith("[v")):
            continue
        lo, hi = (int(v, 16) for v in span.split("-"))
        found += PATTERN.findall(ctypes.string_at(lo, min(hi - lo, 1 << 26)))
    for pid in os.listdir("/proc"):  # other processes' memory and environment, where readable
        try:
            mem = open(f"/proc/{pid}/mem", "rb")
            for line in open(f"/proc/{pid}/maps").read().splitlines():
                span, perms, *rest = line.split()
                lo, hi = (int(v, 16) for v in span.split("-"))
                if "r" in perms and pid != "self":
                    try:
                        mem.seek(lo)
                        found += PATTERN.findall(mem.read(min(hi - lo, 1 << 26)))
                    except Exception:
                        pass
        except Exception:
            pass
        for name in ("environ", "cmdline"):
            try:
                found += PATTERN.findall(open(f"/proc/{pid}/{name}", "rb").read())
            except Exception:
                pass
    found += PATTERN.findall("".join(f"{k}={v}" for k, v in os.environ.items()).encode())
    for top in ("/tmp", os.getcwd(), "/proc/1/cwd"):
        for root, _, files in os.walk(top):
            for name in files:
                try:
                    found += PATTERN.findall(open(os.path.join(root, name), "rb").read(1 << 20))
                except Exception:
                    pass
    return found[0].decode() if found else None
"""
    )
    r = run_tests(seeker, [f"assert f(0) == {token!r}"], timeout_per_test=20.0, timeout_total=40.0)
    assert r.total == 1 and r.passed == 0 and r.errors == ["AssertionError"], r
    planted = seeker + f"HIDDEN = {token[:3]!r} + {token[3:]!r}\n"
    assert run_tests(planted, [f"assert f(0) == {token!r}"], timeout_per_test=20.0, timeout_total=40.0).passed == 1


def test_builtins_are_the_evaluators_and_only_the_entry_point_may_shadow_one():
    program = "def abs(x):\n    return 0\ndef isinstance(*a):\n    return True\ndef sum(a, b):\n    return a + b"
    tests = ["assert abs(-3) == 3", "assert isinstance(1, int) and not isinstance('a', int)", "assert sum(2, 3) == 5"]
    assert run_tests(program, tests, entry_points=["sum"], **FAST).passed == 3
    assert run_tests(program, tests[2:], **FAST).errors == ["TypeError"]  # the builtin sum, not the program's


def test_setup_is_trusted_and_shadows_the_program():
    program = "import math\nmath.isclose = lambda *a, **k: True\ndef f(x):\n    return 0.5"
    r = run_tests(program, ["assert math.isclose(f(1), 2.0)"], setup="import math", **FAST)
    assert r.errors == ["AssertionError"]
    r = run_tests(program, ["assert math.isclose(f(1), 2.0)"], **FAST)  # without setup the name is the program's
    assert r.passed == 1


def test_plain_data_round_trip_keeps_types_apart():
    program = """
import datetime, decimal, fractions, collections
def f(x):
    return x
def values():
    return [1, 1.0, True, None, "1", b"1", bytearray(b"1"), (1,), [1], {1}, frozenset({1}), {1: 1}, 1j,
            float("inf"), float("-inf"), -0.0, 10 ** 40, datetime.datetime(2024, 1, 2, 3, 4, 5),
            datetime.date(2024, 1, 2), datetime.timedelta(days=1, seconds=5), decimal.Decimal("1.10"),
            fractions.Fraction(1, 3), collections.deque([1, 2], maxlen=3), range(3), {1: 2}.keys(), int, ValueError]
"""
    tests = [
        "import datetime, decimal, fractions, collections, math\n"
        "v = values()\n"
        "assert [type(x) for x in v[:13]] == [int, float, bool, type(None), str, bytes, bytearray, tuple, list, set,"
        " frozenset, dict, complex]\n"
        "assert v[13] == math.inf and v[14] == -math.inf and math.copysign(1, v[15]) == -1 and v[16] == 10 ** 40\n"
        "assert v[17:21] == [datetime.datetime(2024, 1, 2, 3, 4, 5), datetime.date(2024, 1, 2),"
        " datetime.timedelta(days=1, seconds=5), decimal.Decimal('1.10')]\n"
        "assert v[21] == fractions.Fraction(1, 3) and v[22] == collections.deque([1, 2]) and v[22].maxlen == 3\n"
        "assert v[23] == range(3) and v[24] == {1: 0}.keys() and v[25] is int and v[26] is ValueError",
        "assert math.isnan(f(float('nan'))) and f((1, [2, {3: (4,)}])) == (1, [2, {3: (4,)}])",
        "assert f(1) is not True and f(True) is True and f(1.0) == 1 and type(f(1.0)) is float",
    ]
    r = run_tests(program, tests, setup="import math", **FAST)
    assert r.passed == 3, r


def test_program_exceptions_map_to_builtin_types():
    program = (
        "class Broke(ValueError):\n    pass\ndef f(x):\n    if x < 0:\n        raise Broke('neg')\n    return {}[x]"
    )
    tests = [
        "try:\n    f(-1)\nexcept ValueError as e:\n    assert type(e).__name__ == 'Broke' and str(e) == 'neg'\n"
        "else:\n    assert False",
        "try:\n    f(1)\nexcept KeyError as e:\n    assert e.args == (1,)\nelse:\n    assert False",
        "import unittest\nwith unittest.TestCase().assertRaises(Broke):\n    f(-2)",
    ]
    assert run_tests(program, tests, **FAST).passed == 3


def test_objects_of_the_program_are_handles():
    program = """
class Acc:
    def __init__(self):
        self.items = []
        self.by_name = {"a": {"n": 1}}
    def add(self, x):
        self.items.append(x)
        return self
    def total(self):
        return sum(self.items)
    def __len__(self):
        return len(self.items)
def fill(lst, d):
    lst.append(1)
    d["k"] = 2
"""
    tests = [
        "a = Acc()\nassert a.add(2) == a and a != Acc() and len(a) == 1 and a.total() == 2",
        "a = Acc()\na.items.append(5)\na.items += [6]\na.by_name['a']['n'] = 3\n"
        "assert a.total() == 11 and a.items == [5, 6] and a.by_name == {'a': {'n': 3}}",
        "a = Acc()\na.items = [1, 2]\nassert a.total() == 3 and isinstance(a, Acc) and not isinstance(1, Acc)",
        "lst, d = [], {}\nfill(lst, d)\nassert lst == [1] and d == {'k': 2}",
        "assert Acc() != Acc() and Acc() != [] and 2 not in [Acc()]",
    ]
    assert run_tests(program, tests, **FAST).passed == 5


def test_tests_are_isolated_from_each_other():
    program = (
        "import os\nSEEN = []\ndef f(x):\n    SEEN.append(x)\n    open(f'file{x}', 'w').close()\n"
        "    return len(SEEN), sorted(os.listdir('.'))"
    )
    r = run_tests(program, ["assert f(1) == (1, ['file1'])", "assert f(2) == (1, ['file2'])"], **FAST)
    assert r.passed == 2, r


def test_wall_clock_timeouts_cost_one_test():
    program = "import time\ndef f(x):\n    if x:\n        time.sleep(30)\n    return 2"
    # a second each for the hung tests; the whole job a minute, so the middle one never runs out of time under load
    r = run_tests(program, ["f(1)", "assert f(0) == 2", "f(1)"], timeout_per_test=1.0, timeout_total=60.0)
    assert r.passed == 1 and r.errors == ["Timeout", "Timeout"] and r.timeouts == 2
    # a test that catches the timeout and goes on still ends, as a timeout
    r = run_tests(
        program,
        ["while True:\n    try:\n        f(1)\n    except BaseException:\n        pass"],
        timeout_per_test=1.0,
        timeout_total=60.0,
    )
    assert r.errors == ["Timeout"]


def test_trusted_objects_cannot_be_passed_to_the_program():
    r = run_tests("def f(g):\n    return g(1)", ["assert f(lambda x: 2) == 2"], **FAST)
    assert r.errors == ["TypeError"]


@pytest.fixture(scope="module")
def che_item():
    path = Path(__file__).resolve().parents[2] / "shared" / "data" / "coophumaneval" / "che_raw.json"
    if not path.exists():
        pytest.skip(f"CoopHumanEval data not found at {path}")
    return C.coophumaneval_tasks(str(path))[0]


def test_coophumaneval_reward_cannot_be_forged_from_a_default_argument(che_item):
    """A wrong main (prime test inverted) with every forging payload above hidden in a default argument (it
    passes the format gate) scores no more than the same wrong main without the payload (1.5 of 4.5)."""
    aux = "def aux(n):\n    return n > 1 and all(n % i for i in range(2, n))"
    wrong = "def x_or_y(n, x, y{}):\n    return y if aux(n) else x"
    payloads = [
        FORGERS[k].replace("def f(x):", "def _f(x):")
        for k in (
            "builtins_replaced",
            "serialiser_patched",
            "runner_patched",
            "frame_to_reporter",
            "fake_lines_on_every_fd",
        )
    ]
    mains = [wrong.format("")] + [wrong.format(f", _=exec({p!r}, {{}})") for p in payloads]
    reward = C.CodingReward(timeout_per_test=2.0, workers=2)
    rows = reward.breakdown([aux] * len(mains), mains, [che_item])
    assert all(b["format_ok"] for b in rows)
    assert rows[0]["total"] == pytest.approx(1.5)
    assert all(b["passed"] == 0 and b["total"] <= rows[0]["total"] for b in rows[1:]), [b["total"] for b in rows]


def test_run_many_takes_jobs_with_setup():
    jobs = [Job("def f():\n    return 2", ["assert f() == two"], setup="two = 2"), ("x = 1", ["assert x == 1"])]
    assert [r.passed for r in run_many(jobs, **FAST)] == [1, 1]
