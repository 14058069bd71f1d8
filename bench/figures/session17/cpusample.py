"""Each second, one line: the time and each of the service's processes (the serve process, its Ray
workers, bench serve's client) as pid:name:CPU ticks so far (user + system, 1/100 s), read from /proc
without forking anything."""

import os
import time

NAMES = ("specdec", "TargetWorker", "DraftWorker")


def sample() -> str:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            if not any(n in cmd[:60] for n in NAMES):
                continue
            fields = open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1].split()
        except OSError:
            continue
        name = cmd.split()[0] if cmd.startswith("ray::") else os.path.basename(cmd.split()[0])
        out.append(f"{pid}:{name.replace(':', '.')}:{int(fields[11]) + int(fields[12])}")
    return " ".join(out)


if __name__ == "__main__":
    while True:
        print(time.strftime("%H:%M:%S", time.gmtime()), sample(), flush=True)
        time.sleep(1)
