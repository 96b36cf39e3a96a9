"""Tools for the agent loop tests: one that works, and the ways a new user's tool goes wrong."""

import time


def echo(text):
    return text


class Unprintable:
    def __str__(self):
        raise RuntimeError("this object cannot be shown")


def raises(text):
    raise ValueError(f"no echo for {text!r} today")


def hangs(text):
    time.sleep(3600)


def floods(text):
    print("x" * 10_000_000)  # 10 MB on stdout, returns None: the printed output is the result


def hogs(text):
    return len(bytearray(4 * 2**30))  # 4 GiB, far past the test's memory limit


def garbage(text):
    return Unprintable()


TOOLS = {"echo": echo}
RAISES = {"echo": raises}
HANGS = {"echo": hangs}
FLOODS = {"echo": floods}
HOGS = {"echo": hogs}
GARBAGE = {"echo": garbage}
OTHER_NAME = {"shout": echo}
NOT_TOOLS = {"echo": "a string, not a function"}


def answered_with_both(sample):
    """1.0 when the final answer holds both echoed letters and both tool calls succeeded."""
    calls = sample["tool_calls"]
    return float(sample["response"].strip() == "AB" and len(calls) == 2 and all(c["error"] is None for c in calls))
