"""A cell that grading stops at the per-cell time limit says so in its own output.

nbclient interrupts a cell that runs past `Execute.timeout` (nbgrader_config.py) and grading
goes on; the cell shows only the interruption (a KeyboardInterrupt, or minidist's "all ranks
were stopped"), and the cells below fail with NameErrors that do not say why. With
`announce_timeouts(Execute)` the stopped cell first gets a line saying that grading stopped it,
after how many seconds, and what to do, in its output, which the student's feedback shows.
"""

from __future__ import annotations

from typing import Any

import nbformat

__all__ = ["announce_timeouts", "timeout_message"]


def timeout_message(seconds: float) -> str:
    return (f"Grading stopped this cell after {seconds:g} s, the time limit of one cell. What "
            f"follows is the interruption, and the cells below that use what this cell would "
            f"have made fail too. Make it faster (the lab says which cells are slow and how to "
            f"keep them fast) and submit again.\n")


def announce_timeouts(execute: Any) -> None:
    """Make `execute` (nbgrader's Execute preprocessor class) add `timeout_message` to the
    output of each cell it stops at its time limit."""
    original = execute._async_handle_timeout
    if getattr(original, "announces", False):  # nbgrader loads its config more than once
        return

    async def handle_timeout(self: Any, timeout: int, cell: Any = None) -> Any:
        if cell is not None:
            cell.outputs.append(nbformat.v4.new_output(
                "stream", name="stderr", text=timeout_message(timeout)))
        return await original(self, timeout, cell)

    handle_timeout.announces = True  # type: ignore[attr-defined]
    execute._async_handle_timeout = handle_timeout
