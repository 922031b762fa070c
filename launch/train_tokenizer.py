"""Train a byte-level BPE tokenizer (HF ``tokenizers``) offline, for --tokenizer-model.

The shipped example, launch/tokenizers/stdlib-bpe-4k, was made with
    python launch/train_tokenizer.py --default-corpus --vocab-size 4096 --output launch/tokenizers/stdlib-bpe-4k
Your own text (files, folders, .jsonl with a 'text' field, as preprocess_data.py reads them):
    python launch/train_tokenizer.py --input docs/ notes.txt --vocab-size 32000 --output tok/
Then: python launch/preprocess_data.py --input ... --output-prefix data/mine --tokenizer-model tok/
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", metavar="PATH", help="text files, folders or .jsonl files")
    p.add_argument("--default-corpus", action="store_true",
                   help="train on the default corpus (the Python standard library sources)")
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size (default 4096)")
    p.add_argument("--output", required=True, metavar="DIR", help="tokenizer directory to write")
    args = p.parse_args(argv)
    if bool(args.input) == bool(args.default_corpus):
        p.error("give --input PATH ... or --default-corpus (one of them)")
    from megatron_grpo.data.bpe import train_bpe
    from megatron_grpo.data.corpus import default_corpus_documents
    from megatron_grpo.data.preprocess import collect_documents

    try:
        docs = default_corpus_documents() if args.default_corpus else collect_documents(args.input)
        size = train_bpe(docs, args.vocab_size, args.output)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: byte-level BPE, vocabulary {size}, trained on {len(docs)} documents")
    return 0


if __name__ == "__main__":
    sys.exit(main())
