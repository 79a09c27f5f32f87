"""minidist: the small distributed-training library that Scaling Lab's labs rebuild.

One module per idea:
    launch  start N ranks from a notebook cell, a script, torchrun or Slurm
    comm    collectives built only from point-to-point send/recv, and byte counting
    cost    the alpha-beta model of communication time and bus-bandwidth factors
    bandwidth  an nccl-tests-style bandwidth benchmark and its plot
    memory  the arithmetic: model state, activations, pipeline bubbles, traffic, MFU
    footprint  measure the bytes PyTorch holds (model state, tensors saved for backward)
    planner  pick a (TP, PP, DP, ZeRO, microbatches, recompute) layout for a cluster
    calculators  lab 02's live memory calculator and pipeline-bubble explorer
    ddp     data parallel training: bucketed gradient all-reduces that overlap backward
"""

__version__ = "0.1.0"
