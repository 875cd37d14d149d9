"""Static-shape steps (the shapes the native engine replays from CUDA graphs on a GPU), run
eagerly on the CPU in fp32: padding the batch to a bucket and the keys to a power of two
changes no real row's hidden states, features or K/V, writes nothing outside the scratch
column of a padding row, and an engine stepping through them decodes (plainly and with
speculation) what an engine without them decodes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from tests.tiny import make_tiny_drafter, make_tiny_model
from tlt_serve import LLM, SamplingParams
from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
from tlt_serve.engine.kv_cache import KVCache
from tlt_serve.engine.runner import extend_batch
from tlt_serve.engine.step_graphs import StepGraphs, StepShape
from tlt_serve.models.compiled import CompiledLayers
from tlt_serve.models.loader import build_model

MAX_LEN = 300


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("graphs") / "llama")


@pytest.mark.parametrize("layers", ["own", "regions", "compiled"])
def test_static_steps_change_no_real_row(target: Path, layers: str) -> None:
    """``layers``: the layers' own forward; the regions ``CompiledLayers`` runs, eagerly;
    the same regions compiled by torch.compile (Inductor's CPU code here). (The regions with
    the Triton attention: ``test_decode_attention``, under Triton's interpreter.)"""
    compiled_before = counters["stats"]["unique_graphs"]
    layer_fn = CompiledLayers(compile=False) if layers == "regions" else None
    graphs = check_static_steps(target, layers == "compiled", layer_fn)
    assert (graphs.layer_fn is None) == (layers == "own")  # no fallback happened
    if layers == "compiled":  # dynamo made graphs of the regions (not a silent eager run)
        assert counters["stats"]["unique_graphs"] > compiled_before


def check_static_steps(target: Path, compile: bool = False,
                       layer_fn: CompiledLayers | None = None) -> StepGraphs:
    """Decode and verify steps through static shapes (padded, eagerly) against the model's
    own forward (packed) from the same cache: the real rows' hidden states, features and
    K/V alike, nothing else written but scratch columns. Returns the static steps."""
    model = build_model(target, torch.float32, MAX_LEN + 16)
    eager_kv = KVCache(model.cfg, 8, MAX_LEN, torch.float32)
    eager_kv.storage.normal_(generator=torch.Generator().manual_seed(0))  # others' rows
    static_kv = KVCache(model.cfg, 8, MAX_LEN, torch.float32)
    static_kv.storage.copy_(eager_kv.storage)
    graphs = StepGraphs(model, static_kv, aux_layers=(0,), capture=False, compile=compile)
    if layer_fn is not None:
        graphs.layer_fn = layer_fn
    steps = [  # (starts, tokens): decode, ragged and uniform; verify with ragged drafts
        ([40, 7, 120], [[5], [9], [11]]),
        ([50] * 5, [[3]] * 5),
        ([60, 10, 200, 33, 5, 90, 71], [[1, 2, 3, 4], [6], [7, 8], [9, 10, 11, 12], [13],
                                         [14, 15, 16], [17, 18]]),
        ([61, 11, 201, 34, 6], [[2, 3, 4, 5], [7, 8, 9, 10], [1], [12], [3, 4]]),
        ([MAX_LEN - 5], [[1, 2, 3]]),
    ]
    for starts, tokens in steps:
        fb, ids = extend_batch(eager_kv, 0, starts, tokens, pack=True)
        want = model(ids, fb, eager_kv.layers, (0,))
        real, ids = extend_batch(static_kv, 0, starts, tokens)
        shape = graphs.shape_of(0, len(tokens), int(ids.shape[1]), real.kv_len)
        assert shape is not None and shape.batch >= len(tokens) and shape.keys >= real.kv_len
        got = graphs.run(shape, real, ids)
        assert got.hidden.shape == want.hidden.shape
        for b, t in enumerate(tokens):  # real positions only: padding queries are not read
            n = len(t)
            torch.testing.assert_close(got.hidden[b, :n], want.hidden[b, :n], atol=1e-5, rtol=0)
            torch.testing.assert_close(got.aux[0][b, :n], want.aux[0][b, :n], atol=1e-5, rtol=0)
        # every row's K/V but the scratch column: the real rows' new entries alike, padding
        # rows (other sequences' rows) untouched
        torch.testing.assert_close(static_kv.storage[..., :MAX_LEN, :],
                                   eager_kv.storage[..., :MAX_LEN, :], atol=1e-5, rtol=0)
    assert set(graphs.steps) == {StepShape(4, 1, 128), StepShape(8, 1, 64),
                                 StepShape(8, 4, 256), StepShape(1, 3, MAX_LEN + 1)}
    return graphs


def test_warming_up_captures_every_size_and_writes_only_scratch(target: Path) -> None:
    model = build_model(target, torch.float32, MAX_LEN + 16)
    kv = KVCache(model.cfg, 8, MAX_LEN, torch.float32)
    kv.storage.normal_(generator=torch.Generator().manual_seed(0))
    before = kv.storage.clone()
    graphs = StepGraphs(model, kv, capture=False)
    graphs.warm((1, 5))
    assert set(graphs.steps) == {StepShape(b, q, 64) for b in (1, 2, 4, 8) for q in (1, 5)}
    assert torch.equal(kv.storage[..., :MAX_LEN, :], before[..., :MAX_LEN, :])


def test_a_failing_compile_falls_back_to_the_layers(target: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    model = build_model(target, torch.float32, MAX_LEN + 16)
    kv = KVCache(model.cfg, 8, MAX_LEN, torch.float32)
    graphs = StepGraphs(model, kv, capture=False)
    graphs.layer_fn = CompiledLayers(compile=False)

    def no_compiler(*args: object) -> None:
        raise RuntimeError("no C compiler found\nmore")

    graphs.layer_fn.layer_in = no_compiler
    starts, tokens = [40, 7], [[5], [9]]
    real, ids = extend_batch(kv, 0, starts, tokens)
    shape = graphs.shape_of(0, 2, 1, real.kv_len)
    assert shape is not None
    got = graphs.run(shape, real, ids)
    assert graphs.layer_fn is None and "no C compiler found" in caplog.text
    fb, ids = extend_batch(kv, 0, starts, tokens)
    torch.testing.assert_close(got.hidden, model(ids, fb, kv.layers).hidden, atol=1e-5, rtol=0)


def test_a_failing_triton_attention_falls_back_to_torchs_keeping_the_regions(
        target: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Triton's kernels cannot launch on a CPU tensor (no interpreter here): the first step
    drops the Triton attention only, and the regions attend through torch's."""
    pytest.importorskip("triton")
    model = build_model(target, torch.float32, MAX_LEN + 16)
    kv = KVCache(model.cfg, 8, MAX_LEN, torch.float32)
    graphs = StepGraphs(model, kv, capture=False)
    regions = graphs.layer_fn = CompiledLayers(compile=False, attention="triton")
    starts, tokens = [40, 7], [[5, 6], [9]]
    real, ids = extend_batch(kv, 0, starts, tokens)
    shape = graphs.shape_of(0, 2, 2, real.kv_len)
    assert shape is not None
    got = graphs.run(shape, real, ids)
    assert graphs.layer_fn is regions and regions.attention == "sdpa"
    assert "the Triton attention failed" in caplog.text
    fb, ids = extend_batch(kv, 0, starts, tokens)
    want = model(ids, fb, kv.layers).hidden
    for b, t in enumerate(tokens):
        torch.testing.assert_close(got.hidden[b, :len(t)], want[b, :len(t)], atol=1e-5, rtol=0)


def test_the_static_shape_of_a_step() -> None:
    from tlt_serve.models.arch import ArchConfig, RopeConfig

    cfg = ArchConfig("llama", 100, 32, 64, 1, 2, 1, 16, 1e-6, RopeConfig(1e4), 512, True,
                     False, False)
    kv = KVCache(cfg, 20, 1000, torch.float32)
    graphs = StepGraphs(None, kv, capture=False)  # type: ignore[arg-type]
    assert graphs.sizes == [1, 2, 4, 8, 16]  # no bucket past the cache's rows
    assert graphs.shape_of(0, 3, 1, 10) == StepShape(4, 1, 64)
    assert graphs.shape_of(0, 9, 5, 65) == StepShape(16, 5, 128)
    assert graphs.shape_of(0, 16, 1, 999) == StepShape(16, 1, 1001)  # at most the row
    assert graphs.shape_of(2, 3, 1, 10) is None  # not from row 0: eager
    assert graphs.shape_of(0, 17, 1, 10) is None  # past the largest bucket: eager
    assert StepGraphs(None, kv, capture=False, max_batch=6).sizes == [1, 2, 4]  # type: ignore[arg-type]


def _llm(target: Path, spec: SpecConfig, static: bool, regions: bool = False) -> LLM:
    llm = LLM(config=EngineConfig(
        model=ModelConfig(model=str(target), dtype="float32", max_model_len=256),
        cache=CacheConfig(max_num_seqs=8), spec=spec))
    if static:  # what --device cuda does, without the capture
        engine = llm.engine
        engine.runner.graphs = StepGraphs(engine.model, engine.kv, engine.spec.feature_layers,
                                          capture=False)
        if regions:  # the layers as the compiled regions run them (uncompiled: the CPU's)
            engine.runner.graphs.layer_fn = CompiledLayers(compile=False)
    return llm


@pytest.mark.parametrize(("method", "regions"), [("none", False), ("ngram", False),
                                                ("drafter", False), ("drafter", True)])
def test_an_engine_on_static_steps_decodes_what_plain_decoding_does(
        target: Path, tmp_path: Path, method: str, regions: bool) -> None:
    spec = SpecConfig()
    if method == "ngram":
        spec = SpecConfig(method="ngram")
    elif method == "drafter":
        drafter = make_tiny_drafter(target, tmp_path / "drafter", seed=1)
        spec = SpecConfig(method="drafter", drafter=str(drafter), min_draft_confidence=0.0)
    prompts = ["The quick brown fox", "def add(a, b):", "What is 12 + 7?", "Bonjour"]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True)
              for n in (40, 7, 64, 23)]
    plain = _llm(target, SpecConfig(), static=False).generate(prompts, params)
    static = _llm(target, spec, static=True, regions=regions)
    got = static.generate(prompts, params)
    for ref, out in zip(plain, got, strict=True):
        assert out.samples[0].token_ids == ref.samples[0].token_ids
        torch.testing.assert_close(out.samples[0].logprobs, ref.samples[0].logprobs,
                                   atol=1e-4, rtol=0)
    graphs = static.engine.runner.graphs
    assert graphs is not None and graphs.steps  # the steps went through static shapes
    if method != "none":
        assert static.engine.stats.spec.steps > 0
        assert any(s.queries > 1 for s in graphs.steps)  # verify steps among them


def test_enforce_eager_is_a_serve_flag() -> None:
    from tlt_serve.flags import parse

    assert parse(["--enforce-eager"]).engine.model.enforce_eager
    assert not parse([]).engine.model.enforce_eager


def test_compiling_and_the_attention_backend_are_serve_flags() -> None:
    from tlt_serve.config import ConfigError
    from tlt_serve.flags import parse

    default = parse([]).engine.model
    assert default.compile and default.attention_backend == "sdpa"
    model = parse(["--no-compile", "--attention-backend", "triton"]).engine.model
    assert not model.compile and model.attention_backend == "triton"
    with pytest.raises(SystemExit):
        parse(["--attention-backend", "flash"])
    with pytest.raises(ConfigError, match="^attention_backend: 'flash'"):
        ModelConfig(attention_backend="flash").validate()
