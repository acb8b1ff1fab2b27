"""Ctrl-C at the command line: `nanovllm generate` interrupted mid-run ends with the shell's
status for it (130) and no traceback; Ctrl-C at `nanovllm chat`'s prompt quits as Ctrl-D does."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

CLI = [sys.executable, "-m", "nanovllm"]


def test_ctrl_c_during_generate_exits_130_without_a_traceback(qwen3_tiny):
    prompts = [f"Once upon a time {i}" for i in range(64)]  # 64 x 1,000 tokens: far longer than the wait
    proc = subprocess.Popen([*CLI, "generate", "--model", str(qwen3_tiny), "--device", "cpu", "--quiet", "--max-tokens",
                             "1000", "--ignore-eos", *prompts],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(6)  # loaded and generating (or still loading: the same answer is due)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs a pseudo-terminal (pty.fork)")
def test_ctrl_c_at_the_chat_prompt_quits_like_ctrl_d(qwen3_tiny):
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: an interactive chat on the pseudo-terminal
        os.execv(sys.executable, [*CLI, "chat", str(qwen3_tiny), "--device", "cpu", "--max-tokens", "4"])
    seen = b""
    deadline = time.monotonic() + 120
    while b">>> " not in seen and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            try:
                seen += os.read(fd, 4096)
            except OSError:
                break
    assert b">>> " in seen, seen[-2000:]
    os.write(fd, b"\x03")  # Ctrl-C
    status = None
    deadline = time.monotonic() + 30
    while status is None and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            try:
                seen += os.read(fd, 4096)
            except OSError:
                pass
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(raw)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    os.close(fd)
    assert status == 0 and b"Traceback" not in seen, seen[-3000:]


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, -signal.SIGTERM)],
                         ids=["ctrl-c", "sigterm"])
def test_serve_stopped_while_it_loads_stops_without_a_traceback(qwen3_tiny, sig, status):
    """A signal while the engine core still loads the model: the server stops with the signal's
    status, and neither it nor its core prints a traceback (the core used to, reporting its
    interrupted load to the parent that was gone)."""
    proc = subprocess.Popen([*CLI, "serve", str(qwen3_tiny), "--device", "cpu", "--port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(2.5)  # the core is still loading (it imports torch and builds the model first)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)  # until the core, which shares stderr, is gone too
    assert proc.returncode == status and "Traceback" not in err, err[-3000:]
