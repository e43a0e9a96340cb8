"""A folder whose space runs out for real, and comes back: the ``disk-full`` fault of the store
transport.

Where this process may mount (root with mount rights), the folder is a small ``tmpfs`` of its own
and :meth:`ScarceFolder.exhaust` fills it with a filler file until the kernel answers ENOSPC ("No
space left on device"); :meth:`ScarceFolder.restore` deletes the filler.  Elsewhere the folder is
made read-only instead (``chmod``: EACCES, "Permission denied"), which a non-root writer cannot
get past either; :attr:`ScarceFolder.how` says which.  Nothing is simulated: the writers see the
operating system's own errors.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
from pathlib import Path

FILLER = ".chaos-filler"


class ScarceFolder:
    """``path`` as a folder that can be made full (or read-only) and given its space back.

    Args:
        path: the folder (created; with a mount, it must be empty).
        size_mb: size of the tmpfs mounted there (its room while not exhausted).
    """

    def __init__(self, path: str | os.PathLike, size_mb: int = 32):
        self.path = Path(path)
        self.size_mb = size_mb
        self.how = ""
        self.exhausted = False

    @classmethod
    def attached(cls, path: str | os.PathLike, how: str) -> "ScarceFolder":
        """A handle on a folder another process prepared (``how``: its :attr:`how`)."""
        folder = cls(path)
        folder.how = how
        return folder

    def __enter__(self) -> "ScarceFolder":
        self.path.mkdir(parents=True, exist_ok=True)
        mounted = os.geteuid() == 0 and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m", "tmpfs", str(self.path)],
            capture_output=True).returncode == 0
        self.how = "tmpfs" if mounted else "read-only" if os.geteuid() != 0 else ""
        if not self.how:
            raise OSError(errno.EPERM, "disk-full needs either a tmpfs mount (root with mount rights) or a "
                                       "non-root writer (a read-only folder stops only those)", str(self.path))
        return self

    def exhaust(self) -> None:
        """No more room: fill the tmpfs to the last byte, or make every folder read-only."""
        if self.how == "tmpfs":
            fd = os.open(self.path / FILLER, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                size = 1 << 20
                while size:  # halve the block at each ENOSPC, down to the last byte
                    try:
                        os.write(fd, b"\0" * size)
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        size //= 2
            finally:
                os.close(fd)
        else:
            for folder in self._folders():
                folder.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP)
        self.exhausted = True

    def restore(self) -> None:
        """The space is back (the filler deleted, the folders writable again)."""
        if self.how == "tmpfs":
            (self.path / FILLER).unlink(missing_ok=True)
        else:
            for folder in self._folders():
                folder.chmod(stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP)
        self.exhausted = False

    def _folders(self) -> list[Path]:
        return [self.path] + [p for p in self.path.rglob("*") if p.is_dir()]

    def __exit__(self, *exc) -> None:
        self.restore()
        if self.how == "tmpfs":
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


def can_exhaust(probe: str | os.PathLike) -> bool:
    """Whether a :class:`ScarceFolder` works here (tries a mount at ``probe``, an empty folder)."""
    try:
        with ScarceFolder(probe, size_mb=1):
            return True
    except OSError:
        return False
