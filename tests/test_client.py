"""The Python client (clients/) against a real server on the tiny model."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from safetensors.torch import load_file

from clients import AsyncClient, BadRequest, Client
from tests.harness import Served

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture
def client(served: Served) -> Client:
    with Client(served.base_url) as c:
        yield c


def test_generate_groups_with_logprobs_and_versions(client: Client) -> None:
    groups = client.generate(PROMPTS, n=3, return_logprob=True, max_new_tokens=6,
                             temperature=1.0, sampling_seed=1, ignore_eos=True)
    assert [len(g) for g in groups] == [3, 3]
    for group, prompt in zip(groups, PROMPTS, strict=True):
        for s in group:
            assert s.num_tokens == 6 and s.finish_reason == "length"
            assert s.prompt_tokens == len(prompt)
            assert s.logprobs is not None and len(s.logprobs) == 6
            assert all(lp <= 0.0 for lp in s.logprobs)
            assert s.weight_version == s.weight_versions[-1]
    greedy = client.generate(PROMPTS, n=2, max_new_tokens=6, temperature=0.0, ignore_eos=True)
    for group in greedy:  # greedy samples of one prompt agree; no logprobs unless asked
        assert group[0].token_ids == group[1].token_ids and group[0].logprobs is None


def test_stream_ends_with_the_non_streamed_sample(client: Client) -> None:
    whole = client.generate([PROMPTS[0]], max_new_tokens=8, temperature=0.0, ignore_eos=True)
    parts = list(client.generate_stream(PROMPTS[0], max_new_tokens=8, temperature=0.0,
                                        ignore_eos=True))
    assert len(parts) >= 2
    lengths = [p.num_tokens for p in parts]
    assert lengths == sorted(lengths)  # cumulative
    assert parts[-1].token_ids == whole[0][0].token_ids and parts[-1].finish_reason == "length"


def test_errors_carry_the_server_message_and_field(client: Client) -> None:
    with pytest.raises(BadRequest) as err:
        client.generate([PROMPTS[0]], temperature=-1.0)
    assert err.value.status == 400 and "temperature" in str(err.value)
    with pytest.raises(TypeError, match="max_new_token"):
        client.generate([PROMPTS[0]], max_new_token=3)  # a typo never reaches the server
    assert client.health()


def test_weight_push_by_upload_and_from_disk(client: Client, served: Served) -> None:
    tensors = load_file(str(Path(served.model_dir) / "model.safetensors"))
    before = client.generate([PROMPTS[0]], max_new_tokens=5, temperature=0.0, ignore_eos=True)
    out = client.update_weights_from_tensors(tensors, weight_version="u1", chunk_bytes=50_000)
    assert out["success"] and client.weight_version() == "u1"
    after = client.generate([PROMPTS[0]], max_new_tokens=5, temperature=0.0, ignore_eos=True)
    assert after[0][0].weight_version == "u1"
    assert after[0][0].token_ids == before[0][0].token_ids  # same weights, same tokens
    name = next(iter(tensors))
    bad = {**tensors, name: tensors[name][:1]}  # wrong shape: refused, old weights kept
    with pytest.raises(BadRequest):
        client.update_weights_from_tensors(bad, weight_version="u2")
    assert client.weight_version() == "u1"
    assert client.update_weights_from_disk(str(served.model_dir), "d1")["success"]
    assert client.weight_version() == "d1"
    with pytest.raises(BadRequest, match="model_path"):
        client.update_weights_from_disk("/nonexistent/dir", "d2")


def test_abort_ends_a_streamed_request(client: Client) -> None:
    seen: list = []

    def consume() -> None:
        seen.extend(client.generate_stream(PROMPTS[1], max_new_tokens=200, ignore_eos=True,
                                           temperature=1.0))

    t = threading.Thread(target=consume)
    t.start()
    while not seen and t.is_alive():
        t.join(0.01)
    client.abort()  # abort all
    t.join(30)
    assert not t.is_alive()
    assert seen[-1].finish_reason == "abort" and seen[-1].num_tokens < 200


def test_async_client_matches_sync(client: Client, served: Served) -> None:
    sync = client.generate(PROMPTS, max_new_tokens=6, temperature=0.0, ignore_eos=True)

    async def go() -> tuple[list, list]:
        async with AsyncClient(served.base_url) as c:
            groups = await c.generate(PROMPTS, max_new_tokens=6, temperature=0.0,
                                      ignore_eos=True)
            parts = [s async for s in c.generate_stream(PROMPTS[1], max_new_tokens=6,
                                                        temperature=0.0, ignore_eos=True)]
            return groups, parts

    groups, parts = asyncio.run(go())
    assert [g[0].token_ids for g in groups] == [g[0].token_ids for g in sync]
    assert parts[-1].token_ids == sync[1][0].token_ids


def test_async_client_pushes_weights_and_reads_versions(served: Served) -> None:
    tensors = load_file(str(Path(served.model_dir) / "model.safetensors"))

    async def go() -> None:
        async with AsyncClient(served.base_url) as c:
            assert await c.health()
            out = await c.update_weights_from_tensors(tensors, "a1", chunk_bytes=50_000)
            assert out["success"] and await c.weight_version() == "a1"
            (sample,), = await c.generate([PROMPTS[0]], max_new_tokens=3, ignore_eos=True)
            assert sample.weight_version == "a1"
            name = next(iter(tensors))
            with pytest.raises(BadRequest):  # wrong shape: refused, old weights kept
                await c.update_weights_from_tensors({**tensors, name: tensors[name][:1]}, "a2")
            assert await c.weight_version() == "a1"
            assert (await c.update_weights_from_disk(str(served.model_dir), "a3"))["success"]
            info = await c.server_info()
            assert info["weight_version"] == "a3"

    asyncio.run(go())


def test_distributed_push(client: Client, served: Served) -> None:
    from benchmarks.common.servers import free_port
    from clients.dist import DistributedPusher

    tensors = load_file(str(Path(served.model_dir) / "model.safetensors"))
    before = client.generate([PROMPTS[0]], max_new_tokens=5, temperature=0.0, ignore_eos=True)
    pusher = DistributedPusher(client, "127.0.0.1", free_port(), group_name="client-test")
    out = pusher.push(sorted(tensors.items()), weight_version="dist-7")
    assert out["success"] and client.weight_version() == "dist-7"
    after = client.generate([PROMPTS[0]], max_new_tokens=5, temperature=0.0, ignore_eos=True)
    assert after[0][0].token_ids == before[0][0].token_ids
    assert after[0][0].weight_version == "dist-7"
    pusher.close()
