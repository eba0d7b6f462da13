"""OpenCue's real clients, in an environment of their own, run as users run them.

The environment is made once per pin list under .cuesched/ (pip from the package index, as a user
would install them), so the tests drive the very cueadmin and pycue a studio has, against our
server, through nothing but CUEBOT_HOSTS.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PINS = ROOT / "tests" / "opencue-clients.txt"


@dataclass(frozen=True)
class Clients:
    venv: Path
    hosts: str  # CUEBOT_HOSTS

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "DATABASE_URL"))}
        env["CUEBOT_HOSTS"] = self.hosts
        env.pop("OPENCUE_CONFIG_FILE", None)
        return env

    def run(self, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=timeout)

    def cueadmin(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return self.run([str(self.venv / "bin" / "cueadmin"), *args], timeout)

    def cueman(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return self.run([str(self.venv / "bin" / "cueman"), *args], timeout)

    def pycue(self, script: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return self.run([str(self.venv / "bin" / "python"), "-c", script], timeout)


def client_venv() -> Path:
    """The clients' environment, made on first use (a few seconds from a warm pip cache)."""
    digest = hashlib.sha256(PINS.read_bytes()).hexdigest()[:12]
    venv = ROOT / ".cuesched" / f"opencue-clients-{digest}"
    if (venv / "bin" / "cueadmin").exists():
        return venv
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "-r", str(PINS)],
        check=True,
        capture_output=True,
    )
    return venv


def ok(result: subprocess.CompletedProcess[str]) -> str:
    """A client command's output, once it has exited 0 (else its whole output in the failure)."""
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout
