import pytest

from tests.distributed.launcher import clean_shared_memory


@pytest.fixture(autouse=True)
def _no_leftover_buffers():
    yield
    clean_shared_memory()
