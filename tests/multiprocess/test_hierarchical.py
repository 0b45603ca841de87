"""Hierarchical collectives on one machine as 2 "nodes" x 2 ranks (node boundary from the
environment), compared with gloo on the same inputs."""

import pytest
import torch
import torch.distributed as dist

from ringcoll.harness.launcher import spawn


def _inputs(rank, numel, dtype, op):
    idx = torch.arange(numel)
    if op == "PRODUCT":
        return ((idx + rank) % 2 + 1).to(dtype)
    return ((idx * 3 + rank * 5) % 7 - 3).to(dtype)  # small integers: every order is exact


FULL = [(torch.float32, op) for op in ("SUM", "PRODUCT", "MIN", "MAX", "AVG")] + \
       [(torch.int32, "SUM"), (torch.int32, "MAX"), (torch.bfloat16, "SUM"), (torch.bfloat16, "AVG")]
SHORT = [(torch.float32, "SUM"), (torch.int32, "MIN")]


def _hierarchical_vs_gloo(rank, world, layout, cases):
    import ringcoll
    from ringcoll.training.hierarchical import HierarchicalCommunicator

    failures = []
    node = layout[rank]
    with HierarchicalCommunicator(node_id=node, buffer_bytes=4096) as h:
        info = (h.num_nodes, h.local_size, h.node_index, h.local_rank)
        for dtype, op in cases:
            for n in (0, 5, 4 * 257 + 3):
                x = _inputs(rank, n, dtype, op)
                ours = x.clone()
                h.all_reduce(ours, op=getattr(ringcoll.ReduceOp, op))
                ref = x.clone()
                if op == "AVG":
                    dist.all_reduce(ref)
                    ref = ref / world
                else:
                    dist.all_reduce(ref, op=getattr(dist.ReduceOp, op))
                if not torch.equal(ours, ref):
                    failures.append(f"all_reduce {dtype} {op} n={n}")
                m = n // world + 1
                full = _inputs(rank, m * world, dtype, op)
                out = torch.empty(m, dtype=dtype)
                h.reduce_scatter_tensor(out, full, op=getattr(ringcoll.ReduceOp, op))
                ref = torch.empty(m, dtype=dtype)
                if op == "AVG":
                    dist.reduce_scatter_tensor(ref, full.clone())
                    ref = ref / world
                else:
                    dist.reduce_scatter_tensor(ref, full.clone(), op=getattr(dist.ReduceOp, op))
                if not torch.equal(out, ref):
                    failures.append(f"reduce_scatter {dtype} {op} m={m}")
        for dtype in dict.fromkeys(dtype for dtype, _ in cases):  # a set would differ in order between ranks
            for m in (0, 1, 333):
                x = _inputs(rank, m, dtype, "SUM")
                out = torch.empty(m * world, dtype=dtype)
                h.all_gather_into_tensor(out, x)
                ref = torch.empty(m * world, dtype=dtype)
                dist.all_gather_into_tensor(ref, x)
                if not torch.equal(out, ref):
                    failures.append(f"all_gather {dtype} m={m}")
    return info, failures


@pytest.mark.parametrize("layout,cases", [
    (("a", "a", "b", "b"), FULL),  # 2 nodes x 2 ranks, node-major rank order (as torchrun numbers them)
    (("a", "b", "a", "b"), SHORT),  # the same nodes with interleaved ranks: the regrouping matters
])
def test_two_nodes_of_two_match_gloo(layout, cases):
    results = spawn(_hierarchical_vs_gloo, 4, layout, cases, timeout=240)
    infos = [info for info, _ in results]
    assert {(n, l) for n, l, _, _ in infos} == {(2, 2)}
    assert sorted((node, local) for _, _, node, local in infos) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank, (_, failures) in enumerate(results):
        assert failures == [], (rank, failures[:10])


def _node_from_env(rank, world):
    from ringcoll.training.hierarchical import HierarchicalCommunicator

    with HierarchicalCommunicator() as h:  # LOCAL_WORLD_SIZE=2 from the environment
        t = torch.full((10,), float(rank))
        h.all_reduce(t)
        return h.num_nodes, h.local_size, t[0].item()


def test_node_boundary_from_local_world_size():
    assert spawn(_node_from_env, 4, env={"LOCAL_WORLD_SIZE": "2"}) == [(2, 2, 6.0)] * 4


def _uneven(rank, world):
    from ringcoll.training.hierarchical import HierarchicalCommunicator

    try:
        HierarchicalCommunicator(node_id="a" if rank < 2 else "b")
    except ValueError as e:
        return str(e)
    return "no error"


def test_uneven_nodes_are_refused():
    for message in spawn(_uneven, 3):
        assert message.startswith("HierarchicalCommunicator: every node needs the same number of ranks")


def _bad_sizes(rank, world):
    from ringcoll.training.hierarchical import HierarchicalCommunicator

    messages = []
    with HierarchicalCommunicator(node_id=rank // 2) as h:
        for call in (lambda: h.reduce_scatter_tensor(torch.empty(3), torch.empty(4 * 3 + 1)),
                     lambda: h.all_gather_into_tensor(torch.empty(4 * 3), torch.empty(3, dtype=torch.int32)),
                     lambda: h.all_reduce(torch.empty(4), op=dist.ReduceOp.BAND)):
            try:
                call()
                messages.append("no error")
            except (TypeError, ValueError) as e:
                messages.append(str(e))
    return messages


def test_bad_arguments_are_refused_by_name():
    for messages in spawn(_bad_sizes, 4):
        # The Communicator's checks and messages (one place: communicator.ArgumentChecks).
        assert messages[0].startswith("reduce_scatter_tensor: output has 3 elements, expected input size (13) / "
                                      "world_size (4)"), messages[0]
        assert messages[1] == "all_gather_into_tensor: output dtype torch.float32 differs from input dtype torch.int32", \
            messages[1]
        assert messages[2].startswith("all_reduce: unsupported reduction op"), messages[2]
