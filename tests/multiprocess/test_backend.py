"""init_process_group(backend="ringcoll"): routing, results against gloo, Work, errors.

One spawn per configuration -- (world 2, "ringcoll"), (world 3, "cpu:ringcoll") -- runs
every check inside the ranks and returns what it saw; the tests below assert on it (a
short third spawn checks the "cpu:ringcoll,cuda:ringcoll" form). The reference is gloo on the same ranks: a
``dist.new_group(backend="gloo")`` beside the ringcoll default group, same inputs.

Routing is observed through ``ringcoll.training.backend.call_counts``: a collective ringcoll
implements must add one to "ringcoll:<op>" and a collective it does not (all_to_all,
send/recv, gather, scatter) must leave every "ringcoll:*" count alone and still give the
right answer (the internal gloo group).
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import ringcoll
from ringcoll._types import torch_tensor_forms
from ringcoll.training import backend
from ringcoll.harness.launcher import spawn

SPAWN_TIMEOUT = 120.0
ENV = {"RINGCOLL_TIMEOUT": "60", "RINGCOLL_CHECK": None}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int8, torch.uint8, torch.int32, torch.int64]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND"]
CONFIGS = [(2, "ringcoll"), (3, "cpu:ringcoll")]
DEVICE_MAP = "cpu:ringcoll,cuda:ringcoll"  # accepted; one RingcollProcessGroup serves both

_all_gather_into_tensor, _reduce_scatter_tensor = torch_tensor_forms()


def _ringcoll_counts() -> dict:
    return {k: v for k, v in backend.call_counts.items() if k.startswith("ringcoll:")}


def _delta(before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in backend.call_counts.items() if v != before.get(k, 0)}


def _input(dtype, op, rank, n=7) -> torch.Tensor:
    """Values whose reduction is exact in every dtype and order (small integers; PRODUCT in
    {1, 2} so products stay tiny). AVG on integers goes to gloo, which refuses it."""
    base = torch.arange(n) + 3 * rank
    if op == "PRODUCT":
        return (1 + (base % 2)).to(dtype)
    if dtype == torch.uint8 or op == "BAND":
        return (base % 7).to(dtype)
    return (base % 9 - 4).to(dtype)


def _all_reduce_matrix(rank, gloo) -> dict:
    """dist.all_reduce of every op x dtype through the backend vs gloo: mismatching cases."""
    mismatches, routes = [], {}
    for dtype in DTYPES:
        for op in OPS:
            if op == "BAND" and dtype.is_floating_point:
                continue
            before = dict(backend.call_counts)
            ours, ref = _input(dtype, op, rank), _input(dtype, op, rank)
            ours_error = ref_error = None
            try:
                dist.all_reduce(ours, op=getattr(dist.ReduceOp, op))
            except RuntimeError as exc:  # gloo refuses AVG on integers; so must we
                ours_error = type(exc).__name__
            routes[f"{op}/{dtype}"] = sorted(_delta(before))
            try:
                dist.all_reduce(ref, op=getattr(dist.ReduceOp, op), group=gloo)
            except RuntimeError as exc:
                ref_error = type(exc).__name__
            if ours_error != ref_error or not torch.equal(ours, ref):
                mismatches.append(f"{op} {dtype}: ringcoll {ours.tolist()} ({ours_error}) "
                                  f"gloo {ref.tolist()} ({ref_error})")
    return {"mismatches": mismatches, "routes": routes}


def _implemented(rank, ws) -> dict:
    """Each collective ringcoll implements, through dist.*: its count and result."""
    seen = {}

    def record(name, fn):
        before = dict(backend.call_counts)
        value = fn()
        seen[name] = {"delta": _delta(before), "value": value}

    def rs_tensor():
        out = torch.empty(3)
        _reduce_scatter_tensor(out, torch.arange(3.0 * ws) * (rank + 1))
        return out

    def ag_tensor():
        out = torch.empty(2 * ws, dtype=torch.int32)
        _all_gather_into_tensor(out, torch.tensor([rank, 10 * rank], dtype=torch.int32))
        return out

    def ag_list():
        outs = [torch.empty(2) for _ in range(ws)]
        dist.all_gather(outs, torch.tensor([rank, -rank], dtype=torch.float32))
        return torch.stack(outs)

    def rs_list():
        out = torch.empty(2, dtype=torch.int64)
        dist.reduce_scatter(out, [torch.full((2,), rank * 100 + r) for r in range(ws)], op=dist.ReduceOp.MAX)
        return out

    def all_reduce():
        t = torch.full((5,), float(rank + 1))
        dist.all_reduce(t)
        return t

    # Built on first use; its segment-name exchange goes over gloo, not over itself.
    record("bootstrap", lambda: dist.group.WORLD.communicator().world_size)
    record("all_reduce", all_reduce)
    record("reduce_scatter_tensor", rs_tensor)
    record("all_gather_into_tensor", ag_tensor)
    record("all_gather", ag_list)
    record("reduce_scatter", rs_list)
    record("barrier", lambda: dist.barrier())

    def broadcast():
        t = torch.full((3,), float(rank))
        dist.broadcast(t, src=ws - 1)
        return t

    def reduce():
        t = torch.tensor([float(rank + 1)])
        dist.reduce(t, dst=0)
        return t

    def broadcast_object_list():  # c10d sends the sizes, then the pickled bytes: two broadcasts
        objs = [{"hello": "world"}] if rank == 0 else [None]
        dist.broadcast_object_list(objs, src=0)
        return objs[0]

    record("broadcast", broadcast)
    record("reduce", reduce)
    record("broadcast_object_list", broadcast_object_list)
    # Functional collectives (DTensor, torch.compile) call the coalesced tensor forms.
    import torch.distributed._functional_collectives as funcol

    record("funcol_all_reduce", lambda: funcol.all_reduce(
        torch.full((3,), float(rank)), "sum", dist.group.WORLD).wait())
    record("funcol_all_gather", lambda: funcol.all_gather_tensor(
        torch.full((2,), float(rank)), 0, dist.group.WORLD).wait())
    record("funcol_reduce_scatter", lambda: funcol.reduce_scatter_tensor(
        torch.arange(2.0 * ws), "sum", 0, dist.group.WORLD).wait())
    # The private spellings older torch calls (and FSDP1 used) land in the same place.
    record("_allgather_base", lambda: dist.group.WORLD._allgather_base(
        torch.empty(ws), torch.tensor([float(rank)])).wait())
    return seen


def _others(rank, ws) -> dict:
    """Collectives ringcoll does not implement: right answers, and no ringcoll call."""
    before = _ringcoll_counts()
    got = {}
    out = torch.empty(ws)
    dist.all_to_all_single(out, torch.arange(float(ws)) + 10 * rank)
    got["all_to_all_single"] = out
    if rank == 0:
        dist.send(torch.tensor([42.0]), dst=ws - 1)
    elif rank == ws - 1:
        r = torch.zeros(1)
        dist.recv(r, src=0)
        got["send_recv"] = r
    gathered = [torch.empty(1) for _ in range(ws)] if rank == 0 else None
    dist.gather(torch.tensor([float(rank)]), gathered, dst=0)
    if rank == 0:
        got["gather"] = torch.cat(gathered)
    s = torch.empty(1)
    dist.scatter(s, [torch.tensor([float(10 + r)]) for r in range(ws)] if rank == 0 else None, src=0)
    got["scatter"] = s
    # Not silently rerouted: ringcoll has no bitwise ops, gloo does.
    b = torch.tensor([0b1100 | rank])
    dist.all_reduce(b, op=dist.ReduceOp.BOR)
    got["all_reduce_bor"] = b
    # Shapes ringcoll does not take (non-contiguous) also go to gloo.
    nc = torch.arange(6.0).view(2, 3).t() * (rank + 1)
    dist.all_reduce(nc)
    got["all_reduce_noncontiguous"] = nc
    return {"got": got, "ringcoll_delta": {k: v - before.get(k, 0) for k, v in _ringcoll_counts().items()
                                           if v != before.get(k, 0)}}


def _overlapping_views(rank, ws) -> dict:
    """Input and output sharing memory, the smaller at chunk 0 of the larger on every rank:
    in place on rank 0 only. ringcoll's rank-dependent check raised on the others while rank
    0 waited on the ring; gloo computes it, reading the input before writing the output."""
    n = 4
    gathered = torch.arange(float(n * ws)) + 100 * rank
    dist.all_gather_into_tensor(gathered, gathered[:n])
    reduced = torch.arange(float(n * ws)) + 100 * rank
    dist.reduce_scatter_tensor(reduced[:n], reduced)
    return {"all_gather": gathered, "reduce_scatter": reduced[:n].clone()}


def _async_and_futures(rank, ws) -> dict:
    t = torch.full((1000,), float(rank))
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    ok = work.wait()
    value = fut.wait()
    return {"wait": ok, "completed": work.is_completed(), "tensor": t[:3],
            "future_is_output": value[0] is t if isinstance(value, list) else None}


RACE_TRIES = 200  # before the fix 7-16 of 300 tries saw the Future still pending after wait()


def _nested_chain(ws) -> list:
    """What torch's PowerSGD hook does: each `then` callback issues a collective and waits for
    it. The callbacks run on ringcoll's worker; the nested calls must run there in line
    instead of queueing behind the callback (which deadlocked: rank 0 timed out, the rest hung)."""
    t = torch.ones(8)

    def nested(fut):
        value = fut.value()  # the collective's Future holds [tensor]; a callback's, what it returned
        inner = (value[0] if isinstance(value, list) else value).clone()
        return dist.all_reduce(inner, async_op=True).get_future().wait()[0]

    fut = dist.all_reduce(t, async_op=True).get_future().then(nested).then(nested)
    return fut.wait().tolist()  # ws, then ws**2, then ws**3


def _profiled(ws) -> list:
    """The ring collectives a torch.profiler trace shows: (name, input dims, dtype, op) per event."""
    import json
    import os
    import tempfile

    t, out = torch.ones(64), torch.empty(64 * ws)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        dist.all_reduce(t)  # synchronous: the plain call's binding path when not profiled
        dist.all_reduce(t, async_op=True).wait()  # on the worker thread
        ringcoll.all_gather_into_tensor(out, t)
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return [(e["name"], e["args"].get("Input Dims"), e["args"].get("dtype"), e["args"].get("op"))
            for e in events if e.get("name", "").startswith("ringcoll:")]


def _work_semantics(rank, ws, gloo) -> dict:
    """torch's Work / Future contract, as gloo keeps it."""
    res = {}
    t = torch.ones(256)
    late = 0
    for _ in range(RACE_TRIES):  # wait() returns only once the Future is done
        work = dist.all_reduce(t, async_op=True)
        fut = work.get_future()
        work.wait()
        late += not fut.done()
        fut.value()
        ours = ringcoll.all_reduce(t, async_op=True)
        ours_fut = ours.get_future()
        ours.wait()
        late += not ours_fut.done()
    res["future_pending_after_wait"] = late
    res["nested_chain"] = _nested_chain(ws)

    # wait(timeout) past its time: a RuntimeError (as gloo's) and a TimeoutError naming the op.
    # Rank 1 calls only once rank 0's wait has timed out (the store says so): no sleep.
    store = dist.distributed_c10d._get_default_store()
    timeouts = []
    # ringcoll's Work takes seconds or, as torch's, a timedelta ("ringcoll timedelta")
    for form in ("c10d", "ringcoll", "ringcoll timedelta"):
        if rank == 1:
            store.wait([f"timed-out-{form}"])
        x = torch.ones(16)
        work = dist.all_reduce(x, async_op=True) if form == "c10d" else ringcoll.all_reduce(x, async_op=True)
        if rank == 0:
            try:
                work.wait(0.05 if form == "ringcoll" else datetime.timedelta(seconds=0.05))
                timeouts.append((form, "no error"))
            except Exception as exc:  # noqa: BLE001 -- the type is what is checked
                timeouts.append((form, type(exc).__name__, isinstance(exc, RuntimeError),
                                 isinstance(exc, TimeoutError), str(exc)))
            store.set(f"timed-out-{form}", "1")
        work.wait()
        timeouts.append((form, "then done", x[0].item()))
    res["timeouts"] = timeouts
    # A timeout in the call's options, as gloo honours it (ringcoll's ignored it: the call
    # waited for the late rank): the sync call raises past it, the collective goes on, and
    # the next call waits for it.
    if rank != 0:
        store.wait(["timed-out-options"])
    res["call_timeout"] = _outcome(lambda: dist.barrier(timeout=datetime.timedelta(seconds=0.05)))
    if rank == 0:
        store.set("timed-out-options", "1")
    x = torch.ones(16)
    dist.all_reduce(x)
    res["after_call_timeout"] = x[0].item()

    # _get_op_type(): the same as gloo's Work for the same call.
    pairs = {}
    for name, call in (("all_reduce", lambda g: dist.all_reduce(torch.ones(4), group=g, async_op=True)),
                       ("reduce_scatter_tensor", lambda g: _reduce_scatter_tensor(
                           torch.empty(2), torch.ones(2 * ws), group=g, async_op=True)),
                       ("all_gather_into_tensor", lambda g: _all_gather_into_tensor(
                           torch.empty(2 * ws), torch.ones(2), group=g, async_op=True))):
        ours, theirs = call(None), call(gloo)
        ours.wait()
        theirs.wait()
        pairs[name] = (ours._get_op_type(), theirs._get_op_type())
    res["op_types"] = pairs
    res["profiled"] = _profiled(ws)

    # A collective that fails under DDP ends in a RuntimeError, not a crash: the Future fails
    # as C++ sees a failure (Python's set_exception stored the error as the value: SIGSEGV).
    broken = dist.new_group(backend="ringcoll")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2), process_group=broken)
    res["break_it"] = _outcome(lambda: dist.all_reduce(torch.ones(4 + rank), group=broken))
    res["ddp_on_broken"] = _outcome(lambda: model(torch.ones(3, 4)).sum().backward())
    failed = dist.all_reduce(torch.ones(4), group=broken, async_op=True).get_future()
    res["future_on_broken"] = _outcome(failed.wait)
    return res


def _outcome(fn) -> tuple:
    """(exception type name, message), or ("no error", "")."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 -- the outcome is what is checked
        return type(exc).__name__, str(exc)
    return "no error", ""


def _subgroup(rank, ws) -> dict:
    sub = dist.new_group(ranks=[0, 1], backend="ringcoll")
    inherited = dist.new_group(ranks=list(range(ws)))  # no backend: the default one
    res = {"inherited_type": type(inherited).__name__}
    if rank in (0, 1):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=sub)
        res["sub_all_reduce"] = t.item()
        res["sub_type"] = type(sub).__name__
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=inherited)
    res["inherited_all_reduce"] = t.item()
    return res


def _errors(rank, ws) -> dict:
    """A ringcoll runtime error reaches the caller: sync from dist.all_reduce, async from wait()."""
    res = {}
    # A root outside the group: gloo's RuntimeError (ringcoll's check raised ValueError,
    # which `except RuntimeError` missed); nothing breaks
    res["bad_roots"] = [_outcome(lambda: dist.broadcast(torch.ones(2), src=ws)),
                        _outcome(lambda: dist.reduce(torch.ones(2), dst=ws))]
    try:  # sizes differ across ranks: mismatch detection raises on every rank, nothing moves
        dist.all_reduce(torch.ones(4 + rank))
        res["sync"] = "no error"
    except ringcoll.RingcollError as exc:
        res["sync"] = type(exc).__name__
    work = dist.all_reduce(torch.ones(4), async_op=True)  # the communicator is now broken
    try:
        work.wait()
        res["async"] = "no error"
    except ringcoll.RingcollError as exc:
        res["async"] = type(exc).__name__
    return res


def _rank_fn(rank: int, ws: int, backend_string: str) -> dict:
    pg = dist.group.WORLD
    out = {"type": type(pg).__name__, "backend": str(dist.get_backend()), "name": pg.name(),
           "backend_string": backend_string}
    gloo = dist.new_group(backend="gloo")
    out["implemented"] = _implemented(rank, ws)
    out["others"] = _others(rank, ws)
    before = dict(backend.call_counts)
    out["overlapping"] = _overlapping_views(rank, ws)
    out["overlapping_on_ringcoll"] = _delta(before)
    out["matrix"] = _all_reduce_matrix(rank, gloo)
    out["async"] = _async_and_futures(rank, ws)
    out["subgroup"] = _subgroup(rank, ws)
    out["work"] = _work_semantics(rank, ws, gloo)
    out["errors"] = _errors(rank, ws)
    comm = pg.communicator()
    # The module-level drop-ins reuse the group's ring instead of building a second one.
    import ringcoll

    out["module_level_reuses_ring"] = ringcoll.get_communicator() is comm
    dist.destroy_process_group(pg)
    out["closed_on_destroy"] = pg._comms == {} and comm._closed
    dist.init_process_group("gloo")  # spawn destroys the group itself at the end
    return out


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"world{c[0]}-{c[1]}")
def runs(request):
    ws, backend_string = request.param
    # A gloo-level hang (the process group timeout) then raises with a traceback instead of
    # running into the spawn timeout.
    return ws, spawn(_rank_fn, ws, backend_string, timeout=SPAWN_TIMEOUT, backend=backend_string, env=ENV,
                     init_timeout=60)


def test_registered_on_import():
    assert "ringcoll" in dist.Backend.backend_list
    assert dist.Backend.RINGCOLL == "ringcoll"
    backend.register()  # idempotent
    assert dist.Backend.backend_list.count("ringcoll") == 1


def test_default_group_is_ringcoll(runs):
    _, outs = runs
    for out in outs:
        assert out["module_level_reuses_ring"]
        assert out["type"] == "RingcollProcessGroup"
        assert out["backend"] == out["backend_string"]  # torch reports the string as given
        assert out["name"] == "ringcoll"


def test_implemented_collectives_run_on_ringcoll(runs):
    ws, outs = runs
    expected = {
        "all_reduce": torch.full((5,), ws * (ws + 1) / 2),
        "all_gather_into_tensor": torch.tensor([v for r in range(ws) for v in (r, 10 * r)], dtype=torch.int32),
        "all_gather": torch.tensor([[float(r), float(-r)] for r in range(ws)]),
    }
    for rank, out in enumerate(outs):
        seen = out["implemented"]
        assert seen["bootstrap"]["value"] == ws
        assert set(seen["bootstrap"]["delta"]) == {"gloo:all_gather"}, seen["bootstrap"]["delta"]
        for name in ["all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather",
                     "reduce_scatter", "barrier", "broadcast", "reduce"]:
            assert seen[name]["delta"] == {f"ringcoll:{name}": 1}, (rank, name, seen[name]["delta"])
        assert seen["broadcast_object_list"]["delta"] == {"ringcoll:broadcast": 2}
        assert seen["broadcast_object_list"]["value"] == {"hello": "world"}
        assert torch.equal(seen["broadcast"]["value"], torch.full((3,), float(ws - 1)))
        # the root gets the sum; every other rank keeps its tensor
        assert seen["reduce"]["value"].item() == (ws * (ws + 1) / 2 if rank == 0 else rank + 1)
        assert seen["_allgather_base"]["delta"] == {"ringcoll:all_gather_into_tensor": 1}
        assert seen["funcol_all_reduce"]["delta"] == {"ringcoll:all_reduce": 1}
        assert seen["funcol_all_gather"]["delta"] == {"ringcoll:all_gather_into_tensor_coalesced": 1}
        assert seen["funcol_reduce_scatter"]["delta"] == {"ringcoll:reduce_scatter_tensor_coalesced": 1}
        assert torch.equal(torch.as_tensor(seen["funcol_all_reduce"]["value"]), torch.full((3,), ws * (ws - 1) / 2))
        assert torch.equal(torch.as_tensor(seen["funcol_all_gather"]["value"]),
                           torch.tensor([float(r) for r in range(ws) for _ in range(2)]))
        assert torch.equal(torch.as_tensor(seen["funcol_reduce_scatter"]["value"]),
                           torch.tensor([2.0 * rank, 2.0 * rank + 1]) * ws)
        for name, want in expected.items():
            assert torch.equal(seen[name]["value"], want), (rank, name, seen[name]["value"])
        # rank k gets chunk k of sum_r (r+1) * arange(3P)
        chunk = torch.arange(3.0 * ws)[3 * rank:3 * rank + 3] * (ws * (ws + 1) / 2)
        assert torch.equal(seen["reduce_scatter_tensor"]["value"], chunk)
        assert torch.equal(seen["reduce_scatter"]["value"], torch.full((2,), (ws - 1) * 100 + rank))


def test_other_collectives_go_to_gloo(runs):
    ws, outs = runs
    for rank, out in enumerate(outs):
        others = out["others"]
        assert others["ringcoll_delta"] == {}, (rank, others["ringcoll_delta"])
        got = others["got"]
        assert torch.equal(got["all_to_all_single"], torch.tensor([float(rank + 10 * r) for r in range(ws)]))
        assert torch.equal(got["scatter"], torch.tensor([float(10 + rank)]))
        bor = 0
        for r in range(ws):
            bor |= 0b1100 | r
        assert got["all_reduce_bor"].item() == bor
        assert torch.equal(got["all_reduce_noncontiguous"], torch.arange(6.0).view(2, 3).t() * (ws * (ws + 1) / 2))
        if rank == 0:
            assert torch.equal(got["gather"], torch.arange(float(ws)))
        if rank == ws - 1:
            assert got["send_recv"].item() == 42.0


def test_input_and_output_overlapping_off_this_ranks_chunk_compute_as_on_gloo(runs):
    ws, outs = runs
    n = 4
    for rank, out in enumerate(outs):
        got = out["overlapping"]
        assert torch.equal(got["all_gather"], torch.cat([torch.arange(float(n)) + 100 * r for r in range(ws)]))
        assert torch.equal(got["reduce_scatter"], sum(torch.arange(float(n * ws))[rank * n:(rank + 1) * n] + 100 * r
                                                      for r in range(ws)))
        assert out["overlapping_on_ringcoll"] == {"ringcoll:all_gather_into_tensor": 1,
                                                  "ringcoll:reduce_scatter_tensor": 1}, out["overlapping_on_ringcoll"]


def test_all_reduce_every_op_and_dtype_equals_gloo(runs):
    _, outs = runs
    for rank, out in enumerate(outs):
        assert out["matrix"]["mismatches"] == [], (rank, out["matrix"]["mismatches"])


def test_all_reduce_routes_by_op_and_dtype(runs):
    _, outs = runs
    routes = outs[0]["matrix"]["routes"]
    for dtype in DTYPES:
        for op in ["SUM", "PRODUCT", "MIN", "MAX"]:
            assert routes[f"{op}/{dtype}"] == ["ringcoll:all_reduce"], (op, dtype)
        avg = routes[f"AVG/{dtype}"]
        assert avg == (["ringcoll:all_reduce"] if dtype.is_floating_point else ["gloo:all_reduce"]), (dtype, avg)
        if not dtype.is_floating_point:
            assert routes[f"BAND/{dtype}"] == ["gloo:all_reduce"]


def test_async_work_and_future(runs):
    ws, outs = runs
    total = ws * (ws - 1) / 2
    for out in outs:
        a = out["async"]
        assert a["wait"] is True and a["completed"] is True
        assert torch.equal(a["tensor"], torch.full((3,), total))
        assert a["future_is_output"] is True


def test_wait_returns_only_once_the_future_is_done(runs):
    _, outs = runs
    assert [out["work"]["future_pending_after_wait"] for out in outs] == [0] * len(outs)


def test_collectives_issued_and_waited_in_future_callbacks(runs):
    ws, outs = runs
    for out in outs:
        assert out["work"]["nested_chain"] == [float(ws) ** 3] * 8


def test_wait_timeout_is_a_runtime_error_naming_the_op(runs):
    ws, outs = runs
    for rank, out in enumerate(outs):
        timeouts = out["work"]["timeouts"]
        done = [entry for entry in timeouts if entry[1] == "then done"]
        assert done == [(form, "then done", float(ws)) for form in ("c10d", "ringcoll", "ringcoll timedelta")], \
            timeouts
        if rank == 0:
            for form in ("c10d", "ringcoll", "ringcoll timedelta"):
                [(_, kind, is_runtime, is_timeout, message)] = [e for e in timeouts if e[0] == form and len(e) == 5]
                assert kind == "RingcollTimeoutError" and is_runtime and is_timeout, (form, kind)
                assert message.startswith("all_reduce: Work.wait(timeout=0.05 s) timed out"), message
        kind, message = out["work"]["call_timeout"]
        assert out["work"]["after_call_timeout"] == float(ws)
        if rank == 0:
            assert kind == "RingcollTimeoutError" and message.startswith("barrier: Work.wait(timeout=0.05 s) timed out")
        else:
            assert kind == "no error", message


def test_work_reports_its_op_type_as_gloo_does(runs):
    """gloo's where gloo's Work names one; its reduce_scatter_tensor says UNKNOWN, NCCL's
    _REDUCE_SCATTER_BASE."""
    _, outs = runs
    op_type = torch._C._distributed_c10d.OpType
    expected = {"all_reduce": op_type.ALLREDUCE, "reduce_scatter_tensor": op_type._REDUCE_SCATTER_BASE,
                "all_gather_into_tensor": op_type.ALLGATHER}
    for out in outs:
        for name, (ours, gloos) in out["work"]["op_types"].items():
            assert ours == int(expected[name]), (name, ours)
            assert gloos in (ours, int(op_type.UNKNOWN)), (name, gloos)


def test_ring_collectives_appear_in_a_profiler_trace(runs):
    ws, outs = runs
    for out in outs:
        seen = out["work"]["profiled"]
        assert ("ringcoll:all_reduce", [[64]], "float32", "SUM") in seen, seen
        assert [e[0] for e in seen].count("ringcoll:all_reduce") == 2, seen  # the sync and the async call
        assert ("ringcoll:all_gather_into_tensor", [[64]], "float32", None) in seen, seen


def test_a_failed_collective_under_ddp_raises_instead_of_crashing(runs):
    _, outs = runs
    for out in outs:
        work = out["work"]
        assert work["break_it"][0] == "RingcollMismatchError", work["break_it"]
        kind, message = work["ddp_on_broken"]
        assert kind == "RuntimeError" and "RingcollError" in message and "communicator is broken" in message, message
        kind, message = work["future_on_broken"]
        assert kind == "RuntimeError" and "RingcollError: all_reduce: communicator is broken" in message, message


def test_subgroups(runs):
    ws, outs = runs
    for rank, out in enumerate(outs):
        sub = out["subgroup"]
        assert sub["inherited_type"] == "RingcollProcessGroup"
        assert sub["inherited_all_reduce"] == ws
        if rank in (0, 1):
            assert sub["sub_type"] == "RingcollProcessGroup"
            assert sub["sub_all_reduce"] == 3.0


def test_errors_reach_the_caller(runs):
    _, outs = runs
    for out in outs:
        assert out["errors"]["sync"] == "RingcollMismatchError"
        for (kind, message), name in zip(out["errors"]["bad_roots"], ("broadcast", "reduce")):
            assert kind == "RuntimeError" and f"{name}: invalid root rank" in message, (kind, message)
        assert out["errors"]["async"] in ("RingcollError", "RingcollMismatchError")


def test_destroy_process_group_releases_the_communicator(runs):
    _, outs = runs
    assert all(out["closed_on_destroy"] for out in outs)


def _device_map_fn(rank: int, ws: int) -> dict:
    t = torch.tensor([float(rank)])
    before = dict(backend.call_counts)
    dist.all_reduce(t)
    return {"type": type(dist.group.WORLD).__name__, "sum": t.item(),
            "ringcoll_calls": _delta(before).get("ringcoll:all_reduce", 0)}


def test_a_group_timeout_past_ringcolls_bound_is_taken_as_the_bound():
    """init_process_group(timeout=50 years): gloo takes it; ringcoll's first collective raised
    ValueError (its bound is 1e9 s)."""
    fifty_years = 50 * 365 * 86400.0
    outs = spawn(_device_map_fn, 2, timeout=SPAWN_TIMEOUT, backend="ringcoll", env=ENV, init_timeout=fifty_years)
    assert [(out["sum"], out["ringcoll_calls"]) for out in outs] == [(1.0, 1), (1.0, 1)]


def test_device_map_form():
    outs = spawn(_device_map_fn, 2, timeout=SPAWN_TIMEOUT, backend=DEVICE_MAP, env=ENV)
    assert outs == [{"type": "RingcollProcessGroup", "sum": 1.0, "ringcoll_calls": 1}] * 2


def _many_forwarded_calls(rank, ws, loops):
    """Calls ringcoll leaves to gloo, many times over: through c10d's own dispatch on this
    Python subclass they deadlocked now and then (a lock-order inversion between the GIL
    and gloo's queue mutex, bench/c10d_python_pg_deadlock.py), which is why backend.py
    forwards them itself."""
    import warnings
    for i in range(loops):
        objs = [{"call": i}] if rank == 0 else [None]
        dist.broadcast_object_list(objs, src=0)
        if objs[0] != {"call": i}:
            return f"call {i}: got {objs[0]}"
        gathered = [torch.empty(1) for _ in range(ws)] if rank == 0 else None
        dist.gather(torch.tensor([float(rank)]), gathered, dst=0)
        if rank == 0 and torch.cat(gathered).tolist() != list(range(ws)):
            return f"call {i}: gather gave {gathered}"
        s = torch.empty(1)
        dist.scatter(s, [torch.tensor([float(r)]) for r in range(ws)] if rank == 0 else None, src=0)
        if s.item() != rank:
            return f"call {i}: scatter gave {s.item()}"
        if i % 10 == 0:
            pair = [torch.ones(2), torch.ones(3)]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # deprecated in torch, still served
                dist.all_reduce_coalesced(pair)
            if not all(bool((t == ws).all()) for t in pair):
                return f"call {i}: all_reduce_coalesced gave {pair}"
    # Not left to c10d's dispatch: forwarded to gloo by the backend, or (all_reduce_coalesced)
    # run on the ring.
    handled = {route: backend.call_counts[route]
               for route in ("gloo:gather", "gloo:scatter", "ringcoll:all_reduce_coalesced")}
    if min(handled.values()) == 0:
        return f"not handled by ringcoll's backend itself: {handled}"
    return "ok"


def test_forwarded_collectives_do_not_deadlock():
    # Before the forwarding, 300 rounds hung in the first or second of three launches.
    assert spawn(_many_forwarded_calls, 2, 300, timeout=120, backend="ringcoll", env=ENV, init_timeout=30) == \
        ["ok", "ok"]


# --- every call form c10d's ProcessGroup accepts, and the caller's thread state ------------

def _call_forms(pg, rank, ws) -> tuple:
    """Each ProcessGroup call form on `pg`, waited for: ({form: the tensors it produced},
    {form: (wait()'s value, is_completed(), is_success(), exception()) after the wait},
    how far the group's sequence number moved meanwhile)."""
    MAX, SUM = dist.ReduceOp.MAX, dist.ReduceOp.SUM
    got, works = {}, {}
    first_call = pg._get_sequence_number_for_group()

    def run(name, fn, *tensors):
        work = fn()
        if isinstance(work, dist.distributed_c10d._CoalescingManager):
            (work,) = work.works  # the one call the coalesced calls became
        returned = work.wait()
        got[name] = [t.clone() for t in tensors]
        works[name] = (returned, work.is_completed(), work.is_success(), work.exception())

    def coalesced(name, *pairs):
        """torch's coalescing manager over `pairs` of (dist function, its arguments), async."""
        def calls():
            with dist.distributed_c10d._coalescing_manager(group=pg, async_ops=True) as manager:
                for fn, args, kw in pairs:
                    fn(*args, group=pg, **kw)
            return manager
        run(name, calls, *[t for _, args, _ in pairs for t in args[:1]])

    base = lambda: torch.arange(5.0) * (rank + 1) - rank  # noqa: E731
    t = base(); run("allreduce(t, op=MAX)", lambda: pg.allreduce(t, op=MAX), t)
    t = base(); run("allreduce([t], op=MAX)", lambda: pg.allreduce([t], op=MAX), t)
    t = base(); run("allreduce([t], MAX)", lambda: pg.allreduce([t], MAX), t)
    t = base(); run("allreduce(t)", lambda: pg.allreduce(t), t)
    t = base(); run("broadcast(t, root=0)", lambda: pg.broadcast(t, root=0), t)
    t = base(); run("broadcast(t, 1)", lambda: pg.broadcast(t, ws - 1), t)
    t = base(); run("reduce(t, root=0, op=SUM)", lambda: pg.reduce(t, root=0, op=SUM), t if rank == 0 else base())
    t = base(); run("reduce(t, 1, MAX)", lambda: pg.reduce(t, ws - 1, MAX), t if rank == ws - 1 else base())
    t = base(); run("reduce([t], opts)", lambda: pg.reduce([t], _c10d_options("ReduceOptions")), t if rank == 0 else base())
    t = base(); run("broadcast([t], opts)", lambda: pg.broadcast([t], _c10d_options("BroadcastOptions")), t)
    outs, t = [torch.empty(5) for _ in range(ws)], base()
    run("allgather(outs, t)", lambda: pg.allgather(outs, t), *outs)
    out, ins = torch.empty(5), [base() + r for r in range(ws)]
    run("reduce_scatter(out, ins, op=MAX)", lambda: pg.reduce_scatter(out, ins, op=MAX), out)
    run("barrier()", lambda: pg.barrier())
    run("barrier(timedelta)", lambda: pg.barrier(datetime.timedelta(seconds=30)))
    if rank == 0:
        run("send([t], dstRank=1, tag=0)", lambda: pg.send([torch.tensor([7.0, 8.0])], dstRank=1, tag=0))
    elif rank == 1:
        r = torch.zeros(2)
        run("recv([r], srcRank=0, tag=0)", lambda: pg.recv([r], srcRank=0, tag=0), r)
    a, b = base(), base()[:3] * 2
    run("allreduce_coalesced", lambda: pg.allreduce_coalesced([a, b], _c10d_options("AllreduceCoalescedOptions")), a, b)
    # The coalesced tensor forms, by each of ProcessGroup's names, and as c10d's coalescing manager makes them
    for name in ("allgather_into_tensor_coalesced", "all_gather_single_coalesced"):
        outs, ins = [torch.empty(5 * ws), torch.empty(2 * ws)], [base(), base()[:2] + 1]
        run(name, lambda: getattr(pg, name)(outs, ins, _c10d_options("AllgatherOptions")), *outs)
    for name in ("reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced"):
        outs, ins = [torch.empty(2), torch.empty(3)], [torch.arange(2.0 * ws) * (rank + 1), torch.arange(3.0 * ws) - rank]
        run(name, lambda: getattr(pg, name)(outs, ins, _c10d_options("ReduceScatterOptions")), *outs)
    coalesced("coalescing manager: all_reduce", *[(dist.all_reduce, (base()[:k],), {"op": MAX}) for k in (5, 3)])
    coalesced("coalescing manager: all_gather_into_tensor",
              *[(dist.all_gather_into_tensor, (torch.empty(k * ws), base()[:k]), {}) for k in (5, 2)])
    coalesced("coalescing manager: reduce_scatter_tensor",
              *[(dist.reduce_scatter_tensor, (torch.empty(k), torch.arange(k * ws * 1.0) + rank), {}) for k in (2, 3)])
    with torch.inference_mode():
        outs, t = [torch.empty(5) for _ in range(ws)], base()
        run("inference_mode allgather", lambda: pg.allgather([outs], [t]), *outs)
        outs = [torch.empty(5) for _ in range(ws)]
        run("inference_mode dist.all_gather async",
            lambda: dist.all_gather(outs, t, group=pg, async_op=True), *outs)
    return got, works, pg._get_sequence_number_for_group() - first_call


def _c10d_options(name):
    return getattr(torch._C._distributed_c10d, name)()


def _forms_fn(rank, ws) -> dict:
    gloo = dist.new_group(backend="gloo")
    before = _ringcoll_counts()
    ours, our_works, our_calls = _call_forms(dist.group.WORLD, rank, ws)
    routed = {k: v - before.get(k, 0) for k, v in _ringcoll_counts().items() if v != before.get(k, 0)}
    # torch.distributed's own coalesced call, through the backend and through gloo
    ours_pair = [torch.arange(4.0) + rank, torch.arange(3.0) * (rank + 1)]
    gloo_pair = [t.clone() for t in ours_pair]
    dist.all_reduce_coalesced(ours_pair, op=dist.ReduceOp.SUM)
    dist.all_reduce_coalesced(gloo_pair, op=dist.ReduceOp.SUM, group=gloo)
    return {"ours": ours, "our_works": our_works, "our_calls": our_calls, "gloo": _call_forms(gloo, rank, ws)[0],
            "routed": routed, "coalesced_api": (ours_pair, gloo_pair)}


@pytest.mark.parametrize("ws", [2, 3])
def test_every_call_form_matches_gloo(ws):
    for rank, out in enumerate(spawn(_forms_fn, ws, timeout=SPAWN_TIMEOUT, backend="ringcoll", env=ENV,
                                     init_timeout=60)):
        assert out["ours"].keys() == out["gloo"].keys(), rank
        for form, tensors in out["gloo"].items():
            assert all(torch.equal(x, y) for x, y in zip(out["ours"][form], tensors)), (rank, form, out["ours"][form],
                                                                                      tensors)
        # Every form's Work, once waited for: wait() True, completed, successful, no exception (c10d's
        # coalescing names once gave back a c10d Work still not completed; gloo's coalesced
        # reduce-scatter's is not either, so this is the rule, not gloo's answer)
        assert {form: w for form, w in out["our_works"].items() if w != (True, True, True, None)} == {}, rank
        # The group's sequence number counts each call once (gloo's counts its reduce-scatters twice, its
        # own two steps; the ring's bootstrap exchange, gloo's work, is not the user's call)
        assert out["our_calls"] == len(out["our_works"]), (rank, out["our_calls"], len(out["our_works"]))
        # The collectives ringcoll implements ran on the ring, coalesced ones included (the coalescing
        # manager's: one call each).
        assert out["routed"].get("ringcoll:all_reduce", 0) >= 4, out["routed"]
        assert out["routed"].get("ringcoll:all_reduce_coalesced") == 2, out["routed"]
        assert out["routed"].get("ringcoll:all_gather_into_tensor_coalesced") == 3, out["routed"]
        assert out["routed"].get("ringcoll:reduce_scatter_tensor_coalesced") == 3, out["routed"]
        assert out["routed"].get("ringcoll:all_gather", 0) >= 3, out["routed"]
        assert out["routed"].get("ringcoll:broadcast", 0) == 3 and out["routed"].get("ringcoll:reduce", 0) == 3, \
            out["routed"]
        ours, ref = out["coalesced_api"]
        assert all(torch.equal(x, y) for x, y in zip(ours, ref)), (ours, ref)
