"""A check for GrammarChecker's workers that crashes or hangs on cue (a module of its own:
the spawned workers import it, and it must import nothing heavy)."""

import os
import time


def crash_on_boom(grammar: str) -> str | None:
    if grammar == "boom":
        os._exit(11)  # as a segfault would: no exception, the worker is simply gone
    if grammar == "hang":
        time.sleep(60)
    return None if grammar.startswith("start") else "bad"
