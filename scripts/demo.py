"""`make demo`: the worker and the SMG router together, and one chat completion through them.

Starts the worker (built-in demo model unless --model is given), then `smg launch` in front
of it without --model-path (the router fetches the tokenizer from the worker), sends one
chat completion, prints it with a curl command to repeat, and keeps both running until
Ctrl-C (or exits at once with --once).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from servicer.sysinfo import free_port

ROOT = Path(__file__).resolve().parent.parent


def wait_for_worker(proc: subprocess.Popen[str]) -> int:
    """The port from the worker's ready line; its later output keeps flowing to stderr."""
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stderr.write(f"  worker | {line}")
        match = re.search(r"ready: serving .* on [\d.]+:(\d+)", line)
        if match:
            threading.Thread(
                target=shutil.copyfileobj, args=(proc.stdout, sys.stderr), daemon=True
            ).start()
            return int(match.group(1))
    raise SystemExit(f"the worker exited with code {proc.wait()}")


def http(method: str, url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


class RouterExited(RuntimeError):
    """The router stopped before it answered; the message holds the end of its output."""


def wait_for_router(base: str, router: subprocess.Popen[bytes], log: Path) -> str:
    for _ in range(240):
        if router.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-8:]
            raise RouterExited("\n".join(f"  router | {line}" for line in tail))
        try:
            status, body = http("GET", f"{base}/v1/models", timeout=2)
            if status == 200 and body.get("data"):
                return body["data"][0]["id"]
        except OSError:  # not listening yet, or someone else's port that does not answer
            pass
        time.sleep(0.25)
    raise SystemExit("the router did not come up")


def start_router(
    smg: str, worker_port: int, http_port: int | None, log: Path
) -> tuple[subprocess.Popen[bytes], str, str]:
    """The router in front of the worker; (process, base URL, model name).

    Ports picked here can be taken by someone else between the pick and the router's bind,
    so a router that exits before it answers is started again on fresh ones (twice at most);
    an --http-port the user named is kept."""
    for attempt in range(3):
        port = http_port or free_port()
        base = f"http://127.0.0.1:{port}"
        with open(log, "wb") as out:
            router = subprocess.Popen(
                [smg, "launch", "--worker-urls", f"grpc://127.0.0.1:{worker_port}",
                 "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                 "--prometheus-port", str(free_port())],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            return router, base, wait_for_router(base, router, log)
        except RouterExited as exited:
            print(f"the router exited before it answered:\n{exited}", file=sys.stderr)
            if attempt < 2:
                print("starting it again on fresh ports", file=sys.stderr)
    raise SystemExit("the router would not start; its output is above")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="model for the worker (default: the demo model)")
    parser.add_argument(
        "--http-port", type=int, default=30000, help="the router's HTTP port (0: any free one)"
    )
    parser.add_argument("--message", default="Tell me about the river.")
    parser.add_argument("--once", action="store_true", help="exit after the first completion")
    args = parser.parse_args()

    smg = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
    if smg is None:
        raise SystemExit("the smg router is not installed: run `make install`")
    worker_args = [sys.executable, "-m", "servicer", "--port", str(free_port())]
    if args.model:
        worker_args += ["--model", args.model]
    worker = subprocess.Popen(
        worker_args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    router = None
    log_dir = tempfile.TemporaryDirectory(prefix="mlx-grpc-worker-demo-")
    try:
        port = wait_for_worker(worker)
        router_log = Path(log_dir.name) / "router.log"
        router, base, model = start_router(smg, port, args.http_port or None, router_log)
        body = {
            "model": model,
            "messages": [{"role": "user", "content": args.message}],
            "max_tokens": 48,
        }
        for _ in range(120):  # the router answers 503 until it has fetched the tokenizer
            status, reply = http("POST", f"{base}/v1/chat/completions", body)
            if status != 503:
                break
            time.sleep(0.25)
        print(json.dumps(reply, indent=2))
        if status != 200:
            return 1
        print(
            "\nRepeat it with:\n"
            f"  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d '{json.dumps(body)}'"
        )
        if args.once:
            return 0
        print("\nWorker and router are running; Ctrl-C stops both.")
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        while not stop.wait(1):
            pass
        return 0
    finally:
        for proc in (router, worker):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)
        log_dir.cleanup()


if __name__ == "__main__":
    sys.exit(main())
