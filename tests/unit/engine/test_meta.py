"""A model built on meta, its layers made real by their own init (engine/meta.py): the same
weights whatever the cut, the schedule or V; a tied parameter filled once, by its first layer; a
parameter no init reaches refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from giantpipe.engine import GPipe
from giantpipe.engine.meta import (
    UnsetError,
    allocate_layers,
    build_on_meta,
    init_layers,
    reset_parameters,
    seeded,
    seeded_init,
)

SEED = 11


def tied() -> nn.Sequential:
    """Embedding, hidden layers with a norm and BatchNorm, a head tied to the embedding."""
    embed, head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
    head.weight = embed.weight
    hidden = [nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(4)]
    return nn.Sequential(embed, *hidden, nn.BatchNorm1d(8), head)


LAYOUTS = [
    ([7], 1, "gpipe"),
    ([3, 4], 2, "gpipe"),
    ([2, 2, 1, 2], 4, "1f1b"),
    ([2, 2, 1, 2], 2, "interleaved"),
    ([1, 2, 2, 2], 2, "zb-v"),
]


@pytest.mark.parametrize(("balance", "workers", "schedule"), LAYOUTS)
def test_a_model_built_on_meta_starts_from_the_same_weights_whatever_the_layout(
    balance: list[int], workers: int, schedule: str
) -> None:
    plain = tied()
    init_layers(plain, SEED)
    model = build_on_meta(tied)
    assert all(p.is_meta for p in model.parameters())
    pipe = GPipe(model, balance, devices=["cpu"] * workers, chunks=4, schedule=schedule, seed=SEED)
    got, want = pipe.state_dict(), plain.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    pipe.close()


def test_each_layer_is_drawn_from_the_run_seed_and_its_index_alone() -> None:
    model = build_on_meta(tied)
    allocate_layers(model, [3], torch.device("cpu"), seeded_init(SEED))  # layer 3 alone
    alone = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    seeded(reset_parameters, SEED)(3, alone)
    assert torch.equal(model[3][0].weight, alone[0].weight)
    other = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    seeded(reset_parameters, SEED)(2, other)
    assert not torch.equal(model[3][0].weight, other[0].weight)  # another index, other values


def test_a_tied_parameter_takes_its_first_layers_values() -> None:
    model = build_on_meta(tied)
    allocate_layers(model, range(len(model)), torch.device("cpu"), seeded_init(SEED))
    first = nn.Embedding(10, 8)
    seeded(reset_parameters, SEED)(0, first)  # N(0, 1): the embedding's own init
    assert model[6].weight is model[0].weight
    assert torch.equal(model[0].weight, first.weight)  # not the head's init drawn over it


class Gain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))  # no reset_parameters reaches it


def test_a_parameter_no_init_reaches_is_refused_by_name() -> None:
    model = build_on_meta(lambda: nn.Sequential(nn.Linear(4, 4), Gain()))
    with pytest.raises(UnsetError, match=r"layer 1 \(Gain\): its init leaves gain without a value"):
        allocate_layers(model, [0, 1], torch.device("cpu"), seeded_init(SEED))


class TiedHead(nn.Module):
    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight  # the embedding's: nothing here initialises it


def test_a_tied_parameter_held_without_its_first_layer_comes_from_there() -> None:
    def build() -> nn.Sequential:
        embed = nn.Embedding(10, 8)
        return nn.Sequential(embed, nn.Linear(8, 8), TiedHead(embed.weight))

    model = build_on_meta(build)
    allocate_layers(model, [2], torch.device("cpu"), seeded_init(SEED))  # as the last rank does
    assert model[0].weight.is_meta and not model[2].weight.is_meta  # its values: TiedSync's
    alone = build_on_meta(
        lambda: nn.Sequential(nn.Linear(8, 8), TiedHead(nn.Parameter(torch.ones(2))))
    )
    with pytest.raises(UnsetError, match=r"layer 1 \(TiedHead\)"):  # tied to nothing: unset
        allocate_layers(alone, [1], torch.device("cpu"), seeded_init(SEED))


def test_a_model_init_of_its_own_is_called_per_layer() -> None:
    def own(index: int, layer: nn.Module) -> None:
        for p in layer.parameters():
            p.fill_(index)

    model = build_on_meta(tied)
    pipe = GPipe(model, [3, 4], devices=["cpu", "cpu"], init=seeded(own, SEED))
    assert float(pipe.partitions[0][2][0].weight[0, 0]) == 2.0
    assert float(pipe.partitions[1][1][1].bias[0]) == 4.0
    pipe.close()
