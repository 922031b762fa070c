"""Strict device mode of the wire counter on 2 gloo ranks (CPU mode): a tensor that is not on its
group's communication device is refused before the backend sees it, on every rank alike (so no
peer hangs), with a message that says what to do; byte counts do not change."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from harness import spawn_ranks


def _refused(out, name, fn):
    """Record the CollectiveDeviceError message of ``fn`` (or what happened instead)."""
    from megatron_grpo.comm.wire import CollectiveDeviceError

    try:
        fn()
    except CollectiveDeviceError as exc:
        out[name] = str(exc)
    except Exception as exc:  # the wrong failure: reported by the test
        out[name] = f"NOT REFUSED BY THE COUNTER: {type(exc).__name__}: {exc}"
    else:
        out[name] = "NOT REFUSED"


def _correct_calls(rank):
    """A mix of counted collectives on the right device (cpu)."""
    import torch.distributed._functional_collectives as fc

    other = 1 - rank
    dist.all_reduce(torch.ones(1000, device="cpu"))
    dist.all_gather([torch.empty(10, device="cpu") for _ in range(2)], torch.ones(10, device="cpu"))
    dist.all_gather_into_tensor(torch.empty(20, device="cpu"), torch.ones(10, device="cpu"))
    dist.reduce_scatter_tensor(torch.empty(5, device="cpu"), torch.ones(10, device="cpu"))
    for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(7, device="cpu"), other),
                                       dist.P2POp(dist.irecv, torch.empty(7, device="cpu"), other)]):
        req.wait()
    dist.all_gather_object([None, None], {"rank": rank})
    fc.all_reduce(torch.ones(8, device="cpu"), "sum", dist.group.WORLD).wait()


def _worker(rank, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["MEGATRON_GRPO_STRICT_COMM"] = "1"  # read by install()
    import torch.distributed._functional_collectives as fc

    from megatron_grpo.comm.wire import wire_counter
    from megatron_grpo.platform import enable_cpu_mode

    enable_cpu_mode(force=True)
    counter = wire_counter()
    out = {"env_strict": counter.strict}
    # A refusal that did not happen on both ranks would show as a timeout here, not a hang.
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    counter.bind_group_device(None, "cpu")
    with torch.device("meta"):  # how the GRPO tests find tensors created without device=
        meta = torch.ones(10)

    # Byte counts are the same with strict off and on.
    counter.set_strict(False)
    counter.reset()
    _correct_calls(rank)
    loose = counter.reset()
    counter.set_strict(True)
    _correct_calls(rank)
    out["same_counts"] = loose == counter.reset()
    out["counts"] = loose["by_op"]

    # Each bad call is made by both ranks and refused by both before gloo sees it.
    cpu = lambda n: torch.empty(n, device="cpu")  # noqa: E731
    _refused(out, "meta_all_reduce", lambda: dist.all_reduce(meta))
    _refused(out, "meta_in_list", lambda: dist.all_gather([cpu(10), meta], torch.ones(10)))
    _refused(out, "meta_output", lambda: dist.all_gather_into_tensor(meta, torch.ones(5)))
    _refused(out, "meta_funcol", lambda: fc.all_reduce(meta, "sum", dist.group.WORLD))
    other = 1 - rank
    _refused(out, "meta_batch", lambda: dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, torch.ones(10), other), dist.P2POp(dist.irecv, meta, other)]))
    out["refused_bytes"] = counter.reset()["total"]  # a refused call counts nothing

    # A group bound to another device (the same group object is found again), then unbound.
    group = dist.new_group([0, 1])
    counter.bind_group_device(group, "cuda:0")
    _refused(out, "wrong_bound_device", lambda: dist.all_reduce(torch.ones(4), group=group))
    counter.bind_group_device(group, None)
    t = torch.ones(4)
    dist.all_reduce(t, group=group)  # unbound gloo group: serves cpu
    out["unbound_ok"] = t.tolist()
    _refused(out, "meta_unbound", lambda: dist.all_reduce(meta, group=group))

    # Unbound group whose backend serves only cuda (like nccl): a host tensor is refused.
    cuda_only = dist.new_group([0, 1], backend="cuda:gloo")
    _refused(out, "host_on_cuda_group", lambda: dist.all_reduce(torch.ones(4), group=cuda_only))

    # The group still works after all the refusals (nothing was half-issued).
    t = torch.ones(3)
    dist.all_reduce(t)
    out["after"] = t.tolist()
    counter.set_strict(False)
    _refused(out, "meta_not_strict_is_not_checked", lambda: dist.all_reduce(meta))
    queue.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def test_strict_mode_refuses_off_device_tensors_on_every_rank():
    results = dict(spawn_ranks(_worker, timeout=240))
    for rank in (0, 1):
        r = results[rank]
        assert r["env_strict"] is True
        assert r["same_counts"], r["counts"]
        assert r["counts"]["all_reduce"] == 4000
        for name, op, arg in [("meta_all_reduce", "all_reduce", "tensor"),
                              ("meta_in_list", "all_gather", "tensor_list[1]"),
                              ("meta_output", "all_gather_into_tensor", "output_tensor"),
                              ("meta_funcol", "funcol.all_reduce", "self"),
                              ("meta_batch", "batch_isend_irecv", "p2p_op_list[1].tensor"),
                              ("meta_unbound", "all_reduce", "tensor")]:
            msg = r[name]
            assert msg.startswith(f"{op}: argument '{arg}' is on device 'meta'"), (name, msg)
            assert f"global rank {rank}" in msg and "device='cpu'" in msg, (name, msg)
        assert "the default group communicates on 'cpu'" in r["meta_all_reduce"]
        msg = r["wrong_bound_device"]
        assert msg.startswith("all_reduce: argument 'tensor' is on device 'cpu'"), msg
        assert "communicates on 'cuda:0'" in msg and "device='cuda:0'" in msg, msg
        msg = r["host_on_cuda_group"]
        assert msg.startswith("all_reduce: argument 'tensor' is on device 'cpu'"), msg
        assert "communicates on 'cuda'" in msg and "device='cuda'" in msg, msg
        assert r["refused_bytes"] == 0
        assert r["unbound_ok"] == [2.0] * 4 and r["after"] == [2.0] * 3
        # Without strict the counter does not look, and gloo accepts the meta tensor silently:
        # the reason strict mode exists.
        assert r["meta_not_strict_is_not_checked"].startswith("NOT REFUSED"), r
