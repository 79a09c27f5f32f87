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
    sharding  element-level shards of flat tensors; reduce-scatter and all-gather for them
    zero    ZeRO-1/2: an optimizer wrapper that updates 1/N of every parameter per rank
    fsdp    ZeRO-3: parameters sharded per unit, gathered on demand, with prefetch
    tensor_parallel  Megatron's f/g, column/row-parallel layers, sequence parallel
    pipeline  pipeline schedules as data (GPipe, 1F1B, interleaved, ZB-H1), validator, simulator
    pipeline_exec  run a schedule on real ranks with send/recv, timestamps and deadlock reports
    gantt   timelines of simulated or measured schedules
    models  the plain MLP, transformer block and tiny GPT every parallel version is checked on
    diagrams  pictures of the collectives and of tensor-parallel splits
"""

__version__ = "0.1.0"
