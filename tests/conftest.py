import os

import pytest

# Tests run the eager path: compiling costs a minute per model and is measured by the benchmarks instead.
os.environ.setdefault("LEVERLAB_EXECUTION_MODE", "eager")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_sessionstart(session):
    """LEVERLAB_REQUIRE_CPP_KERNELS=1 (.ci/run sets it): the C++ kernels must build here. Without it a build that
    fails turns every kernel test into a skip and the engine onto its PyTorch paths, and the suite still passes."""
    if os.environ.get("LEVERLAB_REQUIRE_CPP_KERNELS") == "1":
        from leverlab.kernels import cpu_kernels

        if cpu_kernels.kernels() is None:
            raise pytest.UsageError(
                "LEVERLAB_REQUIRE_CPP_KERNELS=1, but the C++ kernels did not build; the compiler's error: "
                "python -m leverlab.kernels.cpu_kernels")


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
