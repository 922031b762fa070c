"""A small stand-in for Megatron-LM's ``pretrain_gpt.py`` (core_v0.19.x interface): the same
calls into ``megatron.training`` -- ``parse_and_validate_args``, ``gpt_config_from_args``,
``pretrain_cfg_container_from_args``, ``pretrain`` with a dataset provider and a forward step --
on megatron's mock GPT data. The megatron-core wheels from 0.17 on carry ``megatron.training``
but not Megatron-LM's root scripts (``pretrain_gpt.py`` imports ``gpt_builders`` and
``model_provider`` from the checkout), so the runner's tests drive this file; the real script is
run from a Megatron-LM checkout (docs/launch.md)."""

from functools import partial

import torch

from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.core.utils import get_batch_on_this_tp_rank
from megatron.training import get_args, pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import is_first_or_last_pipeline_stage

KEYS = ["attention_mask", "labels", "loss_mask", "position_ids", "tokens"]


def get_batch(data_iterator):
    args = get_args()
    if not is_first_or_last_pipeline_stage(None):
        return [None] * len(KEYS)
    batch = {}
    if mpu.get_tensor_model_parallel_rank() == 0:
        batch = next(data_iterator)
        batch = {k: (batch[k].cuda() if batch.get(k) is not None else None) for k in KEYS}
    batch = get_batch_on_this_tp_rank(
        batch, broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), has_cu_seqlens=False,
        is_hybrid_cp=False, create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        cp_size=1, tp_rank=mpu.get_tensor_model_parallel_rank(), micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length, mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage())
    return [batch.get(k) for k in KEYS]


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model, return_schedule_plan=False):
    attention_mask, labels, loss_mask, position_ids, tokens = get_batch(data_iterator)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def datasets_provider(num_samples, vp_stage=None):
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None, blend_per_split=None,
        split=args.split, path_to_cache=None, tokenizer=build_tokenizer(args),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=args.create_attention_mask_in_dataloader, mid_level_dataset_surplus=0.005)

    def built_here():
        return mpu.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(vp_stage)

    return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, built_here, config).build()


if __name__ == "__main__":
    datasets_provider.is_distributed = True
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    full_config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(full_config, datasets_provider, ModelType.encoder_or_decoder, forward_step)
