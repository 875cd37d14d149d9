"""Hot-swap under load: many concurrent requests while drafters are swapped again and again.

Two servers in one run, same fp32 model and greedy requests: (1) plain decoding, the
reference; (2) speculating with a drafter (at every batch size) while a swapper posts
``/update_drafter_from_disk`` in a loop, alternating two checkpoints with increasing
versions. Every request of (2) must succeed, be well-formed, report versions that exist,
and produce exactly the tokens of (1).

    python -m benchmarks.stress.hot_swap --drafters A,B --requests 200 [--backend vllm --tag vllm]
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.common.prompts import chat_prompts, tokenizer
from benchmarks.common.results import names, parse, parser, report
from benchmarks.common.servers import running_server


async def fire(url: str, prompts: list[list[int]], new: int, desc: str) -> list[Any]:
    """All requests at once (half streamed); each result is the final body or an error."""
    bar = tqdm(total=len(prompts), desc=desc)
    limits = httpx.Limits(max_connections=len(prompts) + 8)
    params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}

    async def one(http: httpx.AsyncClient, i: int) -> Any:
        body = {"input_ids": prompts[i], "sampling_params": params, "stream": i % 2 == 1}
        try:
            if not body["stream"]:
                resp = await http.post("/generate", json=body)
                out = resp.json() if resp.status_code == 200 else f"HTTP {resp.status_code}"
            else:
                out = None
                async with http.stream("POST", "/generate", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            out = json.loads(line[6:])
        except (httpx.HTTPError, json.JSONDecodeError) as err:
            out = f"{type(err).__name__}: {err}"
        bar.update(1)
        return out

    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as http:
        results = await asyncio.gather(*(one(http, i) for i in range(len(prompts))))
    bar.close()
    return list(results)


async def swapping(url: str, drafters: list[str], stop: asyncio.Event) -> list[dict]:
    swaps: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        while not stop.is_set():
            v = len(swaps) + 1
            t0 = time.perf_counter()
            resp = await http.post(
                "/update_drafter_from_disk", json={"path": drafters[v % 2], "version": v}
            )
            swaps.append({"version": v, "status": resp.status_code, "ok": resp.json()["success"],
                          "seconds": round(time.perf_counter() - t0, 3)})
            await asyncio.sleep(0.05)
    return swaps


async def swapped_run(url: str, prompts: list[list[int]], new: int, drafters: list[str]):
    stop = asyncio.Event()
    swapper = asyncio.create_task(swapping(url, drafters, stop))
    results = await fire(url, prompts, new, "spec + swaps")
    stop.set()
    return results, await swapper


def check(ref: list[Any], got: list[Any], new: int, max_version: int) -> dict[str, Any]:
    failed = [i for i, g in enumerate(got) if not isinstance(g, dict)]
    malformed, mismatched, multi = [], [], 0
    for i, g in enumerate(got):
        if i in failed:
            continue
        meta = g.get("meta_info", {})
        versions = meta.get("drafter_versions")
        ok = (
            len(g.get("output_ids", [])) == new
            and isinstance(versions, list)
            and all(0 <= v <= max_version for v in versions)
            and versions == sorted(versions)
            and meta.get("finish_reason", {}).get("type") == "length"
        )
        if not ok:
            malformed.append(i)
        elif not isinstance(ref[i], dict) or g["output_ids"] != ref[i]["output_ids"]:
            mismatched.append(i)
        multi += bool(versions) and len(versions) > 1
    return {"requests": len(got), "failed": len(failed), "malformed": len(malformed),
            "mismatched": len(mismatched), "requests_seeing_several_drafters": multi,
            "examples": [got[i] for i in failed[:3]]}


def main(argv: Sequence[str] | None = None) -> None:
    ap = parser(__doc__, "hot_swap")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafters", type=names, required=True,
                    help="two checkpoints, comma-separated")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--backend", choices=["native", "vllm"], default="native",
                    help="the engine of both servers")
    a = parse(ap, argv)
    drafters = [str(Path(d).expanduser().resolve()) for d in a.drafters]
    if len(drafters) != 2:
        ap.error("--drafters: give two checkpoints")
    prompts = chat_prompts(tokenizer(a.model), 0, a.requests)
    flags = ["--model", a.model, "--dtype", "float32", "--max-num-seqs", str(a.max_num_seqs),
             "--max-model-len", "1024", "--backend", a.backend]
    t0 = time.perf_counter()
    with running_server(flags) as url:
        ref = asyncio.run(fire(url, prompts, a.new_tokens, "plain"))
    plain_s = time.perf_counter() - t0
    spec = ["--speculative", "drafter", "--drafter", drafters[0], "--spec-max-batch",
            str(a.max_num_seqs)]
    t0 = time.perf_counter()
    with running_server(flags + spec) as url:
        got, swaps = asyncio.run(swapped_run(url, prompts, a.new_tokens, drafters))
    result = check(ref, got, a.new_tokens, len(swaps))
    result.update(
        swaps=len(swaps),
        swaps_failed=sum(1 for s in swaps if not s["ok"]),
        swap_seconds_median=sorted(s["seconds"] for s in swaps)[len(swaps) // 2] if swaps else None,
        plain_failed=sum(1 for r in ref if not isinstance(r, dict)),
        wall_s={"plain": round(plain_s, 1), "spec_with_swaps": round(time.perf_counter() - t0, 1)},
    )
    print(json.dumps({k: v for k, v in result.items() if k != "examples"}, indent=2))
    report(a, result)


if __name__ == "__main__":
    main()
