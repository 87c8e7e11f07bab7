"""Which state and socket directories a daemon accepts (safepath.py), and the per-user defaults:
another user's directory, or one everybody may write, on the way is refused (a personal daemon's
`/tmp/gpusched-$UID` made first by someone else let them swap its socket or read a job's log)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpusched.config import default_paths
from gpusched.daemon.safepath import unsafe_reason

OTHER = 4112
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another uid")


def test_ones_own_directories_and_roots_sticky_tmp_are_safe(tmp_path: Path) -> None:
    assert unsafe_reason(str(tmp_path / "state" / "not-yet"), os.geteuid()) is None
    assert unsafe_reason("/tmp/gpusched-test-not-made", os.geteuid()) is None  # /tmp: root's, sticky


@needs_root
def test_another_users_directory_on_the_way_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER, OTHER)
    why = unsafe_reason(str(theirs / "gpusched"), 0)
    assert why is not None and str(theirs) in why and f"uid {OTHER}" in why


def test_a_directory_everybody_may_write_is_refused_unless_it_is_roots_and_sticky(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    why = unsafe_reason(str(open_dir / "state"), os.geteuid())
    assert why is not None and "writable by every user" in why
    open_dir.chmod(0o1777)
    assert (unsafe_reason(str(open_dir / "state"), os.geteuid()) is None) == (os.geteuid() == 0)


@needs_root
def test_a_symlink_into_another_users_directory_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER, OTHER)
    link = tmp_path / "link"
    link.symlink_to(theirs)
    assert unsafe_reason(str(link / "state"), 0) is not None


def test_without_home_the_state_directory_is_the_passwd_home_not_tmp() -> None:
    paths = default_paths(65534, {})  # nobody: no $HOME in the environment (env -i, a service manager)
    assert not paths["state_dir"].startswith("/tmp/"), paths
