"""Diagnostic: tally the bytes of every hivemind RPC by DHT key, in every process of a run.

Put this folder on ``PYTHONPATH`` and name an output folder in ``RPC_TALLY_OUT``; every Python process
started with that environment (learners, and their forked DHT and averager processes) then writes
``<pid>.json`` there every 3 s: for each ``call:<rpc> <get|store> <key>`` (a unary call, request and
response bytes, labelled with the DHT keys of the ``get_many``/``store_many`` it belongs to; hashes and
versions in keys folded) and ``stream_send <message type>`` (every message sent on a stream: all-reduce parts
and state downloads, and hivemind's matchmaking, whose join requests and leader messages are streams too),
``[calls, bytes sent, bytes received]``. ``summarize.py`` adds them up. It wraps private
hivemind 1.1.12 methods, so it is a measuring tool for benchmarks, never imported by p2p_diloco.

    sudo RPC_TALLY_OUT=/tmp/tally PYTHONPATH=scripts/wan/rpc_tally \\
        .venv/bin/python scripts/wan/bench_wan.py --rates 200 --methods decoupled --max-time 90 ...
    python scripts/wan/rpc_tally/summarize.py /tmp/tally
"""

from __future__ import annotations

import collections
import contextvars
import functools
import importlib.abc
import importlib.machinery
import json
import os
import re
import sys
import threading
import time
from types import ModuleType
from typing import Any

OUT = os.environ.get("RPC_TALLY_OUT")
DUMP_EVERY_S = 3.0
_label: contextvars.ContextVar[str] = contextvars.ContextVar("rpc_tally_label", default="?")
_counts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])  # name -> [calls, sent, received]
_pid: list[int | None] = [None]


def _tally(name: str, sent: int, received: int) -> None:
    if _pid[0] != os.getpid():  # first tally in this process (a fork starts with its parent's counts)
        _pid[0] = os.getpid()
        _counts.clear()
        threading.Thread(target=_dump_forever, daemon=True).start()
    c = _counts[name]
    c[0] += 1
    c[1] += sent
    c[2] += received


def _dump_forever() -> None:
    pid = os.getpid()
    while True:
        time.sleep(DUMP_EVERY_S)
        tmp = f"{OUT}/{pid}.json.tmp"
        with open(tmp, "w") as f:
            json.dump({"argv": sys.argv[:3], "counts": dict(_counts)}, f)
        os.replace(tmp, f"{OUT}/{pid}.json")


def _fold(key: Any) -> str:
    return re.sub(r"[0-9a-f]{8,}", "H", re.sub(r"_v\d+", "_vN", str(key)))


def _patch_p2p(module: ModuleType) -> None:
    Client, P2P = module.p2pclient.Client, module.P2P  # every unary call's serialized request and response
    call_unary_handler, send_protobuf = Client.call_unary_handler, P2P.send_protobuf  # pass through the client

    async def call_unary(self: Any, peer_id: Any, proto: str, data: bytes) -> bytes:
        response: bytes = await call_unary_handler(self, peer_id, proto, data)
        _tally(f"call:{proto.split('.')[-1]} {_label.get()}", len(data), len(response))
        return response

    async def send(protobuf: Any, writer: Any) -> None:
        _tally(f"stream_send {type(protobuf).__name__}", protobuf.ByteSize(), 0)
        await send_protobuf(protobuf, writer)

    Client.call_unary_handler = call_unary
    P2P.send_protobuf = staticmethod(send)


def _labelled(fn: Any, verb: str, keys_at: int) -> Any:
    """``fn`` with the RPCs it makes labelled ``<verb> <its keys, folded>``; its argument at ``keys_at`` holds the keys
    (a sequence of keys, or a single string key)."""
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        keys = args[keys_at]
        token = _label.set(f"{verb} " + ",".join(sorted({_fold(k) for k in ([keys] if isinstance(keys, str) else keys)})))
        try:
            return await fn(*args, **kwargs)
        finally:
            _label.reset(token)
    return wrapper


def _patch_node(module: ModuleType) -> None:
    Node = module.DHTNode
    Node.get_many = _labelled(Node.get_many, "get", 1)
    Node.store_many = _labelled(Node.store_many, "store", 1)


def _patch_nearest(module: ModuleType) -> None:
    """p2p_diloco's stores and reads at the nearest nodes (no ``get_many``/``store_many``): labelled the same way.
    Picklable by name (``functools.wraps``): the DHT process runs them."""
    module.store_nearest = _labelled(module.store_nearest, "store", 0)
    module.get_nearest = _labelled(module.get_nearest, "get", 0)


_PATCHES = {"hivemind.p2p.p2p_daemon": _patch_p2p, "hivemind.dht.node": _patch_node,
            "p2p_diloco.net.nearest": _patch_nearest}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if OUT:
    os.makedirs(OUT, exist_ok=True)
    sys.meta_path.insert(0, _Finder())
