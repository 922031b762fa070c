#!/usr/bin/env python
"""Checkpoint tools for megatron-grpo's torch_dist checkpoints.

  inspect DIR                 files with sizes and checksums (verified), iteration, layout, model
                              shape, vocabulary, versions, GRPO tier map
  to-hf DIR OUT [--verify]    megatron (any TP/PP, with or without GRPO state) -> Hugging Face
                              transformers directory (GPT-2 or Llama: config.json, safetensors,
                              tokenizer files), written one layer at a time
  from-hf HF_DIR OUT [--verify]
                              HF GPT-2 / Llama directory -> megatron checkpoint; start any TP/PP
                              layout from it with launch/pretrain_gpt.py --init-from OUT
  strip-grpo DIR OUT          the same checkpoint without GRPO's state: a plain megatron-core
                              checkpoint (model + distributed optimizer), resumable without --grpo

DIR is a --save root (its latest iteration) or one iter_* directory. Every command verifies the
manifest (size and CRC32 of every file) first. --verify compares next-token log-probabilities
of megatron's model and of the transformers model on real text (per-token KL, maximum over
tokens, and top-1 agreement, with thresholds) and, for from-hf, that reading the new checkpoint
back gives the HF tensors bit for bit; it exits 1 when a check fails. Runs on CPU, one process.
See docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpo_ckpt.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="describe a checkpoint (verifies its checksums)")
    i.add_argument("ckpt", metavar="DIR")
    i.add_argument("--json", action="store_true", help="print the description as JSON")
    t = sub.add_parser("to-hf", help="megatron checkpoint -> HF transformers directory")
    t.add_argument("ckpt", metavar="DIR")
    t.add_argument("out", metavar="OUT", help="HF directory to write (replaced when complete)")
    t.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the written tensors (default float32)")
    f = sub.add_parser("from-hf", help="HF transformers directory -> megatron checkpoint")
    f.add_argument("hf", metavar="HF_DIR")
    f.add_argument("out", metavar="OUT", help="checkpoint root to write (iter_0000000 + tracker)")
    f.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="pad the vocabulary as a run at this TP size pads it (default 1)")
    f.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="the training entry's --make-vocab-size-divisible-by (default 128)")
    for sp in (t, f):
        sp.add_argument("--verify", action="store_true",
                        help="check the conversion numerically (exit 1 if it fails)")
        sp.add_argument("--verify-text", metavar="FILE", default=None,
                        help="text for the check (default: Python standard-library sources)")
        sp.add_argument("--verify-seq-length", type=int, default=128, metavar="N",
                        help="tokens per checked sequence (default 128; at most the model's "
                             "learned position table)")
    s = sub.add_parser("strip-grpo", help="write a copy without GRPO's state")
    s.add_argument("ckpt", metavar="DIR")
    s.add_argument("out", metavar="OUT", help="checkpoint root to write")
    return p


def _check(megatron, record, hf_dir: str, args) -> bool:
    from megatron_grpo.convert import verify

    text = open(args.verify_text, encoding="utf-8").read() if args.verify_text else verify.default_text()
    c = record["config"]
    length = args.verify_seq_length
    if c["position_embedding_type"] == "learned_absolute":  # no positions past the table
        length = min(length, c.get("max_position_embeddings") or c["seq_length"])
    tokens = verify.token_batch(verify.tokenizer_of(record), text, length)
    result = verify.check(megatron, hf_dir, tokens)
    print(result.describe(), flush=True)
    return result.ok


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from megatron_grpo.convert.hf_layout import ConversionError
    from megatron_grpo.training.checkpointing import CheckpointError

    try:
        if args.command == "inspect":
            from megatron_grpo.convert import ckpt_tools

            info = ckpt_tools.inspect(args.ckpt)
            print(ckpt_tools.as_json(info) if args.json else ckpt_tools.describe(info))
            return 0
        if args.command == "strip-grpo":
            from megatron_grpo.convert import ckpt_tools

            done = ckpt_tools.strip_grpo(args.ckpt, args.out)
            print(f"wrote {done['checkpoint']}; removed: {'; '.join(done['removed']) or 'nothing (no GRPO state)'}")
            print(f"to continue training: {done['resume']}")
            return 0
        if args.command == "to-hf":
            from megatron_grpo.convert import hf_export
            from megatron_grpo.convert.reader import CheckpointView

            done = hf_export.to_hf(args.ckpt, args.out, args.dtype)
            print(f"wrote {args.out}: {done['family']}, {done['parameters']:,} parameters in "
                  f"{done['shards']} safetensors shards, {done['tokenizer']} (from {done['source']})")
            if args.verify:
                from megatron_grpo.convert.verify import MegatronModel

                view = CheckpointView(args.ckpt)
                return 0 if _check(MegatronModel(view.record, view.path), view.record, args.out, args) else 1
            return 0
        from megatron_grpo.convert import hf_import
        from megatron_grpo.convert.reader import CheckpointView

        done, _ = hf_import.from_hf(args.hf, args.out, args.tensor_model_parallel_size,
                                    args.make_vocab_size_divisible_by)
        print(f"wrote {done['checkpoint']}: {done['family']}, {done['parameters']:,} parameters, "
              f"vocabulary padded to {done['padded_vocab_size']}, tokenizer: {done['tokenizer']}")
        if args.verify:
            from megatron_grpo.convert.verify import MegatronModel

            view = CheckpointView(args.out)
            ok = _check(MegatronModel(view.record, view.path), view.record, args.hf, args)
            diff = hf_import.roundtrip_differences(args.hf, args.out)
            print(f"round trip HF -> megatron -> HF: "
                  f"{'identical tensors' if not diff else 'DIFFERENT: ' + ', '.join(diff[:8])}", flush=True)
            return 0 if ok and not diff else 1
        return 0
    except (CheckpointError, ConversionError, ValueError, FileNotFoundError) as exc:
        print(f"grpo_ckpt.py {args.command}: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"grpo_ckpt.py {args.command}: {exc}. The conversions need Hugging Face transformers: "
              f"pip install -e .[convert]", file=sys.stderr)
        return 2


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # megatron's checkpoint reader/writer leaves a multiprocessing manager (holding our stdout
    # open) and gloo groups behind: stop the one, skip the teardown of the other.
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
    os._exit(code)
