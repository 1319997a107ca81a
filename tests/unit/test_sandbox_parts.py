"""The sandbox's parts on their own: where its cgroups go (cgroup v2 and v1, from fake ``/proc`` files and a
fake hierarchy, since a machine has only one of them), the values written, who owns a working directory, and
the seccomp filter's shape. tests/unit/test_sandbox_isolation.py runs them for real."""

from __future__ import annotations

import os
from pathlib import Path

from rlfleet.environments import cgroups, sandbox_dirs
from rlfleet.environments.cgroups import Placement
from rlfleet.environments.seccomp import user_namespace_filter


def fake_v2(tmp_path: Path, membership: str) -> tuple[Path, str, str]:
    """A cgroup2 mount at tmp_path/cgroup with /system.slice/runner.service (a service's own cgroup)."""
    root = tmp_path / "cgroup"
    service = root / "system.slice" / "runner.service"
    service.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    (root / "cgroup.subtree_control").write_text("memory pids\n")
    (root / "system.slice" / "cgroup.controllers").write_text("memory pids\n")
    (root / "system.slice" / "cgroup.subtree_control").write_text("memory pids\n")
    (service / "cgroup.controllers").write_text("memory pids\n")
    (service / "cgroup.subtree_control").mkdir()  # writing to it fails, as with a cgroup holding processes
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"41 31 0:38 / {root} rw,relatime - cgroup2 cgroup2 rw\n")
    groups = tmp_path / "cgroup-membership"
    groups.write_text(membership)
    return root, str(mountinfo), str(groups)


def test_v2_sandboxes_go_beside_a_caller_whose_cgroup_holds_processes(tmp_path: Path) -> None:
    root, mountinfo, groups = fake_v2(tmp_path, "0::/system.slice/runner.service\n")
    assert cgroups.placement(mountinfo, groups) == Placement(2, (root / "system.slice",))


def test_v2_sandboxes_go_below_a_caller_at_the_root(tmp_path: Path) -> None:
    root, mountinfo, groups = fake_v2(tmp_path, "0::/\n")
    assert cgroups.placement(mountinfo, groups) == Placement(2, (root,))


def test_v2_without_the_controllers_is_no_place(tmp_path: Path) -> None:
    root, mountinfo, groups = fake_v2(tmp_path, "0::/system.slice/runner.service\n")
    (root / "system.slice" / "runner.service" / "cgroup.controllers").write_text("cpu\n")
    reason = cgroups.placement(mountinfo, groups)
    assert isinstance(reason, str) and "cannot give its children the memory and pids" in reason
    assert "cgroup v1: no memory and pids hierarchies" in reason


def test_v1_uses_the_callers_memory_and_pids_cgroups(tmp_path: Path) -> None:
    memory, pids = tmp_path / "memory", tmp_path / "pids"
    (memory / "process_api" / "abc").mkdir(parents=True)
    pids.mkdir()
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        f"35 31 0:32 / {memory} rw,relatime - cgroup cgroup rw,memory\n"
        f"39 31 0:36 / {pids} rw,relatime - cgroup cgroup rw,pids\n"
        f"41 31 0:38 / {tmp_path / 'unified'} rw,relatime - cgroup2 cgroup2 rw\n"
    )
    groups = tmp_path / "cgroup-membership"
    groups.write_text("8:pids:/\n4:memory:/process_api/abc\n0::/\n")
    assert cgroups.placement(str(mountinfo), str(groups)) == Placement(
        1, (memory / "process_api" / "abc", pids)
    )


def test_the_limits_written(tmp_path: Path) -> None:
    missing = cgroups.create("rlfleet-sandbox-1-2-3-x", 2**27, 7, where=Placement(2, (tmp_path / "v2",)))
    assert isinstance(missing, str) and missing.startswith(f"cgroup v2 under {tmp_path / 'v2'}: ")
    (tmp_path / "v2").mkdir()
    v2 = cgroups.create("rlfleet-sandbox-1-2-3-x", 2**27, 7, where=Placement(2, (tmp_path / "v2",)))
    assert isinstance(v2, cgroups.SandboxCgroup)
    made = tmp_path / "v2" / "rlfleet-sandbox-1-2-3-x"
    assert {f.name: f.read_text() for f in made.iterdir()} == {
        "memory.max": str(2**27),
        "memory.swap.max": "0",
        "pids.max": "7",
    }
    assert v2.procs_files == [str(made / "cgroup.procs")] and not v2.oom_killed()
    (made / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert v2.oom_killed()
    for name in ("memory", "pids"):
        (tmp_path / name).mkdir()
    v1 = cgroups.create("s", 2**27, 7, where=Placement(1, (tmp_path / "memory", tmp_path / "pids")))
    assert isinstance(v1, cgroups.SandboxCgroup)
    assert (tmp_path / "memory" / "s" / "memory.memsw.limit_in_bytes").read_text() == str(2**27)
    assert (tmp_path / "pids" / "s" / "pids.max").read_text() == "7"
    assert cgroups.create("s", 1, 1, where="no cgroups here") == "no cgroups here"


def test_who_owns_a_working_directory() -> None:
    own = sandbox_dirs._owner()
    namespace, pid, start = own.split("-")
    assert int(pid) == os.getpid() and sandbox_dirs.owner_alive(f"rlfleet-sandbox-{own}-abc")
    # the same PID started at another time: a recycled PID, its owner is gone
    assert not sandbox_dirs.owner_alive(f"rlfleet-sandbox-{namespace}-{pid}-{int(start) + 1}-abc")
    assert sandbox_dirs.owner_alive(f"rlfleet-sandbox-{int(namespace) + 1}-{pid}-1-abc")  # not ours to judge
    assert sandbox_dirs.owner_alive("rlfleet-sandbox-tmp12345")  # another form: left alone


def test_the_seccomp_filter() -> None:
    x86 = user_namespace_filter("x86_64")
    arm = user_namespace_filter("aarch64")
    assert x86 is not None and arm is not None
    assert len(x86) == 8 * 13 and len(arm) == 8 * 12  # x86_64 also refuses the x32 ABI
    assert user_namespace_filter("riscv64") is None
