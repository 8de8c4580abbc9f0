"""The training loader: rank split without overlap, full coverage per epoch, determinism, exact
resume, validation from the held-out split, and loss weights across document boundaries."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from lmsys.core.errors import DataError
from lmsys.data.loader import Batch, TokenLoader
from lmsys.data.shards import PreparedData
from lmsys.data.tokenizer import EOS_ID

S = 33  # tokens per sample (seq_len 32 + 1)
G = 6  # global batch in sequences: divisible by world sizes 1, 2, 3


@pytest.fixture(scope="module")
def data(prepared) -> PreparedData:
    return PreparedData(prepared)


def loader(data, world: int = 1, rank: int = 0, micro: int | None = None, seed: int = 0, **kw) -> TokenLoader:
    micro = micro or G // world
    return TokenLoader(
        data, "train", tokens_per_sample=S, global_batch_size=G, micro_batch_size=micro,
        rank=rank, world_size=world, seed=seed, **kw,
    )  # fmt: skip


def rows(batch: Batch) -> list[bytes]:
    return [r.numpy().tobytes() for r in batch.tokens]


def all_samples(data, split: str = "train") -> Counter:
    """Every sample of the split: whole samples from the start, then, if S does not divide the
    split, the one that ends at its end."""
    tokens = data.split(split)
    starts = list(range(0, len(tokens) - S + 1, S))
    if len(tokens) % S:
        starts.append(len(tokens) - S)
    return Counter(tokens.read(i, S).astype(np.int64).tobytes() for i in starts)


def global_steps(
    data, world: int, steps: int, micro: int | None = None, seed: int = 0
) -> list[list[list[bytes]]]:
    """[step][rank] -> that rank's rows of the step, in order."""
    loaders = [loader(data, world, r, micro, seed) for r in range(world)]
    out = []
    for _ in range(steps):
        out.append(
            [
                [row for _ in range(lo.micro_batches_per_step) for row in rows(lo.next_batch())]
                for lo in loaders
            ]
        )
    return out


def test_batch_shape_and_dtype(data):
    b = loader(data, micro=2).next_batch()
    assert b.tokens.shape == b.weights.shape == (2, S)
    assert b.tokens.dtype == torch.int64 and b.weights.dtype == torch.float32
    assert int(b.tokens.max()) < data.vocab_size and torch.all(b.weights == 1)


@pytest.mark.parametrize("world, micro", [(1, 3), (2, 1), (3, 2)])
def test_ranks_disjoint_and_full_coverage_per_epoch(data, world, micro):
    samples = all_samples(data)
    n = sum(samples.values())
    steps = -(-n // G) + 1  # one epoch and a bit of the next
    per_step = global_steps(data, world, steps, micro)
    reference = global_steps(data, 1, steps)  # the 1-process order
    stream = []
    for step, ranks in enumerate(per_step):
        assert all(len(r) == G // world for r in ranks)
        flat = [row for r in ranks for row in r]
        assert flat == [row for r in reference[step] for row in r]  # independent of world size
        stream += flat
    epoch = Counter(stream[:n])
    assert epoch == samples  # every sample exactly once in the first epoch
    for step in range(n // G):  # inside the epoch no sample is shared by two ranks of a step
        seen = [Counter(r) for r in per_step[step]]
        assert sum(seen, Counter()) == Counter(row for r in per_step[step] for row in r)
        assert all(not (seen[i] & seen[j]) for i in range(world) for j in range(i + 1, world))
    assert stream[n : n + G] != stream[:G]  # the next epoch is another permutation


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_token_weighted_once_per_epoch(data, world):
    """The split's tail is not dropped: counting each sample's weights at the tokens it was cut
    from, every token of the split is weighted exactly once per epoch (S does not divide it)."""
    split = data.split("train")
    n_tokens = len(split)
    assert n_tokens % S  # the fixture leaves a tail shorter than one sample
    loaders = [loader(data, world, r) for r in range(world)]
    n = loaders[0].num_samples
    assert n == -(-n_tokens // S) and loaders[0].tail_tokens == n_tokens % S
    coverage = np.zeros(n_tokens, dtype=np.int64)
    steps_with_repeats, step_of_last = [], None
    for step in range(-(-n // G)):  # the first epoch ends inside the last of these steps
        for rank, lo in enumerate(loaders):
            indices = lo.sample_indices(step, 0)
            batch = lo.next_batch()
            first = step * G + rank * (G // world)  # stream position of this rank's first row
            for pos, i, tokens, weights in zip(range(first, first + G), indices, batch.tokens, batch.weights):
                if pos >= n:  # the next epoch
                    continue
                start = lo.sample_start(int(i))
                assert np.array_equal(tokens.numpy(), split.read(start, S))
                coverage[start : start + S] += weights.numpy().astype(np.int64)
                if i == n - 1:
                    step_of_last = step
                    assert weights[: lo.repeated_tokens(int(i))].sum() == 0 < lo.repeated_tokens(int(i))
        if loaders[0].step_has_repeats(step):
            steps_with_repeats.append(step)
    assert np.all(coverage == 1)
    # step_has_repeats names exactly the step that drew the partly weighted last sample
    assert step_of_last is not None and steps_with_repeats == [step_of_last]


def test_deterministic_per_seed(data):
    a = global_steps(data, 1, 5, seed=3)
    assert a == global_steps(data, 1, 5, seed=3)
    assert a != global_steps(data, 1, 5, seed=4)


@pytest.mark.parametrize("stop", [6, 7], ids=["between_steps", "mid_step"])
def test_resume_yields_the_same_batches(data, stop):
    """Rank 1 of 2, 3 micro-batches per step: stop after `stop`, restore into a fresh loader."""
    straight = loader(data, world=2, rank=1, micro=1)
    expected = [straight.next_batch() for _ in range(20)]
    first = loader(data, world=2, rank=1, micro=1)
    for _ in range(stop):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # plain data, as stored in a checkpoint
    resumed = loader(data, world=2, rank=1, micro=1)
    resumed.load_state_dict(state)
    for want in expected[stop:]:
        got = resumed.next_batch()
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.weights, want.weights)


def test_resume_between_steps_on_another_world_size(data):
    one = loader(data, world=1)
    for _ in range(4):
        one.next_batch()
    state = one.state_dict()
    expected = [rows(one.next_batch()) for _ in range(3)]
    three = [loader(data, world=3, rank=r) for r in range(3)]
    for lo in three:
        lo.load_state_dict(state)
    for want in expected:
        assert [row for lo in three for row in rows(lo.next_batch())] == want


def test_resume_refuses_mismatches(data):
    lo = loader(data, world=2, rank=0, micro=1)
    lo.next_batch()  # mid-step
    state = lo.state_dict()
    with pytest.raises(DataError, match="in the middle of step 0 with another world_size"):
        loader(data, world=3, rank=0, micro=1).load_state_dict(state)
    with pytest.raises(DataError, match="its saved seed is 0, this run has 5"):
        loader(data, world=2, rank=0, micro=1, seed=5).load_state_dict(state)
    other = TokenLoader(
        data, "train", tokens_per_sample=S + 1, global_batch_size=G, micro_batch_size=1, world_size=2
    )
    with pytest.raises(DataError, match="its saved num_samples is"):
        other.load_state_dict(state)
    bigger = TokenLoader(data, "train", tokens_per_sample=S, global_batch_size=2 * G, micro_batch_size=1)
    with pytest.raises(DataError) as e:  # names the key to set, and the other way out
        bigger.load_state_dict(loader(data).state_dict())
    assert f"its saved global_batch_size is {G}, this run has {2 * G}" in str(e.value)
    assert "trainer.global_batch_tokens" in str(e.value) and "another trainer.run_dir" in str(e.value)


def test_val_batches_come_from_the_held_out_split(data):
    val = all_samples(data, "val")
    train = all_samples(data, "train")
    ranks = [loader(data, world=2, rank=r, micro=3) for r in range(2)]
    for lo in ranks:
        lo.next_batch()  # training progress does not move the validation batches
    batches = [lo.val_batches(3) for lo in ranks]
    got = [[row for b in bs for row in rows(b)] for bs in batches]
    assert all(row in val and row not in train for r in got for row in r)
    assert not set(got[0]) & set(got[1])  # ranks evaluate different sequences
    again = [row for b in ranks[0].val_batches(3) for row in rows(b)]
    assert again == got[0]  # the same sequences at every evaluation


def test_val_batches_zero_cover_the_whole_split_once(data):
    tokens = data.split("val")
    num = len(tokens) // S
    whole = Counter(tokens.read(i * S, S).astype(np.int64).tobytes() for i in range(num))
    fillers = 0
    for world, micro in ((1, 6), (2, 3), (3, 2), (2, 1)):
        ranks = [loader(data, world=world, rank=r, micro=micro) for r in range(world)]
        batches = [lo.val_batches(0) for lo in ranks]
        assert len({len(b) for b in batches}) == 1  # every rank runs as many forwards
        scored: Counter = Counter()
        for batch in (b for bs in batches for b in bs):
            for row, weights in zip(rows(batch), batch.weights, strict=True):
                assert bool(weights.all()) or not bool(weights.any())  # a row is scored or filler
                scored[row] += bool(weights.all())
        assert +scored == whole  # every sequence exactly once
        fillers += sum(len(b) for b in batches) * micro - num
        assert ranks[0].val_coverage(0) == (num, num)
        assert ranks[0].val_coverage(1) == (min(num, micro), num)
    assert fillers > 0  # some round ended past the split's end


def test_eval_batches_score_the_same_sequences_on_any_world_size(data):
    """trainer.eval_batches=N: the split's first N x micro sequences, each once with weight 1,
    however many ranks share them (the same weights, so the same validation loss)."""
    micro, count = 1, 5
    want = [data.split("val").read(i * S, S).astype(np.int64).tobytes() for i in range(micro * count)]
    for world in (1, 2, 3):
        scored: Counter = Counter()
        for rank in range(world):
            for batch in loader(data, world=world, rank=rank, micro=micro).val_batches(count):
                for row, weights in zip(rows(batch), batch.weights, strict=True):
                    scored[row] += bool(weights.all())
        assert +scored == Counter(want), world


def test_mask_doc_boundaries_weights(data):
    plain = loader(data, micro=6)
    masked = loader(data, micro=6, mask_doc_boundaries=True)
    zeros = 0
    for _ in range(30):
        a, b = plain.next_batch(), masked.next_batch()
        assert torch.equal(a.tokens, b.tokens)
        after_eos = torch.zeros_like(b.tokens, dtype=torch.bool)  # (B, S)
        after_eos[:, 1:] = b.tokens[:, :-1] == EOS_ID
        # weight 0 exactly for predicting a document's first token from the previous one's eos
        # (on top of the plain weights, which are 0 only where the split's last sample repeats)
        assert torch.equal(b.weights, a.weights * (~after_eos).float())
        zeros += int(after_eos.sum())
    assert zeros > 0  # documents are short enough that boundaries occur


def test_document_masking_gives_each_batch_its_documents(data):
    """Text data: a new document after every eos (a row's first token starts one), the weights
    as without masking (the model drops the pairs across documents itself), and the step's
    weights no longer all 1."""
    plain, masked = loader(data, micro=6), loader(data, micro=6, document_masking=True)
    assert loader(data, micro=6).next_batch().documents is None and plain.uniform_weights(1)
    assert not masked.uniform_weights(1)
    for _ in range(5):
        batch, want = masked.next_batch(), plain.next_batch()
        assert torch.equal(batch.tokens, want.tokens) and torch.equal(batch.weights, want.weights)
        docs = batch.documents
        assert docs.dtype == torch.int64 and docs.shape == batch.tokens.shape and (docs[:, 0] == 0).all()
        steps = docs[:, 1:] - docs[:, :-1]  # (B, S-1)
        assert torch.equal(steps, (batch.tokens[:, :-1] == EOS_ID).long())


def test_split_shorter_than_a_sample(data):
    n_val = len(data.split("val"))
    with pytest.raises(DataError, match="fewer than one sequence"):
        TokenLoader(data, "val", tokens_per_sample=n_val + 1, global_batch_size=1, micro_batch_size=1)
    lo = TokenLoader(data, "train", tokens_per_sample=n_val + 1, global_batch_size=1, micro_batch_size=1)
    with pytest.raises(DataError, match="the val split .* raise data.val_fraction"):
        lo.val_batches(1)


def test_batch_arguments_are_checked(data):
    with pytest.raises(ValueError, match="does not split into micro-batches"):
        TokenLoader(data, "train", tokens_per_sample=S, global_batch_size=6, micro_batch_size=4)
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        TokenLoader(
            data, "train", tokens_per_sample=S, global_batch_size=6, micro_batch_size=1, rank=2, world_size=2
        )
    with pytest.raises(DataError, match="has no split 'test'"):
        data.split("test")


def test_skipped_steps_are_never_trained_on_and_survive_a_resume(data):
    """A rewind's skipped stream steps (trainer.on_nonfinite=rewind): the loader moves past them,
    its state carries them, and a restored loader skips them too."""
    plain = global_steps(data, 1, 5)  # [step][rank] rows
    skipping = loader(data)
    skipping.skip_steps([1, 3])
    seen = [rows(skipping.next_batch()) for _ in range(3)]
    assert seen == [plain[0][0], plain[2][0], plain[4][0]]
    state = json.loads(json.dumps(skipping.state_dict()))
    assert state["skipped_steps"] == [1, 3] and state["step"] == 5
    early = loader(data)  # a checkpoint from before the skips, told of them afterwards
    early.load_state_dict({**loader(data).state_dict(), "skipped_steps": []})
    early.skip_steps([1, 3])
    assert [rows(early.next_batch()) for _ in range(2)] == seen[:2]
    restored = loader(data)
    restored.load_state_dict({**state, "step": 0})  # the state's skips come with it
    assert [rows(restored.next_batch()) for _ in range(2)] == seen[:2]
    # provenance: where each sequence of a micro-batch comes from, by the loader's own cut
    (entry,) = loader(data, micro=1).provenance(2, 0)[:1]
    first = loader(data, micro=1).sample_indices(2, 0)[0]
    assert entry["sample"] == first and entry["shard"].endswith(".bin")
    assert data.split("train").read(entry["split_offset"], S).tolist() == rows_of(data, entry)


def rows_of(data, entry) -> list[int]:
    """The tokens of a provenance entry, read from its shard file at its offset."""
    shard = np.memmap(data.dir / entry["shard"], dtype=data.dtype, mode="r")
    return shard[entry["shard_offset"] : entry["shard_offset"] + entry["tokens"]].tolist()


@pytest.fixture
def sampled_copy(prepared, tmp_path, monkeypatch):
    """A copy of the prepared data opened as data too large to check in full: the limits lowered
    to nothing, the sample two blocks of 64 ids per shard."""
    import shutil

    from lmsys.data import integrity

    monkeypatch.setattr(integrity, "FULL_CHECK_BYTES", 0)
    monkeypatch.setattr(integrity, "ID_CHECK_BYTES", 0)
    monkeypatch.setattr(integrity, "BLOCK_TOKENS", 64)
    monkeypatch.setattr(integrity, "SAMPLE_BYTES", 0)
    return shutil.copytree(prepared, tmp_path / "copy")


def _poison(directory, split: str, value: int) -> tuple[str, int, int]:
    """An id past the vocabulary in the middle of the split's second shard (or its only one):
    (shard file, position in it, position in the split)."""
    manifest = json.loads((directory / "manifest.json").read_text())
    shards = [s for s in manifest["shards"] if s["split"] == split]
    index = min(1, len(shards) - 1)
    path = directory / shards[index]["file"]
    ids = np.fromfile(path, dtype="<u2")
    where = len(ids) // 2 + 5
    ids[where] = value
    ids.tofile(path)
    return shards[index]["file"], where, sum(s["tokens"] for s in shards[:index]) + where


def test_every_batch_is_checked_before_it_reaches_the_model(sampled_copy):
    """Data above the size checked in full when opened: an id between the sampled blocks stops the
    loader at the step whose global batch holds it, on every rank alike (also the ranks whose own
    micro-batches do not hold it), in one line naming the shard and position; no batch with it is
    ever returned."""
    from lmsys.data.tokenizer import Tokenizer

    vocab = Tokenizer(sampled_copy / "tokenizer.model").vocab_size
    shard, where, split_pos = _poison(sampled_copy, "train", vocab + 9)
    data = PreparedData(sampled_copy)  # the sample misses it
    loaders = [loader(data, world=2, rank=r, micro=1) for r in range(2)]
    holder = next(
        step
        for step in range(loaders[0].num_samples)
        if any(
            loaders[0].sample_start(int(i)) <= split_pos < loaders[0].sample_start(int(i)) + S
            for i in loaders[0].step_indices(step)
        )
    )
    stopped = []
    for lo in loaders:
        with pytest.raises(DataError) as e:
            for _ in range(holder * lo.micro_batches_per_step + lo.micro_batches_per_step):
                assert int(lo.next_batch().tokens.max()) < vocab
        stopped.append((lo.step, str(e.value)))
    assert stopped[0] == stopped[1] and stopped[0][0] == holder  # every rank, the same step and line
    line = stopped[0][1]
    assert "\n" not in line
    assert line.startswith(f"corrupt shard {sampled_copy / shard}: token id {vocab + 9} at position {where} ")
    assert f"lmsys-prepare data.dir={sampled_copy} data.overwrite=true" in line


def test_validation_is_checked_before_the_first_evaluation(sampled_copy):
    from lmsys.data.tokenizer import Tokenizer

    vocab = Tokenizer(sampled_copy / "tokenizer.model").vocab_size
    shard, where, _ = _poison(sampled_copy, "val", vocab)
    lo = loader(PreparedData(sampled_copy))
    lo.next_batch()  # training data is fine
    with pytest.raises(
        DataError, match=rf"corrupt shard {sampled_copy / shard}: token id {vocab} at position {where} "
    ):
        lo.val_batches(1)


def test_a_resume_on_other_tokens_is_refused(data, prepared, tmp_path):
    """Data prepared again with the same tokenizer and as many sequences (here: two ids swapped,
    the manifest updated as lmsys-prepare would write it) is other data: the loader's saved state
    refuses it in one line; a state saved before loaders recorded the split's digest still loads."""
    import shutil

    from lmsys.core.files import sha256_file

    saved = loader(data).state_dict()
    other = shutil.copytree(prepared, tmp_path / "again")
    manifest = json.loads((other / "manifest.json").read_text())
    shard = manifest["shards"][0]
    ids = np.fromfile(other / shard["file"], dtype="<u2")
    i = int(np.flatnonzero(ids[:-1] != ids[1:])[0])
    ids[[i, i + 1]] = ids[[i + 1, i]]
    ids.tofile(other / shard["file"])
    shard["sha256"] = sha256_file(other / shard["file"])
    (other / "manifest.json").write_text(json.dumps(manifest))
    moved = loader(PreparedData(other))
    with pytest.raises(
        DataError, match="saved split_sha256 is .* data.dir holds other tokens than the run trained on"
    ):
        moved.load_state_dict(saved)
    del saved["split_sha256"]
    moved.load_state_dict(saved)
