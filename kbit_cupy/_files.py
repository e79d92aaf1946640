"""Files the package writes and reads: atomic replacement, regular files only.

Every file kbit_cupy writes (safetensors models, benchmark results, figures)
goes through ``atomic_write``: the bytes go to a temporary file in the target's
directory, are flushed and fsynced, and only then ``os.replace`` puts the file
in place, so a reader sees the old file or the new one, never a mix. On any
failure (a full disk, a file-size limit, Ctrl-C, an exception in the caller)
the temporary is removed and the old file is untouched.

A process killed outright (SIGKILL, power loss) cannot clean up; its
temporary keeps a name tooling can recognise, ``.NAME.kbit-tmp-PID-RANDOM``
next to ``NAME``, which ``stale_temporaries`` lists (those whose writer
process is gone) for a sweep. The command line turns SIGTERM into a normal
exit, so a terminated ``python -m kbit_cupy`` cleans up too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO

TEMP_MARKER = ".kbit-tmp-"  # temporaries are named f".{name}{TEMP_MARKER}{pid}-{random}"
_TEMP_NAME = re.compile(r"^\.(?P<name>.+)" + re.escape(TEMP_MARKER) + r"(?P<pid>\d+)-[0-9a-f]+$")


def _fsync(fd: int) -> None:
    os.fsync(fd)


def _fsync_directory(directory: str) -> None:
    """Make the rename itself durable; not every platform or file system allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        _fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    """What a non-regular file is, for messages."""
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device")):
        if test(mode):
            return kind
    return "not a regular file"


def _target(path) -> str:
    """The real file to replace: symlinks are followed so the link keeps working."""
    target = os.path.realpath(os.fspath(path))
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return target
    if not stat.S_ISREG(mode):
        raise ValueError(f"{os.fspath(path)} is {_kind(mode)}, not a regular file; "
                         "give the path of a file to write")
    return target


def _open_temporary(target: str) -> tuple[int, str]:
    directory, name = os.path.split(target)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:
        temp = os.path.join(directory, f".{name}{TEMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}")
        try:
            return os.open(temp, flags, 0o666), temp  # 0o666 & ~umask, as open(path, "w")
        except FileExistsError:
            continue
        except OSError as exc:  # a missing directory, no permission: name the file asked for
            raise type(exc)(exc.errno, exc.strerror, target) from None


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """``with atomic_write(path) as f: f.write(...)``: ``path`` is replaced only on success.

    ``mode`` is ``"wb"`` or ``"w"`` (UTF-8 text). An existing file keeps its
    permission bits; a symlink is followed. Raises ValueError if ``path``
    names a directory or another non-regular file, OSError as writing does;
    in every failing case the old file is byte-identical and no temporary is
    left.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f'mode must be "wb" or "w", got {mode!r}')
    target = _target(path)
    fd, temp = _open_temporary(target)
    try:
        if os.chmod in os.supports_fd:  # keep an existing file's permission bits
            with contextlib.suppress(FileNotFoundError):
                os.chmod(fd, stat.S_IMODE(os.stat(target).st_mode))
        f = open(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {}))  # noqa: SIM115
        fd = None  # the file object owns (and closes) it now
        with f:
            yield f
            f.flush()
            _fsync(f.fileno())
        os.replace(temp, target)
    except BaseException:  # KeyboardInterrupt and SystemExit included: never leave a temporary
        if fd is not None:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    _fsync_directory(os.path.dirname(target))


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """``Path(path).write_bytes(data)``, atomically."""
    with atomic_write(path) as f:
        f.write(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    """``Path(path).write_text(text)`` (UTF-8), atomically."""
    with atomic_write(path, "w") as f:
        f.write(text)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # someone else's process, or no way to tell: keep its file
    return True


def stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Temporaries of ``atomic_write`` in ``directory`` whose writer process has exited.

    They are what a killed writer leaves behind (the target itself is
    intact); delete them. Only this host's process ids are checked, so on a
    directory shared between machines, sweep from the machine that wrote.
    """
    stale = []
    for entry in os.scandir(directory):
        match = _TEMP_NAME.match(entry.name)
        if match and entry.is_file(follow_symlinks=False) and not _process_exists(
                int(match["pid"])):
            stale.append(Path(entry.path))
    return sorted(stale)


def open_regular(path: str | os.PathLike) -> IO[bytes]:
    """``open(path, "rb")`` for regular files only, without blocking on a FIFO.

    Raises ValueError naming ``path`` for a FIFO, socket, device or directory
    (a FIFO would block ``open`` until a writer comes; a device may never
    end); OSError (FileNotFoundError, PermissionError) as ``open`` does.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except IsADirectoryError:  # Windows
        fd = None
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # a socket, or a FIFO opened without O_NONBLOCK support
            raise
        fd = None
    mode = os.fstat(fd).st_mode if fd is not None else os.stat(path).st_mode
    if fd is not None and stat.S_ISREG(mode):
        return open(fd, "rb")
    if fd is not None:
        os.close(fd)
    raise ValueError(f"{os.fspath(path)} is {_kind(mode)}, not a regular file; give the path "
                     "of a file (copy a stream to a file first)")
