#!/usr/bin/env python3
"""Chats without max_tokens against a lane's KV cache (docs/PERFORMANCE.md, "KV on demand").

Starts `BINARY serve --model MODEL --kv-tokens KV --max-running 64` and opens CLIENTS streaming
chat completions at once, none with max_tokens (the gateway gives each the rest of the
context). Each client reads TOKENS content chunks, then closes its connection (an agent
that has what it needs), or reads to the end of an answer that stops sooner; one that gets no token within GIVE_UP seconds gives up. Prints, as
one JSON line: how many got a first token before giving up, their time to first token
(p50 / p90 / max), how many read all TOKENS chunks, errors, the most sequences the lane ran
at once (sampled from /v1/stats) and the lane's KV preemptions (/metrics).

Usage: scripts/kv_demand.py BINARY MODEL_DIR [CLIENTS=64] [TOKENS=64] [KV=16384] [GIVE_UP=10]
"""
import json, socket, subprocess, sys, threading, time

BIN, MODEL = sys.argv[1], sys.argv[2]
CLIENTS = int(sys.argv[3]) if len(sys.argv) > 3 else 64
TOKENS = int(sys.argv[4]) if len(sys.argv) > 4 else 64
KV = int(sys.argv[5]) if len(sys.argv) > 5 else 16384
GIVE_UP = float(sys.argv[6]) if len(sys.argv) > 6 else 10.0
PROMPTS = ["Plan the next step of the task.", "Which tool should be called now?",
           "Summarise the document in one line.", "Write the function's docstring."]


def start():
    p = subprocess.Popen([BIN, "serve", "--model", MODEL, "--listen", "127.0.0.1:0",
                          "--kv-tokens", str(KV), "--max-running", "64"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        line = p.stdout.readline()
        if "gateway listening on " in line:
            hp = line.split("://", 1)[1].split("/", 1)[0]
            threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
            host, port = hp.rsplit(":", 1)
            return p, (host, int(port))
    p.kill()
    raise SystemExit("serve did not start")


def get(addr, path):
    s = socket.create_connection(addr, timeout=10)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data = b""
    while True:
        c = s.recv(65536)
        if not c:
            break
        data += c
    s.close()
    return data.split(b"\r\n\r\n", 1)[-1].decode(errors="replace")


def chat(addr, i, out):
    body = json.dumps({"model": MODEL.rstrip("/").split("/")[-1], "stream": True, "temperature": 0,
                       "messages": [{"role": "user", "content": f"{PROMPTS[i % 4]} ({i})"}]}).encode()
    t0 = time.time()
    r = {"ttft": None, "chunks": 0, "error": None}
    try:
        s = socket.create_connection(addr, timeout=GIVE_UP)
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        buf = b""
        while r["chunks"] < TOKENS:
            left = GIVE_UP - (time.time() - t0) if r["ttft"] is None else 60
            if left <= 0:
                r["error"] = "gave up"
                break
            s.settimeout(left)
            c = s.recv(65536)
            if not c:
                r["error"] = r["error"] or "closed"
                break
            buf += c
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                if b"HTTP/1.1" in ev and b" 200 " not in ev.split(b"\r\n", 1)[0]:
                    r["error"] = ev.split(b"\r\n", 1)[0].decode()
                for line in ev.split(b"\n"):
                    if line.strip() == b"data: [DONE]":
                        # the answer ended (a stop token) before TOKENS chunks: complete
                        r["done"] = True
                    if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                        continue
                    v = json.loads(line[5:])
                    if "error" in v:
                        r["error"] = v["error"].get("message", "error")
                    for ch in v.get("choices", []):
                        if ch.get("delta", {}).get("content"):
                            if r["ttft"] is None:
                                r["ttft"] = time.time() - t0
                            r["chunks"] += 1
            if r["error"] or r.get("done"):
                break
        s.close()
    except socket.timeout:
        r["error"] = "gave up"
    except OSError as e:
        r["error"] = str(e)
    out[i] = r


def pct(v, p):
    v = sorted(v)
    return round(v[min(len(v) - 1, int(p * len(v)))], 3) if v else None


p, addr = start()
try:
    most, stop = [0], [False]

    def sample():
        while not stop[0]:
            try:
                st = json.loads(get(addr, "/v1/stats"))
                most[0] = max(most[0], sum(l.get("stats", {}).get("running", 0) for l in st.get("lanes", [])))
            except Exception:
                pass
            time.sleep(0.05)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out = [None] * CLIENTS
    ts = [threading.Thread(target=chat, args=(addr, i, out)) for i in range(CLIENTS)]
    t0 = time.time()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.time() - t0
    time.sleep(0.3)
    stop[0] = True
    metrics = get(addr, "/metrics")
    pre = sum(float(l.split()[-1]) for l in metrics.splitlines()
              if l.startswith("moelane_kv_preemptions_total"))
    ttft = [r["ttft"] for r in out if r["ttft"] is not None]
    errors = {}
    for r in out:
        if r["error"] and r["chunks"] < TOKENS and not r.get("done"):
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    print(json.dumps({"binary": BIN, "clients": CLIENTS, "tokens": TOKENS, "kv_tokens": KV,
                      "give_up_s": GIVE_UP, "got_first_token": len(ttft),
                      "ttft_p50_s": pct(ttft, 0.5), "ttft_p90_s": pct(ttft, 0.9),
                      "ttft_max_s": pct(ttft, 1.0),
                      "read_all": sum(1 for r in out if r["chunks"] >= TOKENS),
                      "ended_early": sum(1 for r in out if r.get("done") and r["chunks"] < TOKENS),
                      "errors": errors, "most_running": most[0], "preemptions": pre,
                      "wall_s": round(wall, 2)}))
finally:
    p.terminate()
    p.wait(timeout=30)
