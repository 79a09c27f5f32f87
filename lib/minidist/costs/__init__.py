"""Every formula a lab predicts with: alpha-beta, bytes, FLOPs, bubbles, traffic, the planner.

The modules, in import order, and the lab that builds each: README.md beside this file."""
