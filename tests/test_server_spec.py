"""Speculative decoding through the server: the CLI flags, lossless greedy outputs against a
plain server, SGLang's spec_* meta_info, /get_server_info, /metrics, and start-up errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Served, scrape, serve, sse_events
from tlt_serve.cli import main
from tlt_serve.flags import parse as parse_serve_flags

SPEC_FLAGS = ["--speculative", "ngram", "--spec-max-batch", "64"]
PROMPTS = ["The quick brown fox", "def add(a, b):", "What is 12 + 7?", "Bonjour, ça va?"]
GREEDY_LONG = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
SPEC_META = ("spec_accept_length", "spec_verify_ct", "spec_accept_rate")


@pytest.fixture(scope="module")
def spec_served(tiny_model_dir: Path) -> Iterator[Served]:
    """The tiny model served with n-gram speculation, configured through the CLI parser."""
    spec = parse_serve_flags([*SPEC_FLAGS]).engine.spec
    s = serve(tiny_model_dir, spec=spec)
    yield s
    s.stop()


def generate_batch(s: Served, **extra: object) -> list[dict]:
    with s.http() as http:
        resp = http.post("/generate", json={"text": PROMPTS, "sampling_params": GREEDY_LONG,
                                            **extra})
    assert resp.status_code == 200, resp.text
    out: list[dict] = resp.json()
    return out


# ---- CLI --------------------------------------------------------------------------------


def test_cli_spec_flags_build_spec_config() -> None:
    cfg = parse_serve_flags(["--speculative", "drafter", "--drafter", "/d",
                      "--num-draft-tokens", "6", "--spec-max-batch", "3",
                      "--min-draft-confidence", "0.25"]).engine.spec
    assert (cfg.method, cfg.drafter, cfg.num_draft_tokens, cfg.max_batch) == (
        "drafter", "/d", 6, 3)
    assert cfg.min_draft_confidence == 0.25
    assert parse_serve_flags([]).engine.spec.method == "off"


@pytest.mark.parametrize(("argv", "names"), [
    (["--speculative", "drafter"], ("--drafter", "drafter:")),
    (["--num-draft-tokens", "0"], ("--num-draft-tokens", "num_draft_tokens")),
    (["--spec-max-batch", "0"], ("--spec-max-batch", "spec_max_batch")),
    (["--speculative", "eagle"], ("--speculative", "eagle")),
])
def test_cli_bad_spec_values_exit_with_the_flag_named(argv, names, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_serve_flags([*argv])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for name in names:
        assert name in err


def test_cli_missing_drafter_checkpoint_refuses_to_start(tiny_model_dir, tmp_path, capsys) -> None:
    """The engine process fails on the checkpoint (DrafterError): ``serve`` reports it and
    returns 1 before any HTTP server is bound."""
    missing = tmp_path / "nonexistent-drafter"
    code = main(["serve", "--model", str(tiny_model_dir), "--port", "0", "--dtype", "float32",
                 "--max-model-len", "256", "--max-num-seqs", "4", "--log-level", "critical",
                 "--speculative", "drafter", "--drafter", str(missing)])
    out = capsys.readouterr()
    assert code == 1
    assert "engine failed to start" in out.err and "DrafterError" in out.err
    assert str(missing) in out.err
    assert "tlt-serve ready" not in out.out


# ---- a speculating server ---------------------------------------------------------------


def test_ngram_greedy_outputs_equal_plain_server(served, spec_served) -> None:
    plain = generate_batch(served)
    spec = generate_batch(spec_served)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert [o["text"] for o in spec] == [o["text"] for o in plain]
    for o in plain:
        assert not set(SPEC_META) & set(o["meta_info"])  # only when the server speculates
    metas = [o["meta_info"] for o in spec]
    assert any(m["spec_draft_steps"] > 0 for m in metas)
    for m in metas:
        assert m["completion_tokens"] == 40
        assert 0.0 <= m["spec_accept_rate"] <= 1.0
        # SGLang's meaning, as slime reads it: spec_verify_ct counts the decode forwards, and
        # accept_length is tokens per forward (the bonus included).
        forwards, accepted = m["spec_verify_ct"], m["spec_accept_token_num"]
        assert m["spec_draft_steps"] <= forwards
        assert m["spec_accept_length"] == pytest.approx(40 / forwards)
        assert 1.0 < m["spec_accept_length"] <= 5  # num_draft_tokens + the bonus per forward
        # The prefill commits one token, every forward one more and a verify step what it
        # accepted (a step the length limit cut, less).
        assert 1 + forwards <= 40 <= 1 + forwards + accepted
        assert m["spec_accept_rate"] == pytest.approx(
            accepted / m["spec_draft_token_num"] if m["spec_draft_token_num"] else 0.0)
    assert any(m["spec_accept_token_num"] > 0 for m in metas), "random tiny models repeat"


def test_streaming_meta_info_carries_spec_counts(spec_served) -> None:
    body = {"text": PROMPTS[0], "sampling_params": GREEDY_LONG, "stream": True}
    with spec_served.http() as http:
        steps = scrape(http).value("tlt_serve_decode_steps_total")  # fresh from the engine
        with http.stream("POST", "/generate", json=body) as resp:
            events = sse_events(resp.iter_lines())
        steps = scrape(http).value("tlt_serve_decode_steps_total") - steps
    for e in events:
        assert set(SPEC_META) <= set(e["meta_info"])
    last = events[-1]["meta_info"]
    assert last["completion_tokens"] == 40
    counts = [e["meta_info"]["spec_verify_ct"] for e in events]
    assert counts == sorted(counts)  # cumulative
    assert last["spec_verify_ct"] == steps  # alone, its forwards are the engine's decode steps


def test_server_info_and_metrics_report_speculation(served, spec_served) -> None:
    names = ("tlt_serve_spec_verify_steps_total", "tlt_serve_spec_sequence_verifies_total",
             "tlt_serve_spec_draft_tokens_total", "tlt_serve_spec_accepted_tokens_total")
    with spec_served.http() as http:
        first = scrape(http)
        before = {n: first.value(n, missing=0.0) for n in names}
        metas = [o["meta_info"] for o in generate_batch(spec_served)]
        info = http.get("/get_server_info").json()
        m = scrape(http)
    assert info["engine_info"]["spec"] == {
        "method": "ngram", "proposer": "ngram", "num_draft_tokens": 4, "max_batch": 64,
        "drafter": None, "strategies": ["ngram:4"],
    }
    assert info["stats"]["spec"]["steps"] > 0
    # Tokens/s the policy measured, per batch-size bucket it saw.
    assert all(t["ngram:4"] > 0 for t in info["stats"]["spec_policy"].values()), info["stats"]
    assert info["stats"]["spec_policy"]
    steps, verifies, drafted, accepted = (m.value(n) - before[n] for n in names)
    assert 0 < steps <= verifies and 0 <= accepted <= drafted
    # The counters add up the requests' own counts (the batch is all that ran meanwhile).
    assert verifies == sum(meta["spec_draft_steps"] for meta in metas)
    assert accepted == sum(meta["spec_accept_token_num"] for meta in metas)
    # Per batch-size bucket: the buckets the policy measured are the ones that verified.
    buckets = m.labels("tlt_serve_spec_verify_steps_total", "batch_bucket")
    assert buckets and buckets <= set(info["stats"]["spec_by_bucket"])
    for b in buckets:  # per sequence and verify step: <= num_draft_tokens
        length = m.value("tlt_serve_spec_accept_length", batch_bucket=b)
        assert length == pytest.approx(
            m.value("tlt_serve_spec_accepted_tokens_total", batch_bucket=b)
            / m.value("tlt_serve_spec_sequence_verifies_total", batch_bucket=b))
        assert 0 <= length <= 4
    with served.http() as http:
        info = http.get("/get_server_info").json()
        m = scrape(http)
    assert info["engine_info"]["spec"]["method"] == "off"
    assert info["engine_info"]["spec"]["proposer"] == "none"
    assert m.value("tlt_serve_spec_verify_steps_total", missing=0.0) == 0  # never verified


def test_suffix_drafts_across_siblings_and_requests_in_both_dialects(tiny_model_dir) -> None:
    """--speculative suffix: the n samples of one /generate request draft from each other,
    and an OpenAI /v1/completions request for the same prompt drafts from their history
    (prompts are matched by token ids, whatever the dialect): same greedy text as plain
    decoding, nearly every draft accepted the second time."""
    spec = parse_serve_flags(["--speculative", "suffix", "--spec-max-batch", "64",
                       "--num-draft-tokens", "8"]).engine.spec
    plain, s = serve(tiny_model_dir), serve(tiny_model_dir, spec=spec)
    names = ("tlt_serve_spec_accepted_tokens_total", "tlt_serve_spec_sequence_verifies_total")
    try:
        with plain.http() as http:
            ref = http.post("/generate", json={"text": PROMPTS[2],
                                               "sampling_params": GREEDY_LONG}).json()
        with s.http() as http:
            group = http.post("/generate", json={
                "text": PROMPTS[2], "sampling_params": {**GREEDY_LONG, "n": 3}}).json()
            assert [o["text"] for o in group] == [ref["text"]] * 3
            m = scrape(http)
            before = {n: m.value(n, missing=0.0) for n in names}
            body = {"model": str(tiny_model_dir), "prompt": PROMPTS[2], "max_tokens": 40,
                    "temperature": 0,
                    "ignore_eos": True}
            resp = http.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == ref["text"]
            m = scrape(http)
        accepted, verifies = (m.value(n) - before[n] for n in names)
        assert verifies > 0 and accepted / verifies >= 6  # of at most 8 per verify
    finally:
        plain.stop()
        s.stop()
