"""minidist: the small distributed-training library that Scaling Lab's labs rebuild.

One module per idea, in folders by part of the course, lowest first; a module imports only from
folders below its own (README.md beside this file draws them and says which lab builds what):

    core           starting ranks (launch) and their reports, the labs' checks, the one clock
    costs          every formula a lab predicts with: alpha-beta, bytes, FLOPs, bubbles, traffic
    communication  collectives from sends, the one collective layer, counting, the network
    parallel       DDP, ZeRO, FSDP, tensor, pipeline, context and expert parallelism
    jobs           sharded checkpoints, a resumable training job, merged profiles
    pictures       what the labs draw

    from minidist.core.launch import run
    from minidist.communication import collectives
"""

__version__ = "0.1.0"
