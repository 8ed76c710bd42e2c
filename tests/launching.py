"""For tests that start real launchers: an environment free of any launcher's variables, and the
TCP addresses a process tree listens on (read from Linux's /proc)."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import textwrap
import time
from pathlib import Path

__all__ = ["clean_env", "listening_addresses", "descendants", "PROC", "TRAIN_SCRIPT"]

PROC = Path("/proc")
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "TORCHELASTIC_", "GLOO_SOCKET", "NCCL_SOCKET")
LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "OMP_NUM_THREADS")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_NAMES and not k.startswith(LAUNCHER_PREFIXES)}
    return {**env, **extra}
LISTEN = "0A"  # TCP state code in /proc/net/tcp


def wait_for_files(proc: subprocess.Popen, directory: Path, pattern: str, count: int, timeout_s: float,
                   what: str) -> None:
    """Poll until `count` files match `pattern` in `directory` (the job's ranks report in);
    fail with the job's output if it ended first, or with `what` once `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while len(list(directory.glob(pattern))) < count:
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the job ended before {what}:\n{out or ''}{err or ''}")
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.1)


def descendants(root: int) -> list[int]:
    """`root` and every process below it, from each process's parent pid in /proc/PID/stat."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # the process ended
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # fields after "(comm)": state, ppid
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    # The kernel prints each 32-bit word of the address in host (little-endian) order.
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _listening_inodes() -> dict[str, tuple[str, int]]:
    """socket inode -> (address, port) for every listening TCP socket of this network namespace."""
    out = {}
    for table in ("tcp", "tcp6"):
        path = PROC / "net" / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN:
                addr, port = fields[1].split(":")
                out[fields[9]] = (_address(addr), int(port, 16))
    return out


def listening_addresses(root: int) -> dict[int, list[tuple[str, int]]]:
    """pid -> [(address, port)] that `root` and its descendants listen on (pids with none left out)."""
    inodes = _listening_inodes()
    out: dict[int, list[tuple[str, int]]] = {}
    for pid in descendants(root):
        links = []
        try:
            for fd in (PROC / str(pid) / "fd").iterdir():
                links.append(os.readlink(fd))
        except OSError:  # the process, or one of its descriptors, went away meanwhile
            pass
        found = [inodes[link[8:-1]] for link in links
                 if link.startswith("socket:[") and link[8:-1] in inodes]
        if found:
            out[pid] = sorted(found)
    return out


# `python train.py OUT NUM_STAGES [hold]`, run on every rank by a launcher: trains a 5-layer MLP
# as NUM_STAGES pipeline stages with plait's public API, and the same net's deep copy in plain
# PyTorch on the same batches. Each rank writes OUT/rank{rank}.txt: rank, world size, the largest
# parameter difference and the largest loss difference; with "hold" it then waits for OUT/go, so
# that the test can look at its sockets.
TRAIN_SCRIPT = textwrap.dedent("""
    import copy, logging, os, sys, time
    import torch
    from torch import nn
    import plait

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out, num_stages, hold = sys.argv[1], int(sys.argv[2]), sys.argv[3:] == ["hold"]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    ref = copy.deepcopy(net)
    model = plait.Model(net, plait.Config(num_stages=num_stages, num_microbatches=3),
                        optimizer=torch.optim.SGD(net.parameters(), lr=0.1), loss=nn.CrossEntropyLoss())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(30, 8, generator=g), torch.randint(0, 4, (30,), generator=g)
    loss_diff = 0.0
    for step in range(3):
        xb, yb = x[10 * step:10 * step + 10], y[10 * step:10 * step + 10]
        loss = model.train_on_batch(xb, yb)
        ref_opt.zero_grad()
        ref_loss = nn.functional.cross_entropy(ref(xb), yb)
        ref_loss.backward()
        ref_opt.step()
        loss_diff = max(loss_diff, abs(float(loss) - ref_loss.item()))
    state = model.state_dict()
    diff = max(float((state[k] - v).abs().max()) for k, v in ref.state_dict().items())
    with open(os.path.join(out, "rank%d.txt" % model.rank), "w") as f:
        f.write("%d %d %.3g %.3g" % (model.rank, model.world_size, diff, loss_diff))
    deadline = time.monotonic() + 60
    while hold and not os.path.exists(os.path.join(out, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)
""")
