"""minidist: the small distributed-training library that Scaling Lab's labs rebuild.

One module per idea, each importing only modules listed before it:
    cost    the alpha-beta model of communication time, bus-bandwidth factors, and the
            cost of each all-reduce algorithm (Thakur, Rabenseifner & Gropp 2005)
    memory  bytes per rank: model state under ZeRO, activations (Korthikanti)
    traffic what each parallelism sends: Collective records and their totals
    flops   FLOPs per token, MFU and HFU, scaling efficiency
    pipeline  pipeline schedules as data (GPipe, 1F1B, interleaved, ZB-H1), validator,
            simulator, and the bubble and in-flight formulas
    gantt   timelines of simulated or measured schedules
    planner  pick a (TP, PP, DP, ZeRO, microbatches, recompute) layout for a cluster
    widgets  lab 02's live memory calculator and bubble explorer
    launch  start N ranks from a notebook cell, a script, torchrun or Slurm
    comm    collectives built only from point-to-point send/recv: ring, recursive doubling,
            tree and Rabenseifner all-reduces, `auto` choosing by the fitted alpha-beta
            model; count_traffic, the one counter of what any parallelism sends
    network nodes and links: an EMULATED two-tier network (ranks per node, fast links inside,
            slow between, a degraded node) that delays every send, its alpha-beta model,
            hierarchical all-reduce, a pairwise link sweep; a Mesh declares it
    bandwidth  an nccl-tests-style bandwidth benchmark and its plot
    diagrams  pictures of the collectives and of tensor-parallel splits
    models  the plain MLP, transformer block and tiny GPT every parallel version is checked on
    footprint  measure the bytes PyTorch holds (model state, tensors saved for backward)
    sharding  element-level shards of flat tensors; reduce-scatter and all-gather for them
    param_server  parameter servers from send/recv: synchronous, asynchronous (staleness
            recorded), sharded over several server ranks
    compression  gradient compression for ddp's buckets: top-k and PowerSGD with error
            feedback, 8-bit quantization, all sent through comm's send/recv
    ddp     data parallel training: bucketed gradient all-reduces that overlap backward
    zero    ZeRO-1/2: an optimizer wrapper that updates 1/N of every parameter per rank
    fsdp    ZeRO-3: parameters sharded per unit, gathered on demand, with prefetch; a root
            unit for parameters in no unit and for tied weights, as FSDP2
    tensor_parallel  Megatron's f/g, column/row-parallel layers, sequence parallel
    pipeline_exec  run a schedule on real ranks with send/recv, timestamps and deadlock reports
    mesh    dp·pp·tp ranks in Megatron's order (TP fastest), one process group per dimension;
            the same layout as PyTorch's DeviceMesh
    moe     mixture of experts: top-k router, expert parallelism by all-to-all, capacity and
            dropped tokens
    parallelize  TinyGPT on a dp·pp·tp mesh: the course's TP, pipeline and DDP/ZeRO composed;
            bytes per mesh dimension against traffic.mesh_traffic
    checkpoint  sharded checkpoints: per-rank shards, atomic writes, checksums, a COMPLETE
            marker; loading on another world size reshards; model, optimizer and RNG state
    train   a resumable TinyGPT training job (python -m minidist.train): checkpoints, exact
            resume after a crash, NaN/Inf and gradient-spike guards, collective timeouts
    profiling  torch.profiler on every rank, merged: compute, communication and idle per rank,
            overlap fraction, Gantt chart and Chrome trace; the machine's measured peak FLOP/s

Private plumbing: _checks (the input checks every module shares), _supervisor (the rank
processes behind launch.run).
"""

__version__ = "0.1.0"
