"""Write a megatron-core indexed dataset (PREFIX.bin/.idx + PREFIX.meta.json) for training.

Your own text (files, folders searched for .txt/.md/.rst/.py/.jsonl, JSONL with a 'text' field):
    python launch/preprocess_data.py --input docs/ notes.txt data.jsonl --output-prefix data/mine
The default corpus (the Python standard library, offline everywhere, byte tokenizer):
    python launch/preprocess_data.py --default-corpus --output-prefix data/stdlib
The same with the shipped byte-level BPE (4096 tokens, trained offline on that corpus):
    python launch/preprocess_data.py --default-corpus --output-prefix data/stdlib-bpe \
        --tokenizer-model launch/tokenizers/stdlib-bpe-4k
A local Hugging Face tokenizer instead of bytes (needs `pip install transformers`):
    python launch/preprocess_data.py --input docs/ --output-prefix data/mine --tokenizer-model /path/to/tok

Documents are shuffled with --seed before writing (megatron splits train/valid by document order).
"""

import argparse
import os
import sys
import time
import warnings

# Runnable as `python launch/preprocess_data.py` from a checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", metavar="PATH",
                   help="text files, folders (recursive) or .jsonl files with a 'text' field")
    p.add_argument("--output-prefix", required=True, metavar="PREFIX",
                   help="write PREFIX.bin, PREFIX.idx and PREFIX.meta.json")
    p.add_argument("--default-corpus", action="store_true",
                   help="build the Python standard library corpus instead of --input (with the byte "
                        "tokenizer unless --tokenizer-model is given)")
    p.add_argument("--tokenizer-model", metavar="PATH", default=None,
                   help="local Hugging Face tokenizer folder (e.g. the shipped BPE "
                        "launch/tokenizers/stdlib-bpe-4k, or one of launch/train_tokenizer.py); "
                        "default: byte tokenizer")
    p.add_argument("--seed", type=int, default=1234, help="document shuffle seed (default 1234)")
    p.add_argument("--doc-chars", type=int, default=4096, metavar="N",
                   help="cut plain text longer than N characters at blank lines into documents of "
                        "about N characters; 0 keeps one document per file (default 4096)")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.default_corpus:
        if args.input:
            parser.error("--input and --default-corpus exclude each other: give one of them")
    elif not args.input:
        parser.error("--input is required (one or more files/folders), or pass --default-corpus")
    if args.doc_chars < 0:
        parser.error(f"--doc-chars must be >= 0, got {args.doc_chars}")

    # megatron-core warns at import that Transformer Engine/Apex are absent; irrelevant here.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    from megatron_grpo.data.corpus import build_default_dataset
    from megatron_grpo.data.preprocess import describe, preprocess
    from megatron_grpo.data.tokenizer import build_tokenizer

    t0 = time.time()
    try:
        tok = build_tokenizer(args.tokenizer_model)
        if args.default_corpus:
            build_default_dataset(args.output_prefix, seed=args.seed, tokenizer=tok)
        else:
            meta = preprocess(args.input, args.output_prefix, tokenizer=tok, seed=args.seed,
                              doc_chars=args.doc_chars)
            print(f"wrote {args.output_prefix}.bin/.idx/.meta.json: {describe(meta)} "
                  f"in {time.time() - t0:.1f} s")
    except (FileNotFoundError, ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
