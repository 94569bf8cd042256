"""The trainer's prompt order: a seeded permutation per epoch, resumable from a cursor."""

from __future__ import annotations

from forkrl.data.order import DataOrder
from forkrl.data.tasks import make_split


def test_order_resumes_from_a_cursor_and_each_epoch_is_a_permutation() -> None:
    problems = make_split("sum3", "train", 10, seed=0)
    straight = [p.prompt for p in DataOrder(problems, seed=3).take(25)]
    resumed = DataOrder(problems, seed=3, cursor=13)
    assert [p.prompt for p in resumed.take(12)] == straight[13:]
    assert resumed.cursor == 25
    for epoch in range(2):
        assert sorted(straight[10 * epoch: 10 * epoch + 10]) == sorted(p.prompt for p in problems)
    assert straight[:10] != straight[10:20]  # a new shuffle each epoch
    assert straight != [p.prompt for p in DataOrder(problems, seed=4).take(25)]
