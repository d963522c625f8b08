#!/usr/bin/env python3
"""Assemble a minimal root filesystem from this machine's own files, as a tar for `docker import`.

    rootfs.py postgres OUT.tar|-   PostgreSQL 15 (Debian's postgresql-15 package on this machine)
    rootfs.py python OUT.tar|-     this Python interpreter, walsidecar's runtime dependencies and pip,
                                   taken from this interpreter's installed distributions, and
                                   PostgreSQL's psql, pg_waldump and pg_isready

Both trees get the same small skeleton: merged-/usr symlinks, a minimal passwd/group, dash as
/bin/sh and a few coreutils, the C.UTF-8 locale and every shared library `ldd` lists for the
executables and modules included. No package manager and no network are involved.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

PG_VERSION = "15"
PG_LIB = Path(f"/usr/lib/postgresql/{PG_VERSION}")
PG_SHARE = Path(f"/usr/share/postgresql/{PG_VERSION}")
PG_UID = 999          # the postgres user in the image (the official postgres image uses 999 too)
APP_UID = 10001       # the walsidecar user in the image (docker/Dockerfile)
SHARED_OBJECT = re.compile(r"\.so(\.[0-9.]+)?$")
PG_CLIENT_TOOLS = ("psql", "pg_waldump", "pg_isready")
TOOLS = ("dash", "rm", "cat", "ls", "mkdir", "env", "id", "sleep", "locale", "chown")
PY_PREFIX = Path("/usr/local")
# Parts of the standard library a server process never uses.
STDLIB_SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3",
                    "site-packages", "dist-packages"}
STDLIB_SKIP_FILE = re.compile(r"(^turtle\.py$|^EXTERNALLY-MANAGED$|\.opt-[12]\.pyc$|^_tkinter|^_test|^xxlimited|^_xxtest|"
                              r"^_ctypes_test|^_curses|^_dbm|^_gdbm|^nis\.|^_nis|^xxsubtype)")


class Rootfs:
    """A staging directory that becomes the image's /; owners are set when it is written as a tar."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.owners: dict[str, tuple[int, int]] = {}
        self.sources: set[str] = set()   # real host paths already copied (by realpath)

    def path(self, dst: str | Path) -> Path:
        return self.root / str(dst).lstrip("/")

    def mkdir(self, dst: str, mode: int = 0o755, owner: tuple[int, int] | None = None) -> None:
        p = self.path(dst)
        p.mkdir(parents=True, exist_ok=True)
        os.chmod(p, mode)
        if owner:
            self.owners["./" + dst.strip("/")] = owner

    def symlink(self, target: str, dst: str) -> None:
        p = self.path(dst)
        p.parent.mkdir(parents=True, exist_ok=True)
        if not p.is_symlink() and not p.exists():
            p.symlink_to(target)

    def write(self, dst: str, text: str, mode: int = 0o644) -> None:
        p = self.path(dst)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        os.chmod(p, mode)

    def copy(self, src: Path, dst: str | Path) -> None:
        """Copy one file (a symlink stays a symlink), keeping mode and mtime (pyc files check it)."""
        p = self.path(dst)
        if p.is_symlink() or p.exists():
            return
        p.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            p.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, p)
            self.sources.add(os.path.realpath(src))

    def copy_tree(self, src: Path, dst: str | Path, skip_dir=lambda name: False, skip_file=lambda name: False) -> None:
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames[:] = [d for d in dirnames if not skip_dir(d)]
            rel = Path(dirpath).relative_to(src)
            self.path(Path(dst) / rel).mkdir(parents=True, exist_ok=True)
            for name in dirnames:       # symlinked directories are not descended into by os.walk
                if (Path(dirpath) / name).is_symlink():
                    self.copy(Path(dirpath) / name, Path(dst) / rel / name)
            for name in filenames:
                if not skip_file(name):
                    self.copy(Path(dirpath) / name, Path(dst) / rel / name)

    def elf_files(self) -> list[Path]:
        """Executables and shared objects: files in a bin directory or named *.so*, starting with ELF magic."""
        out = []
        for dirpath, _, filenames in os.walk(self.root):
            in_bin = os.path.basename(dirpath) in ("bin", "sbin")
            for name in filenames:
                if not in_bin and not SHARED_OBJECT.search(name):
                    continue
                p = Path(dirpath) / name
                if p.is_symlink() or not p.is_file():
                    continue
                with p.open("rb") as f:
                    if f.read(4) == b"\x7fELF":
                        out.append(p)
        return out

    def add_shared_libraries(self) -> int:
        """Copy every library ldd resolves for the ELF files in the tree; returns how many were added."""
        multiarch = Path(os.path.realpath("/lib/x86_64-linux-gnu/libc.so.6")).parent
        if sysconfig.get_config_var("MULTIARCH"):
            multiarch = Path("/usr/lib") / sysconfig.get_config_var("MULTIARCH")
        wanted: dict[str, str] = {}   # host path as ldd printed it -> its realpath
        files = [str(p) for p in self.elf_files()]
        for i in range(0, len(files), 200):
            out = subprocess.run(["ldd", *files[i:i + 200]], capture_output=True, text=True, check=False).stdout
            for line in out.splitlines():
                m = re.match(r"\s+\S+ => (/\S+) \(", line) or re.match(r"\s+(/\S+) \(", line)
                if m:
                    wanted[m.group(1)] = os.path.realpath(m.group(1))
        added = 0
        root = os.path.realpath(self.root)
        for printed, real in sorted(wanted.items()):
            if real.startswith(root + os.sep):
                continue   # a library shipped inside the tree (e.g. a wheel's bundled libpq)
            if real.startswith(("/usr/lib/", "/usr/lib64/")):
                dst = Path(real)
            elif real.startswith(("/lib/", "/lib64/")):
                dst = Path("/usr" + real)
            else:   # e.g. a libpython outside /usr: put it where the loader looks without ld.so.cache
                dst = multiarch / Path(real).name
            if not self.path(dst).exists():
                self.copy(Path(real), dst)
                added += 1
            link = dst.parent / Path(printed).name
            if link != dst:
                self.symlink(dst.name, str(link))
        self.symlink("../lib/x86_64-linux-gnu/ld-linux-x86-64.so.2", "usr/lib64/ld-linux-x86-64.so.2")
        return added

    def strip(self, paths: list[Path]) -> None:
        """Drop debug symbols (a self-built libpython carries ~18 MB of them)."""
        if shutil.which("strip"):
            for p in paths:
                subprocess.run(["strip", "--strip-unneeded", str(p)], capture_output=True, check=False)

    def write_tar(self, out: str) -> None:
        def owner(info: tarfile.TarInfo) -> tarfile.TarInfo:
            info.uid, info.gid = self.owners.get(info.name, (0, 0))
            info.uname = info.gname = ""
            return info

        if out == "-":
            with tarfile.open(fileobj=sys.stdout.buffer, mode="w|", format=tarfile.GNU_FORMAT) as tar:
                tar.add(self.root, arcname=".", filter=owner)
        else:
            with tarfile.open(out, "w", format=tarfile.GNU_FORMAT) as tar:
                tar.add(self.root, arcname=".", filter=owner)


def skeleton(fs: Rootfs, users: list[tuple[str, int]]) -> None:
    for d in ("usr/bin", "usr/sbin", "usr/lib", "usr/lib64", "usr/local/bin", "etc", "run", "var/tmp",
              "dev", "proc", "sys", "home"):
        fs.mkdir(d)
    fs.mkdir("tmp", 0o1777)
    fs.mkdir("root", 0o700)
    for name in ("bin", "sbin", "lib", "lib64"):
        fs.symlink(f"usr/{name}", name)
    fs.symlink("../run", "var/run")
    passwd = ["root:x:0:0:root:/root:/bin/sh"] + [
        f"{name}:x:{uid}:{uid}::{'/var/lib/postgresql' if name == 'postgres' else '/var/lib/' + name}:/bin/sh"
        for name, uid in users]
    fs.write("etc/passwd", "\n".join(passwd) + "\n")
    fs.write("etc/group", "\n".join(["root:x:0:"] + [f"{n}:x:{u}:" for n, u in users]) + "\n")
    fs.write("etc/nsswitch.conf", "passwd: files\ngroup: files\nhosts: files dns\n")
    for tool in TOOLS:
        found = shutil.which(tool)
        if found:
            fs.copy(Path(os.path.realpath(found)), f"usr/bin/{tool}")
    fs.symlink("dash", "usr/bin/sh")
    locale = Path("/usr/lib/locale/C.utf8")
    if locale.is_dir():
        fs.copy_tree(locale, "usr/lib/locale/C.utf8")


def build_postgres(fs: Rootfs) -> None:
    if not (PG_LIB / "bin" / "postgres").is_file():
        sys.exit(f"rootfs.py: {PG_LIB}/bin/postgres not found; install postgresql-{PG_VERSION} (scripts/install.sh)")
    skeleton(fs, [("postgres", PG_UID)])
    fs.copy_tree(PG_LIB / "bin", PG_LIB / "bin")
    fs.copy_tree(PG_LIB / "lib", PG_LIB / "lib", skip_dir=lambda d: d == "bitcode",
                 skip_file=lambda n: n.startswith("llvmjit"))   # no JIT: libLLVM alone is >100 MB
    fs.copy_tree(PG_SHARE, PG_SHARE)
    fs.copy_tree(Path("/usr/share/zoneinfo"), "usr/share/zoneinfo")
    fs.mkdir("run/postgresql", 0o2775, (PG_UID, PG_UID))
    fs.mkdir("var/lib/postgresql", 0o755, (PG_UID, PG_UID))
    # The default PGDATA: a volume mounted here starts out owned by postgres, as initdb needs.
    fs.mkdir("var/lib/postgresql/data", 0o700, (PG_UID, PG_UID))
    fs.add_shared_libraries()


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_distributions(pyproject: Path) -> list:
    """The installed distributions walsidecar's [project.dependencies] need (with extras), plus pip."""
    import importlib.metadata as md
    import tomllib
    try:
        from packaging.requirements import Requirement
    except ImportError:   # pip vendors it
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]

    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    todo: list[tuple[str, frozenset[str]]] = [(d, frozenset()) for d in deps] + [("pip", frozenset())]
    seen: dict[str, tuple[object, set[str]]] = {}
    while todo:
        spec, _ = todo.pop()
        req = Requirement(spec)
        key = _canon(req.name)
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            sys.exit(f"rootfs.py: {req.name} is not installed for {sys.executable}; run scripts/install.sh")
        if req.specifier and not req.specifier.contains(dist.version, prereleases=True):
            sys.exit(f"rootfs.py: installed {req.name} {dist.version} does not satisfy {spec}; run scripts/install.sh")
        known = seen.get(key)
        extras = set(req.extras)
        if known and extras <= known[1]:
            continue
        merged = extras | (known[1] if known else set())
        seen[key] = (dist, merged)
        for r in dist.requires or []:
            sub = Requirement(r)
            envs = [{"extra": e} for e in sorted(merged)] + [{"extra": ""}]
            if sub.marker is None or any(sub.marker.evaluate(env) for env in envs):
                todo.append((r.split(";")[0], frozenset()))
    return [d for d, _ in seen.values()]


def image_site_packages(exe: Path, ver: str) -> Path:
    """The site directory this interpreter searches once it lives under /usr/local (a venv's base too).

    Debian's python3 looks in dist-packages, not site-packages, so ask the interpreter itself."""
    out = subprocess.run([str(exe), "-S", "-c", "import site, sys; print('\\n'.join(site.getsitepackages([sys.argv[1]])))",
                          str(PY_PREFIX)], capture_output=True, text=True, check=True).stdout.split()
    own = str(PY_PREFIX / "lib" / f"python{ver}") + os.sep
    return Path(next((d for d in out if d.startswith(own)), own + "site-packages"))


def build_python(fs: Rootfs, pyproject: Path) -> None:
    base = Path(sys.base_prefix)
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"

    def mapped(p: Path) -> Path:
        """Host path -> image path: the installation prefix moves to /usr/local (as in python:3.x images)."""
        p = Path(os.path.realpath(p))
        try:
            return PY_PREFIX / p.relative_to(os.path.realpath(base))
        except ValueError:
            return p

    skeleton(fs, [("walsidecar", APP_UID)])
    # PostgreSQL's client tools, for `walsidecar init-postgres` (psql) and looking at safekeeper WAL.
    for tool in PG_CLIENT_TOOLS:
        if (PG_LIB / "bin" / tool).is_file():
            fs.copy(PG_LIB / "bin" / tool, PG_LIB / "bin" / tool)
            fs.symlink(f"../lib/postgresql/{PG_VERSION}/bin/{tool}", f"usr/bin/{tool}")
    exe = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    image_exe = mapped(exe)
    if image_exe == exe and not str(exe).startswith("/usr/"):
        sys.exit(f"rootfs.py: cannot place {exe} in the image")
    fs.copy(exe, image_exe)
    for alias in ("python3", "python"):
        fs.symlink(os.path.relpath(image_exe, PY_PREFIX / "bin"), str(PY_PREFIX / "bin" / alias))
    stdlib = Path(sysconfig.get_path("stdlib"))
    fs.copy_tree(stdlib, mapped(stdlib),
                 skip_dir=lambda d: d in STDLIB_SKIP_DIRS or d.startswith("config-"),
                 skip_file=lambda n: bool(STDLIB_SKIP_FILE.search(n)))
    dynload = Path(sysconfig.get_path("platstdlib")) / "lib-dynload"
    if dynload.is_dir():
        fs.copy_tree(dynload, mapped(dynload), skip_file=lambda n: bool(STDLIB_SKIP_FILE.search(n)))
    site = image_site_packages(exe, ver)
    for dist in runtime_distributions(pyproject):
        location = Path(dist.locate_file(""))
        target = mapped(location) if mapped(location) != Path(os.path.realpath(location)) else site
        is_pip = _canon(dist.metadata["Name"]) == "pip"
        for f in dist.files or []:
            if f.parts[0] == ".." or (is_pip and "__pycache__" in f.parts):
                continue   # console scripts live outside site-packages; pip's bytecode is not needed
            src = location / f
            if src.exists() or src.is_symlink():
                fs.copy(src, target / f)
    fs.add_shared_libraries()
    # Only the interpreter's own files: stripping a wheel's patchelf-ed libraries can break them.
    fs.strip([p for p in fs.elf_files()
              if p == fs.path(image_exe) or p.name.startswith("libpython") or p.parent.name == "lib-dynload"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["postgres", "python"])
    ap.add_argument("out", help="tar file to write, or - for stdout")
    ap.add_argument("--pyproject", type=Path, default=Path(__file__).resolve().parent.parent / "pyproject.toml")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix=f"rootfs-{args.kind}-") as tmp:
        fs = Rootfs(Path(tmp))
        if args.kind == "postgres":
            build_postgres(fs)
        else:
            build_python(fs, args.pyproject)
        fs.write_tar(args.out)


if __name__ == "__main__":
    main()
