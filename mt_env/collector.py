"""`collector_paused`: Python's garbage collector off for a block of work whose objects live until its end anyway.

Why: the collector counts allocations process-wide. Work that holds many new objects at once — a vector call over
256 envs, a rollout of hundreds of episodes — runs young collections that find nothing to free and move every live
object to older generations, until a full collection traverses every object of the process, holding the interpreter
lock all along, so that an engine's worker thread cannot launch its next decode step meanwhile. Measurements:
docs/processes.md ("The garbage collector").

Nothing is left uncollected: the objects made meanwhile count towards the next collection, which the first
allocation after the block starts. A program that switches the collector from another thread during the block
finds it switched back on (when it was on before the block) at its end.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collector_paused():
    """The garbage collector off for the block, then on again if it was on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
