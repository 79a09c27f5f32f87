"""Fakes of Lab 00's exercises: the right values without the communication they teach."""

from fakes import Fake

FAKES = {
    "impl-pass-token": [
        Fake("the token's value from its formula", "sends and receives nothing",
             ("test-pass-token",), """\
    token += world_size * (world_size + 1) // 2 if rank == 0 else (rank + 1) * (rank + 2) // 2"""),
        Fake("an all-reduce of every rank's share", "no token travels the ring: a collective",
             ("test-pass-token",), """\
    shares = torch.zeros(world_size)
    shares[rank] = rank + 1
    dist.all_reduce(shares)
    token += shares.sum() if rank == 0 else shares[:rank + 1].sum()"""),
    ],
    "impl-all-reduce": [
        Fake("the sum from its formula", "no all-reduce: nothing is sent",
             ("test-all-reduce",), """\
    values = world_size * (world_size + 1) / 2 * torch.arange(1, length + 1, dtype=torch.float32)
    return values"""),
        Fake("an all-gather, summed locally", "all-gathers every tensor instead of all-reducing",
             ("test-all-reduce",), """\
    mine = (rank + 1) * torch.arange(1, length + 1, dtype=torch.float32)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    return torch.stack(everyone).sum(dim=0)"""),
    ],
}
