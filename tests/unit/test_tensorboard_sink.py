"""TensorBoardSink: every finite numeric field of a record is a scalar at its iteration, as
TensorBoard itself reads the file back; flags, text and non-finite values are left out."""

import math

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_grpo.training.metrics import TensorBoardSink


def test_records_read_back_as_scalars(tmp_path):
    sink = TensorBoardSink(str(tmp_path))
    for it in (1, 2, 3):
        sink.write({"iteration": it, "loss": 3.0 - it / 4, "wire_bytes": 1000 * it, "grpo_tiered": True,
                    "grpo_tier_map": "cdds", "grad_norm": math.nan if it == 2 else 0.5})
    sink.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["grad_norm", "loss", "wire_bytes"]
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 2.75), (2, 2.5), (3, 2.25)]
    assert [(e.step, e.value) for e in acc.Scalars("wire_bytes")] == [(1, 1000.0), (2, 2000.0), (3, 3000.0)]
    assert [e.step for e in acc.Scalars("grad_norm")] == [1, 3]  # the NaN of step 2 is not written
