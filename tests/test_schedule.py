"""The schedule is pure: check its safety properties by simulation."""
import itertools
import random

import pytest

from weightstream.offload.schedule import Schedule


def simulate(sched: Schedule, steps: int):
    """Run ``steps`` steps; return (slot contents seen by each compute, loads issued)."""
    contents = {}  # slot -> (position, block) loaded there last
    writers_since = {}  # slot -> positions loaded into the slot since its current content
    issued = []
    for load in sched.priming():
        assert load.after_position is None
        contents[load.slot] = (load.position, load.block)
        issued.append(load)
    seen = []
    for p in range(steps * sched.n):
        slot = sched.slot_at(p)
        pos, block = contents[slot]
        # the slot holds exactly this position's block, loaded for this position
        assert pos == p and block == sched.block_at(p), (p, slot, contents[slot])
        seen.append((p, slot, block))
        nxt = sched.after_compute(p)
        # the next load into this slot waits for this compute, nothing else
        assert nxt.slot == slot and nxt.after_position == p
        contents[nxt.slot] = (nxt.position, nxt.block)
        issued.append(nxt)
    return seen, issued


@pytest.mark.parametrize("num_blocks", range(2, 10))
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_slot_reuse_never_overlaps(num_blocks, slots):
    for resident in range(num_blocks):
        sched = Schedule(num_blocks, resident, slots)
        seen, issued = simulate(sched, steps=3)
        # every streamed block computes once per step, in order
        blocks = [b for _, _, b in seen]
        assert blocks == list(sched.streamed) * 3
        # resident blocks are never loaded
        assert all(ld.block >= resident for ld in issued)
        assert sched.resident_blocks == tuple(range(resident)) and sched.num_resident == resident
        # at most `slots` loads are outstanding (issued, not yet computed) at a time
        for p in range(len(seen)):
            outstanding = [ld for ld in issued if ld.position > p and ld.position <= p + sched.ring_slots]
            assert len({ld.slot for ld in outstanding}) == len(outstanding) <= sched.ring_slots


def test_last_block_prefetches_first_of_next_step():
    sched = Schedule(5, 0, 2)
    assert sched.after_compute(3).block == 0 and sched.after_compute(3).position == 5
    assert sched.after_compute(4).block == 1


def test_odd_block_count_alternates_slots_between_steps():
    sched = Schedule(3, 0, 2)
    first = [sched.slot_at(p) for p in range(3)]
    second = [sched.slot_at(p) for p in range(3, 6)]
    assert first == [0, 1, 0] and second == [1, 0, 1]


def test_resident_blocks_shift_the_ring():
    sched = Schedule(6, 2, 2)
    assert sched.streamed == (2, 3, 4, 5)
    assert [ld.block for ld in sched.priming()] == [2, 3]
    assert sched.after_compute(3).block == 3  # last streamed block prefetches the second


def test_slots_capped_by_streamed_blocks():
    assert Schedule(4, 3, 2).ring_slots == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_blocks=0), "num_blocks=0"),
        (dict(num_blocks=3, resident=3), "resident_layers=3"),
        (dict(num_blocks=3, resident=-1), "resident_layers=-1"),
        (dict(num_blocks=3, num_slots=0), "num_slots=0"),
        (dict(num_blocks=True), "must be an int"),
    ],
)
def test_rejections(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Schedule(**kwargs)


def simulate_step_local(sched: Schedule, steps: int):
    contents, seen = {}, []
    for step in range(steps):
        for load in sched.step_start(step):  # issued when the step starts
            assert load.after_position is None and sched.step_of(load.position) == step
            contents[load.slot] = (load.position, load.block)
        for k in range(sched.n):
            p = step * sched.n + k
            slot = sched.slot_at(p)
            assert contents[slot] == (p, sched.block_at(p)), (p, contents)
            seen.append((step, slot, sched.block_at(p)))
            nxt = sched.after_compute(p)
            if nxt is not None:  # only within the step, into the slot just freed
                assert sched.step_of(nxt.position) == step and nxt.slot == slot and nxt.after_position == p
                contents[nxt.slot] = (nxt.position, nxt.block)
            else:
                assert k + sched.ring_slots >= sched.n
    return seen


@pytest.mark.parametrize("num_blocks", range(3, 10))
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_step_local_loads_stay_in_their_step(num_blocks, slots):
    for resident in range(1, num_blocks):
        sched = Schedule(num_blocks, resident, slots, step_local=True)
        seen = simulate_step_local(sched, steps=3)
        # every step uses the same slot pattern: one graph serves every step
        per_step = [[(s, b) for st, s, b in seen if st == step] for step in range(3)]
        assert per_step[0] == per_step[1] == per_step[2]
        assert sched.phase_period == 1


def test_step_local_must_be_a_bool():
    with pytest.raises(TypeError, match="step_local"):
        Schedule(4, 1, 2, step_local=1)


def simulate_defer_last(sched: Schedule, steps: int):
    """The CUDA-graph ring without resident blocks: as :func:`simulate`, except
    the load waiting for a step's last block is issued at the next step's start."""
    plain = Schedule(sched.num_blocks, sched.resident, sched.num_slots)
    contents, deferred = {}, []
    for load in sched.priming():
        assert load.after_position is None and load.position < sched.ring_slots - 1
        contents[load.slot] = (load.position, load.block)
    for step in range(steps):
        starts = sched.step_start(step)
        assert [ld.position for ld in starts] == [step * sched.n + sched.ring_slots - 1]
        for load in starts:
            assert load.after_position is None  # ordered after the previous step as a whole
            # the slot's previous reader is the previous step's last block: it has finished
            assert step == 0 or plain.load(load.position).after_position == step * sched.n - 1
            contents[load.slot] = (load.position, load.block)
            deferred.append(load.position)
        for k in range(sched.n):
            p = step * sched.n + k
            slot = sched.slot_at(p)
            assert slot == plain.slot_at(p)  # same ring, same phases
            assert contents[slot] == (p, sched.block_at(p)), (p, contents)
            nxt = sched.after_compute(p)
            if k == sched.n - 1:
                assert nxt is None  # deferred to the next step's start
                continue
            assert nxt == plain.after_compute(p)
            contents[nxt.slot] = (nxt.position, nxt.block)
    return deferred


@pytest.mark.parametrize("num_blocks", range(2, 10))
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_defer_last_moves_only_the_boundary_load(num_blocks, slots):
    sched = Schedule(num_blocks, 0, slots, defer_last=True)
    simulate_defer_last(sched, steps=4)
    assert sched.has_step_start and sched.phase_period == Schedule(num_blocks, 0, slots).phase_period
    assert len(sched.carried(1)) == sched.ring_slots - 1
    assert sched.refill(2) == [sched.load(2 * sched.n + i) for i in range(sched.ring_slots)]


def test_defer_last_and_step_local_exclude_each_other():
    with pytest.raises(ValueError, match="exclude each other"):
        Schedule(4, 1, 2, step_local=True, defer_last=True)
    with pytest.raises(TypeError, match="defer_last"):
        Schedule(4, 0, 2, defer_last="yes")


# -- any resident subset ---------------------------------------------------------------

def subsets(num_blocks: int, rng: random.Random, count: int):
    """Resident subsets of ``range(num_blocks)`` leaving one block streamed: all of
    them for small counts, else ``count`` random ones (with the edge cases)."""
    every = [c for k in range(num_blocks) for c in itertools.combinations(range(num_blocks), k)]
    if len(every) <= count:
        return every
    picked = rng.sample(every, count)
    return picked + [(), tuple(range(1, num_blocks)), tuple(range(num_blocks - 1))]


def check_outstanding(sched: Schedule, seen, issued):
    for p in range(len(seen)):
        outstanding = [ld for ld in issued if p < ld.position <= p + sched.ring_slots]
        assert len({ld.slot for ld in outstanding}) == len(outstanding) <= sched.ring_slots


@pytest.mark.parametrize("num_blocks", range(1, 11))
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_any_resident_subset_keeps_the_ring_safe(num_blocks, slots):
    rng = random.Random(num_blocks * 10 + slots)
    for res in subsets(num_blocks, rng, 40):
        sched = Schedule(num_blocks, res, slots)
        streamed = [b for b in range(num_blocks) if b not in res]
        assert sched.streamed == tuple(streamed) and sched.resident_blocks == tuple(sorted(res))
        assert sched.n == len(streamed) and sched.num_resident == len(res) and sched.first == streamed[0]
        assert [sched.index(b) for b in streamed] == list(range(len(streamed)))
        assert [sched.is_streamed(b) for b in range(num_blocks)] == [b not in res for b in range(num_blocks)]
        seen, issued = simulate(sched, steps=3)
        assert [b for _, _, b in seen] == streamed * 3  # every streamed block once per step, in order
        assert not {ld.block for ld in issued} & set(res)  # resident blocks are never loaded
        check_outstanding(sched, seen, issued)
        # slots depend only on positions: the same ring as the first-N schedule with as many streamed
        plain = Schedule(num_blocks, num_blocks - len(streamed), slots)
        assert [sched.slot_at(p) for p in range(3 * sched.n)] == [plain.slot_at(p) for p in range(3 * plain.n)]
        assert sched.phase_period == plain.phase_period


@pytest.mark.parametrize("num_blocks", range(2, 10))
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_step_local_with_any_resident_subset(num_blocks, slots):
    rng = random.Random(500 + num_blocks * 10 + slots)
    for res in subsets(num_blocks, rng, 30):
        if not res:
            continue
        sched = Schedule(num_blocks, res, slots, step_local=True)
        seen = simulate_step_local(sched, steps=3)
        per_step = [[(s, b) for st, s, b in seen if st == step] for step in range(3)]
        assert per_step[0] == per_step[1] == per_step[2]
        assert [b for _, b in per_step[0]] == list(sched.streamed)
        # the step-start loads are the step's first streamed blocks
        assert [ld.block for ld in sched.step_start(1)] == list(sched.streamed[: sched.ring_slots])
        assert sched.priming() == [] and sched.phase_period == 1


@pytest.mark.parametrize("num_blocks", range(2, 9))
def test_defer_last_with_any_resident_subset(num_blocks):
    rng = random.Random(900 + num_blocks)
    for slots in (1, 2, 3):
        for res in subsets(num_blocks, rng, 20):
            sched = Schedule(num_blocks, res, slots, defer_last=True)
            simulate_defer_last(sched, steps=3)


def test_subset_accessors_and_equality():
    sched = Schedule(6, (4, 1), 2)
    assert sched.resident == (1, 4) and sched.resident_blocks == (1, 4) and sched.num_resident == 2
    assert sched.streamed == (0, 2, 3, 5) and sched.first == 0 and sched.n == 4
    assert [sched.block_at(p) for p in range(6)] == [0, 2, 3, 5, 0, 2]
    assert sched.index(5) == 3
    assert [ld.block for ld in sched.priming()] == [0, 2]
    assert sched.after_compute(3).block == 2  # block 5 (last) frees its slot for block 2 of the next step
    # a prefix subset is the first-N schedule (the int form is kept for readers of .resident)
    assert Schedule(6, (0, 1), 2) == Schedule(6, 2, 2) and Schedule(6, frozenset({1, 0}), 2).resident == 2
    assert Schedule(6, [], 2).resident == 0 and Schedule(6, (), 2).first == 0
    assert hash(Schedule(6, [4, 1], 2)) == hash(sched) and Schedule(6, [4, 1], 2) == sched
    assert Schedule(6, (0, 1, 2, 3, 4), 3).ring_slots == 1 and Schedule(6, (1, 2, 3, 4, 5)).first == 0


@pytest.mark.parametrize("block, words", [
    (1, "block=1 is not streamed (resident)"),
    (6, "block=6 is not streamed (not a block index 0..5)"),
    (-1, "block=-1 is not streamed (not a block index 0..5)"),
])
def test_index_of_a_block_that_does_not_stream(block, words):
    with pytest.raises(ValueError) as e:
        Schedule(6, (1, 4), 2).index(block)
    assert words in str(e.value) and "[0, 2, 3, 5]" in str(e.value)


@pytest.mark.parametrize("resident, error, words", [
    ((0, 1, 2), ValueError, "keeps all 3 blocks resident; allowed: at most 2"),
    ((3,), ValueError, "block 3 is not allowed; allowed: block indices 0..2"),
    ((-1,), ValueError, "block -1 is not allowed"),
    ((1, 1), ValueError, "names a block twice"),
    ((1.0,), TypeError, "block 1.0 must be an int"),
    ((True,), TypeError, "block True must be an int"),
    ("1", TypeError, "Schedule.resident='1' must be an int or a tuple"),
    (True, TypeError, "Schedule.resident=True must be an int"),
    (None, TypeError, "Schedule.resident=None must be an int or a tuple"),
])
def test_subset_rejections_name_the_value(resident, error, words):
    with pytest.raises(error) as e:
        Schedule(3, resident, 2)
    assert words in str(e.value)
