"""Starting ranks and their reports, the checks the labs run, the one clock and event type.

The modules, in import order, and the lab that builds each: README.md beside this file."""
