"""A deterministic synthetic token dataset and a data loader that reshards exactly.

Samples come from a fixed random Markov chain over the vocabulary, so there is
something to learn. The loader walks one global, per-epoch shuffled order; a global
batch is the next ``global_batch`` indices and data-parallel rank r takes its slice.
The loader's whole state is therefore global (epoch, position), identical on every
rank: after a resume with any other data-parallel degree, no sample is skipped or seen
twice. unickpt checks on save that every rank agrees on it.
"""

from __future__ import annotations

import torch


class MarkovTokens:
    """``size`` sequences of ``seq + 1`` tokens, sample i a pure function of (seed, i)."""

    def __init__(self, size: int, seq: int, vocab: int, seed: int) -> None:
        self.size, self.seq, self.vocab, self.seed = size, seq, vocab, seed
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(vocab, vocab, generator=g) * 3.0
        self.transitions = torch.softmax(logits, dim=-1)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        tokens = torch.empty(self.seq + 1, dtype=torch.int64)
        tokens[0] = torch.randint(self.vocab, (1,), generator=g)
        for t in range(self.seq):
            tokens[t + 1] = torch.multinomial(self.transitions[tokens[t]], 1, generator=g)
        return tokens


class ReshardableLoader:
    """Global batches in a seeded per-epoch order; this rank's slice of each."""

    def __init__(self, data: MarkovTokens, global_batch: int, dp_rank: int, dp: int, seed: int) -> None:
        if global_batch % dp:
            raise ValueError(f"global batch {global_batch} does not divide over {dp} data-parallel ranks")
        self.data, self.global_batch, self.dp_rank, self.dp, self.seed = data, global_batch, dp_rank, dp, seed
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(len(self.data), generator=torch.Generator().manual_seed(self.seed + epoch))

    def global_indices(self) -> list[int]:
        """The indices of the next global batch; advances the loader."""
        out: list[int] = []
        while len(out) < self.global_batch:
            order = self._order(self.epoch)
            take = order[self.position : self.position + self.global_batch - len(out)].tolist()
            out += take
            self.position += len(take)
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of this rank's slice of the next global batch."""
        idx = self.global_indices()
        per = self.global_batch // self.dp
        mine = idx[self.dp_rank * per : (self.dp_rank + 1) * per]
        tokens = torch.stack([self.data[i] for i in mine])
        return tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict[str, int]:
        """The loader's position: the same on every rank, whatever the dp degree."""
        return {"epoch": self.epoch, "position": self.position, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position (any dp degree; the global batch must match)."""
        if state["global_batch"] != self.global_batch:
            raise ValueError(f"checkpoint used global batch {state['global_batch']}, this run {self.global_batch}")
        self.epoch, self.position = state["epoch"], state["position"]
