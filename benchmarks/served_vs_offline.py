"""Served vs offline: does the HTTP front end starve the engine?

The same closed-loop workload twice, in one run: (1) the offline engine (`LLM.generate`) on
all requests at once with `max_num_seqs` = concurrency; (2) the real server (`tlt-serve serve`
in a subprocess) with `concurrency` streaming clients, each sending its next request when the
previous one finishes. Output lengths vary (EOS ignored) so continuous batching matters.

    python -m benchmarks.served_vs_offline --concurrency 64 --requests 256
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from tqdm import tqdm

from benchmarks import report
from benchmarks.prompts import chat_messages
from benchmarks.serverproc import running_server
from tlt_serve import LLM, SamplingParams
from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig


def workload(llm_tok, n: int, min_new: int, max_new: int) -> list[tuple[list[int], int]]:
    span = max_new - min_new + 1
    return [
        (llm_tok.apply_chat_template(chat_messages(i)), min_new + (i * 37) % span)
        for i in range(n)
    ]


def offline(cfg: EngineConfig, reqs: list[tuple[list[int], int]]) -> dict:
    llm = LLM(config=cfg)
    llm.generate([reqs[0][0]], SamplingParams(max_new_tokens=4))  # warm-up
    params = [SamplingParams(max_new_tokens=m, temperature=0.0, ignore_eos=True) for _, m in reqs]
    t0 = time.perf_counter()
    res = llm.generate([p for p, _ in reqs], params, use_tqdm=True)
    dt = time.perf_counter() - t0
    tokens = sum(len(r.samples[0].token_ids) for r in res)
    return {"seconds": dt, "tokens": tokens, "tok_s": tokens / dt}


async def served(url: str, reqs: list[tuple[list[int], int]], concurrency: int) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)
    tokens = 0
    bar = tqdm(total=len(reqs), desc="served")

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            prompt, new = queue.get_nowait()
            body = {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
                "stream": True,
            }
            last = None
            async with http.stream("POST", "/generate", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        last = json.loads(line[6:])
            assert last is not None
            tokens += last["meta_info"]["completion_tokens"]
            bar.update(1)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        warm = {"input_ids": reqs[0][0], "sampling_params": {"max_new_tokens": 4}}
        (await http.post("/generate", json=warm)).raise_for_status()
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        dt = time.perf_counter() - t0
    bar.close()
    return {"seconds": dt, "tokens": tokens, "tok_s": tokens / dt}


def main() -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--min-new", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--out", default="benchmarks/results/served_vs_offline.json")
    args = ap.parse_args()
    cfg = EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len),
        cache=CacheConfig(max_num_seqs=args.concurrency),
    )
    from tlt_serve.models.provision import resolve_model_path
    from tlt_serve.models.tokenizer import load_tokenizer

    reqs = workload(
        load_tokenizer(resolve_model_path(args.model)), args.requests, args.min_new, args.max_new
    )
    off = offline(cfg, reqs)
    print(f"offline: {off['tok_s']:.1f} tok/s ({off['tokens']} tokens, {off['seconds']:.1f} s)")
    server_args = [
        "--model", args.model, "--dtype", args.dtype, "--max-num-seqs", str(args.concurrency),
        "--max-model-len", str(args.max_model_len),
    ]
    with running_server(server_args) as url:
        srv = asyncio.run(served(url, reqs, args.concurrency))
    ratio = srv["tok_s"] / off["tok_s"]
    print(f"served:  {srv['tok_s']:.1f} tok/s ({srv['tokens']} tokens, {srv['seconds']:.1f} s)")
    print(f"served / offline = {ratio:.3f}")
    out = {"benchmark": "served_vs_offline", "args": vars(args), "offline": off, "served": srv,
           "ratio": ratio}
    report.write(out, args.out)


if __name__ == "__main__":
    main()
