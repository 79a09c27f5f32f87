"""A learnable task with a known optimum, generated in code: reverse a string of digits.

    task = Reversal(digits=8)
    ids, targets = task.problems(64, torch.Generator().manual_seed(0))   # [64, 16] each
    print(task.show(ids[:2]))                    # 31415926=62951413
    task.optimum()                               # the lowest mean loss any model can reach
    task.exact_match(logits, targets)            # the fraction of answers entirely right

A problem is `digits` random digits, "=", then the same digits reversed: 17 tokens for 8
digits. A language model reads the 16 tokens before the last and predicts the 16 after the
first (`ids`, `targets`), and the loss is the mean over all 16 predictions, prompt included.

Its optimum is known. The first digit is never predicted; the next `digits - 1` are uniform
and independent of what came before, so no model predicts them better than the uniform
distribution, at ln 10 nats each; "=" and every digit of the answer follow from the prompt,
at 0 nats for a model that has learned the task. A loss curve can be drawn against it, and the
answer can be read: `show` prints problems as a person checks them.

Held-out problems are drawn from another seed: among 10^8 prompts, a few thousand training
batches rarely contain one of them, and `exact_match` on them measures the rule, not memory.

`ProblemStream` is the job's data: a torch.Generator of its own, so that its position is a
state to checkpoint (`state_dict`, `load_state_dict`), as a sampler's is (Lab 09).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from minidist.core._checks import positive_int

__all__ = ["Reversal", "ProblemStream"]

EQUALS = 10
"""The token between the prompt and the answer; 0..9 are the digits."""


class Reversal:
    """Reverse `digits` random digits (see the module doc)."""

    def __init__(self, digits: int = 8):
        positive_int(digits=digits)
        if digits < 2:
            raise ValueError(f"digits={digits}: reversing one digit is copying it; use digits >= 2")
        self.digits = digits
        self.vocab = 11  # ten digits and "="
        self.seq_len = 2 * digits  # tokens the model reads (and predicts) per problem

    @property
    def answer(self) -> slice:
        """Where the answer's predictions are in `targets`: its last `digits` positions."""
        return slice(self.digits, 2 * self.digits)

    def problems(self, count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """`count` problems as (ids, targets), each [count, 2·digits] of int64: targets are
        ids shifted by one token."""
        positive_int(count=count)
        prompt = torch.randint(0, 10, (count, self.digits), generator=generator)
        equals = torch.full((count, 1), EQUALS)
        whole = torch.cat([prompt, equals, prompt.flip(1)], dim=1)
        return whole[:, :-1].contiguous(), whole[:, 1:].contiguous()

    def held_out(self, count: int = 1000, seed: int = 12345) -> tuple[torch.Tensor, torch.Tensor]:
        """A fixed set of problems for measuring accuracy, from a seed no training run uses."""
        return self.problems(count, torch.Generator().manual_seed(seed))

    def optimum(self) -> float:
        """The lowest mean loss (nats per prediction) any model can reach: digits - 1 uniform
        prompt digits at ln 10 each, every other prediction at 0."""
        return (self.digits - 1) * math.log(10) / self.seq_len

    def exact_match(self, logits: torch.Tensor, targets: torch.Tensor) -> float:
        """The fraction of problems whose whole answer is the argmax of `logits`
        [batch, 2·digits, vocab]. Teacher forcing gives the same answers as greedy decoding
        here: every answer token is right exactly when all the ones before it are."""
        guess = logits[:, self.answer].argmax(-1)
        return (guess == targets[:, self.answer]).all(dim=1).float().mean().item()

    def show(self, ids: torch.Tensor, logits: torch.Tensor | None = None) -> str:
        """Problems as text, one a line: `31415926=62951413`, or with the model's answer and a
        mark, `31415926=62951413 ✓` / `31415926=62951431 ✗ (62951413)`."""
        lines = []
        for k, row in enumerate(ids):
            prompt = "".join(str(int(t)) for t in row[:self.digits])
            truth = prompt[::-1]
            if logits is None:
                lines.append(f"{prompt}={truth}")
                continue
            guess = "".join(str(int(t)) for t in logits[k, self.answer].argmax(-1))
            mark = "✓" if guess == truth else f"✗ ({truth})"
            lines.append(f"{prompt}={guess} {mark}")
        return "\n".join(lines)


class ProblemStream:
    """The training problems, batch after batch, from a generator of its own; its state is
    what a checkpoint saves so that a resumed job draws the same batches."""

    def __init__(self, task: Reversal, seed: int = 0):
        self.task = task
        self.generator = torch.Generator().manual_seed(seed)
        self.batches = 0

    def next_batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.batches += 1
        return self.task.problems(size, self.generator)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.batches = state["batches"]
