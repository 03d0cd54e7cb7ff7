#!/usr/bin/env python3
"""Resource figures under attack, next to the same figures at rest (docs/SECURITY.md).

Starts `moelane serve` (gateway, primary and sidecar in one process) and a sidecar process
with a TCP data port on the tiny checkpoint, then:
  1. opens N idle connections to the gateway (default 20,000): the gateway's memory and
     descriptors, and /health's latency meanwhile, against the same at rest;
  2. sends a 1 GiB length prefix and nothing else on 3 connections to the data port: the
     sidecar's memory against the same at rest;
  3. posts two 8 MB prompts at once: the gateway's peak memory, /health's worst latency while
     they are handled, and their answers.
Usage: scripts/attack_figures.py BINARY MODEL_DIR [IDLE_CONNECTIONS]
"""
import json, os, resource, socket, subprocess, sys, threading, time

BIN, MODEL = sys.argv[1], sys.argv[2]
IDLE = int(sys.argv[3]) if len(sys.argv) > 3 else 20000


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def rss_fds(pid):
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def start(args, want):
    p = subprocess.Popen([BIN] + args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        line = p.stdout.readline()
        if want in line:
            threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
            return p
    raise SystemExit(f"{args[0]} did not start")


def health_ms(port):
    t0 = time.time()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    while s.recv(65536):
        pass
    s.close()
    return (time.time() - t0) * 1000


def post(port, body, out):
    t0 = time.time()
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    s.sendall(head.encode() + body)
    data = b""
    while True:
        c = s.recv(65536)
        if not c:
            break
        data += c
    out.append((data.split(b" ", 2)[1].decode() if data else "none", time.time() - t0))


def mb(b):
    return f"{b / 2**20:.0f} MiB"


soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
# this client's own descriptors bound the attack (the processes started inherit the limit)
IDLE = min(IDLE, hard - 200)
gw_port = free_port()
serve = start(["serve", "--model", MODEL, "--listen", f"127.0.0.1:{gw_port}"], "gateway listening on")
sport, dport = free_port(), free_port()
side = start(["lane", "--role", "sidecar", "--model", MODEL, "--listen", f"127.0.0.1:{sport}",
              "--data", f"127.0.0.1:{dport}"], "sidecar control")
time.sleep(1)
try:
    rest = rss_fds(serve.pid)
    rest_h = sorted(health_ms(gw_port) for _ in range(20))[10]
    print(f"gateway at rest: {mb(rest[0])}, {rest[1]} descriptors, /health p50 {rest_h:.2f} ms")
    # 1. idle connections
    socks, refused = [], 0
    for _ in range(IDLE):
        try:
            socks.append(socket.create_connection(("127.0.0.1", gw_port), timeout=2))
        except OSError:
            refused += 1
    time.sleep(2)
    busy = rss_fds(serve.pid)
    hs = [health_ms(gw_port) for _ in range(5)]
    print(f"gateway with {len(socks)} idle connections opened ({refused} failed to open): "
          f"{mb(busy[0])}, {busy[1]} descriptors, /health {min(hs):.1f}-{max(hs):.1f} ms "
          f"(a new connection waits for a slot past --max-connections)")
    for s in socks:
        s.close()
    socks = []
    time.sleep(2)
    # 2. length prefixes on the data port
    side_rest = rss_fds(side.pid)
    pre = []
    for _ in range(3):
        c = socket.create_connection(("127.0.0.1", dport))
        c.sendall((1 << 30).to_bytes(4, "little"))
        pre.append(c)
    time.sleep(2)
    side_busy = rss_fds(side.pid)
    print(f"sidecar at rest {mb(side_rest[0])}; with 3 connections each claiming a 1 GiB frame: "
          f"{mb(side_busy[0])}")
    for c in pre:
        c.close()
    # 3. two 8 MB prompts at once
    body = json.dumps({"model": os.path.basename(MODEL.rstrip('/')), "prompt": "word " * 1_600_000,
                       "max_tokens": 1}).encode()
    peak, worst, out = [0], [0.0], []
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], rss_fds(serve.pid)[0])
            worst[0] = max(worst[0], health_ms(gw_port))
            time.sleep(0.05)

    w = threading.Thread(target=watch)
    w.start()
    ts = [threading.Thread(target=post, args=(gw_port, body, out)) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    done.set()
    w.join()
    after = rss_fds(serve.pid)
    print(f"two {len(body) / 1e6:.1f} MB prompts at once: answers {[(c, round(s, 2)) for c, s in out]}, "
          f"gateway peak {mb(peak[0])} (after {mb(after[0])}), /health worst {worst[0]:.1f} ms meanwhile")
finally:
    serve.kill()
    side.kill()
