import shutil

import pytest

pytest_plugins = ["tests.cluster.fixtures", "tests.cluster.pbs_servers", "tests.local_run"]


@pytest.fixture(scope="session")
def shellcheck() -> str:
    path = shutil.which("shellcheck")
    if path is None:
        pytest.fail("shellcheck is not installed: apt-get install -y shellcheck (scripts/setup-tests does it)")
    return path
