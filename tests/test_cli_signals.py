"""Ctrl-C at the command line: `nanovllm generate` interrupted mid-run ends with the shell's
status for it (130) and no traceback; Ctrl-C at `nanovllm chat`'s prompt quits as Ctrl-D does, at
once (no Enter needed), and Ctrl-C mid-reply stops the reply."""
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
    seen = []
    for line in proc.stderr:  # until the model has loaded
        seen.append(line)
        if " loaded in " in line:
            break
    time.sleep(1.0)  # generating (or still starting: the same answer is due)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    err = "".join(seen) + err
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]


class _Terminal:
    """`nanovllm chat` on a pseudo-terminal, as in a real one: Ctrl-C is the terminal's interrupt
    character (b"\\x03"), which its line discipline turns into SIGINT for the foreground process
    group (the process as a whole: the kernel picks the thread that takes it)."""

    def __init__(self, *args: str):
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: an interactive chat on the pseudo-terminal
            try:
                os.execv(sys.executable, [*CLI, "chat", *args])
            finally:
                os._exit(127)
        self.seen = b""
        self.status: int | None = None

    def _read(self, timeout: float) -> None:
        if select.select([self.fd], [], [], timeout)[0]:
            try:
                self.seen += os.read(self.fd, 4096)
            except OSError:  # the child is gone
                time.sleep(timeout)

    def wait_for(self, text: bytes, after: int, timeout: float) -> int:
        """Read until `text` shows in the output past offset `after`; the offset where it ends."""
        deadline = time.monotonic() + timeout
        while text not in self.seen[after:] and time.monotonic() < deadline:
            self._read(0.2)
        assert text in self.seen[after:], self.seen[-3000:]
        return self.seen.index(text, after) + len(text)

    def wait_for_output(self, after: int, timeout: float) -> None:
        """Read until there is output past offset `after`."""
        deadline = time.monotonic() + timeout
        while len(self.seen) <= after and time.monotonic() < deadline:
            self._read(0.2)
        assert len(self.seen) > after, self.seen[-3000:]

    def exit_status(self, timeout: float) -> int | None:
        """The child's exit status once it exits, None if it is still running after `timeout`."""
        deadline = time.monotonic() + timeout
        while self.status is None and time.monotonic() < deadline:
            self._read(0.2)
            done, raw = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.status = os.waitstatus_to_exitcode(raw)
        return self.status

    def close(self) -> None:
        if self.status is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


needs_pty = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin",
                               reason="needs a pseudo-terminal (pty.fork)")


@needs_pty
def test_ctrl_c_at_the_chat_prompt_quits_like_ctrl_d(qwen3_tiny):
    term = _Terminal(str(qwen3_tiny), "--device", "cpu", "--max-tokens", "4")
    try:
        term.wait_for(b">>> ", 0, timeout=120)
        # input() blocks in read() by now (CPython acts on a signal that lands after it printed
        # the prompt but before its read() only once a line is read)
        time.sleep(0.5)
        os.write(term.fd, b"\x03")  # Ctrl-C, and no Enter after it
        status = term.exit_status(timeout=30)
    finally:
        term.close()
    assert status == 0 and b"Traceback" not in term.seen, term.seen[-3000:]


@needs_pty
def test_ctrl_c_stops_a_chat_reply_then_quits_at_the_prompt(qwen3_tiny):
    """Ctrl-C mid-reply stops the reply and gives the prompt back; Ctrl-C at that prompt then
    quits at once, with torch's threads started by the reply there beside the main thread."""
    term = _Terminal(str(qwen3_tiny), "--device", "cpu", "--max-tokens", "1000", "--ignore-eos")
    try:
        end = term.wait_for(b">>> ", 0, timeout=120)
        os.write(term.fd, b"hello\r")
        end = term.wait_for(b"hello\r\n", end, timeout=30)  # the terminal's echo
        term.wait_for_output(end, timeout=60)  # the reply is streaming (1,000 tokens: many seconds)
        os.write(term.fd, b"\x03")
        end = term.wait_for(b" [stopped]\r\n>>> ", end, timeout=30)
        time.sleep(0.5)  # input() blocks in read() by now (as above)
        os.write(term.fd, b"\x03")  # no Enter after it
        status = term.exit_status(timeout=30)
    finally:
        term.close()
    assert status == 0 and b"Traceback" not in term.seen, term.seen[-3000:]


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, -signal.SIGTERM)],
                         ids=["ctrl-c", "sigterm"])
def test_serve_stopped_while_it_loads_stops_without_a_traceback(qwen3_tiny, sig, status):
    """A signal while the engine core still loads the model: the server stops with the signal's
    status, and neither it nor its core prints a traceback (the core used to, reporting its
    interrupted load to the parent that was gone)."""
    proc = subprocess.Popen([*CLI, "serve", str(qwen3_tiny), "--device", "cpu", "--port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2.5)  # the core is still loading (it imports torch and builds the model first)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)  # until the core, which shares stderr, is gone too
    finally:
        if proc.poll() is None:  # a server left running would outlive the test
            proc.kill()
            proc.wait()
    assert proc.returncode == status and "Traceback" not in err, err[-3000:]


def test_a_signal_just_before_uvicorn_serves_still_stops_the_front_end(qwen3_tiny, monkeypatch):
    """SIGTERM after the front-end set its own handlers but before uvicorn installed its: the
    server still stops (status 0) instead of serving on with the signal forgotten."""
    from nanovllm.engine.core import CoreProcess
    from nanovllm.entrypoints.frontend import FrontendConfig, run_frontend
    from nanovllm.entrypoints.limits import ServerLimits
    from nanovllm.entrypoints.server import GracefulServer

    real_run = GracefulServer.run

    def run_after_a_signal(self, *args, **kwargs):
        signal.raise_signal(signal.SIGTERM)
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(GracefulServer, "run", run_after_a_signal)
    core = CoreProcess(str(qwen3_tiny), dict(device="cpu", max_model_len=256, num_kvcache_blocks=32), max_pending=16)
    try:
        cfg = FrontendConfig(core.addresses, core.info, "tiny", None, "127.0.0.1", 0, 2.0, "warning", False, None,
                             30.0, ServerLimits())
        start = time.monotonic()
        assert run_frontend(cfg, core_alive=core.is_alive) == 0
        assert time.monotonic() - start < 30  # not served on until something else ends it
    finally:
        core.shutdown()
