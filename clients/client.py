"""Python client for a tlt-serve rollout server: sync (``Client``) and async (``AsyncClient``).

    from clients import Client
    with Client("http://127.0.0.1:30000") as c:
        groups = c.generate([prompt_ids], n=8, temperature=1.0, max_new_tokens=256,
                            return_logprob=True)
        for s in groups[0]:
            s.token_ids, s.logprobs, s.weight_version, s.spec
        c.update_weights_from_disk("/ckpt/step-3", weight_version="3")

Both clients build the same requests (``_generate_body``) and parse the same replies
(``clients.results``); only the transport differs. Errors surface as ``ServerError``
subclasses carrying the server's message and field. Weight pushes: from disk (a path the
server can read), by tensor upload (safetensors, chunked), or over torch.distributed
(``DistributedPusher``). The official ``openai`` SDK works against ``{url}/v1`` as is
(``clients/openai_example.py``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import httpx
import torch
from safetensors.torch import save

from clients.results import Sample, ServerError, group_samples, parse_sample, raise_for

UPLOAD_CHUNK_BYTES = 64 << 20
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                 "stop_token_ids", "ignore_eos", "sampling_seed", "skip_special_tokens")


def _generate_body(
    prompts: Sequence[Sequence[int]], n: int, return_logprob: bool, stream: bool,
    sampling: Mapping[str, Any],
) -> dict[str, Any]:
    unknown = set(sampling) - set(SAMPLING_KEYS)
    if unknown:
        raise TypeError(f"unknown sampling parameter(s): {sorted(unknown)}")
    params = {k: v for k, v in sampling.items() if v is not None}
    params["n"] = n
    return {"input_ids": [list(p) for p in prompts], "sampling_params": params,
            "return_logprob": return_logprob, "stream": stream}


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _sse_payload(line: str) -> dict[str, Any] | None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    body = json.loads(line[6:])
    if "error" in body:  # the server failed mid-stream
        err = body["error"]
        raise ServerError(int(err.get("code", 500)), str(err.get("message")), err.get("param"))
    return dict(body)


def _chunks(tensors: Mapping[str, torch.Tensor], chunk_bytes: int) -> list[bytes]:
    blob = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
    return [blob[i : i + chunk_bytes] for i in range(0, len(blob), chunk_bytes)] or [b""]


def _upload_parts(
    tensors: Mapping[str, torch.Tensor], weight_version: str | None, chunk_bytes: int,
    upload_id: str,
) -> Iterator[tuple[dict[str, Any], bytes]]:
    """(query params, body) of each ``/update_weights_from_tensor`` chunk, in order."""
    chunks = _chunks(tensors, chunk_bytes)
    for i, data in enumerate(chunks):
        params: dict[str, Any] = {"chunk": i, "num_chunks": len(chunks), "upload_id": upload_id}
        if weight_version is not None:
            params["weight_version"] = weight_version
        yield params, data


class Client:
    """Synchronous client (one ``httpx.Client``; thread-safe for concurrent calls)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 3600.0) -> None:
        self.http = httpx.Client(base_url=url, headers=_headers(api_key), timeout=timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _post(self, path: str, body: Any = None, **kw: Any) -> Any:
        resp = self.http.post(path, json=body, **kw)
        raise_for(resp)
        return resp.json()

    def _get(self, path: str, **kw: Any) -> Any:
        resp = self.http.get(path, **kw)
        raise_for(resp)
        return resp.json()

    # ---- generation ----------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], n: int = 1, return_logprob: bool = False,
        **sampling: Any,
    ) -> list[list[Sample]]:
        """One group of ``n`` samples per prompt (token-id prompts)."""
        body = _generate_body(prompts, n, return_logprob, False, sampling)
        out = self._post("/generate", body)
        return group_samples(out if isinstance(out, list) else [out], len(prompts), n)

    def generate_stream(
        self, prompt: Sequence[int], return_logprob: bool = False, **sampling: Any
    ) -> Iterator[Sample]:
        """One sample, streamed: each item is the sample so far (cumulative)."""
        body = _generate_body([prompt], 1, return_logprob, True, sampling)
        body["input_ids"] = list(prompt)
        with self.http.stream("POST", "/generate", json=body) as resp:
            if resp.status_code >= 400:
                resp.read()
                raise_for(resp)
            for line in resp.iter_lines():
                payload = _sse_payload(line)
                if payload is not None:
                    yield parse_sample(payload)

    def abort(self, rid: str | None = None) -> None:
        """Abort one request (its rid, as reported in ``Sample.rid``) or all of them."""
        self._post("/abort_request", {"rid": rid} if rid else {"abort_all": True})

    def pause(self, mode: str = "abort") -> None:
        self._post("/pause_generation", {"mode": mode})

    def resume(self) -> None:
        self._post("/continue_generation", {})

    # ---- weights -------------------------------------------------------------------------
    def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> dict:
        return dict(self._post("/update_weights_from_disk",
                               {"model_path": path, "weight_version": weight_version}))

    def update_weights_from_tensors(
        self, tensors: Mapping[str, torch.Tensor], weight_version: str | None = None,
        chunk_bytes: int = UPLOAD_CHUNK_BYTES, upload_id: str = "client",
    ) -> dict:
        """Upload named tensors (HF names) as a safetensors payload, in chunks."""
        out: dict = {}
        for params, data in _upload_parts(tensors, weight_version, chunk_bytes, upload_id):
            out = dict(self._post("/update_weights_from_tensor", None, content=data,
                                  params=params))
        return out

    def pause_drafter_training(self) -> None:
        """Tell a ``--train-drafter`` server the machine is busy (e.g. the RL update runs on
        the same cores): its drafter trainer stops within one micro-step."""
        self._post("/pause_drafter_training", {})

    def resume_drafter_training(self) -> None:
        self._post("/resume_drafter_training", {})

    def weight_version(self) -> str:
        return str(self._get("/get_weight_version")["weight_version"])

    # ---- information ---------------------------------------------------------------------
    def health(self) -> bool:
        return self.http.get("/health").status_code == 200

    def server_info(self) -> dict:
        return dict(self._get("/get_server_info"))

    def drafter_info(self) -> dict:
        return dict(self._get("/get_drafter_info"))


class AsyncClient:
    """The same API for asyncio (``await c.generate(...)``; ``async for`` over a stream)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 3600.0,
                 max_connections: int = 512) -> None:
        limits = httpx.Limits(max_connections=max_connections)
        self.http = httpx.AsyncClient(base_url=url, headers=_headers(api_key), timeout=timeout,
                                      limits=limits)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.http.aclose()

    async def _post(self, path: str, body: Any = None, **kw: Any) -> Any:
        resp = await self.http.post(path, json=body, **kw)
        raise_for(resp)
        return resp.json()

    async def _get(self, path: str, **kw: Any) -> Any:
        resp = await self.http.get(path, **kw)
        raise_for(resp)
        return resp.json()

    async def generate(
        self, prompts: Sequence[Sequence[int]], n: int = 1, return_logprob: bool = False,
        **sampling: Any,
    ) -> list[list[Sample]]:
        body = _generate_body(prompts, n, return_logprob, False, sampling)
        out = await self._post("/generate", body)
        return group_samples(out if isinstance(out, list) else [out], len(prompts), n)

    async def generate_stream(
        self, prompt: Sequence[int], return_logprob: bool = False, **sampling: Any
    ) -> AsyncIterator[Sample]:
        body = _generate_body([prompt], 1, return_logprob, True, sampling)
        body["input_ids"] = list(prompt)
        async with self.http.stream("POST", "/generate", json=body) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                raise_for(resp)
            async for line in resp.aiter_lines():
                payload = _sse_payload(line)
                if payload is not None:
                    yield parse_sample(payload)

    async def abort(self, rid: str | None = None) -> None:
        await self._post("/abort_request", {"rid": rid} if rid else {"abort_all": True})

    async def pause(self, mode: str = "abort") -> None:
        await self._post("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._post("/continue_generation", {})

    async def update_weights_from_disk(self, path: str, weight_version: str | None = None
                                       ) -> dict:
        return dict(await self._post("/update_weights_from_disk",
                                     {"model_path": path, "weight_version": weight_version}))

    async def update_weights_from_tensors(
        self, tensors: Mapping[str, torch.Tensor], weight_version: str | None = None,
        chunk_bytes: int = UPLOAD_CHUNK_BYTES, upload_id: str = "client",
    ) -> dict:
        out: dict = {}
        for params, data in _upload_parts(tensors, weight_version, chunk_bytes, upload_id):
            out = dict(await self._post("/update_weights_from_tensor", None, content=data,
                                        params=params))
        return out

    async def pause_drafter_training(self) -> None:
        await self._post("/pause_drafter_training", {})

    async def resume_drafter_training(self) -> None:
        await self._post("/resume_drafter_training", {})

    async def weight_version(self) -> str:
        return str((await self._get("/get_weight_version"))["weight_version"])

    async def health(self) -> bool:
        return (await self.http.get("/health")).status_code == 200

    async def server_info(self) -> dict:
        return dict(await self._get("/get_server_info"))

    async def drafter_info(self) -> dict:
        return dict(await self._get("/get_drafter_info"))
