"""Open N GetGeneration (or Generate) calls over one raw HTTP/2 connection and never read a byte;
prints the broker's RSS before, while the calls are held, and after the socket is closed.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/unread_replies.py HOST PORT REQUEST_ID N BROKER_PID [Generate]

REQUEST_ID names a finished generation (with a large image: e.g. 2048x2048) on a node started
without credentials on loopback (`kvrelay up`, tiny preset); BROKER_PID is its broker process.
"""
import argparse
import socket
import struct
import time

from kvrelay.suggest import SuggestingArgumentParser
from kvrelay.v1 import generation_pb2

_parser = SuggestingArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
_parser.add_argument("host", help="the broker's host")
_parser.add_argument("port", type=int, help="the broker's gRPC port")
_parser.add_argument("request_id", help="a finished generation with a large image")
_parser.add_argument("n", type=int, help="calls to hold open unread")
_parser.add_argument("broker_pid", type=int, help="the broker process, whose RSS is printed")
_parser.add_argument("method", nargs="?", default="GetGeneration", choices=["GetGeneration", "Generate"],
                     help="the RPC (default: %(default)s)")
_args = _parser.parse_args()
host, port, rid, n, bpid, method = _args.host, _args.port, _args.request_id, _args.n, _args.broker_pid, _args.method

def rss(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) // 1024

def frame(ftype, flags, sid, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([ftype, flags]) + struct.pack(">I", sid) + payload

def lit(name, value):
    n, v = name.encode(), value.encode()
    assert len(n) < 127 and len(v) < 127
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v

req = (generation_pb2.GetGenerationRequest(request_id=rid) if method == "GetGeneration"
       else generation_pb2.GenerateRequest(request_id=rid, prompt="big one", width=2048, height=2048,
            num_inference_steps=1, guidance_scale=1.0)).SerializeToString()
body = b"\x00" + struct.pack(">I", len(req)) + req
hdrs = b"".join(lit(k, v) for k, v in [(":method", "POST"), (":scheme", "http"),
        (":path", f"/kvrelay.v1.GenerationService/{method}"), (":authority", f"{host}:{port}"),
        ("content-type", "application/grpc"), ("te", "trailers")])
s = socket.create_connection((host, port))
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
print("broker rss MB before:", rss(bpid), flush=True)
s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0) + frame(4, 1, 0))
for i in range(n):
    sid = 2 * i + 1
    s.sendall(frame(1, 4, sid, hdrs) + frame(0, 1, sid, body))
time.sleep(8)
print(f"broker rss MB with {n} unread {method} calls held:", rss(bpid), flush=True)
s.close()
time.sleep(5)
print("broker rss MB 5 s after the socket closed:", rss(bpid), flush=True)
