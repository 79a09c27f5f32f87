"""Fakes of Lab 06's exercises: formulas that ignore a parameter the first example cannot see,
and 1F1B schedules that lean on the library or forget that m may be small. impl-bubble-formulas
has two solution regions (one per function) that each get the same fake source, so its fakes
pick their formula by the function they run in."""

from fakes import Fake

FAKES = {
    "impl-bubble-formulas": [
        Fake("the naive bubble", "bubble_of_total ignores m: (p-1)/p, right for one microbatch",
             ("test-bubble-formulas",), """\
    import sys
    if sys._getframe().f_code.co_name == "bubble_of_total":
        return (p - 1) / p
    return (p - 1) / m"""),
        Fake("four stages", "bubble_relative_to_ideal ignores p: 3/m, right for p = 4",
             ("test-bubble-formulas",), """\
    import sys
    if sys._getframe().f_code.co_name == "bubble_of_total":
        return (p - 1) / (m + p - 1)
    return 3 / m"""),
    ],
    "impl-1f1b": [
        Fake("the library's 1F1B", "takes each rank's actions from pipeline.schedule('1f1b')",
             ("test-1f1b", "test-1f1b-on-ranks"), """\
        actions = pipeline.schedule("1f1b", p, m).compute(rank)"""),
        Fake("a warm-up of p-1-rank", "ignores m in the warm-up: wrong when m < p - 1 - rank",
             ("test-1f1b",), """\
        warmup = p - 1 - rank
        actions = [Action("F", rank, j) for j in range(warmup)]
        for j in range(m - warmup):
            actions += [Action("F", rank, warmup + j), Action("B", rank, j)]
        actions += [Action("B", rank, j) for j in range(m - warmup, m)]"""),
    ],
    "impl-interleaved-bubble": [
        Fake("1F1B's bubble", "ignores v: right for one chunk per rank",
             ("test-interleaved-bubble",), """\
    return (p - 1) / (m + p - 1)"""),
        Fake("1F1B's bubble over v", "divides the share of total time by v instead of the "
             "bubble's time", ("test-interleaved-bubble",), """\
    return (p - 1) / (m + p - 1) / v"""),
    ],
    "impl-zb-idle": [
        Fake("p - 1 forwards", "ignores T_B and T_W: (p-1)·T_F, right when all are 1",
             ("test-zb-idle",), """\
    return (p - 1) * t_f"""),
        Fake("a third of 1F1B's", "(p-1)(T_F+T_B+T_W)/3: right only when the three are equal",
             ("test-zb-idle",), """\
    return (p - 1) * (t_f + t_b + t_w) / 3"""),
    ],
}
