"""What the labs draw: timelines, collectives, nodes and links, widgets.

The modules, in import order, and the lab that builds each: README.md beside this file."""
