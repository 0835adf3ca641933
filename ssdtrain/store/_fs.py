"""What the storage layer needs to know about a filesystem, and hole punching.

Linux-first; elsewhere every helper degrades to a safe answer (``"unknown"`` filesystem, no hole
punching, no direct I/O) instead of raising.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import mmap
import os
import secrets

__all__ = [
    "punch_hole",
    "fs_type",
    "is_ram_backed",
    "is_network_fs",
    "direct_io_supported",
    "free_bytes",
    "total_bytes",
    "aligned_buffer",
    "make_dirs",
    "remove_dirs",
    "RAM_FS",
    "NETWORK_FS",
]

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

RAM_FS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs", "shm"})
"""Filesystems that live in RAM: offloading activations there frees no memory."""

NETWORK_FS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "afs", "9p", "ceph", "glusterfs",
    "lustre", "gpfs", "beegfs", "orangefs", "pvfs2", "ocfs2", "gfs2", "fuse.sshfs",
    "fuse.glusterfs", "fuse.ceph", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs", "fuse.rclone",
})
"""Filesystems whose bandwidth and latency are the network's, not a local drive's."""

_UNSUPPORTED = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})


@functools.cache
def _fallocate():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None
    fn = getattr(libc, "fallocate64", None) or getattr(libc, "fallocate", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Deallocates ``length`` bytes at ``offset`` of an open file, keeping its size.

    The range then reads as zeros and its blocks go back to the filesystem (which passes the trim
    on to the drive when mounted with ``discard`` or at the next ``fstrim``).

    Returns:
        ``True`` when the hole was punched (or ``length`` is 0), ``False`` when the platform or
        filesystem cannot punch holes.

    Raises:
        OSError: any other failure (a bad descriptor, an I/O error).
    """
    if length <= 0:
        return True
    fn = _fallocate()
    if fn is None:
        return False
    while True:
        if fn(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) == 0:
            return True
        err = ctypes.get_errno()
        if err == errno.EINTR:
            continue
        if err in _UNSUPPORTED:
            return False
        raise OSError(err, f"fallocate(PUNCH_HOLE, offset={offset}, length={length}): {os.strerror(err)}")


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo (octal).
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and len(field) >= i + 4 and all(c in "01234567" for c in field[i + 1:i + 4]):
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _existing(path: str | os.PathLike) -> str:
    """The real path of ``path`` or of its nearest existing ancestor."""
    p = os.path.realpath(os.path.abspath(os.fspath(path)))
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def _mount_of(path: str | os.PathLike, mountinfo: str = "/proc/self/mountinfo") -> tuple[str, str, str]:
    """``(mount point, filesystem type, source)`` of the mount holding ``path``."""
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ("/", "unknown", "")
    return _match_mount(_existing(path), lines)


def _match_mount(path: str, lines: list[str]) -> tuple[str, str, str]:
    best = ("/", "unknown", "")
    best_len = -1
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or not tail:
            continue
        mnt = _unescape(fields[4])
        inside = path == mnt or mnt == "/" or path.startswith(mnt.rstrip("/") + "/")
        # Later lines are mounted on top of earlier ones at the same point: ">=" keeps the last.
        if inside and len(mnt) >= best_len:
            best = (mnt, tail[0], _unescape(tail[1]) if len(tail) > 1 else "")
            best_len = len(mnt)
    return best


def fs_type(path: str | os.PathLike) -> str:
    """Filesystem type (``"ext4"``, ``"xfs"``, ``"tmpfs"``, ``"nfs4"``, ...) of the mount holding
    ``path`` (or its nearest existing ancestor); ``"unknown"`` when it cannot be told."""
    return _mount_of(path)[1]


def is_ram_backed(path: str | os.PathLike) -> bool:
    """Whether ``path`` lives in RAM (tmpfs, ramfs): offloading there saves no memory."""
    return fs_type(path) in RAM_FS


def is_network_fs(path: str | os.PathLike) -> bool:
    """Whether ``path`` is on a network or cluster filesystem (NFS, SMB, Lustre, ...)."""
    t = fs_type(path)
    return t in NETWORK_FS or t.startswith(("nfs", "fuse.sshfs"))


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous, page-aligned, zero-filled memory of ``nbytes`` (rounded up to a page), usable
    as an O_DIRECT source or destination (``memoryview(buf)``)."""
    return mmap.mmap(-1, max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE))


def direct_io_supported(directory: str | os.PathLike, block: int = 4096) -> bool:
    """Whether files in ``directory`` can be opened with ``O_DIRECT`` and written in aligned
    blocks of ``block`` bytes. Writes and removes a private temporary file; never raises for a
    plain "no" (``EINVAL``, ``EOPNOTSUPP``), nor when the platform has no ``O_DIRECT``.

    Raises:
        OSError: the directory is missing or not writable.
    """
    o_direct = getattr(os, "O_DIRECT", 0)
    if not o_direct:
        return False
    name = os.path.join(os.fspath(directory), f".ssdtrain-odirect-{os.getpid()}-{secrets.token_hex(6)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(name, flags | o_direct, 0o600)
    except OSError as e:
        if e.errno in (errno.EINVAL, *_UNSUPPORTED):
            return False
        raise
    try:
        buf = aligned_buffer(block)
        try:
            with memoryview(buf) as view:
                return os.pwrite(fd, view[:block], 0) == block
        except OSError as e:
            if e.errno in (errno.EINVAL, *_UNSUPPORTED):
                return False
            raise
        finally:
            buf.close()
    finally:
        os.close(fd)
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass


def make_dirs(path: str) -> list[str]:
    """Creates ``path`` and its missing parents, each with mode 0700 whatever the umask (a
    umask only removes bits; ``os.makedirs`` leaves parents to the umask: 0777 under ``umask
    000``). Nothing created survives a failure.

    Returns:
        The directories created, parents first (for :func:`remove_dirs` if a later step fails).

    Raises:
        OSError: a level cannot be created (after removing the levels this call created).
    """
    missing = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    created: list[str] = []
    try:
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                if not os.path.isdir(d):
                    raise
                continue  # made meanwhile by someone else: theirs, not ours to remove
            created.append(d)
    except BaseException:
        remove_dirs(created)
        raise
    return created


def remove_dirs(created: list[str]) -> None:
    """Removes directories listed parents first by :func:`make_dirs`, deepest first; leaves any
    that is no longer empty."""
    for d in reversed(created):
        try:
            os.rmdir(d)
        except OSError:
            pass


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged process may still write on the filesystem holding ``path``."""
    st = os.statvfs(_existing(path))
    return st.f_bavail * st.f_frsize


def total_bytes(path: str | os.PathLike) -> int:
    """Size of the filesystem holding ``path`` (its drive's capacity, for endurance figures)."""
    st = os.statvfs(_existing(path))
    return st.f_blocks * st.f_frsize
