"""minidist: the small distributed-training library that Scaling Lab's labs rebuild.

One module per idea, each importing only modules listed before it:

Arithmetic (no torch needed)
    cost      the alpha-beta model of communication time, bus-bandwidth factors, and the cost
              of each all-reduce algorithm (Thakur, Rabenseifner & Gropp 2005)
    memory    bytes per rank: model state under ZeRO, activations (Korthikanti)
    tiers     where model state lives with offload (device, host, NVMe), the bytes that
              cross PCIe and the disk per step, the offloaded step's time (ZeRO-Offload §4)
    fsdp1     FSDP1's options in FSDP2's terms; parameters held per ShardingStrategy
    traffic   what each parallelism sends: formulas, and count_traffic, the one counter of
              what a rank really sends (every collective's record, every message's bytes)
    flops     FLOPs per token, MFU and HFU, scaling efficiency
    timeline  Event, the one record of something a rank did, on the one clock; the one
              timeline chart
    pipeline  pipeline schedules as data (GPipe, 1F1B, interleaved, ZB-H1), validator,
              simulator, and the bubble and in-flight formulas
    gantt     the pipeline's timelines drawn
    planner   pick a (TP, PP, DP, ZeRO, microbatches, recompute) layout for a cluster
    widgets   lab 02's live memory calculator and bubble explorer

Ranks and communication
    launch      start N ranks from a notebook cell, a script, torchrun or Slurm
    flat        tensors as one flat buffer and back
    comm        collectives from point-to-point send/recv, as Lab 01 writes them: the ring,
                recursive doubling, the tree, Rabenseifner; Ring, the one place for neighbours
    timing      the one timing loop: implementations in turns, the slowest rank's time
    streaming   comm's algorithms made fast (segments that stream), fit_links and "auto"
    network     nodes and links: an EMULATED two-tier network (ranks per node, fast links
                inside, slow between, a degraded node) delaying every send, its alpha-beta
                model, hierarchical all-reduce, a pairwise link sweep; a Mesh declares it
    collectives the one layer every collective goes through: recorded for count_traffic, run
                by torch or by minidist (`impl`), `group=None` meaning every rank
    mesh        named dimensions over the ranks, one process group each: the one topology
    bandwidth   an nccl-tests-style bandwidth benchmark and its plot
    diagrams    pictures of the collectives and of tensor-parallel splits

Parallelism
    models      the plain MLP, transformer block and tiny GPT every parallel version is
                checked on
    footprint   measure the bytes PyTorch holds (model state, tensors saved for backward)
    offload     optimizer state on the host or NVMe: counted host<->device copies, an
                emulated device-memory budget, real-I/O NVMe files (ZeRO-Offload, -Infinity)
    param_server  parameter servers from send/recv: synchronous, asynchronous, sharded
    compression   top-k and PowerSGD with error feedback, 8-bit quantization, for DDP
    ddp         data parallel: bucketed gradient all-reduces that overlap backward
    zero        ZeRO-1/2: an optimizer wrapper that updates 1/N of every parameter per rank
    fsdp        ZeRO-3: parameters sharded per unit, gathered on demand, with prefetch
    tensor_parallel  Megatron's f/g, column/row-parallel layers, sequence parallel, async TP
    clipping    gradient clipping by the global norm, sharded or tensor/pipeline parallel
    pipeline_exec    run a schedule on real ranks: shapes, the interpreter, deadlock reports
    pipeline_harness a pipeline from a notebook, against one process and PyTorch's pipelining
    moe         mixture of experts: top-k router, expert parallelism by all-to-all
    context_parallel  attention over a sequence split across cp ranks: ring attention
                (online-softmax merge, transfers overlapping compute), the zigzag layout,
                DeepSpeed-Ulysses' all-to-alls
    parallelize TinyGPT on a dp·pp·(cp·)tp mesh: the course's TP, pipeline, DDP/ZeRO and
                context parallelism composed

Fault tolerance and measuring
    checkpoint  sharded checkpoints: atomic per-rank files, a COMPLETE marker, resharding
    train       a resumable TinyGPT training job (python -m minidist.train)
    profiling   torch.profiler on every rank, merged: compute, communication, idle, overlap

The labs' own plumbing
    predictions  commit a prediction before its measurement; the grader reads it as first
                 committed

Private plumbing: _checks (the input checks every module shares), _supervisor (the rank
processes behind launch.run), _calls (each rank's latest collective or point-to-point call,
recorded for launch.run's reports), _diagnose (mismatches, wait-for cycles and native
messages, read from those calls and stacks).
"""

__version__ = "0.1.0"
