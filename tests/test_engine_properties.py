"""Property-based tests (hypothesis) of the engine's bookkeeping: random sequences of admit /
step / abort / abort-all / weight update, with and without speculation (drafter and n-gram),
must leave no leaked or doubly owned KV row and end every sample exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tlt_serve import SamplingParams
from tlt_serve.backends.native.updates import EngineUpdates
from tlt_serve.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
from tlt_serve.engine.engine import Engine
from tlt_serve.models.loader import iter_safetensors
from tlt_serve.speculative.decoder import build_spec_decoder

ROWS, MAX_LEN = 4, 48


def make_engine(model: Path, spec: SpecConfig) -> Engine:
    return Engine(EngineConfig(
        model=ModelConfig(model=str(model), dtype="float32", max_model_len=MAX_LEN),
        cache=CacheConfig(max_num_seqs=ROWS), spec=spec, seed=0), build_spec_decoder)


class EngineMachine(RuleBasedStateMachine):
    engine: Engine  # set by the test (one engine per spec mode, reused across examples)
    model: Path

    @initialize()
    def start(self) -> None:
        assert not self.engine.has_work()  # the previous example drained it
        self.samples: dict[str, int] = {}  # sample rid -> max_new_tokens
        self.tokens: dict[str, int] = {}  # sample rid -> tokens seen
        self.ended: dict[str, int] = {}  # sample rid -> finished outputs seen
        self.families: list[str] = []
        self.next_id = 0

    def absorb(self, outs: list) -> None:
        for o in outs:
            assert o.rid in self.samples, f"output for unknown rid {o.rid}"
            assert self.ended.get(o.rid, 0) == 0, f"output after the end of {o.rid}"
            self.tokens[o.rid] = self.tokens.get(o.rid, 0) + len(o.token_ids)
            assert self.tokens[o.rid] <= self.samples[o.rid]
            if o.finished:
                self.ended[o.rid] = self.ended.get(o.rid, 0) + 1

    @rule(prompt_len=st.integers(1, 20), n=st.integers(1, 3), new=st.integers(1, 12),
          temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 9))
    def add(self, prompt_len: int, n: int, new: int, temperature: float, seed: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = [(7 * i + seed) % 300 + 3 for i in range(prompt_len)]
        params = SamplingParams(max_new_tokens=new, temperature=temperature, n=n, seed=seed,
                                ignore_eos=seed % 2 == 0)
        for sub in self.engine.add_request(rid, prompt, params):
            self.samples[sub] = new
        self.families.append(rid)

    @rule(times=st.integers(1, 4))
    def step(self, times: int) -> None:
        for _ in range(times):
            self.absorb(self.engine.step())

    @precondition(lambda self: bool(self.families))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.families))  # live or already finished
        self.absorb(self.engine.abort(rid))

    @rule()
    def abort_all(self) -> None:
        self.absorb(self.engine.abort_all())

    @rule()
    def update_weights(self) -> None:
        EngineUpdates(self.engine).load(iter_safetensors(self.model), f"w{self.next_id}")

    @invariant()
    def rows_are_owned_once(self) -> None:
        sched = self.engine.scheduler
        assert len(sched.running) <= ROWS
        assert [r.row for r in sched.running] == list(range(len(sched.running)))
        assert all(r.row == -1 for r in sched.waiting)
        live = [r.rid for r in sched.waiting] + [r.rid for r in sched.running]
        assert len(live) == len(set(live))
        assert not set(live) & {rid for rid, n in self.ended.items() if n}

    def teardown(self) -> None:
        for _ in range(10_000):
            if not self.engine.has_work():
                break
            self.absorb(self.engine.step())
        assert not self.engine.has_work()
        # Every sample ended exactly once (finished, or aborted with its partial output).
        assert {rid: self.ended.get(rid, 0) for rid in self.samples} == dict.fromkeys(
            self.samples, 1)


SPECS = {
    "off": SpecConfig(),
    "ngram": SpecConfig(method="ngram", num_draft_tokens=3),
    "suffix": SpecConfig(method="suffix", num_draft_tokens=3, tree_topk=2, verify_budget=4),
    "drafter": None,  # filled with the tiny drafter below
}


@pytest.mark.parametrize("mode", list(SPECS))
def test_engine_bookkeeping_properties(mode: str, tiny_model_dir: Path,
                                       tiny_drafter_dir: Path) -> None:
    spec = SPECS[mode] or SpecConfig(
        method="drafter", min_draft_confidence=0.0, drafter=str(tiny_drafter_dir),
        num_draft_tokens=3,
    )
    machine = type(f"Engine_{mode}", (EngineMachine,), {
        "engine": make_engine(tiny_model_dir, spec), "model": tiny_model_dir})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=25, stateful_step_count=30, deadline=None,
        suppress_health_check=list(HealthCheck)))
