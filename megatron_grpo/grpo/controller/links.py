"""The controller's side of --grpo-compress: which tiers compress on the group GRPO syncs over.

The rule and the measurement are the communication policy's (megatron_grpo.comm.link_decision);
here they meet the run: the group (the data-parallel group, or between instances of megatron's
partial distributed optimizer), the formats the tiers use, the exact warm-up, the A/B after it,
what error feedback still owes when a format stops being used, and the checkpoint.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_grpo.comm.link_decision import LinkDecision, StepTimeAB, group_spans_nodes, probe
from megatron_grpo.comm.wire import ranks_per_node

AB_SETTLE_STEPS = 2
"""Tiered steps before the A/B starts: the first compressed steps allocate their buffers."""
AB_RETEST_CHANGE = 0.1
"""A re-tier that changes the compressed tiers' elements by more than this share runs the A/B
again (the exposed share of the sync depends on how much of the model compresses)."""


class LinkPolicy:
    """One LinkDecision for the group GRPO compresses on, and the A/B that confirms ``auto``."""

    def __init__(self, config, units: list, dp_group, device: torch.device, counter, formats: Dict[str, object],
                 agree_group) -> None:
        self.config = config
        self.device = device
        self.agree_group = agree_group
        first = units[0].group if units else None
        ddp_config = getattr(first, "ddp_config", None)
        self.hierarchical = getattr(ddp_config, "num_distributed_optimizer_instances", 1) > 1
        self.group = first.inter_distributed_optimizer_instance_group if self.hierarchical else dp_group
        name = "between instances" if self.hierarchical else "data-parallel group"
        spans = group_spans_nodes(self.group, ranks_per_node()) if dist.is_initialized() else False
        self.decision = LinkDecision(config.compress, name, spans)
        self.formats = formats
        self.ab = StepTimeAB(config.compress_ab_steps)
        self.exact_now = False
        """This step runs exact for the A/B's second half."""
        self.ab_elements: Optional[int] = None
        self.events: List[str] = []
        members = dist.get_world_size(self.group) if dist.is_initialized() else 1
        result = None
        if config.compress == "auto" and members > 1 and formats and not self.hierarchical:
            numel = max(b.grad_data.numel() for u in units for b in u.group.buckets)
            bucket = first.buckets[0]
            param_data = getattr(bucket, "param_data", None)
            with counter.tag("grpo_control"):
                result = probe(self.group, numel, formats, device, bucket.grad_data.dtype,
                               param_data.dtype if param_data is not None else bucket.grad_data.dtype,
                               residual_dtype=config.residual_dtype, agree_group=agree_group)
        self.decision.decide(sorted(formats), result)
        if config.compress == "auto" and self.hierarchical:
            # The inter-instance path has no probe yet: across nodes it compresses (the case it
            # was built for), inside one node it does not; the A/B still confirms.
            for fmt in self.decision.compress:
                self.decision.compress[fmt] = spans
        self.report(self.decision.line())

    def report(self, line: str) -> None:
        self.events.append(line)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"[grpo] compression: {line}", flush=True)

    def compresses(self, fmt: str) -> bool:
        return not self.exact_now and self.decision.compresses(fmt)

    # ------------------------------------------------------------------ per step
    def begin_step(self, k: int, tiered: bool, compressed_elements: int) -> None:
        """Before iteration ``k``: start, run and conclude the A/B (auto, where it compresses)."""
        d = self.decision
        wants_ab = d.mode == "auto" and d.any_compressed() and self.config.compress_ab_steps > 0
        if wants_ab and tiered and self.ab.start is None and not self.ab.done:
            self.ab.start = k + AB_SETTLE_STEPS
            self.ab_elements = compressed_elements
        elif wants_ab and self.ab.done and self.ab_elements and \
                abs(compressed_elements - self.ab_elements) > AB_RETEST_CHANGE * self.ab_elements:
            self.report(f"re-tiering changed the compressed tiers' elements from {self.ab_elements} "
                        f"to {compressed_elements}: the step-time A/B runs again")
            self.ab = StepTimeAB(self.config.compress_ab_steps)
            self.ab.start = k + AB_SETTLE_STEPS
            self.ab_elements = compressed_elements
        verdict = self.ab.verdict(self.device, self.agree_group) if self.ab.start is not None else None
        if verdict is not None:
            fast, slow = self.ab.medians
            summary = (f"A/B of step time ({self.ab.steps} steps each): compressed "
                       f"{fast * 1e3:.1f} ms, exact {slow * 1e3:.1f} ms")
            if verdict:
                d.confirmed = True
                self.report(f"{summary}: compression kept")
            else:
                d.fall_back()
                self.report(f"{summary}: no gain, every tier syncs exactly on the {d.name}")
        self.exact_now = self.ab.phase(k) == "exact"

    def record(self, k: int, step_time: float) -> None:
        self.ab.record(k, step_time)

    def metrics(self) -> Dict[str, float]:
        out = self.decision.metrics()
        if self.exact_now:
            out["grpo_compress_ab_exact_step"] = 1.0
        return out

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> Dict:
        """The decision and the A/B as they stand: a resume with the same --grpo-compress keeps
        them (the run continues as the uninterrupted one would, bit for bit), another mode
        decides anew."""
        return {**self.decision.state_dict(), "ab_start": self.ab.start, "ab_done": self.ab.done,
                "ab_times": {k: list(v) for k, v in self.ab.times.items()},
                "ab_medians": getattr(self.ab, "medians", None), "ab_elements": self.ab_elements}

    def load_state_dict(self, state: Optional[Dict]) -> None:
        if not state or state.get("mode") != self.decision.mode:
            if state:
                self.report(f"the checkpoint was written with --grpo-compress {state.get('mode')}; "
                            f"this run decides with --grpo-compress {self.decision.mode}")
            return
        self.decision.compress = {f: bool(v) for f, v in state["compress"].items()}
        self.decision.confirmed = state["confirmed"]
        self.ab.start, self.ab.done = state["ab_start"], state["ab_done"]
        self.ab.times = {k: list(v) for k, v in state["ab_times"].items()}
        if state.get("ab_medians") is not None:
            self.ab.medians = list(state["ab_medians"])
        self.ab_elements = state.get("ab_elements")
        self.report(f"resumed with the checkpoint's decision: {self.decision.line()}")
