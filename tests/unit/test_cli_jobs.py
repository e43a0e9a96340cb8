"""``nemo-dcr demo`` and ``check-layout``: arguments refused before launch, and ``--timeout`` stops
the whole job (torchrun and every rank it started) with a clean message.

The timeout tests launch a stand-in for torchrun (named as such below): a process that starts
"rank" processes which never finish, the situation ``--timeout`` exists for, in seconds instead
of the minutes a real job would need to get stuck.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_dcr.tools.cli import main
from nemo_dcr.tools.commands import check_layout, demo

# Stand-in for torchrun: starts two "ranks" (each ignoring SIGTERM, as a rank stuck in a
# collective may), writes their pids, and waits for them forever.
STANDIN_TORCHRUN = r"""
import signal, subprocess, sys, time
ranks = [subprocess.Popen([sys.executable, "-c",
         "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
         for _ in range(2)]
open(sys.argv[1], "w").write(" ".join(str(r.pid) for r in ranks))
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"launched {args[0][:4] if args else kwargs}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.mark.parametrize("argv, text", [
    (["check-layout", "--model", "dense-tiny", "--steps", "-1"], "--steps"),
    (["check-layout", "--model", "dense-tiny", "--steps", "0"], "--steps"),
    (["check-layout", "--model", "dense-tiny", "--layers", "0"], "layers"),
    (["check-layout", "--model", "dense-tiny", "--timeout", "0"], "--timeout"),
    (["demo", "--steps", "0"], "run.steps"),
    (["demo", "--steps", "-2"], "run.steps"),
    (["demo", "--timeout", "-1"], "--timeout"),
    (["demo", "trainer.lr=nan"], "trainer.lr"),
    (["demo", "trainer.lr=[1"], "trainer.lr"),
])
def test_bad_arguments_exit_2_before_anything_is_launched(no_launch, tmp_path, capsys, argv, text):
    if argv[0] == "demo":
        argv = argv + ["--run-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert text in err and "Traceback" not in err


def test_malformed_config_file_exits_2(no_launch, tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("run: {steps: 2\n")
    assert main(["demo", "--config", str(tmp_path / "bad.yaml"), "--run-dir", str(tmp_path / "r")]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def _standin(tmp_path: Path) -> tuple[list[str], Path]:
    pids = tmp_path / "pids"
    return [sys.executable, "-c", STANDIN_TORCHRUN, str(pids)], pids


@pytest.mark.parametrize("command", ["demo", "check-layout"])
def test_timeout_stops_torchrun_and_every_rank(tmp_path, monkeypatch, capsys, command):
    cmd, pids = _standin(tmp_path)
    if command == "demo":
        monkeypatch.setattr(demo, "build_command", lambda *a: cmd)
        argv = ["demo", "--run-dir", str(tmp_path / "run"), "--timeout", "3"]
    else:
        monkeypatch.setattr(check_layout, "_command", lambda *a: cmd)
        argv = ["check-layout", "--model", "dense-tiny", "--timeout", "3"]
    t0 = time.monotonic()
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 124 and "timed out after 3 s" in err and "Traceback" not in err, err
    ranks = [int(p) for p in pids.read_text().split()]
    assert len(ranks) == 2 and not any(_alive(p) for p in ranks)
    assert time.monotonic() - t0 < 60


def test_a_failed_demo_names_the_ranks_errors_once(tmp_path):
    log = tmp_path / "job.log"
    log.write_text("[rank1]: Traceback (most recent call last):\n"
                   "[rank1]: RuntimeError: Connection closed by peer [127.0.0.1]:53646.\n"
                   "[rank2]: RuntimeError: Connection closed by peer [127.0.0.1]:9905.\n"
                   "[rank0]: nemo_dcr.transport.errors.TransportError: engine 6 lost\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")
    assert demo.rank_errors(log) == ["rank 1: RuntimeError: Connection closed by peer [127.0.0.1]:53646.",
                                     "rank 0: nemo_dcr.transport.errors.TransportError: engine 6 lost"]


def test_the_engine_process_says_how_it_died():
    import multiprocessing as mp

    from nemo_dcr.tools.demo.engine_process import EngineProcess

    handle = EngineProcess.__new__(EngineProcess)
    handle.log = "runs/x/engine.log"
    handle.proc = mp.get_context("spawn").Process(target=time.sleep, args=(60,))
    handle.proc.start()
    assert handle.died() is None
    handle.proc.kill()
    handle.proc.join()
    assert handle.died() == ("the engine process was killed by SIGKILL: often the kernel's out-of-memory killer "
                             "(see dmesg) (its output: runs/x/engine.log)")
