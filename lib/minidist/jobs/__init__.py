"""Whole training jobs: sharded checkpoints, a resumable run, merged profiles.

The modules, in import order, and the lab that builds each: README.md beside this file."""
