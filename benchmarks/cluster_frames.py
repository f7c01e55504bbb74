"""What a byte between two simulated hosts costs the CPU, by frame size (the MTU).

    python benchmarks/cluster_frames.py                 # 1500, 9000 and 65000 bytes
    python benchmarks/cluster_frames.py --mtus 1500,65000 --megabytes 200

For each frame size it brings up a cluster of two hosts with one rank's namespace each
(numpitron.cluster, links far faster than the stream), streams --megabytes over one TCP
connection from host 0 to host 1, and reads the machine's CPU time (user, system,
interrupts; /proc/stat) around it. The kernel's work per frame, not per byte, is most
of that time: the cores it takes are the cores that stand for accelerators, which is
why numpitron/cluster/network.py sizes frames as large as its token buckets allow.
Needs root. Prints one line per frame size: Mbit/s and CPU nanoseconds per byte.
"""

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PREFIX = "npt-frames-"
PORT = 5599
CHUNK = 1 << 20


def cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine so far: user, nice, system, irq and softirq."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / os.sysconf("SC_CLK_TCK")


def receive(address: str, total: int) -> None:
    server = socket.create_server((address, PORT))
    connection, _ = server.accept()
    buffer, got = bytearray(CHUNK), 0
    while got < total:
        n = connection.recv_into(buffer)
        if not n:
            break
        got += n
    print(got)


def send(address: str, total: int) -> None:
    for _ in range(100):                      # the receiver may not listen yet
        try:
            connection = socket.create_connection((address, PORT))
            break
        except ConnectionRefusedError:
            time.sleep(0.05)
    data, sent = b"\0" * CHUNK, 0
    while sent < total:
        connection.sendall(data)
        sent += CHUNK
    connection.close()


def cluster(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "numpitron.cluster", "--prefix", PREFIX, *args], cwd=REPO, check=True,
                   capture_output=True, text=True)


def measure(mtu: int, total: int) -> tuple[float, float]:
    """(Mbit/s, CPU ns per byte) of one stream at this frame size."""
    cluster("down")
    cluster("up", "--hosts", "2", "--ranks-per-host", "1", "--inter-host-rate", "40gbit", "--intra-host-rate",
            "40gbit", "--mtu", str(mtu))
    try:
        target = "10.211.2.1"                 # host 1's one rank (network.ClusterSpec.slot_address)
        me = [sys.executable, __file__, "--total", str(total)]
        receiver = subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}h1s0", *me, "--receive", target],
                                    stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        busy, start = cpu_seconds(), time.perf_counter()
        subprocess.run(["ip", "netns", "exec", f"{PREFIX}h0s0", *me, "--send", target], check=True)
        got = int(receiver.communicate(timeout=120)[0])
        wall, busy = time.perf_counter() - start, cpu_seconds() - busy
    finally:
        cluster("down")
    return 8 * got / wall / 1e6, 1e9 * busy / got


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mtus", default="1500,9000,65000")
    p.add_argument("--megabytes", type=int, default=400)
    p.add_argument("--total", type=int, help=argparse.SUPPRESS)
    p.add_argument("--send", help=argparse.SUPPRESS)
    p.add_argument("--receive", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.send:
        return send(args.send, args.total)
    if args.receive:
        return receive(args.receive, args.total)
    print("| MTU (bytes) | Mbit/s | CPU ns per byte |")
    print("| ---: | ---: | ---: |")
    for mtu in map(int, args.mtus.split(",")):
        rate, cost = measure(mtu, args.megabytes << 20)
        print(f"| {mtu} | {rate:.0f} | {cost:.2f} |", flush=True)


if __name__ == "__main__":
    main()
