"""The user-facing tools: the streaming client and `make demo`."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from support import ROOT, SMG


def test_client_streams_the_greedy_text(server, reference):
    result = subprocess.run(
        [
            sys.executable, "-m", "servicer.client", "--address", server.address,
            "--text", "The river", "--max-tokens", "10", "--temperature", "0", "--ignore-eos",
        ],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=True,
    )  # fmt: skip
    expected = reference.tokenizer.decode(
        reference.greedy(reference.encode("The river"), 10), skip_special_tokens=True
    )
    assert result.stdout == expected + "\n"
    assert "[length: " in result.stderr


@pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")
def test_demo_sends_a_chat_completion_through_the_router(demo_dir):
    result = subprocess.run(
        [sys.executable, "scripts/demo.py", "--once", "--model", str(demo_dir),
         "--http-port", "0"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"finish_reason"' in result.stdout
    assert "curl -s http://127.0.0.1:" in result.stdout


@pytest.mark.skipif(SMG is None, reason="the smg router is a dev dependency")
def test_demo_shows_why_the_router_would_not_start(demo_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        result = subprocess.run(
            [sys.executable, "scripts/demo.py", "--once", "--model", str(demo_dir),
             "--http-port", str(busy.getsockname()[1])],
            capture_output=True, text=True, timeout=300, cwd=ROOT,
        )  # fmt: skip
    assert result.returncode != 0
    assert "router | " in result.stderr
    assert "Address already in use" in result.stderr
