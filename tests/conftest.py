import os

import pytest

# Tests run the eager path: compiling costs a minute per model and is measured by the benchmarks instead.
os.environ.setdefault("LEVERLAB_EXECUTION_MODE", "eager")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """checkpoint_factory(arch) -> path of a tiny random HF checkpoint, made once per session."""
    from tests.checkpoints import make_checkpoint

    made = {}

    def make(arch: str = "qwen3", **overrides):
        key = (arch, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = make_checkpoint(tmp_path_factory.mktemp(f"ckpt-{arch}"), arch, **overrides)
        return str(made[key])

    return make
