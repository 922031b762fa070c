"""The byte counter on real gloo collectives (2 ranks): every collective torch offers is counted
once with its ring volume (wire.py's table), with and without CPU mode; tags, nesting, P = 1; the
guard that fails on a collective the counter does not know."""

import functools
import os
import pickle
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import spawn_ranks

OBJ = {"payload": "x" * 40}  # same pickle size on both ranks


def _wait(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            _wait(y)
    elif hasattr(x, "wait"):
        x.wait()


def _c10d_calls(rank, measure):
    """(name, fn) for every torch.distributed collective; the expectations are in the test."""
    import torch.distributed.distributed_c10d as c10d

    other = 1 - rank
    o, e = torch.ones, torch.empty
    u8 = torch.uint8
    measure("all_reduce", lambda: dist.all_reduce(o(1000)))
    measure("all_reduce_coalesced", lambda: dist.all_reduce_coalesced([o(1000), o(10)]))
    measure("reduce", lambda: dist.reduce(o(1000), dst=0))
    measure("broadcast", lambda: dist.broadcast(o(1000), src=0))
    measure("reduce_scatter_single", lambda: dist.reduce_scatter_single(e(500), o(1000)))
    measure("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(e(500), o(1000)))
    measure("_reduce_scatter_base", lambda: dist._reduce_scatter_base(e(500), o(1000)))
    measure("reduce_scatter", lambda: dist.reduce_scatter(e(10), [o(10), o(10)]))
    measure("all_gather_single", lambda: dist.all_gather_single(e(2000), o(1000)))
    measure("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(e(2000), o(1000)))
    measure("_all_gather_base", lambda: dist._all_gather_base(e(2000), o(1000)))
    measure("all_gather", lambda: dist.all_gather([e(10), e(10)], o(10)))
    measure("all_gather_coalesced",
            lambda: dist.all_gather_coalesced([[e(10), e(5)], [e(10), e(5)]], [o(10), o(5)]))
    measure("all_to_all_single", lambda: dist.all_to_all_single(e(1000, dtype=u8), o(1000, dtype=u8)))
    # Uneven: both ranks keep 3 rows for rank 0 and send 7 to rank 1 (16-byte rows).
    measure("all_to_all_single_uneven", lambda: dist.all_to_all_single(
        e(6 if rank == 0 else 14, 4), o(10, 4), output_split_sizes=[3, 3] if rank == 0 else [7, 7],
        input_split_sizes=[3, 7]))
    measure("all_to_all", lambda: dist.all_to_all([e(500), e(500)], [o(500), o(500)]))
    measure("gather", lambda: dist.gather(o(1000), [e(1000), e(1000)] if rank == 0 else None, dst=0))
    measure("gather_group_dst",
            lambda: dist.gather(o(1000), [e(1000), e(1000)] if rank == 1 else None, group_dst=1))
    measure("scatter", lambda: dist.scatter(e(1000), [o(1000), o(1000)] if rank == 0 else None, src=0))

    def p2p():
        if rank == 0:
            dist.send(o(250), dst=1)
        else:
            dist.recv(e(250), src=0)
    measure("send_recv", p2p)

    def ip2p():
        (dist.isend(o(250), dst=1) if rank == 0 else dist.irecv(e(250), src=0)).wait()
    measure("isend_irecv", ip2p)
    measure("batch_isend_irecv", lambda: _wait(dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, o(100), other), dist.P2POp(dist.irecv, e(100), other)])))

    def coalesced():
        with c10d._coalescing_manager():
            dist.all_reduce(o(1000))
            dist.all_reduce(o(10))
    measure("coalescing_manager", coalesced)
    measure("barrier", lambda: dist.barrier())

    # Object collectives: built on the tensor ones, which count them.
    measure("all_gather_object", lambda: dist.all_gather_object([None, None], OBJ))
    measure("gather_object", lambda: dist.gather_object(OBJ, [None, None] if rank == 0 else None, dst=0))
    measure("broadcast_object_list", lambda: dist.broadcast_object_list([OBJ if rank == 0 else None], src=0))
    measure("scatter_object_list", lambda: dist.scatter_object_list(
        [None], [OBJ, {"b": 1}] if rank == 0 else None, src=0))
    for batch in (False, True):
        def objects(batch=batch):
            if rank == 0:
                dist.send_object_list([OBJ], dst=1, use_batch=batch)
            else:
                dist.recv_object_list([None], src=0, use_batch=batch)
        measure("object_p2p" + ("_batch" if batch else ""), objects)


def _funcol_calls(rank, measure):
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh

    W = dist.group.WORLD
    other = 1 - rank
    o, e = torch.ones, torch.empty

    def m(name, fn):
        measure("funcol." + name, lambda: _wait(fn()))
    m("all_reduce", lambda: fc.all_reduce(o(1000), "sum", W))
    m("all_reduce_inplace", lambda: fc.all_reduce_inplace(o(1000)))
    m("all_reduce_coalesced", lambda: fc.all_reduce_coalesced([o(1000), o(10)], "sum", W))
    m("broadcast", lambda: fc.broadcast(o(1000), 0, W))
    for name in ("all_gather_single", "all_gather_single_autograd", "all_gather_tensor",
                 "all_gather_tensor_autograd"):
        m(name, lambda name=name: getattr(fc, name)(o(1000), 0, W))
    m("all_gather_tensor_inplace", lambda: fc.all_gather_tensor_inplace(e(2000), o(1000), W))
    m("all_gather_inplace", lambda: fc.all_gather_inplace([e(1000), e(1000)], o(1000), W))
    for name in ("all_gather_single_coalesced", "all_gather_into_tensor_coalesced"):
        m(name, lambda name=name: getattr(fc, name)([o(1000), o(10)], W))
    for name in ("reduce_scatter_single", "reduce_scatter_single_autograd", "reduce_scatter_tensor",
                 "reduce_scatter_tensor_autograd"):
        m(name, lambda name=name: getattr(fc, name)(o(1000), "sum", 0, W))
    m("reduce_scatter_tensor_inplace", lambda: fc.reduce_scatter_tensor_inplace(e(500), o(1000), "sum", W))
    for name in ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"):
        m(name, lambda name=name: getattr(fc, name)([o(1000), o(10)], "sum", [0, 0], W))
    u8 = torch.uint8
    for name in ("all_to_all_single", "all_to_all_single_autograd"):
        m(name, lambda name=name: getattr(fc, name)(o(1000, dtype=u8), None, None, W))
    m("all_to_all_inplace", lambda: fc.all_to_all_inplace(e(1000, dtype=u8), o(1000, dtype=u8), group=W))
    m("permute_tensor", lambda: fc.permute_tensor(o(250), [1, 0], W))
    m("p2p_inplace", lambda: fc.isend_inplace(o(250), 1) if rank == 0 else fc.irecv_inplace(e(250), 0))
    m("batch_p2p_ops_inplace", lambda: fc.batch_p2p_ops_inplace(
        ["isend", "irecv"] if rank == 0 else ["irecv", "isend"], [other, other], [0, 0],
        [o(100), e(100)] if rank == 0 else [e(100), o(100)], W))
    mesh = init_device_mesh("cpu", (2,))
    measure("funcol.mesh", lambda: _wait(fc.all_reduce(o(1000), "sum", mesh)))
    measure("funcol.ranks", lambda: _wait(fc.all_reduce(o(1000), "sum", [0, 1])))
    measure("funcol.name", lambda: _wait(fc.all_reduce(o(1000), "sum", W.group_name)))


def _worker(rank, port, queue, cpu_mode=True):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import warnings

    warnings.simplefilter("ignore")  # the deprecated aliases are called on purpose
    from megatron_grpo.comm import wire, wire_rules
    from megatron_grpo.comm.wire import wire_counter

    if cpu_mode:
        from megatron_grpo.platform import enable_cpu_mode

        enable_cpu_mode(force=True)  # counted once under the torch-function mode too
    counter = wire_counter()
    # A failing collective must not leave the peer blocked for the default 30 minutes.
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    out = {}

    def measure(name, fn):
        counter.reset()
        try:
            fn()
        except Exception as exc:  # reported (and failed on) by the test, with the others
            out[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            return
        snap = counter.reset()
        out[name] = (snap["total"], snap["calls"])

    _c10d_calls(rank, measure)
    _funcol_calls(rank, measure)
    with counter.tag("core"):
        dist.all_reduce(torch.ones(10))
        with counter.tag("dynamic"):
            dist.all_reduce(torch.ones(20))
    out["tags"] = counter.reset()["by_tag"]
    groups = [dist.new_group([0]), dist.new_group([1])]
    measure("one_rank_group", lambda: dist.all_reduce(torch.ones(100), group=groups[rank]))
    # Every rule really replaced the torch function (in both namespaces).
    import torch.distributed._functional_collectives as fc
    import torch.distributed.distributed_c10d as c10d
    out["unwrapped"] = [n for n in [*wire_rules.C10D_RULES, "batch_isend_irecv"]
                        for mod in (c10d, dist) if not getattr(getattr(mod, n), "_wire_counted", False)]
    out["unwrapped"] += ["funcol." + n for n in wire_rules.FUNCOL_RULES
                         if not getattr(getattr(fc, n), "_wire_counted", False)]
    out["audit"] = wire.audit()
    queue.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


S = len(pickle.dumps(OBJ))
SMALL = len(pickle.dumps({"b": 1}))


def _expected(rank):
    """name -> (bytes this rank sends, {op: calls}) for P = 2."""
    root0 = rank == 0
    one = lambda op, b: (b, {op: 1})  # noqa: E731
    exp = {
        "all_reduce": one("all_reduce", 4000),                       # 2 (P-1)/P * 4000
        "all_reduce_coalesced": one("all_reduce_coalesced", 4040),   # per tensor
        "reduce": one("reduce", 2000),                               # (P-1)/P * 4000
        "broadcast": one("broadcast", 2000),
        "reduce_scatter_single": one("reduce_scatter_single", 2000),  # (P-1) * B(out)
        "reduce_scatter_tensor": one("reduce_scatter_tensor", 2000),
        "_reduce_scatter_base": one("_reduce_scatter_base", 2000),
        "reduce_scatter": one("reduce_scatter", 40),                 # the other rank's entry
        "all_gather_single": one("all_gather_single", 4000),         # (P-1) * B(in)
        "all_gather_into_tensor": one("all_gather_into_tensor", 4000),
        "_all_gather_base": one("_all_gather_base", 4000),
        "all_gather": one("all_gather", 40),
        "all_gather_coalesced": one("all_gather_coalesced", 60),
        "all_to_all_single": one("all_to_all_single", 500),          # the half that leaves
        "all_to_all_single_uneven": one("all_to_all_single", (7 if root0 else 3) * 16),
        "all_to_all": one("all_to_all", 2000),
        "gather": one("gather", 0 if root0 else 4000),               # non-root sends B
        "gather_group_dst": one("gather", 4000 if root0 else 0),
        "scatter": one("scatter", 4000 if root0 else 0),             # root sends P-1 entries
        "send_recv": one("send", 1000) if root0 else one("recv", 0),
        "isend_irecv": one("isend", 1000) if root0 else one("irecv", 0),
        "batch_isend_irecv": (400, {"isend": 1, "irecv": 1}),
        "coalescing_manager": (4040, {"all_reduce": 2}),
        "barrier": (0, {}),
        # object collectives = their primitives: 8-byte sizes, then the pickles
        "all_gather_object": (8 + S, {"all_gather": 2}),
        "gather_object": (8 + (0 if root0 else S), {"all_gather": 1, "gather": 1}),
        "broadcast_object_list": (8 // 2 + S // 2, {"broadcast": 2}),
        "scatter_object_list": (4 + (max(S, SMALL) + 8 if root0 else 0),
                                {"broadcast": 1, "scatter": 2}),
        "object_p2p": (8 + S, {"send": 2}) if root0 else (0, {"recv": 2}),
        "object_p2p_batch": (8 + S, {"isend": 2}) if root0 else (0, {"irecv": 2}),
    }
    f = lambda name, b: (b, {"funcol." + name: 1})  # noqa: E731
    for name, b in [("all_reduce", 4000), ("all_reduce_inplace", 4000),
                    ("all_reduce_coalesced", 4040), ("broadcast", 2000),
                    ("all_gather_single", 4000), ("all_gather_single_autograd", 4000),
                    ("all_gather_tensor", 4000), ("all_gather_tensor_autograd", 4000),
                    ("all_gather_tensor_inplace", 4000), ("all_gather_inplace", 4000),
                    ("all_gather_single_coalesced", 4040), ("all_gather_into_tensor_coalesced", 4040),
                    ("reduce_scatter_single", 2000), ("reduce_scatter_single_autograd", 2000),
                    ("reduce_scatter_tensor", 2000), ("reduce_scatter_tensor_autograd", 2000),
                    ("reduce_scatter_tensor_inplace", 2000),
                    ("reduce_scatter_single_coalesced", 2020),
                    ("reduce_scatter_tensor_coalesced", 2020),
                    ("all_to_all_single", 500), ("all_to_all_single_autograd", 500),
                    ("all_to_all_inplace", 500), ("permute_tensor", 1000),
                    ("batch_p2p_ops_inplace", 400)]:
        exp["funcol." + name] = f(name, b)
    exp["funcol.p2p_inplace"] = f("isend_inplace", 1000) if root0 else f("irecv_inplace", 0)
    for name in ("mesh", "ranks", "name"):
        exp["funcol." + name] = f("all_reduce", 4000)
    exp["one_rank_group"] = one("all_reduce", 0)
    return exp


@pytest.mark.parametrize("cpu_mode", [True, False], ids=["cpu_mode", "plain"])
def test_every_collective_counted_once_with_ring_volumes(cpu_mode):
    results = dict(spawn_ranks(functools.partial(_worker, cpu_mode=cpu_mode), timeout=300))
    for rank in (0, 1):
        r = results[rank]
        assert r["audit"] == [] and r["unwrapped"] == []
        assert r.pop("tags") == {"core": 40, "dynamic": 80}
        for key in ("audit", "unwrapped"):
            r.pop(key)
        expected = _expected(rank)
        wrong = {k: (r.get(k), v) for k, v in expected.items() if r.get(k) != v}
        assert not wrong, f"rank {rank}: name: (measured, expected) {wrong}"
        assert set(r) == set(expected)


def test_audit_finds_nothing_uncounted_in_this_torch():
    from megatron_grpo.comm.wire import audit

    assert audit() == []


def test_a_new_torch_collective_fails_install(monkeypatch):
    """What a torch upgrade adding a collective looks like: install() refuses, naming it."""
    import torch.distributed._functional_collectives as fc
    import torch.distributed.distributed_c10d as c10d

    from megatron_grpo.comm import wire

    def all_reduce_fancy(tensor, op=None, group=None, async_op=False):
        pass

    def new_funcol(self, group, tag=""):
        pass

    monkeypatch.setattr(c10d, "all_reduce_fancy", all_reduce_fancy, raising=False)
    monkeypatch.setattr(dist, "all_reduce_fancy", all_reduce_fancy, raising=False)
    new_funcol.__module__ = fc.__name__
    monkeypatch.setattr(fc, "all_gather_fancy", new_funcol, raising=False)
    assert wire.audit() == ["torch.distributed.all_reduce_fancy", f"{fc.__name__}.all_gather_fancy"]
    monkeypatch.setattr(wire, "_AUDITED", False)
    original = dist.all_reduce
    with pytest.raises(wire.UncountedCollectiveError, match="all_reduce_fancy.*all_gather_fancy"):
        wire.WireCounter().install()
    assert dist.all_reduce is original  # refused before changing anything


def _link_worker(rank, port, queue):
    # 4 ranks, 2 per node: {0, 1} and {2, 3} are nodes.
    os.environ["MEGATRON_GRPO_RANKS_PER_NODE"] = "2"
    from megatron_grpo.comm.wire import WireCounter

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                            timeout=timedelta(seconds=60))
    counter = WireCounter()
    counter.install()
    node = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    across = across[0] if rank in (0, 2) else across[1]
    t = torch.ones(250)  # 1000 bytes
    counter.reset()
    dist.all_reduce(t, group=node)     # 2 (P-1)/P B = 1000, inside a node
    dist.all_reduce(t, group=across)   # 1000, between nodes
    dist.all_reduce(t)                 # default group, 4 ranks on 2 nodes: 1500
    snap = counter.reset()
    queue.put((rank, snap["by_link"], snap["total"]))
    dist.destroy_process_group()


def test_bytes_are_split_by_link_class():
    results = spawn_ranks(_link_worker, nranks=4, timeout=300)
    assert sorted(r for r, _, _ in results) == [0, 1, 2, 3]
    for rank, by_link, total in results:
        assert by_link == {"intra_node": 1000, "inter_node": 2500}, rank
        assert total == 3500
