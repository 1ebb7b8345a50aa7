"""The held-out choice: a pure function of the sample id, in the core, tested without Prefect."""

from eaglet.split import heldout_ids, is_heldout


def test_heldout_ids_are_the_same_whatever_the_order_or_the_run():
    ids = [f"s{i:04d}" for i in range(2000)]
    chosen = heldout_ids(ids, 0.1)
    assert chosen == heldout_ids(reversed(ids), 0.1)
    assert chosen == {i for i in ids if is_heldout(i, 0.1)}
    assert 150 < len(chosen) < 250  # about the fraction asked for
    assert heldout_ids(ids, 0.0) == set() and heldout_ids(ids, 1.0) == set(ids)


def test_the_turns_of_a_conversation_are_held_out_together():
    ids = [f"c{i}" for i in range(200)]
    turns = [f"{i}#turn{n}" for i in ids for n in (2, 3)]
    chosen = heldout_ids(ids + turns, 0.3)
    assert {t for t in turns if t.split("#")[0] in chosen} == chosen - set(ids)
