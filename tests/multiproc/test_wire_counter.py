"""The byte counter on real gloo collectives (2 ranks): each rule, tags, nesting, P = 1."""

import os

import torch
import torch.distributed as dist

from harness import spawn_ranks


def _worker(rank, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron_grpo.comm.wire import wire_counter
    from megatron_grpo.platform import enable_cpu_mode

    enable_cpu_mode()  # the collectives must be counted once under the torch-function mode too
    counter = wire_counter()
    dist.init_process_group("gloo", rank=rank, world_size=2)
    out = {}

    def measure(name, fn):
        counter.reset()
        fn()
        out[name] = counter.reset()["total"]

    x = torch.ones(1000)  # 4000 bytes
    measure("all_reduce", lambda: dist.all_reduce(x))
    measure("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(torch.empty(500), torch.ones(1000)))
    measure("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.empty(2000), torch.ones(1000)))
    measure("all_to_all_single", lambda: dist.all_to_all_single(torch.empty(1000, dtype=torch.uint8),
                                                                torch.ones(1000, dtype=torch.uint8)))
    measure("broadcast", lambda: dist.broadcast(torch.ones(1000), src=0))
    measure("all_gather", lambda: dist.all_gather([torch.empty(10), torch.empty(10)], torch.ones(10)))

    def p2p():
        if rank == 0:
            dist.send(torch.ones(250), dst=1)
        else:
            dist.recv(torch.empty(250), src=0)
    measure("send", p2p)
    with counter.tag("core"):
        dist.all_reduce(torch.ones(10))
        with counter.tag("dynamic"):
            dist.all_reduce(torch.ones(20))
    snap = counter.reset()
    out["tags"] = snap["by_tag"]
    groups = [dist.new_group([0]), dist.new_group([1])]
    measure("one_rank_group", lambda: dist.all_reduce(torch.ones(100), group=groups[rank]))
    queue.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def test_each_collective_counted_once_with_ring_volumes():
    results = dict(spawn_ranks(_worker))
    for rank in (0, 1):
        r = results[rank]
        assert r["all_reduce"] == 4000                 # 2 (P-1)/P * 4000
        assert r["reduce_scatter_tensor"] == 2000      # (P-1) * 500 floats * 4
        assert r["all_gather_into_tensor"] == 4000     # (P-1) * 1000 floats * 4
        assert r["all_to_all_single"] == 500           # the half that leaves this rank
        assert r["broadcast"] == 2000                  # (P-1)/P * 4000
        assert r["all_gather"] == 40
        assert r["send"] == (1000 if rank == 0 else 0)  # recv sends nothing
        assert r["tags"] == {"core": 40, "dynamic": 80}
        assert r["one_rank_group"] == 0

