"""A worker for `parallax run` tests: prints where horovodrun's gloo rendezvous server
listens, as `RENDEZVOUS rank=R listen=ADDR,...` (hex, as /proc/net/tcp and tcp6 give them:
0100007F is 127.0.0.1, 00000000 is 0.0.0.0). Imports nothing heavy."""
import os

port = int(os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"])
found = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    with open(table) as lines:
        for line in list(lines)[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.append(address)
print(f"RENDEZVOUS rank={os.environ['HOROVOD_RANK']} "
      f"addr={os.environ['HOROVOD_GLOO_RENDEZVOUS_ADDR']} listen={','.join(found)}", flush=True)
