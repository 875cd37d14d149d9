from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


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
