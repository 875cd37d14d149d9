"""HTTP load on a server and what it measures, for every tool that sends requests.

A request is streamed and timed in either dialect: tlt-serve/SGLang ``/generate`` or OpenAI
``/v1/completions`` (what vLLM and other peers speak). Three ways to send a workload
(a list of (prompt ids, sampling params)):

  rollout      all at once, as an RL step sends them: makespan, the small-batch phase, tail
               time and throughput and running sequences over time;
  poisson      open loop, Poisson arrivals at a rate: latency and throughput;
  closed_loop  ``c`` clients, each sending its next request when the previous one ends.

Each warms the server up with one short request first and sums its requests' timings up
with ``timing.latency_stats``. ``generate_all`` sends every request at once unstreamed and
returns the responses.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.common.timing import Timed, latency_stats, small_batch_phase, timeline
from clients.results import spec_verifies

Requests = list[tuple[list[int], dict[str, Any]]]


@dataclass(frozen=True)
class Endpoint:
    """Where to send: a server's URL, its dialect and (OpenAI dialect) its model name."""

    url: str
    dialect: str = "generate"  # generate | openai
    model: str = "default"


async def stream_generate(http: httpx.AsyncClient, ids: list[int], params: dict[str, Any],
                          t: Timed) -> None:
    body = {"input_ids": ids, "sampling_params": params, "stream": True}
    async with http.stream("POST", "/generate", json=body) as resp:
        if resp.status_code != 200:
            t.error = f"HTTP {resp.status_code}"
            return
        last = None
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
                if "error" in last:
                    t.error = str(last["error"].get("message"))
                    return
                t.note(len(last["output_ids"]))
        if last is not None:
            meta = last["meta_info"]
            if "spec_verify_ct" in meta:
                t.verify_ct, accepted = spec_verifies(meta)
                t.accept_length = accepted / t.verify_ct if t.verify_ct else 0.0
    t.done = time.monotonic()


async def stream_openai(http: httpx.AsyncClient, model: str, ids: list[int],
                        params: dict[str, Any], t: Timed) -> None:
    body = {
        "model": model, "prompt": ids, "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": params["max_new_tokens"], "temperature": params.get("temperature", 1.0),
        "ignore_eos": params.get("ignore_eos", False),  # vLLM extra, accepted by tlt-serve
    }
    if "sampling_seed" in params:
        body["seed"] = params["sampling_seed"]
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            t.error = f"HTTP {resp.status_code}"
            return
        seen = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                seen = max(seen, int(chunk["usage"]["completion_tokens"]))
            elif chunk.get("choices") and chunk["choices"][0].get("text"):
                seen += 1  # one chunk per decode step (a speculating server may send more)
            t.note(seen)
    t.done = time.monotonic()


async def send(http: httpx.AsyncClient, ep: Endpoint, ids: list[int],
               params: dict[str, Any]) -> Timed:
    """One request, streamed and timed; a transport error is the result's ``error``."""
    t = Timed(time.monotonic())
    try:
        if ep.dialect == "openai":
            await stream_openai(http, ep.model, ids, params, t)
        else:
            await stream_generate(http, ids, params, t)
    except httpx.HTTPError as err:
        t.error = f"{type(err).__name__}: {err}"
    return t


def _client(ep: Endpoint, connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=ep.url, timeout=7200,
                             limits=httpx.Limits(max_connections=connections + 8))


async def _warm_up(http: httpx.AsyncClient, ep: Endpoint, reqs: Requests) -> None:
    await send(http, ep, reqs[0][0], {"max_new_tokens": 4})


async def rollout(ep: Endpoint, reqs: Requests, label: str, spec_max_batch: int,
                  bin_s: float) -> dict[str, Any]:
    """Every request at once: latency stats, makespan, tail (from 90% done to the last), the
    small-batch phase (at most ``spec_max_batch`` running), a timeline and the lengths."""
    async with _client(ep, len(reqs)) as http:
        await _warm_up(http, ep, reqs)
        bar = tqdm(total=len(reqs), desc=f"{label} rollout")
        t0 = time.monotonic()

        async def one(ids: list[int], params: dict[str, Any]) -> Timed:
            t = await send(http, ep, ids, params)
            bar.update(1)
            return t

        done = list(await asyncio.gather(*(one(i, p) for i, p in reqs)))
        bar.close()
    stats = latency_stats(done, t0)
    ends = sorted(t.done - t0 for t in done if t.done is not None)
    stats["makespan_s"] = ends[-1] if ends else None
    stats["tail_s"] = ends[-1] - ends[int(0.9 * (len(ends) - 1))] if ends else None
    stats.update(small_batch_phase(ends, spec_max_batch))
    stats["timeline"] = timeline(done, t0, bin_s)
    stats["lengths"] = sorted(t.tokens for t in done)
    return stats


async def poisson(ep: Endpoint, reqs: Requests, label: str, rate: float,
                  seed: int) -> dict[str, Any]:
    """Open loop: requests arrive at Poisson times, ``rate`` per second."""
    rng = random.Random(seed + 1)
    async with _client(ep, len(reqs)) as http:
        await _warm_up(http, ep, reqs)
        bar = tqdm(total=len(reqs), desc=f"{label} poisson {rate}/s")
        t0 = time.monotonic()
        tasks = []
        for ids, params in reqs:
            tasks.append(asyncio.create_task(send(http, ep, ids, params)))
            tasks[-1].add_done_callback(lambda _: bar.update(1))
            await asyncio.sleep(rng.expovariate(rate))
        done = list(await asyncio.gather(*tasks))
        bar.close()
    return {"rate": rate, **latency_stats(done, t0)}


async def closed_loop(ep: Endpoint, reqs: Requests, c: int, label: str) -> dict[str, Any]:
    """``c`` clients, each sending its next request when the previous one ends."""
    queue = list(reqs)
    done: list[Timed] = []
    async with _client(ep, c) as http:
        await _warm_up(http, ep, reqs)
        bar = tqdm(total=len(reqs), desc=f"{label} concurrency {c}")
        t0 = time.monotonic()

        async def worker() -> None:
            while queue:
                ids, params = queue.pop(0)
                done.append(await send(http, ep, ids, params))
                bar.update(1)

        await asyncio.gather(*(worker() for _ in range(c)))
        bar.close()
    return latency_stats(done, t0)


async def generate_all(url: str, reqs: Requests, label: str) -> list[dict[str, Any]]:
    """Every request at once, not streamed: the server's responses, in order."""
    async with _client(Endpoint(url), len(reqs)) as http:
        bar = tqdm(total=len(reqs), desc=label)

        async def one(ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
            r = await http.post("/generate", json={"input_ids": ids, "sampling_params": params})
            r.raise_for_status()
            bar.update(1)
            return dict(r.json())

        outs = await asyncio.gather(*(one(i, p) for i, p in reqs))
        bar.close()
    return list(outs)
