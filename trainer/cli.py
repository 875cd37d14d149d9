"""``tlt-train warmup --model M --out PATH``: train a drafter for M from M's own outputs."""

from __future__ import annotations

import argparse
import json
import sys

from trainer.data import DataConfig
from trainer.train import TrainConfig
from trainer.warmup import DTYPES, WarmupConfig, warmup

# Config field (as validation messages name it) → command-line flag.
FLAGS = {
    "num_prompts": "--num-prompts",
    "heldout_prompts": "--heldout",
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "max_num_seqs": "--max-num-seqs",
    "draft_vocab": "--draft-vocab",
    "steps": "--steps",
    "batch_tokens": "--batch-tokens",
    "row_len": "--row-len",
    "lr": "--lr",
    "unroll": "--unroll",
    "threads": "--threads",
    "dtype": "--dtype",
    "eval_depth": "--eval-depth",
    "out": "--out",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tlt-train", description="drafter training")
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser(
        "warmup",
        help="train an EAGLE-style drafter from the target's own responses (CPU)",
        description="Generate responses with the target, compute its features, train a "
        "drafter on them and write a checkpoint for --speculative drafter --drafter PATH.",
    )
    d, t = DataConfig(), TrainConfig()
    w.add_argument("--model", default=WarmupConfig.model, help="the target (as tlt-serve)")
    w.add_argument("--out", required=True, metavar="PATH", help="checkpoint directory")
    w.add_argument("--num-prompts", type=int, default=d.num_prompts, metavar="N")
    w.add_argument(
        "--heldout",
        type=int,
        default=d.heldout_prompts,
        metavar="N",
        help="prompts kept out of training (greedy) for the accept estimate",
    )
    w.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, metavar="T")
    w.add_argument(
        "--temperature",
        type=float,
        default=d.temperature,
        metavar="T",
        help="sampling temperature of the training responses",
    )
    w.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        metavar="N",
        help="engine rows while generating",
    )
    w.add_argument(
        "--draft-vocab",
        type=int,
        default=d.draft_vocab_size,
        metavar="V",
        help="draft head size (most frequent tokens); 0 = full vocabulary",
    )
    w.add_argument("--steps", type=int, default=t.steps, metavar="S")
    w.add_argument("--batch-tokens", type=int, default=t.batch_tokens, metavar="B")
    w.add_argument(
        "--row-len", type=int, default=t.row_len, metavar="L", help="packed row length (pairs)"
    )
    w.add_argument("--lr", type=float, default=t.lr)
    w.add_argument(
        "--unroll",
        type=int,
        default=t.unroll,
        metavar="K",
        help="chain steps trained per position (1 = teacher forcing only)",
    )
    w.add_argument("--eval-depth", type=int, default=WarmupConfig.eval_depth, metavar="K")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument(
        "--threads", type=int, default=None, metavar="N", help="torch threads (default: torch's)"
    )
    w.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=WarmupConfig.dtype,
        help="target dtype while generating and computing features",
    )
    w.add_argument(
        "--data-cache",
        default=None,
        metavar="FILE",
        help="keep generated data + features here and reuse them when they match",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> WarmupConfig:
    return WarmupConfig(
        model=args.model,
        out=args.out,
        seed=args.seed,
        threads=args.threads,
        dtype=args.dtype,
        eval_depth=args.eval_depth,
        data_cache=args.data_cache,
        data=DataConfig(
            num_prompts=args.num_prompts,
            heldout_prompts=args.heldout,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            max_num_seqs=args.max_num_seqs,
            draft_vocab_size=args.draft_vocab,
        ),
        train=TrainConfig(
            steps=args.steps,
            batch_tokens=args.batch_tokens,
            row_len=args.row_len,
            lr=args.lr,
            unroll=args.unroll,
        ),
    )


def flag_message(err: Exception) -> str:
    """A config error ``field: ...`` with the field replaced by its flag."""
    text = str(err)
    field, sep, rest = text.partition(":")
    return f"{FLAGS[field]}:{rest}" if sep and field in FLAGS else text


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    try:
        cfg.validate()
    except ValueError as err:
        parser.error(flag_message(err))
    from tlt_serve.models.provision import resolve_model_path

    try:
        resolve_model_path(cfg.model)
    except (FileNotFoundError, ValueError) as err:
        parser.error(f"--model: {err}")
    result = warmup(cfg)
    offline = result.report["offline"]
    print(json.dumps({"out": str(result.path), **result.report["timings"]}), file=sys.stderr)
    print(
        f"wrote {result.path}: offline accept length {offline['trained']['accept_length']:.3f} "
        f"at depth {offline['depth']} (untrained {offline['untrained']['accept_length']:.3f}), "
        f"top-1 {offline['trained']['top1']:.3f}; {result.report['timings']['total_s']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
