"""A rank for tests/train/test_torchrun.py: on SIGTERM it "writes its checkpoint" for
SAVE_SECONDS_<LOCAL_RANK> seconds, then leaves OUT/saved-<LOCAL_RANK>. OUT/ready-<LOCAL_RANK>
says it is up and handling the signal. Usage: python slow_checkpoint_rank.py OUT"""

import os
import signal
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
local_rank = os.environ["LOCAL_RANK"]
save_seconds = float(os.environ[f"SAVE_SECONDS_{local_rank}"])


def save_then_exit(signum, frame):
    time.sleep(save_seconds)
    (out / f"saved-{local_rank}").write_text("")
    sys.exit(0)


signal.signal(signal.SIGTERM, save_then_exit)
(out / f"ready-{local_rank}").write_text("")
while True:
    time.sleep(0.1)
