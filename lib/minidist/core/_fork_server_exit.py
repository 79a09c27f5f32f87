"""Imported only in the fork server, last in its preload list (minidist.core._supervisor).

Once the process that started it is gone, the fork server would spend seconds tearing down
torch's modules (about 5 s on a busy laptop) while looking like a leftover rank; it has no
state worth finalizing, so it exits at once. atexit runs the last registered first, so this
runs before torch's own handlers. Ranks never reach it: they leave with os._exit.
"""

import atexit
import os

atexit.register(os._exit, 0)
