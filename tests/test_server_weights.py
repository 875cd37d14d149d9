"""Weight updates over HTTP: from disk, from uploaded safetensors bytes (chunked), versions,
and rejected updates that leave the old weights serving."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load, load_file, save

from tests.harness import (
    MAX_MODEL_LEN,
    Served,
    engine_counts,
    scrape,
    wait_for,
)
from tlt_serve import LLM, SamplingParams
from tlt_serve.weight_sync import WeightSyncGroup, specs_of

PROMPT = [5, 17, 42, 99]
GREEDY = {"max_new_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def other_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama", seed=1)


def offline(model_dir: Path) -> list[int]:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN)
    out = llm.generate([PROMPT], SamplingParams(**GREEDY))
    return out[0].samples[0].token_ids


@pytest.fixture(scope="module")
def expected(tiny_model_dir, other_dir) -> dict[str, list[int]]:
    ref = {"base": offline(tiny_model_dir), "other": offline(other_dir)}
    assert ref["base"] != ref["other"], "the two tiny models must disagree for these tests"
    return ref


@pytest.fixture
def http(served: Served, tiny_model_dir) -> Iterator[httpx.Client]:
    with served.http() as client:
        # Every test starts from the base weights, labelled "base", generation running.
        client.post("/continue_generation")
        resp = client.post("/update_weights_from_disk",
                           json={"model_path": str(tiny_model_dir), "weight_version": "base"})
        assert resp.status_code == 200, resp.text
        yield client


def generate(http: httpx.Client) -> dict:
    return http.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}).json()


def checkpoint_bytes(model_dir: Path) -> bytes:
    return (model_dir / "model.safetensors").read_bytes()


def upload(http: httpx.Client, data: bytes, chunks: int, **params: str) -> httpx.Response:
    size = -(-len(data) // chunks)
    resp = None
    for i in range(chunks):
        query = {"chunk": i, "num_chunks": chunks, **params}
        resp = http.post("/update_weights_from_tensor", params=query,
                         content=data[i * size : (i + 1) * size])
        assert resp.status_code == 200 or i == chunks - 1, resp.text
    assert resp is not None
    return resp


def test_update_from_disk_changes_outputs_and_version(http, other_dir, expected) -> None:
    assert generate(http)["output_ids"] == expected["base"]
    resp = http.post("/update_weights_from_disk",
                     json={"model_path": str(other_dir), "weight_version": "v7"})
    assert resp.status_code == 200
    assert resp.json()["success"] and resp.json()["weight_version"] == "v7"
    out = generate(http)
    assert out["output_ids"] == expected["other"]
    assert out["meta_info"]["weight_version"] == "v7"
    assert http.get("/get_weight_version").json() == {"weight_version": "v7"}
    assert scrape(http).value("tlt_serve_weight_version_info", version="v7") == 1


def test_update_from_tensor_in_chunks(http, tiny_model_dir, other_dir, expected) -> None:
    resp = upload(http, checkpoint_bytes(other_dir), 3, weight_version="12")
    assert resp.status_code == 200 and resp.json() == {
        "success": True, "message": resp.json()["message"], "weight_version": "12",
        "num_paused_requests": 0,
    }
    assert generate(http)["output_ids"] == expected["other"]
    # No version given: it increments.
    resp = upload(http, checkpoint_bytes(tiny_model_dir), 1)
    assert resp.json()["weight_version"] == "13"
    out = generate(http)
    assert out["output_ids"] == expected["base"] and out["meta_info"]["weight_version"] == "13"


def test_served_weights_export_and_reload_exactly(http, tiny_model_dir, other_dir,
                                                   expected) -> None:
    """``GET /get_weights``: what a joining replica copies from a peer."""
    http.post("/update_weights_from_disk",
              json={"model_path": str(other_dir), "weight_version": "peer"})
    resp = http.get("/get_weights")
    assert resp.status_code == 200 and resp.headers["x-weight-version"] == "peer"
    exported = load(resp.content)
    on_disk = load_file(other_dir / "model.safetensors")
    assert exported.keys() <= on_disk.keys() and len(exported) >= len(on_disk) - 1
    assert all(torch.equal(t, on_disk[k]) for k, t in exported.items())
    # Back on the base weights, loading the export serves the peer's outputs again.
    http.post("/update_weights_from_disk", json={"model_path": str(tiny_model_dir)})
    assert generate(http)["output_ids"] == expected["base"]
    assert upload(http, resp.content, 1, weight_version="peer").status_code == 200
    out = generate(http)
    assert out["output_ids"] == expected["other"] and out["meta_info"]["weight_version"] == "peer"


def test_partial_tensor_update(http, other_dir) -> None:
    """A subset of tensors is a valid update (e.g. only the final norm)."""
    tensors = load_file(str(other_dir / "model.safetensors"))
    resp = upload(http, save({"model.norm.weight": tensors["model.norm.weight"]}), 1)
    assert resp.status_code == 200 and "1 tensors" in resp.json()["message"]


@pytest.mark.parametrize("payload", [
    b"this is not a safetensors file",
    save({"model.norm.weight": torch.ones(3)}),  # wrong shape
    save({"model.layers.0.nonsense.weight": torch.ones(64)}),  # unknown name
    save({"model.norm.weight": torch.full((64,), float("nan"))}),  # non-finite
    save({"model.norm.weight": torch.ones(64, dtype=torch.int32)}),  # wrong dtype
    b"",
    "truncated",  # a real checkpoint of the other model, cut short
])
def test_bad_tensor_updates_are_rejected_and_old_weights_keep_serving(
    http, expected, other_dir, payload
) -> None:
    if payload == "truncated":
        payload = checkpoint_bytes(other_dir)[:-1000]
    resp = upload(http, payload, 1, weight_version="bad")
    assert resp.status_code == 400
    body = resp.json()
    assert body["success"] is False and body["weight_version"] == "base"
    out = generate(http)
    assert out["output_ids"] == expected["base"] and out["meta_info"]["weight_version"] == "base"


def test_shape_error_names_the_tensor(http) -> None:
    resp = upload(http, save({"model.norm.weight": torch.ones(3)}), 1)
    assert "model.norm.weight" in resp.json()["message"]


def test_out_of_order_chunk_discards_the_upload(http, other_dir, expected) -> None:
    data = checkpoint_bytes(other_dir)
    ok = http.post("/update_weights_from_tensor", params={"chunk": 0, "num_chunks": 2},
                   content=data[:100])
    assert ok.status_code == 200 and ok.json()["success"]
    bad = http.post("/update_weights_from_tensor", params={"chunk": 0, "num_chunks": 3},
                    content=data[:100])  # restart with another count: allowed
    assert bad.status_code == 200
    skip = http.post("/update_weights_from_tensor", params={"chunk": 2, "num_chunks": 3},
                     content=data[100:])
    assert skip.status_code == 400
    assert generate(http)["output_ids"] == expected["base"]


def test_missing_disk_checkpoint_is_400(http, tmp_path, expected) -> None:
    resp = http.post("/update_weights_from_disk", json={"model_path": str(tmp_path)})
    assert resp.status_code == 400 and resp.json()["success"] is False
    assert generate(http)["output_ids"] == expected["base"]


def test_update_weight_version(served, http) -> None:
    """By SGLang's default a running request ends first (abort, its partial output on the old
    version); with ``abort_all_requests`` false it goes on under the new version."""
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 240,
                                                       "ignore_eos": True}}
    outs: list[dict] = []

    def run() -> None:
        with served.http() as c:
            outs.append(c.post("/generate", json=body).json())

    for version, keep in (("step-42", None), ("step-43", False)):
        worker = threading.Thread(target=run)
        worker.start()
        wait_for(lambda: engine_counts(http)[0] == 1, interval=0.001)
        http.post("/pause_generation", json={"mode": "in_place"})  # it cannot finish first
        req = {"new_version": version} if keep is None else {
            "new_version": version, "abort_all_requests": keep}
        resp = http.post("/update_weight_version", json=req)
        assert resp.status_code == 200 and resp.json()["weight_version"] == version
        http.post("/continue_generation")
        worker.join(120)
    assert len(outs) == 2
    aborted, kept = (o["meta_info"] for o in outs)
    assert aborted["finish_reason"]["type"] == "abort" and aborted["weight_versions"] == ["base"]
    assert kept["finish_reason"]["type"] == "length"
    assert kept["weight_versions"][0] == "step-42" and kept["weight_versions"][-1] == "step-43"
    assert http.get("/get_weight_version").json()["weight_version"] == "step-43"
    assert generate(http)["meta_info"]["weight_version"] == "step-43"


@pytest.mark.parametrize("mode", ["in_place", "abort"])
def test_weight_update_during_generation(served, http, other_dir, expected, mode) -> None:
    """in_place: the running request keeps its KV and finishes on the new weights (its
    versions say so); abort: it ends at once with its partial output on the old version.
    Either way a request queued during the pause runs on the new weights only."""
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 200,
                                                       "ignore_eos": True}, "stream": True}
    queued: dict[str, dict] = {}

    def wait_in_queue() -> None:
        with served.http() as c:
            queued["out"] = generate(c)

    with served.http() as streamer, streamer.stream("POST", "/generate", json=body) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        http.post("/pause_generation", json={"mode": mode})
        waiter = threading.Thread(target=wait_in_queue)
        waiter.start()
        wait_for(lambda: engine_counts(http)[1] == 1)  # the new request waits in the queue
        update = http.post("/update_weights_from_disk",
                           json={"model_path": str(other_dir), "weight_version": "next"})
        assert update.status_code == 200
        http.post("/continue_generation")
        last = [line for line in lines if line.startswith("data: {")][-1]
        waiter.join(60)
    final = httpx.Response(200, content=last[len("data: "):]).json()
    meta = final["meta_info"]
    if mode == "in_place":
        assert meta["weight_versions"] == ["base", "next"] and meta["weight_version"] == "next"
        assert meta["finish_reason"]["type"] == "length" and len(final["output_ids"]) == 200
    else:
        assert meta["weight_versions"] == ["base"] and meta["finish_reason"]["type"] == "abort"
        assert 0 < len(final["output_ids"]) < 200
    after = queued["out"]
    assert after["meta_info"]["weight_versions"] == ["next"]
    assert after["output_ids"] == expected["other"]
    wait_for(lambda: engine_counts(http) == (0, 0, 0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_update_from_distributed_group(served, http, other_dir, expected) -> None:
    """The test process plays the trainer: rank 0 of a gloo group, broadcasting weights."""
    port = free_port()
    replies: dict[str, httpx.Response] = {}

    def call(path: str, body: dict) -> None:
        with served.http() as c:
            replies[path] = c.post(path, json=body)

    init = threading.Thread(target=call, args=("/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": str(port),  # a string, as AReaL sends it
        "rank_offset": 1, "world_size": 2, "group_name": "rl", "backend": "gloo",
    }))
    init.start()
    trainer = WeightSyncGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=60)
    init.join(60)
    assert replies["/init_weights_update_group"].status_code == 200

    named = sorted(load_file(str(other_dir / "model.safetensors")).items())
    specs = specs_of(named)
    update = threading.Thread(target=call, args=("/update_weights_from_distributed", {
        "names": [s.name for s in specs], "dtypes": [f"torch.{s.dtype}" for s in specs],
        "shapes": [list(s.shape) for s in specs], "weight_version": "dist-1", "group_name": "rl",
    }))
    update.start()
    trainer.send(named)
    update.join(60)
    resp = replies["/update_weights_from_distributed"]
    assert resp.status_code == 200 and resp.json()["weight_version"] == "dist-1"
    out = generate(http)
    assert out["output_ids"] == expected["other"]
    assert out["meta_info"]["weight_version"] == "dist-1"

    bad = http.post("/update_weights_from_distributed", json={
        "names": ["x"], "dtypes": ["int8"], "shapes": [[1]], "group_name": "rl"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dtypes"
    wrong = http.post("/update_weights_from_distributed", json={
        "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]})
    assert wrong.status_code == 400 and "group" in wrong.json()["message"]
    assert http.post("/destroy_weights_update_group", json={"group_name": "rl"}).status_code == 200
    missing = http.post("/update_weights_from_distributed", json={
        "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]})
    assert missing.status_code == 400 and "init" in missing.json()["message"]


def test_nccl_on_a_cpu_engine_is_refused_by_name(http) -> None:
    """NCCL moves GPU memory: a CPU engine refuses it before any rendezvous (gloo works)."""
    t0 = time.monotonic()
    resp = http.post("/init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
        "world_size": 2, "backend": "nccl", "timeout_s": 30})
    assert resp.status_code == 400, resp.text
    assert "backend: nccl moves GPU memory" in resp.json()["message"]
    assert time.monotonic() - t0 < 10


def test_a_trainer_that_never_joins_does_not_stall_serving(served, http, expected) -> None:
    """The rendezvous waits on a worker thread: requests keep being served meanwhile, a
    second weight-sync call is refused as busy, and the init fails cleanly at its timeout."""
    replies: dict[str, httpx.Response] = {}

    def init() -> None:
        with served.http() as c:
            replies["init"] = c.post("/init_weights_update_group", json={
                "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
                "world_size": 2, "timeout_s": 4})

    def busy() -> bool:  # refused as busy: the init is waiting for rank 0 (else "no group")
        resp = http.post("/destroy_weights_update_group", json={})
        assert resp.status_code == 400, resp.text
        return "busy" in resp.json()["message"]

    waiter = threading.Thread(target=init)
    t0 = time.monotonic()
    waiter.start()
    wait_for(busy, 4, "the init to wait for rank 0")
    assert generate(http)["output_ids"] == expected["base"]
    assert busy() and waiter.is_alive()  # served while the init still waited
    waiter.join(60)
    assert replies["init"].status_code == 400
    assert "init_weights_update_group failed" in replies["init"].json()["message"]
    assert time.monotonic() - t0 >= 4
    assert generate(http)["output_ids"] == expected["base"]


def test_a_receiver_keeping_tensors_elsewhere_holds_one_buffer_at_a_time() -> None:
    """The vLLM backend moves each broadcast tensor to host memory as it arrives: the
    receiving device (a GPU over NCCL) then holds one buffer, never the whole update."""
    import gc
    import weakref

    port = free_port()
    sent = [(f"w{i}", torch.arange(6, dtype=torch.float32).reshape(2, 3) + i) for i in range(4)]
    buffers: list[weakref.ref[torch.Tensor]] = []
    alive: list[int] = []  # earlier buffers still alive as each tensor arrives
    received: list[list[tuple[str, torch.Tensor]]] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        gc.collect()
        alive.append(sum(b() is not None for b in buffers))
        buffers.append(weakref.ref(tensor))
        return tensor.clone()

    def engine() -> None:
        group = WeightSyncGroup("127.0.0.1", port, 1, 2, "gloo", timeout_s=60)
        received.append(group.receive(specs_of(sent), keep))

    receiver = threading.Thread(target=engine)
    receiver.start()
    WeightSyncGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=60).send(sent)
    receiver.join(60)
    (got,) = received
    assert [n for n, _ in got] == [n for n, _ in sent]
    assert all(torch.equal(g, s) for (_, g), (_, s) in zip(got, sent, strict=True))
    assert alive == [0, 0, 0, 0]


def test_vllm_weight_transfer_routes(served, http, other_dir, expected) -> None:
    """vLLM's weight-transfer routes as a trainer drives them (here over gloo, the test
    process rank 0): join, then a step of two rounds between start and finish, the version
    named at finish; refusals by field; leaving the group."""
    port = free_port()
    replies: dict[str, httpx.Response] = {}

    def call(path: str, body: dict) -> None:
        with served.http() as c:
            replies[path] = c.post(path, json=body)

    assert http.post("/update_weights", json={"update_info": {
        "names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[64]]}}
    ).status_code == 400  # no update started
    bad = http.post("/init_weight_transfer_engine", json={"init_info": {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
        "world_size": 2, "packed": True}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "init_info.packed"
    init = threading.Thread(target=call, args=("/init_weight_transfer_engine", {"init_info": {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
        "world_size": 2}}))
    init.start()
    trainer = WeightSyncGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=60)
    init.join(60)
    assert replies["/init_weight_transfer_engine"].status_code == 200

    assert http.post("/start_weight_update").json() == {"message": "Weight update started"}
    named = sorted(load_file(str(other_dir / "model.safetensors")).items())
    half = len(named) // 2
    for part in (named[:half], named[half:]):  # two rounds, each applied whole
        specs = specs_of(part)
        update = threading.Thread(target=call, args=("/update_weights", {"update_info": {
            "names": [s.name for s in specs], "dtype_names": [s.dtype for s in specs],
            "shapes": [list(s.shape) for s in specs]}}))
        update.start()
        trainer.send(part)
        update.join(60)
        assert replies["/update_weights"].status_code == 200, replies["/update_weights"].text
    done = http.post("/finish_weight_update", json={"weight_version": "step-1"})
    assert done.status_code == 200 and done.json()["weight_version"] == "step-1"
    out = generate(http)
    assert out["output_ids"] == expected["other"]
    assert out["meta_info"]["weight_version"] == "step-1"

    assert http.post("/finish_weight_update").status_code == 400  # none open
    http.post("/start_weight_update")
    wrong = http.post("/update_weights", json={"update_info": {
        "names": ["x"], "dtype_names": ["int8"], "shapes": [[1]]}})
    assert wrong.status_code == 400
    assert wrong.json()["error"]["param"] == "update_info.dtype_names"
    assert http.post("/finish_weight_update").status_code == 200
    assert http.post("/shutdown_weight_transfer_engine").status_code == 200
