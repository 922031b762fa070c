"""``--check-weight-hash-interval``: verify that copies of the weights which must be identical are.

Megatron keeps several copies of every weight and relies on sync paths to keep them equal:

* **dp** - every data-parallel replica holds the whole model; gradients are reduced and (with
  the distributed optimizer) updated shards are all-gathered back into every replica;
* **tp** - parameters that tensor parallelism does not split (layer norms, row-parallel biases:
  no ``tensor_model_parallel`` attribute) are held in full by every TP rank and are never synced:
  they stay equal only because every TP rank computes bit-identical gradients for them;
* **pp** - with tied embeddings and PP > 1 the last stage keeps its own copy of the word
  embedding (``output_layer.weight``, marked ``shared_embedding``) whose gradient megatron
  all-reduces with the first stage's over the embedding group (megatron-core 0.16.1 marks both
  copies ``shared_embedding``). GPTModel's default, which training/model.py keeps, is untied:
  then there is nothing to compare and no pp collective is issued.

A bug in any of these paths does not crash: replicas silently drift and the run trains a model
that is no longer one model. ``check_weight_hashes`` hashes every parameter on the device and
compares the hashes across each group.

Design (why it scales to GPU runs):

* the digest is computed on the parameters' device; only a small int64 vector (3 values per
  parameter) crosses the wire, via one ``all_gather_into_tensor`` per group, and comes to the
  host once for comparison;
* it is exact integer arithmetic on the raw bits (16-bit words, position-weighted sums), so it
  does not depend on reduction order and any single changed bit changes the digest;
* the collectives issued depend only on the model's structure and the layout (never on the
  values), so every rank of a group issues the same calls with the same sizes; a failure adds
  one world-wide ``all_gather_object`` of the findings, on every rank alike, so every rank can
  report the same names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from megatron_grpo.grpo.config import ConfigError

FLAG = "--check-weight-hash-interval"

# Digest arithmetic: 16-bit words (< 2**16) times weights (<= 2**20) summed over at most
# _CHUNK words stay below 2**58, so each chunk sum is exact in int64 (no overflow, which torch
# does not define); chunk sums are folded modulo the Mersenne prime 2**61 - 1.
_CHUNK = 1 << 22
_MOD = (1 << 61) - 1
# Two positional weightings with different (prime) periods: a swap of two words is missed only
# if both periods divide their distance.
_W1_PERIOD = 1048573
_W2_MULT, _W2_PERIOD = 40503, 1048571

GROUP_NAMES = {"dp": "data-parallel", "tp": "tensor-parallel", "pp": "pipeline tied-embedding"}


class WeightHashMismatch(RuntimeError):
    """Raised by the training loop when replicas that must be bit-identical differ."""


@dataclass(frozen=True)
class Mismatch:
    """One parameter whose copies differ within one group."""

    group: str
    """'dp', 'tp' or 'pp' (see GROUP_NAMES)."""
    param: str
    """The parameter's name in the model's named_parameters() (prefixed 'chunkK.' with several
    model chunks)."""
    ranks: Tuple[int, ...]
    """Global ranks of the group."""
    classes: Tuple[Tuple[int, ...], ...]
    """The group's global ranks partitioned by identical bytes (more than one class = mismatch)."""

    def split(self) -> str:
        """'{0} vs {1}': the ranks holding each distinct version."""
        return " vs ".join("{" + ", ".join(map(str, c)) + "}" for c in self.classes)


@dataclass
class WeightHashResult:
    """Outcome of one check; ``ok`` and ``mismatches`` are the same on every rank."""

    ok: bool
    mismatches: List[Mismatch] = field(default_factory=list)
    checked: Dict[str, int] = field(default_factory=dict)
    """Parameters this rank compared per group ('dp'/'tp'/'pp'); 0 where the group has 1 rank.
    'dp_instance_only' (only when some): how many of the dp ones were compared only inside the
    distributed-optimizer instance."""

    @property
    def groups(self) -> List[str]:
        """The kinds of group that disagreed, in dp, tp, pp order."""
        return [g for g in GROUP_NAMES if any(m.group == g for m in self.mismatches)]

    def params(self, group: Optional[str] = None) -> List[str]:
        """Distinct names of the parameters that differ (within ``group`` if given)."""
        names: List[str] = []
        for m in self.mismatches:
            if (group is None or m.group == group) and m.param not in names:
                names.append(m.param)
        return names

    def describe(self, limit: int = 5) -> str:
        """One line per kind of group that disagreed, naming its first ``limit`` parameters and,
        for each, which ranks hold which version (one 'A vs B' per group instance)."""
        lines = []
        for g in self.groups:
            names = self.params(g)
            parts = []
            for name in names[:limit]:
                splits = "; ".join(m.split() for m in self.mismatches
                                   if m.group == g and m.param == name)
                parts.append(f"{name} (ranks {splits})")
            more = f"; ... and {len(names) - limit} more" if len(names) > limit else ""
            lines.append(f"{GROUP_NAMES[g]} ({g}) copies differ for {len(names)} parameter(s): "
                         f"{'; '.join(parts)}{more}")
        return "\n".join(lines)


def validate_interval(interval) -> Optional[int]:
    """The flag's value, or ConfigError naming the flag (arguments.validate does not know it)."""
    if interval is None:
        return None
    if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
        raise ConfigError(f"{FLAG} must be a positive integer (check every N iterations), "
                          f"got {interval!r}")
    return interval


def check_due(interval: Optional[int], iteration: int) -> bool:
    return interval is not None and iteration % interval == 0


def failure_message(result: WeightHashResult, iteration: int, limit: int = 5) -> str:
    """The text of the error the training loop raises (identical on every rank)."""
    return (f"weight hash check failed at iteration {iteration} ({FLAG}):\n"
            f"{result.describe(limit)}\n"
            f"Copies of these weights that must be bit-identical have diverged: a bug in a "
            f"gradient or parameter sync path (data-parallel reduce / parameter all-gather, "
            f"tensor-parallel replicated-parameter gradients, or the tied-embedding all-reduce). "
            f"Stopping the run rather than training on diverged replicas; checkpoints saved "
            f"after the last passing check may hold diverged weights.")


# -- digest ------------------------------------------------------------------------------------

def _words(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` as a 1-D integer tensor (a view: DDP parameters are contiguous)."""
    flat = t.detach().reshape(-1)
    if flat.element_size() == 1:
        return flat.view(torch.uint8)
    # Reinterpreting as 16-bit words covers fp32, bf16, fp16 and wider types alike.
    return flat.view(torch.int16)


def _word_sums(t: torch.Tensor) -> torch.Tensor:
    """[s1, s2] int64 on ``t``'s device: two position-weighted sums of the raw bits."""
    words = _words(t)
    dev = words.device
    acc = torch.zeros(2, dtype=torch.int64, device=dev)
    for start in range(0, words.numel(), _CHUNK):
        w = words[start:start + _CHUNK].to(torch.int64) & 0xFFFF  # unsigned word value
        idx = torch.arange(start, start + w.numel(), dtype=torch.int64, device=dev)
        k1 = idx % _W1_PERIOD + 1
        k2 = (idx * _W2_MULT) % _W2_PERIOD + 1
        acc = (acc + torch.stack([(w * k1).sum(), (w * k2).sum()])) % _MOD
    return acc


def tensor_digest(t: torch.Tensor) -> torch.Tensor:
    """[numel, s1, s2] int64 on ``t``'s device (any single changed bit changes s1 and s2)."""
    return _digests([t], t.device)[0]


def _digests(params: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[len(params), 3] int64 on ``device``: one digest row per parameter, computed there."""
    if not params:
        return torch.zeros(0, 3, dtype=torch.int64, device=device)
    # One host->device copy for all sizes, not one per parameter.
    numels = torch.tensor([p.numel() for p in params], dtype=torch.int64, device=device)
    return torch.cat([numels[:, None], torch.stack([_word_sums(p) for p in params])], dim=1)


# -- comparison --------------------------------------------------------------------------------

def _named_params(ddp_model_chunks) -> List[Tuple[str, torch.nn.Parameter]]:
    from megatron.core.utils import unwrap_model

    chunks = list(ddp_model_chunks)
    out = []
    for i, chunk in enumerate(chunks):
        prefix = f"chunk{i}." if len(chunks) > 1 else ""
        # Names as the user's model reports them (no DDP / Float16Module 'module.' prefixes).
        out += [(prefix + n, p) for n, p in unwrap_model(chunk).named_parameters()]
    return out


def _classes(column: List[tuple], ranks: Sequence[int]) -> Tuple[Tuple[int, ...], ...]:
    by_value: Dict[tuple, List[int]] = {}
    for value, rank in zip(column, ranks):
        by_value.setdefault(value, []).append(rank)
    return tuple(tuple(rs) for rs in by_value.values())


def _compare(kind: str, names: List[str], rows: torch.Tensor, group) -> List[Mismatch]:
    """All-gather ``rows`` ([n, k] int64) over ``group``; a Mismatch per row that differs."""
    size = dist.get_world_size(group)
    flat = rows.reshape(-1).contiguous()
    gathered = torch.empty(size * flat.numel(), dtype=flat.dtype, device=flat.device)
    dist.all_gather_into_tensor(gathered, flat, group=group)
    table = gathered.view(size, *rows.shape).cpu().tolist()  # the one small device->host copy
    ranks = dist.get_process_group_ranks(group)
    found = []
    for i, name in enumerate(names):
        column = [tuple(table[r][i]) for r in range(size)]
        if any(c != column[0] for c in column[1:]):
            found.append(Mismatch(kind, name, tuple(ranks), _classes(column, ranks)))
    return found


def check_weight_hashes(ddp_model_chunks, local_params: Optional[Set] = None) -> WeightHashResult:
    """Compare every parameter across the dp group, replicated ones across the tp group and the
    tied word embedding across the embedding group. Collective: call on every rank.
    ``local_params`` (ids of parameters): their dp copies are compared inside each
    distributed-optimizer instance only (megatron's partial data-parallel group), for GRPO's
    periodic tiers between syncs, when the instances are meant to differ. Every rank of a dp
    group must pass the same set (it depends only on the replica's tier plan)."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.comm.wire import wire_counter

    for chunk in ddp_model_chunks:
        cfg = getattr(chunk, "ddp_config", None)
        if cfg is not None and getattr(cfg, "overlap_param_gather", False):
            # The updated shards would still be in flight until the next forward: every replica
            # would look diverged. Not used by this project; refuse rather than report garbage.
            raise ValueError(f"{FLAG} does not support overlap_param_gather")
    from megatron.core.utils import unwrap_model

    named = _named_params(ddp_model_chunks)
    tied = any(getattr(unwrap_model(c), "share_embeddings_and_output_weights", False)
               for c in ddp_model_chunks)
    device = named[0][1].device if named else torch.device("cpu")
    # Every tensor handed to a collective is created on the parameters' device (NCCL rejects
    # host tensors); tagged so per-step figures do not count this as gradient traffic.
    with wire_counter().tag("weight_check"):
        found: List[Mismatch] = []
        checked = {"dp": 0, "tp": 0, "pp": 0}
        digests = _digests([p for _, p in named], device)
        names = [n for n, _ in named]

        # dp: all parameters. Expert (MoE) parameters, allreduce=False, are replicated over the
        # expert data-parallel group instead; none exist in this project's models.
        dp_group = ps.get_data_parallel_group(with_context_parallel=True)
        local = local_params or set()
        dp_idx = [i for i, (_, p) in enumerate(named) if getattr(p, "allreduce", True)]
        everywhere = [i for i in dp_idx if id(named[i][1]) not in local]
        if dist.get_world_size(dp_group) > 1 and everywhere:
            found += _compare("dp", [names[i] for i in everywhere], digests[everywhere], dp_group)
        inside = [i for i in dp_idx if id(named[i][1]) in local]
        if inside:  # the same on every rank of the dp group (one tier plan)
            group = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
            if dist.get_world_size(group) > 1:
                found += _compare("dp", [names[i] for i in inside], digests[inside], group)
        checked["dp"] = len(dp_idx) if dist.get_world_size(dp_group) > 1 else 0
        if inside:
            checked["dp_instance_only"] = len(inside)

        # tp: parameters that tensor parallelism does not split.
        tp_group = ps.get_tensor_model_parallel_group()
        tp_idx = [i for i, (_, p) in enumerate(named)
                  if not getattr(p, "tensor_model_parallel", False) and getattr(p, "allreduce", True)]
        if dist.get_world_size(tp_group) > 1 and tp_idx:
            found += _compare("tp", [names[i] for i in tp_idx], digests[tp_idx], tp_group)
            checked["tp"] = len(tp_idx)

        # pp: the tied word embedding, first stage vs last stage (tying is a model setting, the
        # same on every stage; GPTModel's default, used by training/model.py, is untied). Each
        # member sends one fixed-size row [count, numel, s1, s2] (zeros on a stage without a
        # shared weight), so the members' calls match whatever each stage holds.
        emb_group = ps.get_embedding_group(check_initialized=False)
        if tied and emb_group is not None and ps.is_rank_in_embedding_group() \
                and dist.get_world_size(emb_group) > 1:
            shared = [i for i, (_, p) in enumerate(named) if getattr(p, "shared_embedding", False)]
            row = torch.zeros(1, 4, dtype=torch.int64, device=device)
            if shared:
                sel = digests[shared]
                row[0, 0] = len(shared)
                row[0, 1] = sel[:, 0].sum()
                row[0, 2:] = sel[:, 1:].sum(0) % _MOD
            label = " + ".join(names[i] for i in shared) or "(no shared embedding on this stage)"
            found += _compare("pp", [label], row, emb_group)
            checked["pp"] = len(shared)

        # Every rank learns whether any group anywhere disagreed (one int64, world-wide), then
        # only on failure the findings themselves, so all ranks raise the same error.
        flag = torch.tensor([1 if found else 0], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag.item()) == 0:
            return WeightHashResult(True, [], checked)
        everyone: List[Optional[List[Mismatch]]] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, found)
    unique = sorted({m for ms in everyone for m in (ms or [])},
                    key=lambda m: ("dp tp pp".split().index(m.group), m.ranks, m.param))
    return WeightHashResult(False, unique, checked)
