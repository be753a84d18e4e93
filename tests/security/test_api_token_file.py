"""Issue 32, finding 9: the API token file in the data folder was written with the default mode
and only then chmod 600 (a moment in which another user could open it, and keep reading), by a
path that followed a symlink, and any file found under its name was taken as the token, whoever
wrote it. A token file is now 0600 from its creation and published whole; one found there is
used only if it is a plain file of the API's own uid that no one else may read or write.

The attacker is a real second user (uid 1000, through setpriv) with write access to a shared
data folder (a sticky, world-writable one like /tmp)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import uuid
from pathlib import Path

import pytest

from rollstream.api.auth import UnsafeTokenFile, load_token

ATTACKER = 1000
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv to act as a second user")
ATTACKER_TOKEN = "attacker-chosen-token"


def as_attacker(script: str) -> None:
    subprocess.run(["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups", "--",
                    "sh", "-euc", script], check=True, env={"PATH": "/usr/bin:/bin"})


@pytest.fixture
def shared_data_dir(monkeypatch):
    """A data folder other users may write into (sticky, like /tmp), and no token in the env."""
    monkeypatch.delenv("ROLLSTREAM_API_TOKEN", raising=False)
    monkeypatch.delenv("ROLLSTREAM_API_TOKEN_FILE", raising=False)
    path = Path(f"/tmp/rs-data-{uuid.uuid4().hex[:8]}")
    path.mkdir()
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def attacker_folder():
    path = f"/var/tmp/rs-attacker-{uuid.uuid4().hex[:8]}"
    as_attacker(f"mkdir -m 0755 {path}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _load(data_dir: Path) -> str | Exception:
    try:
        return load_token(data_dir)
    except Exception as error:  # the attacker's outcome is asserted first
        return error


def test_api_token_file_planted_by_another_user_never_becomes_the_token(shared_data_dir):
    as_attacker(f"umask 077; printf {ATTACKER_TOKEN} > {shared_data_dir}/api-token")
    outcome = _load(shared_data_dir)
    assert outcome != ATTACKER_TOKEN, "the API took the token another user wrote"
    assert isinstance(outcome, UnsafeTokenFile) and "ROLLSTREAM_API_TOKEN" in str(outcome), outcome


def test_api_token_symlink_planted_by_another_user_is_neither_read_nor_written_through(shared_data_dir,
                                                                                       attacker_folder):
    chosen, fresh = f"{attacker_folder}/chosen", f"{attacker_folder}/fresh"
    as_attacker(f"printf {ATTACKER_TOKEN} > {chosen}; ln -s {chosen} {shared_data_dir}/api-token")
    outcome = _load(shared_data_dir)
    assert outcome != ATTACKER_TOKEN, "the API took the token of the file the planted symlink names"
    assert isinstance(outcome, UnsafeTokenFile), outcome
    # A symlink to a name not yet there: root made the token file where the attacker chose.
    os.unlink(shared_data_dir / "api-token")
    as_attacker(f"ln -s {fresh} {shared_data_dir}/api-token")
    outcome = _load(shared_data_dir)
    assert not os.path.lexists(fresh), "root wrote the token into the attacker's folder"
    assert isinstance(outcome, UnsafeTokenFile), outcome


def test_api_token_file_readable_by_others_is_refused(shared_data_dir):
    path = shared_data_dir / "api-token"
    path.write_text("left-world-readable")
    path.chmod(0o644)
    assert isinstance(_load(shared_data_dir), UnsafeTokenFile)


def test_api_token_file_is_made_0600_and_kept_across_starts(shared_data_dir):
    token = load_token(shared_data_dir)
    info = os.lstat(shared_data_dir / "api-token")
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
    assert len(token) >= 32 and load_token(shared_data_dir) == token
    assert sorted(os.listdir(shared_data_dir)) == ["api-token"]  # no draft left behind
