"""The systemd units: `systemd-analyze verify` accepts them, and the GPU-safe hardening stays put.

verify needs every ExecStart binary to exist, so each unit is copied into a temp dir with its
ExecStart pointed at this venv's `sidecar`; the rest of the unit is checked as shipped. No running
systemd is needed (verify and `security --offline` work on plain files), so this runs in CI
containers; a fresh Debian without systemd gets the package installed when the test runs as root.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.cli import parse_ollama_host

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parents[1]
UNITS = REPO / "systemd"
SYSTEM_UNIT = UNITS / "spec-sidecar.service"
USER_UNIT = UNITS / "spec-sidecar-user.service"
DROP_IN = UNITS / "ollama.service.d" / "spec-sidecar.conf"

# [Service] keys that sandbox the process: each must be explained by a comment (why GPUs still work).
HARDENING = re.compile(r"^(Protect|Private|Restrict|Device|SystemCall|Capability|Ambient|NoNewPrivileges|"
                       r"LockPersonality|MemoryDeny|DynamicUser|SupplementaryGroups|UMask|ProcSubset)")


@pytest.fixture(scope="module")
def analyze() -> str:
    exe = shutil.which("systemd-analyze")
    if exe:
        return exe
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-q"], check=True, env=env, timeout=600, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "systemd"], check=True,
                       env=env, timeout=900, capture_output=True)
        exe = shutil.which("systemd-analyze")
        if exe:
            return exe
    pytest.fail("systemd-analyze is missing: install Debian's `systemd` package (apt-get install systemd), "
                "or run the suite as root on a machine with apt-get so this test can install it")


@pytest.fixture(scope="module")
def sidecar_bin() -> Path:
    exe = Path(sys.executable).with_name("sidecar")
    if not exe.exists():
        found = shutil.which("sidecar")
        if found is None:
            pytest.fail("no `sidecar` entry point next to the interpreter or on PATH: run `pip install -e .`")
        exe = Path(found)
    return exe


def entries(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) for every assignment, repeated keys kept (configparser would refuse them)."""
    out, section = [], ""
    for raw in path.read_text().splitlines():
        s = raw.strip()
        if not s or s.startswith(("#", ";")):
            continue
        if s.startswith("["):
            section = s.strip("[]")
            continue
        key, _, value = s.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def values(path: Path, key: str, section: str = "Service") -> list[str]:
    return [v for s, k, v in entries(path) if s == section and k == key]


def installable_copy(unit: Path, dest: Path, sidecar_bin: Path) -> Path:
    """The unit with ExecStart's binary replaced by this venv's, arguments untouched."""
    dest.mkdir(parents=True, exist_ok=True)
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={sidecar_bin}", unit.read_text(), count=1, flags=re.M)
    out = dest / unit.name
    out.write_text(text)
    return out


def verify(analyze: str, unit: Path, *, user: bool = False, tmp: Path) -> list[str]:
    """Run verify; return its complaints about our files (it exits 0 on unknown keys, so read them)."""
    env = {**os.environ, "SYSTEMD_LOG_COLOR": "0"}
    cmd = [analyze]
    if user:
        runtime = tmp / "xdg-runtime"  # the user manager wants one; no session needed
        runtime.mkdir(mode=0o700, exist_ok=True)
        env["XDG_RUNTIME_DIR"] = str(runtime)
        cmd.append("--user")
    r = subprocess.run([*cmd, "verify", "--man=no", str(unit)], capture_output=True, text=True, env=env,
                       timeout=120)
    ours = (unit.name, unit.parent.name)
    complaints = [ln for ln in (r.stdout + r.stderr).splitlines() if any(n in ln for n in ours)]
    if r.returncode != 0:
        complaints.append(f"exit {r.returncode}: {r.stdout}{r.stderr}")
    return complaints


def test_system_unit_verifies(analyze: str, sidecar_bin: Path, tmp_path: Path) -> None:
    unit = installable_copy(SYSTEM_UNIT, tmp_path / "system", sidecar_bin)
    assert verify(analyze, unit, tmp=tmp_path) == []


def test_verify_catches_mistakes(analyze: str, sidecar_bin: Path, tmp_path: Path) -> None:
    """The harness itself: an unknown key and a missing binary are reported, not silently passed."""
    unit = installable_copy(SYSTEM_UNIT, tmp_path / "bad", sidecar_bin)
    unit.write_text(unit.read_text().replace("[Service]\n", "[Service]\nPrivateDevice=no\n"))
    assert any("PrivateDevice" in c for c in verify(analyze, unit, tmp=tmp_path))
    missing = tmp_path / "missing" / SYSTEM_UNIT.name
    missing.parent.mkdir()
    missing.write_text(SYSTEM_UNIT.read_text().replace("/opt/spec-sidecar/bin/sidecar", "/nonexistent/sidecar"))
    assert verify(analyze, missing, tmp=tmp_path) != []


def test_user_unit_verifies(analyze: str, sidecar_bin: Path, tmp_path: Path) -> None:
    unit = installable_copy(USER_UNIT, tmp_path / "user", sidecar_bin)
    assert verify(analyze, unit, user=True, tmp=tmp_path) == []


def test_ollama_drop_in_verifies_and_moves_ollama(analyze: str, tmp_path: Path) -> None:
    d = tmp_path / "units"
    (d / "ollama.service.d").mkdir(parents=True)
    # A stand-in for Ollama's own unit; verify reads drop-ins from the directory next to it.
    (d / "ollama.service").write_text(f"[Unit]\nDescription=Ollama\n[Service]\nExecStart={shutil.which('sleep')} 1\n")
    shutil.copy(DROP_IN, d / "ollama.service.d" / DROP_IN.name)
    assert verify(analyze, d / "ollama.service", tmp=tmp_path) == []
    env = dict(v.strip('"').split("=", 1) for v in values(DROP_IN, "Environment"))
    assert parse_ollama_host(env["OLLAMA_HOST"]) == ("127.0.0.1", 11435)


def test_security_exposure_stays_low(analyze: str, sidecar_bin: Path, tmp_path: Path) -> None:
    """`systemd-analyze security` scores the sandbox 0 (locked) to 10 (open); guard against erosion."""
    unit = installable_copy(SYSTEM_UNIT, tmp_path / "sec", sidecar_bin)
    r = subprocess.run([analyze, "security", "--offline=yes", "--no-pager", str(unit)], capture_output=True,
                       text=True, timeout=120)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", r.stdout)
    if m is None and "offline" in r.stderr:
        pytest.skip(f"systemd-analyze too old for --offline: {r.stderr.strip()}")
    assert m is not None, r.stdout + r.stderr
    assert float(m.group(1)) <= 3.0, r.stdout


def test_service_contract() -> None:
    """What the daemon and the README rely on."""
    for unit in (SYSTEM_UNIT, USER_UNIT):
        assert values(unit, "Type") == ["notify"], unit
        assert values(unit, "Restart") == ["on-failure"], unit
        assert values(unit, "ExecReload") == ["/bin/kill -HUP $MAINPID"], unit
        assert values(unit, "WatchdogSec"), unit
        assert values(unit, "KillMode") == ["mixed"], unit
        assert " serve --config " in values(unit, "ExecStart")[0], unit
    assert values(SYSTEM_UNIT, "EnvironmentFile") == ["-/etc/spec-sidecar/env"]
    assert values(SYSTEM_UNIT, "ExecStart")[0].startswith("/")  # absolute, as systemd requires
    assert values(SYSTEM_UNIT, "WantedBy", "Install") == ["multi-user.target"]
    assert values(USER_UNIT, "WantedBy", "Install") == ["default.target"]


def test_hardening_keeps_gpus_usable() -> None:
    s = dict((k, v) for sec, k, v in entries(SYSTEM_UNIT) if sec == "Service")
    assert s["ProtectSystem"] == "strict"
    assert s["ProtectHome"] == "read-only"
    assert s["PrivateTmp"] == "yes"
    assert s["NoNewPrivileges"] == "yes"
    assert s.get("PrivateDevices", "no") == "no"  # yes would hide /dev/nvidia*, /dev/dri, /dev/kfd
    assert s.get("MemoryDenyWriteExecute", "no") == "no"  # ctypes callbacks and CUDA JIT need W+X
    assert s["DevicePolicy"] == "closed"
    allowed = {v.split()[0]: v.split()[1] for v in values(SYSTEM_UNIT, "DeviceAllow")}
    assert allowed == {"char-nvidia*": "rw", "char-drm": "rw", "char-kfd": "rw"}
    families = s["RestrictAddressFamilies"].split()
    assert "AF_UNIX" in families  # sd_notify (and CUDA MPS)
    # The user unit cannot apply device cgroups; it must not pretend to.
    assert not [k for _, k, _ in entries(USER_UNIT) if k.startswith(("Device", "PrivateDevices"))]


def test_every_hardening_option_is_explained() -> None:
    """Each sandboxing line sits in a block that starts with a comment saying why GPUs still work."""
    for unit in (SYSTEM_UNIT, USER_UNIT):
        lines = unit.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("#") or not HARDENING.match(line):
                continue
            j = i - 1
            while j >= 0 and lines[j].strip() and not lines[j].startswith("#") and not lines[j].startswith("["):
                j -= 1
            assert j >= 0 and lines[j].startswith("#"), f"{unit.name}: {line!r} has no explaining comment"


def test_cli_accepts_the_unit_arguments(sidecar_bin: Path) -> None:
    r = subprocess.run([str(sidecar_bin), "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--config" in r.stdout
