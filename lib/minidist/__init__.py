"""minidist: the small distributed-training library that Scaling Lab's labs rebuild.

One module per idea:
    launch  start N ranks from a notebook cell, a script, torchrun or Slurm
    comm    collectives built only from point-to-point send/recv, and byte counting
    cost    the alpha-beta model of communication time and bus-bandwidth factors
    bandwidth  an nccl-tests-style bandwidth benchmark and its plot
"""

__version__ = "0.1.0"
