"""A check for GrammarChecker's workers that crashes or hangs on cue, and the rule chain
that overflows llguidance's stack (a module of its own: spawned workers and child processes
import it, and it must import nothing heavy)."""

import os
import time


def crash_on_boom(grammar: str) -> str | None:
    if grammar == "boom":
        os._exit(11)  # as a segfault would: no exception, the worker is simply gone
    if grammar == "hang":
        time.sleep(60)
    return None if grammar.startswith("start") else "bad"


def chained_rules(n: int) -> str:
    """The fuzzer's grammar: without limits, llguidance recurses once per rule and a few
    thousand overflow an 8 MiB stack (SIGSEGV)."""
    return "\n".join(["start: r0", *(f'r{i}: "a" r{i + 1} | "b"' for i in range(n)),
                      f'r{n}: "c"'])
