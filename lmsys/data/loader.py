"""The training loader: fixed-length sequences cut from prepared token shards.

Order. A split (the concatenation of its shards, see lmsys.data.shards) of n tokens is cut into
N = ceil(n / L) samples of L = `tokens_per_sample` tokens: sample i starts at token i*L, except
that when L does not divide n the last one ends at the split's end (starts at n - L), so its
first L - (n mod L) tokens repeat the end of the sample before; they carry loss weight 0
(`Batch.weights`), and every token of the split counts exactly once per epoch. Epoch e visits
the samples in the order `permutation(N)` drawn from a generator seeded with (seed, e); the
epochs are laid end to end as one stream, and optimizer step s takes stream positions
[s*G, (s+1)*G) with G the global batch in sequences. So every sample is seen exactly once in
every N consecutive positions (full coverage per epoch, an epoch may end mid-step), and the
global batch of a step does not depend on the number of ranks.

Ranks. Rank r of W takes the contiguous slice [r*G/W, (r+1)*G/W) of each step's global batch
and cuts it into micro-batches of `micro_batch_size`, in order: no sample is shared between
ranks, and the concatenation over ranks is the 1-process batch.

Skipped steps. `skip_steps(steps)` marks stream steps never to be trained on (a step whose
data made the loss non-finite or diverge, trainer.on_nonfinite=rewind): reaching one, the
loader moves on to the next step's positions. They are part of the resume state.

Ids. Before a step's first micro-batch every rank checks that the ids of the step's whole
global batch (every rank's sequences) are below the vocabulary, and before the first evaluation
the whole validation split: data too large to check in full when opened (lmsys.data.integrity)
ends a run, on every rank at the same step, in one line naming the shard and position.

Resume. The whole state is the stream position (a step and a micro-batch index), the skipped
steps, plus the settings it is checked against (the split's digest among them: data prepared
again is refused): a restored loader yields exactly the batches an uninterrupted
one would, for any world size that divides the global batch when restored between steps, and
for the same world size and micro-batch size when restored in the middle of a step.

Validation. `val_batches(n)` always reads the held-out "val" split (a document goes to one
split only, see lmsys.prepare), the same sequences at every evaluation; `val_batches(0)` every
sequence of it once.

Loss weights (SPEC section 8) travel with each batch: the weights the data stores (a chat
split: 1 on the assistant's tokens, 0 elsewhere, padding included), else ones; and with
`mask_doc_boundaries`, a zero for the prediction of a document's first token from the previous
document's last token (its eos).

Documents. With `document_masking` each batch also carries its documents (`Batch.documents`,
(B, S) non-decreasing ids): the starts a chat split stores, else counted from the eos that ends
every document of a text split. A row's first token starts a document (the rest of a document
cut by the row's start). The model then attends and numbers positions within each document and
counts only the pairs inside one (lmsys.model.transformer). A chat split is stored in rows of its
data.seq_len (lmsys.data.shards), which the loader must be given.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmsys.core.console import command, warn
from lmsys.core.errors import DataError
from lmsys.data.integrity import first_past_vocabulary, past_vocabulary
from lmsys.data.shards import PreparedData, SplitTokens, check_row_length, prepare_again, too_short

__all__ = ["Batch", "TokenLoader"]

STATE_VERSION = 2  # 2: the split's tail is a last, partly weighted sample


@dataclass
class Batch:
    tokens: torch.Tensor  # (B, S) int64 token ids
    weights: torch.Tensor  # (B, S) float32: weights[b, s] weighs the prediction of tokens[b, s]
    documents: torch.Tensor | None = None  # (B, S) int64 document ids (document_masking), or None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch on `device`."""
        docs = self.documents
        return Batch(
            self.tokens.to(device, non_blocking=non_blocking),
            self.weights.to(device, non_blocking=non_blocking),
            None if docs is None else docs.to(device, non_blocking=non_blocking),
        )


# What each setting of a loader's saved state comes from, and how a resume gets it back.
_RESUME_HINTS = {
    "version": "resume with the lmsys version that saved it",
    "split": "resume on the split it was saved on",
    "seed": "set trainer.seed as the run had it (its config.yaml)",
    "split_sha256": "data.dir holds other tokens than the run trained on (prepared again from other "
    "sources or settings): resume on the data it was trained on",
    "num_samples": "the train split holds another number of sequences (data.dir or data.seq_len "
    "changed): set them as the run had them (its config.yaml)",
    "tokens_per_sample": "set data.seq_len as the run had it (its config.yaml)",
    "global_batch_size": "it is the sequences per step, trainer.global_batch_tokens / data.seq_len: "
    "set trainer.global_batch_tokens as the run had it (its config.yaml)",
    "tokenizer_sha256": "data.dir was prepared with another tokenizer: use the run's data.dir",
}


class TokenLoader:
    """Micro-batches of one rank for training (`next_batch`) and validation (`val_batches`)."""

    def __init__(
        self,
        data: PreparedData,
        split: str,
        *,
        tokens_per_sample: int,
        global_batch_size: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        mask_doc_boundaries: bool = False,
        document_masking: bool = False,
    ):
        if global_batch_size % (micro_batch_size * world_size):
            raise ValueError(
                f"global batch of {global_batch_size} sequences does not split into micro-batches of "
                f"{micro_batch_size} on {world_size} ranks"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.data, self.split_name = data, split
        self.tokens = data.split(split)
        self.sample_len = tokens_per_sample
        self.global_batch, self.micro_batch = global_batch_size, micro_batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.mask_doc_boundaries, self.document_masking = mask_doc_boundaries, document_masking
        check_row_length(data, tokens_per_sample)
        if data.manifest.get("packing") and not document_masking and split == "train":
            warn(
                command(),
                f"{data.dir} packs several conversations into a row and data.document_masking is false: "
                "they attend to each other; data.document_masking=true makes each its own sequence",
            )
        if len(self.tokens) < tokens_per_sample:
            raise too_short(data.dir, split, len(self.tokens), tokens_per_sample)
        # Tokens after the last whole sample; when > 0 they end the last, partly weighted sample.
        self.tail_tokens = len(self.tokens) % tokens_per_sample
        self.num_samples = -(-len(self.tokens) // tokens_per_sample)
        self.micro_batches_per_step = global_batch_size // (micro_batch_size * world_size)
        self.step = 0  # optimizer steps fully consumed
        self.micro = 0  # micro-batches of the current step consumed by this rank
        self.skipped: set[int] = set()  # stream steps never trained on (skip_steps)
        self._epoch_orders: dict[int, np.ndarray] = {}
        self._checked_step = -1  # the step whose global batch check_ids last passed
        self._val_checked = False

    # -- order ------------------------------------------------------------------------------

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._epoch_orders:
            if len(self._epoch_orders) > 2:  # a step spans at most two epochs unless G > N
                self._epoch_orders.clear()
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch_orders[epoch] = rng.permutation(self.num_samples)
        return self._epoch_orders[epoch]

    def sample_indices(self, step: int, micro: int) -> np.ndarray:
        """Sample indices of this rank's micro-batch `micro` of optimizer step `step`."""
        first = (
            step * self.global_batch
            + self.rank * (self.global_batch // self.world_size)
            + micro * self.micro_batch
        )
        positions = np.arange(first, first + self.micro_batch)  # (micro_batch,)
        return np.array(
            [self._order(int(p) // self.num_samples)[int(p) % self.num_samples] for p in positions]
        )

    def sample_start(self, index: int) -> int:
        """First token of sample `index` in the split (the last one ends at the split's end)."""
        return min(index * self.sample_len, len(self.tokens) - self.sample_len)

    def repeated_tokens(self, index: int) -> int:
        """How many leading tokens of sample `index` repeat the previous sample (weight 0)."""
        last = index == self.num_samples - 1 and self.tail_tokens > 0
        return self.sample_len - self.tail_tokens if last else 0

    def step_has_repeats(self, step: int) -> bool:
        """Whether the global batch of optimizer step `step` (0-based) holds the partly weighted
        last sample, i.e. whether its loss weights are not all 1 before document masking."""
        if self.tail_tokens == 0:
            return False
        positions = np.arange(step * self.global_batch, (step + 1) * self.global_batch)  # (G,)
        epochs, offsets = positions // self.num_samples, positions % self.num_samples
        return any(self._order(int(e))[int(o)] == self.num_samples - 1 for e, o in zip(epochs, offsets))

    def skip_steps(self, steps: list[int] | set[int]) -> None:
        """Never train on the data of these stream steps (0-based, as `step`)."""
        self.skipped |= {int(s) for s in steps}
        self._skip_ahead()

    def _skip_ahead(self) -> None:
        if self.micro == 0:  # between steps only: a step under way keeps its data
            while self.step in self.skipped:
                self.step += 1

    def provenance(self, step: int, micro: int) -> list[dict[str, Any]]:
        """Where each sequence of this rank's micro-batch `micro` of stream step `step` comes from:
        its sample index, its first token in the split, and the shard file and offset there."""
        out = []
        for index in self.sample_indices(step, micro):
            start = self.sample_start(int(index))
            shard, offset = self.tokens.locate(start)
            out.append(
                {"split": self.split_name, "sample": int(index), "split_offset": start,
                 "shard": shard, "shard_offset": offset, "tokens": self.sample_len}
            )  # fmt: skip
        return out

    @property
    def epoch(self) -> float:
        """Epochs completed, fractional, at the current position."""
        return self.step * self.global_batch / self.num_samples

    # -- batches ----------------------------------------------------------------------------

    def _batch(self, indices: np.ndarray, tokens: SplitTokens | None = None) -> Batch:
        """Samples `indices` of this loader's split, or whole samples `indices` of `tokens`, as
        one micro-batch."""
        if tokens is None:
            source = self.tokens
            starts = [self.sample_start(int(i)) for i in indices]
            repeats = [self.repeated_tokens(int(i)) for i in indices]
        else:
            source = tokens
            starts, repeats = [int(i) * self.sample_len for i in indices], [0] * len(indices)
        rows = [source.read(start, self.sample_len) for start in starts]
        tokens = torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, S)
        stored = [source.read_weights(start, self.sample_len) for start in starts]
        if stored and stored[0] is not None:
            weights = torch.from_numpy(np.stack(stored).astype(np.float32))  # (B, S)
        else:
            weights = torch.ones(tokens.shape, dtype=torch.float32)  # (B, S)
        for row, repeated in enumerate(repeats):
            weights[row, :repeated] = 0.0  # counted in the sample before
        documents = None
        if self.mask_doc_boundaries or self.document_masking:
            documents = self._documents(source, starts, tokens)  # (B, S)
        if self.mask_doc_boundaries:
            weights[:, 1:][documents[:, 1:] != documents[:, :-1]] = 0.0
        return Batch(tokens, weights, documents if self.document_masking else None)

    def _documents(self, source: SplitTokens, starts: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """Each token's document (B, S), counted from 0 in every row: the starts the split stores,
        else a new document after every eos."""
        stored = [source.read_documents(start, self.sample_len) for start in starts]
        if stored[0] is not None:
            documents = torch.from_numpy(np.stack(stored))  # (B, S)
            return documents - documents[:, :1]
        documents = torch.zeros_like(tokens)  # (B, S)
        documents[:, 1:] = (tokens[:, :-1] == self.data.eos_id).cumsum(dim=1)
        return documents

    def uniform_weights(self, step: int) -> bool:
        """Whether every loss weight the model uses in optimizer step `step`'s global batch is 1,
        so that their sum is known without reading them: no stored weights, no masked boundary,
        no documents (a pair across two does not count) and no repeated tokens."""
        plain = self.tokens.weights is None and not (self.mask_doc_boundaries or self.document_masking)
        return plain and not self.step_has_repeats(step)

    def step_indices(self, step: int) -> np.ndarray:
        """Sample indices of the whole global batch of optimizer step `step` (every rank's)."""
        positions = np.arange(step * self.global_batch, (step + 1) * self.global_batch)  # (G,)
        return np.array(
            [self._order(int(p) // self.num_samples)[int(p) % self.num_samples] for p in positions]
        )

    def check_ids(self, tokens: SplitTokens, starts: Iterable[int]) -> None:
        """DataError, one line naming the shard and position, when a sequence of `sample_len` tokens
        at one of `starts` holds an id past the vocabulary: shards above the size checked in full
        when opened (lmsys.data.integrity) are checked here, before any id reaches the model."""
        vocab = self.data.vocab_size
        for start in starts:
            ids = tokens.read(int(start), self.sample_len)  # (S,)
            if int(ids.max()) < vocab:
                continue
            where = int(np.flatnonzero(ids >= vocab)[0])
            shard, offset = tokens.locate(int(start) + where)
            path, redo = self.data.dir / shard, prepare_again(self.data.dir)
            raise past_vocabulary(path, int(ids[where]), offset, vocab, redo)

    def check_split(self, tokens: SplitTokens) -> None:
        """`check_ids` for a whole split: a vectorised max over each of its shards."""
        for name, ids in zip(tokens.files, tokens.shards):
            redo = prepare_again(self.data.dir)
            if error := first_past_vocabulary(ids, 0, self.data.vocab_size, self.data.dir / name, redo):
                raise error

    def next_batch(self) -> Batch:
        if self.micro == 0 or self._checked_step != self.step:
            # every rank checks the whole step, so all of them stop at the same step, alike
            self.check_ids(self.tokens, (self.sample_start(int(i)) for i in self.step_indices(self.step)))
            self._checked_step = self.step
        batch = self._batch(self.sample_indices(self.step, self.micro))
        self.micro += 1
        if self.micro == self.micro_batches_per_step:
            self.step, self.micro = self.step + 1, 0
            self._skip_ahead()
        return batch

    def val_batches(self, count: int) -> list[Batch]:
        """This rank's micro-batches of the held-out "val" split (whatever split this loader trains
        on), from its start, in order: the same held-out sequences at every evaluation, rank r
        taking every W-th micro-batch. count=N: the split's first N x micro_batch_size sequences
        (cycling when the split is shorter), the same sequences on any world size; count=0: the
        whole split, every sequence exactly once. Rows past those sequences, which fill the last
        round, repeat the split's first sequences with loss weight 0 (every rank runs the same
        number of forwards, which ZeRO-3's collectives need)."""
        tokens = self._val_tokens()
        num = len(tokens) // self.sample_len
        if not self._val_checked:  # the whole split, once: every rank alike
            self.check_split(tokens)
            self._val_checked = True
        scored = num if count == 0 else count * self.micro_batch  # sequences, all ranks together
        per_round = self.micro_batch * self.world_size
        out = []
        for b in range(-(-scored // per_round)):
            first = b * per_round + self.rank * self.micro_batch
            indices = np.arange(first, first + self.micro_batch)
            batch = self._batch(indices % num, tokens)
            batch.weights[indices >= scored] = 0.0
            out.append(batch)
        return out

    def val_coverage(self, count: int) -> tuple[int, int]:
        """(distinct validation sequences that `val_batches(count)` scores on all ranks together,
        sequences in the split)."""
        num = len(self._val_tokens()) // self.sample_len
        return (num if count == 0 else min(num, count * self.micro_batch)), num

    def _val_tokens(self) -> SplitTokens:
        tokens = self.tokens if self.split_name == "val" else self.data.split("val")
        if len(tokens) < self.sample_len:
            raise too_short(self.data.dir, "val", len(tokens), self.sample_len)
        return tokens

    # -- resume -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "split": self.split_name,
            "step": self.step,
            "micro": self.micro,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "tokens_per_sample": self.sample_len,
            "global_batch_size": self.global_batch,
            "tokenizer_sha256": self.data.tokenizer_sha256,
            "split_sha256": self.data.split_sha256(self.split_name),
            # Only needed to resume in the middle of a step (any world size resumes between steps).
            "micro_batch_size": self.micro_batch,
            "world_size": self.world_size,
            "rank": self.rank,
            "skipped_steps": sorted(self.skipped),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in (
            "version",
            "split",
            "seed",
            "split_sha256",
            "num_samples",
            "tokens_per_sample",
            "global_batch_size",
            "tokenizer_sha256",
        ):
            if key == "split_sha256" and key not in state:
                continue  # saved before loaders recorded it
            if state.get(key) != mine[key]:
                raise DataError(
                    f"cannot resume the loader: its saved {key} is {state.get(key)!r}, "
                    f"this run has {mine[key]!r}; {_RESUME_HINTS[key]}, or start a new run in "
                    "another trainer.run_dir"
                )
        micro = int(state.get("micro", 0))
        if micro:  # mid-step: only this rank's own cut of the step continues where it stopped
            for key in ("micro_batch_size", "world_size", "rank"):
                if state.get(key) != mine[key]:
                    raise DataError(
                        f"cannot resume the loader in the middle of step {state['step']} with another "
                        f"{key} (saved {state.get(key)!r}, this run has {mine[key]!r}); resume from a "
                        "checkpoint taken between steps"
                    )
        self.step, self.micro = int(state["step"]), micro
        self.skipped = set()
        self.skip_steps(state.get("skipped_steps", []))
