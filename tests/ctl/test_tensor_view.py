"""`mlxctl status`'s lines for a tensor-parallel group across hosts (``tensor_view.py``):
pure, from the daemon's ``tensor`` as rank 0 and a rank host build it."""

from __future__ import annotations

from mlxctl.tensor_view import tensor_lines


def test_rank_0_shows_the_group_and_each_ranks_host_and_state() -> None:
    tensor = {"role": "rank0", "size": 2, "state": "down",
              "why": "tensor-parallel rank 1 on host 10.0.0.11:19000 is lost: gone",
              "ranks": [{"rank": 0, "agent": "10.0.0.10:19000", "ring": "10.0.0.10:40000",
                         "state": "exited", "error": None},
                        {"rank": 1, "agent": "10.0.0.11:19000", "ring": "10.0.0.11:40001",
                         "state": "lost", "error": "gone", "since": 1.0}]}
    assert tensor_lines(tensor) == [
        "tensor group of 2 ranks across hosts: down (tensor-parallel rank 1 on host "
        "10.0.0.11:19000 is lost: gone)",
        "  rank 0  10.0.0.10:19000  ring 10.0.0.10:40000  exited",
        "  rank 1  10.0.0.11:19000  ring 10.0.0.11:40001  lost: gone"]
    stage = {**tensor, "state": "formed", "why": None,
             "stage": {"layers": [0, 2], "node_id": "stage-0"}}
    assert tensor_lines(stage)[0] == ("tensor group of 2 ranks across hosts of stage stage-0 "
                                      "(layers [0, 2)): formed")


def test_a_rank_host_shows_its_rank_or_that_it_waits() -> None:
    assert tensor_lines({"role": "tensor_parallel_rank", "rank": 1, "size": 2,
                         "ring": "10.0.0.11:40001", "rank0": "10.0.0.10:40000",
                         "state": "running"}) == [
        "tensor rank 1 of 2: ring 10.0.0.11:40001, rank 0 at 10.0.0.10:40000, worker tp-1 "
        "running"]
    # a pipeline stage's rank (daemon/stage_peers.py): its stage and worker named
    assert tensor_lines({"role": "tensor_parallel_rank", "rank": 1, "size": 2,
                         "ring": "10.0.0.12:40001", "rank0": "10.0.0.10:40000",
                         "worker": "stage-tp-1",
                         "stage": {"layers": [2, 4], "node_id": "stage-1"},
                         "state": "running"}) == [
        "tensor rank 1 of 2 of stage stage-1 (layers [2, 4)): ring 10.0.0.12:40001, rank 0 "
        "at 10.0.0.10:40000, worker stage-tp-1 running"]
    assert tensor_lines({"role": "tensor_parallel_rank", "rank": None}) == [
        "tensor rank host: waiting for rank 0's daemon to ask it to join"]
    assert tensor_lines(None) == []
