import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """tests/gpu needs CUDA; on a CPU machine every test here is skipped (and says why)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(skip)
