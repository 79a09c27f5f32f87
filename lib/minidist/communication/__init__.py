"""Collectives from point-to-point sends, the one layer every collective goes through, links.

The modules, in import order, and the lab that builds each: README.md beside this file."""
