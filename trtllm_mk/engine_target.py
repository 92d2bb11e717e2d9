"""Where a build writes: a fresh folder beside the engine directory, renamed into place when complete.

A build never deletes what it did not make. It replaces an existing folder only when that folder is
an engine (its manifest.json says so) or empty; anything else is refused in one line before the
search starts. A lock file beside the target makes a second build into the same directory refuse
at once instead of mixing its files with the first one's. SIGTERM (and Ctrl-C) ends the build
through the normal error path, which stops the compiler and removes the unfinished folder; the
folder of a build killed outright (SIGKILL) is named ``.<name>.building-*`` and removed by the next
build into the same target.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

from .errors import EngineError

ENGINE_FORMAT = "trtllm_mk-engine"
# marks a folder as a build's own work in progress: only folders holding it are ever removed as stale
BUILDING_MARK = ".trtllm_mk-building"


def is_engine_dir(path: Path) -> bool:
    """An engine directory: its manifest.json names the engine format (or, written by older builds,
    lists the engine's own files)."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict):
        return False
    files = manifest.get("files")
    return manifest.get("format") == ENGINE_FORMAT or (
        isinstance(files, dict) and {"schedule.json", "megakernel.cubin"} <= set(files))


def check_target(out: Path) -> Path:
    """The absolute target, or a one-line refusal: a file, the current folder or one of its parents,
    a folder of other files, a parent that cannot be written."""
    target = Path(os.path.abspath(out))
    cwd = Path.cwd().resolve()
    if target.exists() and not target.is_dir():
        raise EngineError(f"{out}: is a file, not an engine directory; choose another --output-dir")
    if target.exists() and (target.resolve() == cwd or target.resolve() in cwd.parents):
        raise EngineError(f"{out}: is the current folder or contains it; choose a new folder for the engine")
    if target.is_dir() and any(target.iterdir()) and not is_engine_dir(target):
        raise EngineError(f"{out}: holds files that are not an engine; the build replaces only an engine "
                          "directory (choose a new or empty --output-dir)")
    parent = target.parent
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise EngineError(f"{out}: {probe} is a file, so the engine directory cannot be created there")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise EngineError(f"{out}: {probe} is not writable; choose an --output-dir you can write")
    return target


class EngineTarget:
    """``with EngineTarget(out) as t:`` write into ``t.tmp``, then ``t.commit()``. Leaving the block
    without commit (an error, SIGTERM, Ctrl-C) removes ``t.tmp`` and nothing else."""

    def __init__(self, out: str | Path):
        self.target = check_target(Path(out))
        self.tmp: Path | None = None
        self._lock_fd: int | None = None
        self._lock_path = self.target.parent / f".{self.target.name}.lock"
        self._old_handler = None

    def __enter__(self) -> "EngineTarget":
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:   # a place no folder can be made in (/proc), a read-only file system
            raise EngineError(f"{self.target}: the engine directory cannot be created there ({e.strerror}); "
                              "choose another --output-dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise EngineError(f"{self.target}: another build is writing this engine directory now; wait for it "
                              "to finish or choose another --output-dir") from None
        self._lock_fd = fd
        for stale in self.target.parent.glob(f".{self.target.name}.building-*"):
            if (stale / BUILDING_MARK).is_file():        # a killed build's folder (we hold the lock)
                shutil.rmtree(stale, ignore_errors=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.building-", dir=self.target.parent))
        # mkdtemp makes the folder 0700; an engine is read as any directory the user makes (its umask), by
        # a serving account or through a container mount too
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.tmp, 0o777 & ~umask)
        (self.tmp / BUILDING_MARK).write_text("an unfinished trtllm_mk build; removed by the next build here\n")
        self._old_handler = signal.getsignal(signal.SIGTERM)
        try:
            signal.signal(signal.SIGTERM, _raise_interrupt)
        except ValueError:          # not the main thread: the caller keeps its own handling
            self._old_handler = None
        return self

    def commit(self) -> Path:
        """Move the finished folder into place; a replaced engine is removed only after that."""
        assert self.tmp is not None
        old = None
        if self.target.exists():
            if any(self.target.iterdir()) and not is_engine_dir(self.target):
                raise EngineError(f"{self.target}: files that are not an engine appeared there during the build; "
                                  "nothing was replaced")
            old = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.replaced-", dir=self.target.parent))
            os.rename(self.target, old / "engine")
        (self.tmp / BUILDING_MARK).unlink()
        os.rename(self.tmp, self.target)
        self.tmp = None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.target

    def __exit__(self, *exc) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)
        if self._lock_fd is not None:
            try:
                self._lock_path.unlink()
            except OSError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = None


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
