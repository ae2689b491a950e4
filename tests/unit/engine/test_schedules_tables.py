"""1F1B, interleaved, ZB-H1 and ZB-V as data: exact tables, the validator over every size,
errors."""

from __future__ import annotations

import pytest

from giantpipe.engine.schedules import SCHEDULE_NAMES, build_schedule
from giantpipe.engine.schedules.actions import Action, Schedule, in_flight, validate
from giantpipe.engine.schedules.fill_drain import expected_bubble, fill_drain
from giantpipe.engine.schedules.one_f_one_b import interleaved, one_f_one_b, zb_h1, zb_v


def table(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in worker) for worker in schedule.actions]


def test_1f1b_k2_m4_exact_table() -> None:
    assert table(one_f_one_b(2, 4)) == [
        "F0@0 F1@0 B0@0 F2@0 B1@0 F3@0 B2@0 B3@0",
        "F0@1 B0@1 F1@1 B1@1 F2@1 B2@1 F3@1 B3@1",
    ]


def test_1f1b_k3_m4_exact_table() -> None:
    assert table(one_f_one_b(3, 4)) == [
        "F0@0 F1@0 F2@0 B0@0 F3@0 B1@0 B2@0 B3@0",
        "F0@1 F1@1 B0@1 F2@1 B1@1 F3@1 B2@1 B3@1",
        "F0@2 B0@2 F1@2 B1@2 F2@2 B2@2 F3@2 B3@2",
    ]


def test_interleaved_k2_v2_m4_exact_table() -> None:
    s = interleaved(2, 4, 2)
    assert s.num_stages == 4 and s.num_workers == 2 and s.virtual_stages == 2
    assert s.placement == (0, 1, 0, 1)
    assert table(s) == [
        "F0@0 F1@0 F0@2 F1@2 F2@0 B0@2 F3@0 B1@2 F2@2 B0@0 F3@2 B1@0 B2@2 B3@2 B2@0 B3@0",
        "F0@1 F1@1 F0@3 B0@3 F1@3 B1@3 F2@1 B0@1 F3@1 B1@1 F2@3 B2@3 F3@3 B3@3 B2@1 B3@1",
    ]


def test_zb_h1_k3_m4_exact_table() -> None:
    assert table(zb_h1(3, 4)) == [
        "F0@0 F1@0 F2@0 B0@0 W0@0 F3@0 B1@0 W1@0 B2@0 W2@0 B3@0 W3@0",
        "F0@1 F1@1 B0@1 F2@1 B1@1 W0@1 F3@1 B2@1 W1@1 B3@1 W2@1 W3@1",
        "F0@2 B0@2 F1@2 B1@2 F2@2 B2@2 W0@2 F3@2 B3@2 W1@2 W2@2 W3@2",
    ]


def test_zb_v_k2_m4_exact_table() -> None:
    s = zb_v(2, 4)
    assert s.num_stages == 4 and s.virtual_stages == 2 and s.placement == (0, 1, 1, 0)
    assert table(s) == [
        "F0@0 F1@0 F2@0 F0@3 B0@3 W0@3 F1@3 B0@0 B1@3 W0@0 F3@0 B1@0 W1@3 F2@3 B2@3 W1@0 "
        "W2@3 B2@0 W2@0 F3@3 B3@3 W3@3 B3@0 W3@0",
        "F0@1 F0@2 F1@1 F1@2 B0@2 B0@1 W0@2 F2@1 B1@2 B1@1 W0@1 F2@2 W1@2 F3@1 B2@2 B2@1 "
        "W1@1 F3@2 W2@2 W2@1 B3@2 B3@1 W3@2 W3@1",
    ]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])
def test_zb_v_holds_no_more_than_1f1b(k: int, m: int) -> None:
    # Worker w holds stages w and 2K-1-w, each half a 1F1B stage: at most 2K halves = K whole
    for worker in zb_v(k, m).actions:
        held = peak = 0
        for a in worker:  # a half stage's activations are held from its F to its W
            held += {"F": 1, "W": -1}.get(a.kind, 0)
            peak = max(peak, held)
        assert peak <= 2 * min(k, m)


def test_zb_v_needs_two_virtual_stages() -> None:
    with pytest.raises(ValueError, match=r"zb-v runs 2 stages per worker \(virtual_stages=2"):
        build_schedule("zb-v", 2, 4, 1)


def test_looped_gpipe_with_virtual_stages() -> None:
    s = fill_drain(2, 2, virtual_stages=2)
    assert s.is_fill_drain() and s.placement == (0, 1, 0, 1)
    assert table(s) == [
        "F0@0 F1@0 F0@2 F1@2 B1@2 B0@2 B1@0 B0@0",
        "F0@1 F1@1 F0@3 F1@3 B1@3 B0@3 B1@1 B0@1",
    ]


def _sizes() -> list[tuple[str, int, int, int]]:
    cases = []
    for k in range(1, 9):
        for m in range(1, 17):
            cases += [("gpipe", k, m, 1), ("1f1b", k, m, 1), ("zb-h1", k, m, 1)]
            cases += [("gpipe", k, m, 2), ("zb-v", k, m, 2)]
            if m % k == 0:
                cases += [("interleaved", k, m, v) for v in (2, 3, 4)]
    return cases


@pytest.mark.slow
def test_every_schedule_validates_for_k_up_to_8_and_m_up_to_16() -> None:
    for name, k, m, v in _sizes():
        s = build_schedule(name, k, m, v)  # build_schedule validates
        validate(s)
        assert s.num_stages == k * v and s.num_workers == k
        ws = sum(a.kind == "W" for w in s.actions for a in w)
        assert ws == {"zb-h1": k * m, "zb-v": 2 * k * m}.get(name, 0)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])
def test_in_flight_micro_batches(k: int, m: int) -> None:
    assert in_flight(fill_drain(k, m)) == [m] * k
    assert in_flight(one_f_one_b(k, m)) == [min(k - s, m) for s in range(k)]
    assert max(in_flight(zb_h1(k, m))) <= min(k, m)


def test_interleaved_rejects_m_not_multiple_of_k() -> None:
    with pytest.raises(ValueError, match=r"chunks=6\) to be a multiple of the number of workers"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="virtual_stages >= 2"):
        build_schedule("interleaved", 2, 4, 1)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_one_stage_schedules_reject_virtual_stages(name: str) -> None:
    with pytest.raises(ValueError, match="use 'interleaved' for virtual stages"):
        build_schedule(name, 2, 4, 2)


def test_names_registry() -> None:
    assert SCHEDULE_NAMES == ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
    with pytest.raises(ValueError, match="choose one of"):
        build_schedule("zigzag", 2, 2)


def _custom(actions: list[list[Action]], placement: tuple[int, ...] = (0, 1)) -> Schedule:
    return Schedule("custom", len(placement), 1, tuple(tuple(w) for w in actions), placement)


def test_fill_drain_over_another_schedules_placement() -> None:
    # the forward door and the F-only phase of a ZB-V pipe: fill-drain on its V placement
    s = fill_drain(2, 2, 2, placement=(0, 1, 1, 0))
    validate(s)
    assert table(s) == [
        "F0@0 F1@0 F0@3 F1@3 B1@3 B0@3 B1@0 B0@0",
        "F0@1 F1@1 F0@2 F1@2 B1@2 B0@2 B1@1 B0@1",
    ]


def test_validator_rejects_w_before_its_b() -> None:
    f0, f1, b0, b1 = Action("F", 0, 0), Action("F", 1, 0), Action("B", 0, 0), Action("B", 1, 0)
    bad = _custom([[f0, Action("W", 0, 0), b0], [f1, b1]])
    with pytest.raises(ValueError, match="deadlocks; waiting: W0@0"):
        validate(bad)
    dup = _custom([[f0, b0, Action("W", 0, 0), Action("W", 0, 0)], [f1, b1]])
    with pytest.raises(ValueError, match="runs W0@0 more than once"):
        validate(dup)
    wrong_worker = _custom([[f0, b0], [f1, b1, Action("W", 0, 0)]])
    with pytest.raises(ValueError, match="W0@0 is on worker 1"):
        validate(wrong_worker)


def test_validator_checks_placement_of_virtual_stages() -> None:
    actions = [[Action("F", s, 0) for s in (0, 2)] + [Action("B", s, 0) for s in (2, 0)]]
    actions.append([Action("F", 1, 0), Action("B", 1, 0)])
    with pytest.raises(ValueError, match="places 2 stages, but has 3"):
        validate(Schedule("custom", 3, 1, tuple(tuple(w) for w in actions), (0, 1)))
    with pytest.raises(ValueError, match="stage 2 is placed on worker 5"):
        validate(Schedule("custom", 3, 1, tuple(tuple(w) for w in actions), (0, 1, 5)))
    # a looped order that waits for a later virtual stage first deadlocks
    looped = [[Action("F", 0, 0), Action("F", 2, 0), Action("B", 0, 0), Action("B", 2, 0)]]
    looped.append([Action("F", 1, 0), Action("B", 1, 0)])
    with pytest.raises(ValueError, match="deadlocks"):
        validate(Schedule("custom", 3, 1, tuple(tuple(w) for w in looped), (0, 1, 0)))


@pytest.mark.parametrize(("k", "m", "v", "bubble"), [(4, 8, 1, 3 / 11), (4, 8, 2, 3 / 19)])
def test_expected_bubble_with_virtual_stages(k: int, m: int, v: int, bubble: float) -> None:
    assert expected_bubble(k, m, v) == pytest.approx(bubble)
