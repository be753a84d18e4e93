import os
import subprocess
import tarfile
from pathlib import Path


def test_script_is_executable():
    assert os.access("/app/backup.sh", os.X_OK)


def test_script_runs_and_archives_the_data(tmp_path):
    Path("/app/backups/data.tar.gz").unlink(missing_ok=True)
    result = subprocess.run(["/app/backup.sh"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    with tarfile.open("/app/backups/data.tar.gz") as archive:
        names = {name.lstrip("./") for name in archive.getnames()}
        assert "notes.txt" in names
        assert archive.extractfile("./notes.txt").read() == b"important\n"
