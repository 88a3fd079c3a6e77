"""Threads for the heavy work that must not compete with a worker's step thread or its event loop.

Contract: `background_executor(threads, name)` is a `ThreadPoolExecutor` whose threads run at the lowest CPU
priority (nice 19; on Linux a thread's own, and the threads it starts — xgrammar's compile workers, Pillow's,
torch's — inherit it), so the step thread and the event loop get a core whenever they want one. What runs there
(Pillow decoding and resizing, numpy, the vision encoder in torch, xgrammar's compiler) releases the GIL for its
long parts. Where the priority cannot be lowered (another OS) the threads run at normal priority, logged once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading

logger = logging.getLogger(__name__)

LOWEST_PRIORITY = 19
_warned = threading.Event()


def lower_priority() -> None:
    """This thread (and the threads it starts from now on) at the lowest CPU priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
    except (AttributeError, OSError) as exc:
        if not _warned.is_set():
            _warned.set()
            logger.warning("background threads run at normal CPU priority: %s", exc)


def background_executor(threads: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=lower_priority)
