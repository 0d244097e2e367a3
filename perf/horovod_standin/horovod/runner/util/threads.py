"""What Horovod's test helpers (test/utils/common.py) import from its runner."""

import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Start ``target(*args)`` in a daemon thread and return the thread."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
