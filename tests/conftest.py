from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.harness import Served, serve
from tests.tiny import make_tiny_drafter, make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def tiny_drafter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised drafter checkpoint for ``tiny_model_dir``."""
    return make_tiny_drafter(tiny_model_dir, tmp_path_factory.mktemp("drafter") / "d")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory):
    made: dict[tuple[str, int], Path] = {}

    def make(model_type: str = "llama", seed: int = 0) -> Path:
        key = (model_type, seed)
        if key not in made:
            made[key] = make_tiny_model(
                tmp_path_factory.mktemp("tiny") / f"{model_type}-{seed}", model_type, seed
            )
        return made[key]

    return make


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[Served]:
    """A real server (engine process + uvicorn) on the tiny model, once per test module.

    Modules that need other settings (API key, fewer rows) define their own."""
    s = serve(tiny_model_dir)
    yield s
    s.stop()


@pytest.fixture
def http(served: Served) -> Iterator[httpx.Client]:
    with served.http() as client:
        yield client
