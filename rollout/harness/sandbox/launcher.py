"""The sandbox's launcher: run as ``python -I -S launcher.py SPEC_JSON`` by process.py, never
imported by it. Standard library only, single-threaded, so namespaces can be entered safely.

What it does, in order:
1. (root only) joins a fresh pids cgroup capped at the process limit, when the host has one;
2. enters new namespaces: network (no interfaces but a downed loopback: nothing is reachable),
   pid (everything the code starts dies with the namespace's first process), mount (every mount
   read-only except the working directory); an unprivileged caller gets a user namespace first;
3. forks the namespace's first process, which forks the worker and reaps until the worker ends;
4. the worker sets its rlimits, drops every capability, and execs the program in its directory.

One JSON line goes to the status descriptor: the worker's end (exit code or signal, CPU seconds)
and which isolation took effect, or an "error" when isolation that was required failed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24
# a user namespace may not change these on mounts it inherited: a remount must repeat them
_KEPT_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": 1024,
    "nodiratime": 2048,
    "relatime": 1 << 21,
}

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def _mount(source, target: str, flags: int) -> None:
    src = None if source is None else source.encode()
    _check(_libc.mount(src, target.encode(), None, flags, None), f"mount {target}")


def _join_pids_cgroup(spec: dict) -> bool:
    """As root, RLIMIT_NPROC is not enforced: a pids cgroup bounds the process count instead."""
    path = spec.get("pids_cgroup")
    if not path:
        return False
    try:
        os.mkdir(path)
        with open(os.path.join(path, "pids.max"), "w") as handle:
            handle.write(str(spec["limits"]["processes"]))
        with open(os.path.join(path, "cgroup.procs"), "w") as handle:
            handle.write(str(os.getpid()))
    except OSError:
        return False
    return True


def _enter_namespaces(required_network: bool) -> list[str]:
    """The strongest set of namespaces this host allows; raises when network isolation was
    required and is not possible."""
    root = os.geteuid() == 0
    uid, gid = os.getuid(), os.getgid()
    base = 0 if root else CLONE_NEWUSER
    attempts = [
        (["net", "pid", "mount"], CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS),
        (["net", "pid"], CLONE_NEWNET | CLONE_NEWPID),
        (["net"], CLONE_NEWNET),
    ]
    if not required_network:
        attempts += [(["pid", "mount"], CLONE_NEWPID | CLONE_NEWNS), (["pid"], CLONE_NEWPID)]
    last_error = None
    for names, flags in attempts:
        try:
            _unshare(base | flags)
        except OSError as error:
            last_error = error
            continue
        if not root:  # map our own ids only: an unprivileged user may do no more
            with open("/proc/self/setgroups", "w") as handle:
                handle.write("deny")
            with open("/proc/self/uid_map", "w") as handle:
                handle.write(f"{uid} {uid} 1")
            with open("/proc/self/gid_map", "w") as handle:
                handle.write(f"{gid} {gid} 1")
        return names
    if required_network:
        raise OSError(f"no network namespace could be created ({last_error})")
    return []


def _mount_points() -> list[tuple[str, int]]:
    """(mount point, flags to keep) for every mount, from /proc/self/mountinfo."""
    points = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # octal escapes (\040)
            kept = 0
            for option in fields[5].split(","):
                kept |= _KEPT_FLAGS.get(option, 0)
            points.append((point, kept))
    return points


def _read_only_except(workdir: str) -> bool:
    """Every mount read-only except workdir; False (and nothing promised) when any step fails."""
    try:
        _mount(None, "/", MS_REC | MS_PRIVATE)
        _mount(workdir, workdir, MS_BIND | MS_REC)
        points = _mount_points()
        for point, kept in points:
            if point == workdir:
                continue
            try:
                _mount(None, point, MS_BIND | MS_REMOUNT | MS_RDONLY | kept)
            except OSError:
                if point == "/":
                    return False
        # the work dir's own bind mount stays writable: remount it so explicitly, last
        kept = dict(points).get(workdir, 0)
        _mount(None, workdir, MS_BIND | MS_REMOUNT | kept)
    except OSError:
        return False
    return True


def _drop_capabilities() -> None:
    """A root worker keeps uid 0 but no capability survives its exec: it cannot remount, reach
    outside its namespaces, or override file permissions."""
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    with open("/proc/sys/kernel/cap_last_cap") as handle:
        last = int(handle.read())
    for cap in range(last + 1):
        _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)


def _set_limits(limits: dict) -> None:
    cpu = int(limits["cpu_s"])
    # soft < hard: SIGXCPU first (reported as cpu), SIGKILL a second later if it is ignored
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # a failure here is reported by the probe; the cgroup or the timeout bounds processes then
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)


def _worker(spec: dict, status_fd: int) -> None:
    try:
        os.close(status_fd)  # the code must not be able to forge its own report
        os.chdir(spec["cwd"])
        _set_limits(spec["limits"])
        if os.geteuid() == 0:
            _drop_capabilities()
        argv = spec["argv"]
        os.execvpe(argv[0], argv, spec["env"])
    except OSError as error:
        os.write(2, f"sandbox: cannot run {spec['argv'][0]!r}: {error}\n".encode())
        os._exit(127)


def _supervise(spec: dict, status_fd: int, as_init: bool) -> dict:
    """Fork the worker and wait for it; as a pid namespace's init, reap every orphan too."""
    worker = os.fork()
    if worker == 0:
        _worker(spec, status_fd)
    while True:
        pid, status, usage = os.wait4(-1 if as_init else worker, 0)
        if pid != worker:
            continue
        end = {"cpu_s": usage.ru_utime + usage.ru_stime}
        if os.WIFSIGNALED(status):
            end["signal"] = os.WTERMSIG(status)
        else:
            end["exit"] = os.WEXITSTATUS(status)
        return end


def main() -> None:
    spec = json.loads(sys.argv[1])
    status_fd = spec["status_fd"]

    def report(message: dict) -> None:
        os.write(status_fd, (json.dumps(message) + "\n").encode())

    cgroup = os.geteuid() == 0 and _join_pids_cgroup(spec)
    try:
        namespaces = _enter_namespaces(spec["require_network_isolation"])
    except OSError as error:
        report({"error": str(error)})
        return
    if "mount" in namespaces and not _read_only_except(spec["cwd"]):
        namespaces.remove("mount")
    isolation = {"namespaces": namespaces, "pids_cgroup": bool(cgroup)}
    if "pid" not in namespaces:
        report({**_supervise(spec, status_fd, as_init=False), **isolation})
        return
    init = os.fork()
    if init == 0:  # pid 1 of the new namespace: when it exits, the kernel kills the rest
        report({**_supervise(spec, status_fd, as_init=True), **isolation})
        os._exit(0)
    os.waitpid(init, 0)


if __name__ == "__main__":
    main()
