"""Log events in the console format escape what the volume holds (adversarial pass).

The console format is the one a person reads on a terminal (`kubectl exec -it`, a warm Job run by
hand). Its events carry strings read from the volume: a lease holder's pod name from
``leases/<digest>.holder.json``, pod names from use records, entry names from a listing. Anyone who
can write the volume writes those, so each must reach the terminal escaped (cachemgr.core.printable),
as tables and error lines do. (JSON logs escape by JSON's rules: ASCII only.)

Real pods: the holder is a real compiling pod whose name carries escapes (as a planted
``.holder.json`` would), the waiter a real pod logging in the console format.
"""

from __future__ import annotations

import signal
from pathlib import Path

from cachemgr_testkit.podlib import Cluster, free_port, wait_for
from cachemgr_testkit.scenarios import vllm_argv

EVIL = "evil\x1b]0;owned\x07\x1b[2J\u202e"


def test_a_holder_name_from_the_volume_reaches_a_console_log_escaped(pods: Cluster, root: Path) -> None:
    holder = pods.start(
        "holder",
        vllm_argv(free_port()),
        cache_root=root,
        env={"POD_NAME": EVIL, "STANDIN_COMPILE_SECONDS": "30"},
    )
    holder.wait_phase("compiling")
    waiter = pods.start(
        "waiter", vllm_argv(free_port()), cache_root=root, env={"CACHEMGR_LOG_FORMAT": "console"}
    )

    def waiting() -> str | None:
        text = waiter.log.read_bytes().decode(errors="replace")
        return text if "waiting_for_compile" in text and "holder=" in text else None

    text = wait_for(waiting, what="the waiter's waiting_for_compile event naming the holder")
    waiter.signal(signal.SIGTERM)
    holder.signal(signal.SIGTERM)
    waiter.wait_exit()
    holder.wait_exit()
    assert "\x1b" not in text, "no raw escape from the volume reaches the terminal"
    assert "\x07" not in text
    assert "\u202e" not in text
    assert "evil\\x1b]0;owned\\x07\\x1b[2J\\u202e" in text, "shown, escaped"
