"""A tensor-parallel stage's default prompt-cache bound is shared by its ranks on one
host: each rank holds about as many bytes as rank 0's store counts."""

from __future__ import annotations

import pytest

from mlxceld.workers.stage import ranks_here


@pytest.mark.parametrize(("hosts", "ranks"), [
    ((), 1),  # a stage of its own
    (("127.0.0.1:5000", "127.0.0.1:5001"), 2),  # tp_size 2 within one host
    (("10.0.0.1:5000", "10.0.0.2:5000"), 1),  # ranks across hosts
    (("10.0.0.1:5000", "10.0.0.1:5001", "10.0.0.2:5000", "10.0.0.2:5001"), 2),
    (("[fe80::1]:5000", "[fe80::1]:5001", "[fe80::2]:5000"), 2),
])
def test_the_ranks_on_rank_0s_host_share_its_default_bound(hosts: tuple[str, ...],
                                                           ranks: int) -> None:
    assert ranks_here(hosts) == ranks
