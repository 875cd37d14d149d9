"""``tlt-train warmup --model M --out PATH``: train a drafter for M from M's own outputs.
``tlt-train online --server URL --state-dir DIR``: keep a running server's drafter fresh
(``--fleet ROUTER_URL``: one drafter for every replica behind an sglang-router).
``tlt-train export-vllm DRAFTER --out PATH``: the drafter as vLLM's EAGLE-1 drafter reads it."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time

import torch

from tlt_serve.devices import device_problem
from trainer.data import PROMPT_SOURCES, DataConfig
from trainer.fleet_link import FleetLink
from trainer.link import LinkError, ServerLink
from trainer.online import OnlineConfig, OnlineTrainer
from trainer.store import StoreConfig
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
    "feature_layers": "--feature-layers",
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


def _layers(text: str) -> tuple[int, ...]:
    """'2,15,27' → (2, 15, 27)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated layer indices, got {text!r}") from None


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
        "--prompts",
        choices=PROMPT_SOURCES,
        default=d.prompts,
        help="who writes the prompts: the target itself (its own user turns), templates, or both",
    )
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
    w.add_argument(
        "--feature-layers",
        type=_layers,
        default=d.feature_layers,
        metavar="I,J,K",
        help="fuse these target layers' residual streams (EAGLE-3 style, e.g. 2,15,27 for "
        "low / mid / high of 30 layers); default: the final hidden state (EAGLE-1)",
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
    o = sub.add_parser(
        "online",
        help="keep a running server's drafter up to date (trains in its idle gaps)",
        description="Pull captured samples from a tlt-serve server started with --capture, "
        "train the drafter while the server is idle enough, and hot-swap better drafters in.",
    )
    oc = OnlineConfig()
    where = o.add_mutually_exclusive_group()
    where.add_argument("--server", default=oc.server, metavar="URL")
    where.add_argument("--fleet", default=None, metavar="ROUTER_URL",
                       help="train one drafter for every replica behind this sglang-router: "
                       "samples from all, training while some replica is idle (on its cores "
                       "when it is on this machine), each drafter published to all")
    o.add_argument("--no-lend-cores", action="store_true",
                   help="with --fleet: train on this process's own cores, not an idle "
                   "replica's")
    o.add_argument("--state-dir", required=True, metavar="DIR", help="checkpoints + published")
    o.add_argument("--init", default=None, metavar="PATH", help="drafter to start from")
    o.add_argument("--api-key", default=os.environ.get("TLT_SERVE_API_KEY"))
    o.add_argument("--lr", type=float, default=oc.lr)
    o.add_argument("--rows", type=int, default=oc.rows, metavar="N",
                   help="packed rows per micro-step (one tick)")
    o.add_argument("--row-len", type=int, default=oc.row_len, metavar="L")
    o.add_argument("--accum", type=int, default=oc.accum, metavar="N",
                   help="micro-steps per optimizer step")
    o.add_argument("--eval-every", type=int, default=oc.eval_every, metavar="STEPS")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--threads", type=int, default=None, metavar="N")
    o.add_argument("--device", default=oc.device, metavar="DEV",
                   help="where the drafter trains: cpu, cuda or cuda:N (beside the engine on "
                   "its GPU, in the gaps it leaves)")
    o.add_argument("--memory-gib", type=float, default=0.0, metavar="G",
                   help="on a GPU: the most the trainer allocates there (its share beside the "
                   "engine; 0: no cap)")
    o.add_argument("--shared-feed", action="store_true",
                   help="the server runs on this machine: take its captured features by "
                   "reference (on a GPU they never leave it; the sample store then lives "
                   "there, within half of --memory-gib)")
    o.add_argument("--log-level", default="info")
    e = sub.add_parser(
        "export-vllm",
        help="write a drafter checkpoint as vLLM's EAGLE-1 Llama drafter loads it",
        description="Copy a drafter checkpoint into the form vLLM's EagleLlamaForCausalLM "
        "loads (--speculative-config '{\"method\": \"eagle\", \"model\": PATH}'): its "
        "architecture name, no fc bias, the full vocabulary.",
    )
    e.add_argument("drafter", metavar="DRAFTER", help="a tlt-serve drafter checkpoint")
    e.add_argument("--out", required=True, metavar="PATH")
    return parser


def run_export(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from tlt_serve.speculative.checkpoint import DrafterError
    from tlt_serve.speculative.export import export_vllm_eagle

    try:
        report = export_vllm_eagle(args.drafter, args.out)
    except DrafterError as err:
        parser.error(str(err))
    print(json.dumps(report.as_dict()))
    return 0


def online_config(args: argparse.Namespace) -> OnlineConfig:
    return OnlineConfig(
        server=args.server,
        state_dir=args.state_dir,
        init=args.init,
        api_key=args.api_key,
        lr=args.lr,
        rows=args.rows,
        row_len=args.row_len,
        accum=args.accum,
        eval_every=args.eval_every,
        seed=args.seed,
        device=args.device,
        memory_bytes=int(args.memory_gib * 2**30),
        # fed by reference on a GPU the store holds features there: half the budget at most
        store=StoreConfig(max_bytes=int(args.memory_gib * 2**29)
                          if args.shared_feed and args.device.startswith("cuda") else 0),
    )


def run_online(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    cfg = online_config(args)
    try:
        cfg.validate()
    except ValueError as err:
        parser.error(str(err))
    if args.threads:
        torch.set_num_threads(args.threads)
    if (why := device_problem(cfg.device)) is not None:
        parser.exit(2, f"tlt-train: {why}\n")
    if cfg.memory_bytes and cfg.device.startswith("cuda"):
        device = torch.device(cfg.device)
        if device.index is None:  # the allocator's share is per device index
            device = torch.device("cuda", torch.cuda.current_device())
        total = torch.cuda.get_device_properties(device).total_memory
        # the caching allocator refuses to grow past this share: an OOM in the trainer,
        # never in the engine beside it
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.memory_bytes / total), device)
    link: ServerLink | FleetLink
    if args.fleet and args.shared_feed:
        parser.error("argument --shared-feed: not with --fleet (replicas may be elsewhere)")
    if args.fleet:
        link = FleetLink(args.fleet, cfg.api_key, lend_cores=not args.no_lend_cores)
    else:
        link = ServerLink(cfg.server, cfg.api_key, share=args.shared_feed)
    trainer = None
    while trainer is None:  # the server may still be starting
        try:
            trainer = OnlineTrainer(cfg, link)
        except LinkError as err:
            logging.getLogger("trainer.online").warning("waiting for the server: %s", err)
            time.sleep(2.0)
        except ValueError as err:
            parser.error(str(err))
    signal.signal(signal.SIGTERM, lambda *_: trainer.stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        trainer.run()
    trainer.checkpoint()
    link.close()
    return 0


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
            prompts=args.prompts,
            heldout_prompts=args.heldout,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            max_num_seqs=args.max_num_seqs,
            draft_vocab_size=args.draft_vocab,
            feature_layers=args.feature_layers,
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
    if args.command == "online":
        return run_online(args, parser)
    if args.command == "export-vllm":
        return run_export(args, parser)
    cfg = config_from_args(args)
    try:
        cfg.validate()
    except ValueError as err:
        parser.error(flag_message(err))
    from tlt_serve.models.arch import ArchConfig
    from tlt_serve.models.provision import resolve_model_path

    try:
        num_layers = ArchConfig.from_dir(resolve_model_path(cfg.model)).num_layers
    except (FileNotFoundError, ValueError) as err:
        parser.error(f"--model: {err}")
    try:
        cfg.data.check_layers(num_layers)
    except ValueError as err:
        parser.error(flag_message(err))
    result = warmup(cfg)
    offline = result.report["offline"]
    print(json.dumps({"out": str(result.path), **result.report["timings"]}), file=sys.stderr)
    print(
        f"wrote {result.path}: offline accept length {offline['trained']['accept_length']:.3f} "
        f"at depth {offline['depth']} (untrained {offline['untrained']['accept_length']:.3f}), "
        f"top-1 {offline['trained']['top1']:.3f}, walked as greedy serving does "
        f"{offline['trained']['walk_accept_length']:.3f}; "
        f"{result.report['timings']['total_s']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
