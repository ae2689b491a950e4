"""sequentialize: any module becomes a flat Sequential whose pieces the engine pipelines, with the
model's outputs, gradients, parameter names and tied weights.

The model here has what real ones have: keyword inputs, a bool mask riding along, a residual
branch that crosses every cut, BatchNorm and dropout, input and output embeddings tied, a dict
output with the loss. Hugging Face and torchvision models: test_capture_models.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from giantpipe import GPipe, sequentialize
from giantpipe.engine.capture import CaptureError
from giantpipe.engine.capture.cuts import repeated_blocks
from giantpipe.engine.partition import shared_parameters
from giantpipe.perf.balance import solve_balance
from giantpipe.testing import reference_step, step_seed

MODES = ["always", "except_last", "never"]
VOCAB, D, BATCH, T = 13, 16, 8, 5


class Block(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D)
        self.drop = nn.Dropout(p)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        z = self.bn(self.fc(h).transpose(1, 2)).transpose(1, 2)
        return h + self.drop(torch.relu(z)) * mask.unsqueeze(-1)


class TiedLM(nn.Module):
    """Embedding and head share one weight; the embedding also skips to the end."""

    def __init__(self, blocks: int = 4, p: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(p) for _ in range(blocks)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        first = h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h, mask)
        logits = self.head(self.norm(h + first))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out


def batch(n: int = BATCH) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, T), generator=g)
    mask = torch.rand(n, T, generator=g) > 0.3
    return ids, mask, torch.randint(0, VOCAB, (n, T), generator=g)


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.fixture(scope="module")
def captured() -> tuple[TiedLM, nn.Sequential]:
    model = TiedLM(blocks=6)
    ids, mask, _ = batch()
    return model, sequentialize(model, ids, mask, output="logits")


def by_name(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.state_dict(keep_vars=True))


def assert_same_grads(pipe: nn.Module, plain: nn.Module) -> None:
    mine = by_name(pipe)
    for name, p in plain.named_parameters():
        assert mine[name].grad is not None, name
        torch.testing.assert_close(mine[name].grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_outputs_gradients_and_statistics_equal_the_model() -> None:
    model = TiedLM()
    ids, mask, labels = batch()
    seq = sequentialize(copy.deepcopy(model), input_ids=ids, mask=mask, labels=labels)
    want = model(input_ids=ids, mask=mask, labels=labels)
    got = seq.unflatten(seq(seq.flatten(input_ids=ids, mask=mask, labels=labels)))
    assert set(got) == {"logits", "loss"}  # the model's dict, back in its form
    torch.testing.assert_close(got["logits"], want["logits"])
    torch.testing.assert_close(got["loss"], want["loss"])
    want["loss"].backward()
    got["loss"].backward()
    assert_same_grads(seq, model)
    for name, buf in model.named_buffers():
        torch.testing.assert_close(by_name(seq)[name], buf, msg=name)


def test_pieces_at_repeated_blocks_or_at_given_split_points(captured) -> None:
    model, seq = captured
    ids, mask, _ = batch()
    assert repeated_blocks(model) == [[f"blocks.{i}" for i in range(6)]]
    assert len(seq) == 8  # embedding, 6 blocks, head
    assert len(sequentialize(model, ids, mask, split_points=["blocks.1", "blocks.3"])) == 3


def test_checkpoints_keep_the_models_names_both_ways(captured) -> None:
    model, seq = captured
    pipe = GPipe(copy.deepcopy(seq), balance=[2, 3, 3], devices=["cpu"] * 3)
    assert list(seq.state_dict()) == list(pipe.state_dict())
    assert set(pipe.state_dict()) == set(model.state_dict())  # the tied head.weight too
    plain = TiedLM(blocks=6)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)
    plain.load_state_dict(pipe.state_dict(), strict=True)
    torch.testing.assert_close(plain.embed.weight, model.embed.weight)
    pipe.load_state_dict(TiedLM(blocks=6).state_dict(), strict=True)
    seq.load_state_dict(model.state_dict(), strict=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tied", "devices", "copies"),
    [
        ("share", ["cpu"] * 3, 1),  # one device: one object, both uses accumulate into it
        ("share", ["cpu:0", "cpu:1", "cpu:2"], 2),  # distinct devices: a copy on the last stage
        ("carry", ["cpu:0", "cpu:1", "cpu:2"], 1),  # held by the first stage, carried as a value
    ],
)
def test_a_tied_weight_stays_tied_across_stages(
    captured, tied: str, devices: list[str], copies: int
) -> None:
    model, _ = captured
    ids, mask, labels = batch()
    plain = copy.deepcopy(model)
    seq = sequentialize(copy.deepcopy(model), ids, mask, tied=tied)
    pipe = GPipe(seq, balance=[1, 3, 4], devices=devices, chunks=1)  # BatchNorm: whole batch
    held = {id(p): p for name, p in pipe.named_parameters(remove_duplicate=False)
            if p.shape == (VOCAB, D)}  # fmt: skip
    assert len(held) == copies
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    pipe_opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    for _ in range(2):  # the copies take the same step, so the second step is tied too
        for opt in (plain_opt, pipe_opt):
            opt.zero_grad()
        token_loss(plain(ids, mask)["logits"], labels).backward()
        pipe.train_step((ids, mask), labels, token_loss)
        norm = pipe.clip_grad_norm_(1e9)  # a copy counts once
        torch.testing.assert_close(norm, nn.utils.clip_grad_norm_(plain.parameters(), 1e9))
        for p in held.values():
            torch.testing.assert_close(p.grad, plain.embed.weight.grad)  # both uses summed
        plain_opt.step()
        pipe_opt.step()
        for p in held.values():
            torch.testing.assert_close(p, plain.embed.weight)


def test_tied_copies_sum_only_this_steps_gradients() -> None:
    # Accumulation over two steps: what p.grad held before the step is kept, not summed again
    embed = nn.Embedding(VOCAB, D)
    head = nn.Linear(D, VOCAB, bias=False)
    head.weight = embed.weight
    model = nn.Sequential(embed, nn.Tanh(), head)
    assert shared_parameters(model) == [[(0, "weight"), (2, "weight")]]
    plain = copy.deepcopy(model)
    pipe = GPipe(copy.deepcopy(model), [2, 1], devices=["cpu:0", "cpu:1"], chunks=2)
    assert len(pipe.tied.groups) == 1 and pipe[0].weight is not pipe[2].weight
    ids, labels = batch()[0], batch()[2]
    for _ in range(2):
        token_loss(plain(ids), labels).backward()
        pipe.train_step(ids, labels, token_loss)
    torch.testing.assert_close(pipe[0].weight.grad, plain[0].weight.grad)
    torch.testing.assert_close(pipe[2].weight.grad, plain[0].weight.grad)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("schedule", "k", "v", "chunks"),
    [("gpipe", 1, 1, 3), ("gpipe", 2, 1, 4), ("1f1b", 3, 1, 4), ("zb-h1", 4, 1, 8)]
    + [("interleaved", 2, 2, 4), ("interleaved", 4, 2, 4)],
)
def test_every_schedule_and_mode_equals_the_model(
    captured, schedule: str, k: int, v: int, chunks: int, mode: str
) -> None:
    model, seq = captured
    ids, mask, labels = batch()
    plain = copy.deepcopy(model)
    for x, m, y in zip(ids.chunk(chunks), mask.chunk(chunks), labels.chunk(chunks)):
        (token_loss(plain(x, m)["logits"], y) * (len(y) / BATCH)).backward()
    pipe = GPipe(
        copy.deepcopy(seq),
        solve_balance([1.0] * len(seq), k * v),
        devices=["cpu"] * k,
        chunks=chunks,
        checkpoint=mode,
        schedule=schedule,
        virtual_stages=v,
    )
    pipe.train_step((ids, mask), labels, token_loss)
    assert_same_grads(pipe, plain)


@pytest.fixture(scope="module")
def with_dropout() -> tuple[TiedLM, nn.Sequential]:
    model = TiedLM(blocks=3, p=0.3)
    ids, mask, _ = batch()
    return model, sequentialize(model, ids, mask, output="logits")


@pytest.mark.parametrize("mode", MODES)
def test_dropout_masks_are_replayed(with_dropout, mode: str) -> None:
    _, seq = with_dropout
    ids, mask, labels = batch()
    plain, ref_loss = reference_step(seq, (ids, mask), labels, 4, step_seed(3), token_loss)
    pipe = GPipe(copy.deepcopy(seq), [2, 3], devices=["cpu"] * 2, chunks=4, checkpoint=mode)
    torch.manual_seed(3)
    loss = pipe.train_step((ids, mask), labels, token_loss)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
    for (name, p), (_, q) in zip(pipe.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_eval_turns_dropout_and_batchnorm_statistics_off(with_dropout) -> None:
    model, seq = copy.deepcopy(with_dropout)
    ids, mask, _ = batch()
    assert seq.training and model.training  # captured in training mode, modes restored
    with torch.no_grad():
        for b in model.modules():
            if isinstance(b, nn.BatchNorm1d):
                b.running_mean.uniform_(-1, 1)
    seq.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(seq((ids, mask)), model(ids, mask)["logits"])


# ---- failures: one message, naming the submodule and what to do ---------------------------


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.first(x))


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # Python control flow on a tensor value
            return x * 2
        return x


def test_data_dependent_control_flow_names_the_submodule() -> None:
    with pytest.raises(CaptureError, match=r"cannot capture `gate`.*torch.where"):
        sequentialize(Branchy(), torch.randn(4, 4))


def test_a_split_point_that_is_not_a_submodule() -> None:
    ids, mask, _ = batch()
    model = TiedLM()
    model.forward = None  # type: ignore[assignment,method-assign]  # refused before any capture
    with pytest.raises(CaptureError, match=r"`blocks.9` is not a submodule.*'blocks.0'"):
        sequentialize(model, ids, mask, split_points=["blocks.9"])


def test_a_cut_through_a_tied_parameter_can_be_refused() -> None:
    ids, mask, _ = batch()
    with pytest.raises(CaptureError, match=r"`embed.weight` is used on both sides.*tied='share'"):
        sequentialize(TiedLM(), ids, mask, tied="error")


def test_a_batch_of_one_is_refused() -> None:
    ids, mask, _ = batch(1)
    with pytest.raises(CaptureError, match="at least 2 samples"):
        sequentialize(TiedLM(), ids, mask)


class Pairs(nn.Module):
    """Folds a sequence into pairs of positions: its shape arithmetic reads the length."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc(h.reshape(h.shape[0], h.shape[1] // 2, 2 * h.shape[2]))


@pytest.mark.parametrize(("dynamic", "other_length_runs"), [("all", True), ("batch", False)])
def test_dynamic_says_which_dimensions_may_differ_from_the_example(
    dynamic: str, other_length_runs: bool
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Pairs(), Pairs())
    seq = sequentialize(model, torch.randn(3, 8, D), dynamic=dynamic)
    x = torch.randn(5, 8, D)  # another batch size: always
    torch.testing.assert_close(seq(seq.flatten(x)), model(x))
    longer = torch.randn(2, 12, D)
    if other_length_runs:
        torch.testing.assert_close(seq(seq.flatten(longer)), model(longer))
    else:  # the length was captured as the example's 8
        with pytest.raises(RuntimeError):
            seq(seq.flatten(longer))


def test_an_unknown_dynamic_is_refused() -> None:
    with pytest.raises(ValueError, match="dynamic must be 'all' or 'batch', got 'seq'"):
        sequentialize(nn.Sequential(Pairs()), torch.randn(3, 8, D), dynamic="seq")
