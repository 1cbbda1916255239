import os
import shutil

import pytest

# No test reaches the real Hugging Face Hub (validate asks it of a hub model the cache lacks): a
# closed port refuses at once; a test that needs a hub serves tests.hub_stand_in and points here.
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"

pytest_plugins = ["tests.cluster.fixtures", "tests.cluster.hosts", "tests.cluster.pbs_servers", "tests.local_run"]


@pytest.fixture(scope="session")
def shellcheck() -> str:
    path = shutil.which("shellcheck")
    if path is None:
        pytest.fail("shellcheck is not installed: apt-get install -y shellcheck (scripts/setup-tests does it)")
    return path
