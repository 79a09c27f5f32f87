"""One module per parallelism, and the models each is checked on.

The modules, in import order, and the lab that builds each: README.md beside this file."""
