"""Child processes (tensor-parallel ranks, data-parallel replicas) that leave when their parent goes."""

from __future__ import annotations

import os
import threading
import time


def exit_with_parent(parent_pid: int, name: str) -> None:
    """If the parent process goes away without a word (killed), exit too (status 3): no orphans."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name=name, daemon=True).start()
