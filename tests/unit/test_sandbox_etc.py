"""The /etc a bubblewrap sandbox binds (pipeline/harness/backends/sandbox_etc.py), made from a host folder of
the test's own."""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.harness.backends.sandbox_etc import prepared_etc


def host_etc(tmp_path: Path) -> Path:
    host = tmp_path / "host-etc"
    (host / "ssl" / "certs").mkdir(parents=True)
    (host / "ssl" / "private").mkdir()
    (host / "ssl" / "private" / "server.key").write_text("secret")
    (host / "ssl" / "certs" / "ca-certificates.crt").write_text("roots")
    (host / "ssl" / "certs" / "abcd.0").symlink_to("ca-certificates.crt")
    (host / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (host / "localtime").symlink_to("/usr/share/zoneinfo/Etc/UTC")
    (host / "shadow").write_text("root:hash")
    return host


def test_the_folder_holds_copies_of_the_entries_and_nothing_else(tmp_path: Path) -> None:
    etc = prepared_etc(tmp_path / "root", host_etc(tmp_path))
    assert sorted(os.listdir(etc)) == ["localtime", "passwd", "resolv.conf", "ssl"]
    assert (etc / "passwd").read_text() == "root:x:0:0::/root:/bin/sh\n"
    assert os.readlink(etc / "localtime") == "/usr/share/zoneinfo/Etc/UTC", "links copied as links"
    assert os.readlink(etc / "ssl" / "certs" / "abcd.0") == "ca-certificates.crt"
    assert sorted(os.listdir(etc / "ssl")) == ["certs"], "no private keys"
    assert (etc / "resolv.conf").read_text() == "", "a mount point for the internet's resolv.conf"


def test_the_same_content_is_one_folder_and_a_change_makes_another(tmp_path: Path) -> None:
    host, root = host_etc(tmp_path), tmp_path / "root"
    first = prepared_etc(root, host)
    assert prepared_etc(root, host) == first
    (host / "ssl" / "private" / "server.key").write_text("another secret")  # left out: no new folder
    assert prepared_etc(root, host) == first
    (host / "passwd").write_text("root:x:0:0::/root:/bin/sh\nagent:x:1000:1000::/home/agent:/bin/sh\n")
    second = prepared_etc(root, host)
    assert second != first
    assert "agent" in (second / "passwd").read_text()
    assert sorted(p.name for p in root.iterdir()) == sorted([first.name, second.name]), "no staging left"
