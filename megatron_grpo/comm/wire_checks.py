"""The wire counter's strict mode: which tensors of a call it checks, and what it says when a
tensor is on a device the call's group does not communicate on (megatron_grpo/comm/wire.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _tensors_in(arg, values):
    """(name, tensor) for the tensors of a list argument, one level of nesting (lists of
    output lists in all_gather_coalesced)."""
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            yield f"{arg}[{i}]", v
        elif isinstance(v, (list, tuple)):
            for j, w in enumerate(v):
                if isinstance(w, torch.Tensor):
                    yield f"{arg}[{i}][{j}]", w


def _device_message(op, arg, dev, expected) -> str:
    bound, served, group_name = expected
    if bound is not None:
        want, suggest = f"'{bound}'", str(bound)
    else:
        types = sorted(served or ())
        want = " or ".join(f"'{t}'" for t in types) or "its backend's device"
        suggest = "cpu" if "cpu" in types else (types[0] if types else "<the group's device>")
    try:
        rank = dist.get_rank()
    except Exception:
        rank = "?"
    why = "" if dev.type != "meta" else (
        " A meta tensor was created without an explicit device= (inside `with "
        "torch.device('meta')`, which tests use to find such tensors).")
    how = "" if bound is not None else (
        " (pin it with wire_counter().bind_group_device(group, device))")
    return (f"{op}: argument '{arg}' is on device '{dev}', but {group_name} communicates on "
            f"{want}{how} (global rank {rank}).{why} Create the tensor with "
            f"device={suggest!r} (e.g. torch.empty(..., device={suggest!r})) before handing it "
            f"to {op}.")
