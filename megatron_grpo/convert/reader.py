"""Read a torch_dist checkpoint without building the training job.

megatron-core writes every tensor of the model under one global key whatever the TP/PP layout
(TP shards and pipeline stages are chunks of it; the layers of the decoder are stacked along a
leading axis: ``decoder.layers.mlp.linear_fc2.weight`` is [num_layers, hidden, ffn]). So one
reader serves every layout, and :meth:`CheckpointView.tensor` reads one layer's slice at a time
through torch.distributed.checkpoint's own resharding reader: a conversion holds a few tensors,
never the model.
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import torch

from megatron_grpo.training import checkpointing as ckpt


def _slice_planner(key: str, offsets: Tuple[int, ...], sizes: Tuple[int, ...]):
    """A DefaultLoadPlanner that reads one region (offsets, sizes) of one key into a plain tensor."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class Planner(DefaultLoadPlanner):
        def create_local_plan(self):
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            self.plan = LoadPlan(create_read_items_for_chunk_list(
                key, self.metadata.state_dict_metadata[key], [chunk]))
            return self.plan

        def lookup_tensor(self, index):
            # read items are offset relative to our region; the default lookup expects a
            # ShardedTensor for offset indices
            return self.state_dict[index.fqn]

    return Planner(flatten_state_dict=False, flatten_sharded_tensors=False)


class CheckpointView:
    """One checkpoint: a ``--save`` root (its latest iteration) or an ``iter_*`` directory.

    The manifest is verified (size and CRC32 of every file) on opening, so a damaged
    checkpoint is named before a byte is converted."""

    def __init__(self, path: str) -> None:
        path = os.path.abspath(path)
        if os.path.isfile(os.path.join(path, ckpt.TRACKER)):
            path = ckpt.iteration_dir(path, ckpt.latest_iteration(path))
        if not os.path.isdir(path):
            raise ckpt.CheckpointError(f"{path}: no such checkpoint directory; pass a --save root "
                                       f"(with {ckpt.TRACKER}) or one of its iter_* directories")
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise ckpt.CheckpointError(f"{path}: no .metadata file, so not a torch_dist checkpoint "
                                       f"(megatron-core dist_checkpointing)")
        self.path = path
        if not os.path.isfile(os.path.join(path, ckpt.MANIFEST)):
            raise ckpt.CheckpointError(
                f"{path}: no {ckpt.MANIFEST}, so its files cannot be verified and its model shape is "
                f"not recorded: either the save was interrupted (load an earlier iter_* directory) "
                f"or it was not written by launch/pretrain_gpt.py (a Megatron-LM checkpoint: not "
                f"supported by these tools yet)")
        self.manifest = ckpt.verify_checkpoint(path)
        from torch.distributed.checkpoint import FileSystemReader

        self._metadata = FileSystemReader(path).read_metadata()

    @property
    def record(self) -> Optional[Dict]:
        """The model record the training entry wrote (model config, vocabulary, tokenizer,
        versions), or None for checkpoints written before it existed."""
        return self.manifest.get("model")

    def tensors(self) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        """Every tensor key with its global shape and dtype."""
        out = {}
        for key, md in self._metadata.state_dict_metadata.items():
            if hasattr(md, "size"):
                out[key] = (tuple(md.size), md.properties.dtype)
        return out

    def objects(self) -> list:
        """Keys of the non-tensor entries (megatron ShardedObjects: optimizer metadata,
        transformer-engine ``_extra_state``)."""
        return [k for k, md in self._metadata.state_dict_metadata.items() if not hasattr(md, "size")]

    def has(self, key: str) -> bool:
        return key in self._metadata.state_dict_metadata

    def tensor(self, key: str, layer: Optional[int] = None) -> torch.Tensor:
        """The global tensor ``key``, or its slice ``[layer]`` of a layer-stacked key."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        if key not in self._metadata.state_dict_metadata:
            raise ckpt.CheckpointError(f"{self.path}: no tensor {key!r} in the checkpoint")
        md = self._metadata.state_dict_metadata[key]
        shape = tuple(md.size)
        if layer is None:
            out = torch.empty(shape, dtype=md.properties.dtype)
            planner = _slice_planner(key, (0,) * len(shape), shape)
        else:
            out = torch.empty((1,) + shape[1:], dtype=md.properties.dtype)
            planner = _slice_planner(key, (layer,) + (0,) * (len(shape) - 1), out.shape)
        # no_dist: a plain process reads it; torch warns that it assumes so, once per call
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({key: out}, storage_reader=FileSystemReader(self.path), planner=planner, no_dist=True)
        return out if layer is None else out[0]

    def common(self) -> Dict:
        """megatron's common state: the run's iteration, scheduler and GRPO's replica-wide state
        under ``common``. megatron-core up to 0.18 writes it to ``common.pt``; 0.19 stores it
        as a sharded object inside the torch_dist files. megatron's own reader takes either
        (``load_common_state_dict``); a ``common.pt`` is read directly, as before."""
        legacy = os.path.join(self.path, "common.pt")
        if os.path.isfile(legacy):
            return torch.load(legacy, map_location="cpu", weights_only=False)
        from megatron.core.dist_checkpointing import load_common_state_dict

        return load_common_state_dict(self.path)
