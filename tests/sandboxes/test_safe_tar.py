"""Hostile image tarballs, built here with tarfile, unpacked by safe_tar (images.py's only way in).

Each test writes the archive an attacker would hand to `rollstream images pull` and checks what
lands on the host: nothing outside the destination, no special files, no setuid bits, no
foreign owners. They run on the venv's own Python (Debian 12: 3.11.2, no tarfile ``filter=``).
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from rollstream.sandboxes.safe_tar import UnsafeArchive, extract


def _tarball(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> str:
    with tarfile.open(path, "w") as archive:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            archive.addfile(info, io.BytesIO(data) if data is not None else None)
    return str(path)


def _entry(name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, linkname: str = "",
           uid: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname, info.uid, info.gid = kind, mode, linkname, uid, uid
    return info


@pytest.fixture
def host(tmp_path):
    """A host folder beside the destination, with a file an attacker wants to reach."""
    outside = tmp_path / "host"
    outside.mkdir()
    (outside / "secret").write_text("host secret")
    destination = tmp_path / "rootfs"
    destination.mkdir()
    return outside, destination


def _everything_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def test_a_plain_rootfs_tarball_unpacks_with_its_files_links_and_modes(tmp_path):
    tarball = _tarball(tmp_path / "ok.tar", [
        (_entry("./usr", tarfile.DIRTYPE, 0o755), None),
        (_entry("./usr/bin", tarfile.DIRTYPE, 0o555), None),
        (_entry("./usr/bin/tool", mode=0o755), b"#!/bin/sh\necho hi\n"),
        (_entry("./usr/bin/tool-again", tarfile.LNKTYPE, linkname="./usr/bin/tool"), None),
        (_entry("./bin", tarfile.SYMTYPE, linkname="usr/bin"), None),
        (_entry("./etc", tarfile.DIRTYPE, 0o755), None),
        (_entry("./etc/alternatives", tarfile.DIRTYPE, 0o755), None),
        (_entry("./etc/alternatives/tool", tarfile.SYMTYPE, linkname="/usr/bin/tool"), None),
    ])
    destination = tmp_path / "rootfs"
    destination.mkdir()
    extract(tarball, str(destination))
    assert (destination / "bin" / "tool").read_text() == "#!/bin/sh\necho hi\n"
    assert os.path.samefile(destination / "usr/bin/tool", destination / "usr/bin/tool-again")
    # An absolute target means the image's own file: rewritten relative, it stays inside on the host.
    assert os.readlink(destination / "etc/alternatives/tool") == "../../usr/bin/tool"
    assert (destination / "etc/alternatives/tool").resolve() == (destination / "usr/bin/tool").resolve()
    assert stat.S_IMODE((destination / "usr/bin").stat().st_mode) == 0o555
    assert stat.S_IMODE((destination / "usr/bin/tool").stat().st_mode) == 0o755


@pytest.mark.parametrize("name", ["/abs-evil", "../evil", "./a/../../evil", "a/../../../evil"])
def test_member_names_that_are_absolute_or_climb_out_are_refused_and_nothing_lands_outside(host, name):
    outside, destination = host
    tarball = _tarball(destination.parent / "evil.tar", [(_entry(name), b"pwned")])
    with pytest.raises(UnsafeArchive, match="absolute|'\\.\\.'"):
        extract(tarball, str(destination))
    assert not (destination.parent / "evil").exists() and not Path("/abs-evil").exists()
    assert _everything_under(destination) == set()


def test_a_file_written_through_an_earlier_symlinked_folder_is_refused(host):
    outside, destination = host
    # The folder is a symlink to the host; the next member writes "into" it.
    tarball = _tarball(destination.parent / "evil.tar", [
        (_entry("etc", tarfile.SYMTYPE, linkname=str(outside)), None),
        (_entry("etc/secret", mode=0o644), b"overwritten"),
    ])
    with pytest.raises(UnsafeArchive, match="not a folder of the archive"):
        extract(tarball, str(destination))
    assert (outside / "secret").read_text() == "host secret"


def test_a_file_written_through_a_relative_symlink_climbing_out_is_refused(host):
    outside, destination = host
    tarball = _tarball(destination.parent / "evil.tar", [
        (_entry("up", tarfile.SYMTYPE, linkname="../host"), None),
        (_entry("up/secret", mode=0o644), b"overwritten"),
    ])
    with pytest.raises(UnsafeArchive, match="climbs out"):
        extract(tarball, str(destination))
    assert (outside / "secret").read_text() == "host secret"
    assert not os.path.lexists(destination / "up")


def test_a_symlink_that_escapes_through_another_symlink_is_refused(host):
    outside, destination = host
    # Each target alone stays inside by its own words; together, on the host, `here/..` is the parent.
    tarball = _tarball(destination.parent / "evil.tar", [
        (_entry("here", tarfile.SYMTYPE, linkname="."), None),
        (_entry("out", tarfile.SYMTYPE, linkname="here/../host/secret"), None),
    ])
    with pytest.raises(UnsafeArchive, match="leaves the archive's folder"):
        extract(tarball, str(destination))


@pytest.mark.parametrize("linkname", ["/etc/passwd", "../host/secret", "link-to-host/secret"])
def test_hard_links_to_host_files_are_refused(host, linkname):
    outside, destination = host
    tarball = _tarball(destination.parent / "evil.tar", [
        (_entry("link-to-host", tarfile.SYMTYPE, linkname="../host"), None) if linkname.startswith("link")
        else (_entry("harmless"), b""),
        (_entry("stolen", tarfile.LNKTYPE, linkname=linkname), None),
    ])
    with pytest.raises(UnsafeArchive):
        extract(tarball, str(destination))
    assert os.stat(outside / "secret").st_nlink == 1
    assert os.stat("/etc/passwd").st_nlink == 1


def test_device_nodes_and_fifos_are_left_out(host):
    outside, destination = host
    disk = _entry("dev/sda", tarfile.BLKTYPE, 0o666)
    disk.devmajor, disk.devminor = 8, 0
    memory = _entry("dev/mem", tarfile.CHRTYPE, 0o666)
    memory.devmajor, memory.devminor = 1, 1
    tarball = _tarball(destination.parent / "dev.tar", [
        (_entry("dev", tarfile.DIRTYPE, 0o755), None), (disk, None), (memory, None),
        (_entry("dev/pipe", tarfile.FIFOTYPE, 0o666), None), (_entry("dev/ok"), b"fine"),
    ])
    done = extract(tarball, str(destination))
    assert sorted(done.skipped_special) == ["dev/mem", "dev/pipe", "dev/sda"]
    assert _everything_under(destination) == {"dev", "dev/ok"}


def test_setuid_setgid_sticky_and_group_or_other_write_bits_are_stripped(host):
    outside, destination = host
    tarball = _tarball(destination.parent / "modes.tar", [
        (_entry("suid-shell", mode=0o4755), b"\x7fELF"),
        (_entry("sgid", mode=0o2777), b"x"),
        (_entry("tmp", tarfile.DIRTYPE, 0o1777), None),
    ])
    extract(tarball, str(destination))
    assert stat.S_IMODE((destination / "suid-shell").stat().st_mode) == 0o755
    assert stat.S_IMODE((destination / "sgid").stat().st_mode) == 0o755
    assert stat.S_IMODE((destination / "tmp").stat().st_mode) == 0o755


def test_entries_belong_to_the_unpacking_user_not_the_archives_owners(host):
    outside, destination = host
    tarball = _tarball(destination.parent / "owners.tar", [
        (_entry("etc", tarfile.DIRTYPE, 0o755, uid=1000), None),
        (_entry("etc/shadow", mode=0o644, uid=1000), b"x"),
    ])
    extract(tarball, str(destination))
    owners = {(p.lstat().st_uid, p.lstat().st_gid) for p in destination.rglob("*")}
    assert owners == {(os.geteuid(), os.getegid())}


def test_a_later_member_replacing_a_file_with_a_symlink_cannot_write_through_it(host):
    outside, destination = host
    tarball = _tarball(destination.parent / "swap.tar", [
        (_entry("f"), b"first"),
        (_entry("f", tarfile.SYMTYPE, linkname="../host/secret"), None),
    ])
    with pytest.raises(UnsafeArchive, match="climbs out"):
        extract(tarball, str(destination))
    assert (outside / "secret").read_text() == "host secret"


def test_a_refused_pull_leaves_no_rootfs_in_the_cache(host, tmp_path):
    from rollstream.sandboxes import images

    outside, destination = host
    tarball = _tarball(tmp_path / "evil.tar", [(_entry("ok"), b"x"), (_entry("../evil"), b"x")])
    images_dir = tmp_path / "images"
    with pytest.raises(UnsafeArchive):
        images.pull_image(tarball, "bwrap", str(images_dir))
    assert images.list_images(str(images_dir)) == []
    assert not any(images_dir.iterdir())
