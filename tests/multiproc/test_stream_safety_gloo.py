"""The side-stream rules through the real bucket group, on two gloo ranks.

A megatron DDP model (overlap on) with GRPO installed, every unit dynamic, its error-feedback
residuals in the memory tier's OffloadedResiduals, and the controller's streams replaced by the
stream double (tests/stream_double.py). Backward's hooks run GRPOBucketGroup.start_grad_sync
inside the side stream's context, so ErrorFeedback.owed's add and the store's release happen
there, as on a GPU. The double fails the run if a residual is freed under the pending add.

Every compressed sync must also finish on the side stream (comm/streams.py, CommOrder): the
side stream waits for the exchange, decodes, records an event, and the main stream's only
dependency on it is a wait on that event: no decode kernel, collective wait or side-stream join
on the main stream in finish_grad_sync. With gradient release (GRPO's DDP, one unit in flight)
the in-flight window finishes the oldest unit during backward the same way, and frees its full
gradient right after, on the main stream.

Without release, kernel races are not checked (``check_races=False``): the double tracks whole
storages, and megatron's buckets are views of one buffer, so backward writing one bucket on the
main stream looks like a race with the side stream reading another. With release every bucket
has storage of its own and races are checked too.
"""

import functools
import re

import pytest

from harness import megatron_rank, spawn_ranks

LAYERS, WIDTH, BUCKET, STEPS = 4, 32, 1000, 4


def _train(rank, release):
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_grpo.grpo.config import GRPOConfig
    from megatron_grpo.grpo.controller.core import GRPOController
    from megatron_grpo.megatron import grpo_data_parallel_group, install
    from megatron_grpo.megatron.ddp import GRPODistributedDataParallel
    from megatron_grpo.offload import ChunkStore, OffloadConfig
    from megatron_grpo.offload.residuals import OffloadedResiduals
    from stream_double import StreamDouble

    tf = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=BUCKET,
        grad_reduce_in_fp32=True)
    config = GRPOConfig(enabled=True, compress="all", warmup_iters=100, grad_units_in_flight=1)
    if release:
        ddp = GRPODistributedDataParallel(tf, ddp_config, module, grpo_config=config)
    else:
        ddp = DistributedDataParallel(tf, ddp_config, module)
    ctrl = GRPOController(config, [ddp], torch.device("cpu"), grpo_data_parallel_group())
    install([ddp], ctrl)
    ctrl.tiers = ["dynamic"] * len(ctrl.units)
    with ChunkStore(OffloadConfig(chunk_mb=0.25, capacity=8 << 20), rank=rank) as store, \
            StreamDouble(check_races=release) as double:
        residuals = OffloadedResiduals(store, "cpu", lookahead=2)
        ctrl.ef.use_store(residuals)
        double.install(ctrl)
        windowed = 0
        for step in range(STEPS):
            ctrl.begin_step(step)
            residuals.begin_step()  # the memory tier's TierPlacement.begin_step does this
            ddp.zero_grad_buffer()
            x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))
            module(x).square().mean().backward()  # start_grad_sync, on the side stream
            # Units the in-flight window finished during backward (release: all but the last).
            windowed += sum(1 for g in ddp.bucket_groups if g.__dict__.get("_grpo_completed"))
            ddp.finish_grad_sync()
            ctrl.end_step()
            store.wait_all()  # every write lands: which residual is where is the same each run
            residuals.settle()
        return {"units": len(ctrl.units), "keys": len(ctrl.ef.keys()),
                "cross_stream_frees": double.cross_stream_frees,
                "side_sections": double.log.count("enter:side"), "finishes": _finishes(double.log),
                "main_waits": sorted({re.sub(r"#\d+$", "#n", e) for e in double.log
                                      if e.startswith("main<-")}),
                "main_joins": double.log.count("main<-side"), "windowed": windowed}


def _finishes(log):
    """How each compressed sync finished, from the side stream's wait for its exchange to the
    main stream's next entry: a list of (entries that violate the order, the main stream's
    entry is a wait on the event the side stream recorded last), one per sync."""
    out = []
    for i, entry in enumerate(log):
        if entry != "side<-collective":
            continue
        bad, recorded, j = [], None, i + 1
        while j < len(log) and not log[j].startswith("main"):
            if log[j].startswith("record:side#"):
                recorded = log[j][len("record:"):]
            elif log[j].startswith(("kernel:side", "collective:side")):
                if recorded is not None:
                    bad.append(f"after the event: {log[j]}")  # a decode the event does not cover
            elif log[j] not in ("exit:side", "record_stream:side"):
                bad.append(log[j])  # a synchronize, another stream's wait or section
            j += 1
        out.append((bad, recorded is not None and j < len(log) and log[j] == f"main<-event:{recorded}"))
    return out


@pytest.mark.parametrize("release", [False, True], ids=["megatron-buffer", "release-window-1"])
def test_offloaded_residuals_outlive_the_side_stream_add_and_syncs_finish_on_it(release):
    for r in spawn_ranks(functools.partial(megatron_rank, body=_train, release=release), 2, timeout=240):
        assert "error" not in r, r["error"]
        # The main stream's dependencies: the decoded events, and end_step's one join per step
        # (no collective's wait, no join per unit).
        assert r["main_waits"] == ["main<-event:side#n", "main<-side"] and r["main_joins"] == STEPS
        assert len(r["finishes"]) == LAYERS * STEPS
        assert all(not bad and waited for bad, waited in r["finishes"]), r["finishes"]
        assert r["windowed"] == ((LAYERS - 1) * STEPS if release else 0)
        # Two side-stream sections per unit and step: its start_grad_sync, and its finish
        # (the exchange's wait and the decode).
        assert r["keys"] == r["units"] == LAYERS and r["side_sections"] == 2 * LAYERS * STEPS
        # From the third step on, the two residuals the store fetched at the step's start (main
        # stream) were released under the side stream's pending add, protected by record_stream.
        assert r["cross_stream_frees"] == 2 * (STEPS - 2)
