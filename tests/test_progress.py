"""eaglet.progress.Steps: the lines of work made of a few long steps (the served check's
servers): one as each step starts and ends, the ETA of the whole from the steps done, and a
heartbeat while a step runs longer than the heartbeat's period."""

import re
import threading
import time

from eaglet.progress import Steps


def test_steps_say_each_start_and_end_with_an_eta_and_beat_while_one_runs():
    lines: list[str] = []
    lock = threading.Lock()

    def log(line: str) -> None:
        with lock:
            lines.append(line)

    with Steps("served check", 2, log, every_s=0.05) as steps:
        steps.start("vLLM at k=1")
        time.sleep(0.3)  # a server starting: the heartbeat speaks
        steps.finish("220 tokens/s")
        steps.start("vLLM at k=2")
        steps.finish()
    time.sleep(0.2)  # ended: no beat after the block
    assert lines[0] == "served check 1/2: vLLM at k=1"
    beats = [
        line for line in lines if re.fullmatch(r"served check 1/2: vLLM at k=1 \(\d+ s\)", line)
    ]
    assert len(beats) >= 3, lines
    done = [line for line in lines if " done " in line]
    assert re.fullmatch(
        r"served check 1/2 done \(vLLM at k=1, \d+ s\): 220 tokens/s, ETA 0:00:0\d", done[0]
    ), done
    assert done[1].startswith("served check 2/2 done (vLLM at k=2") and "ETA" not in done[1]
    assert lines[-1] == done[1]
