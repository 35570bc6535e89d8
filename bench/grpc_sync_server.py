"""An experiment, not the product: the same ``Attend`` served by a sync ``grpc.server`` with a thread
pool, beside the service's ``grpc.aio`` server, to compare what each adds to a small call.

    python -m bench.grpc_sync_server --grpc-port 50061 --device cpu --warmup-shapes 1x1x16x16
    python -m bench.grpc_latency --server sync           # starts this itself

Every option is ``python -m service``'s (``--threads`` is this script's: the pool's size). The
engine runs on an asyncio loop in a thread of its own; each call's thread hands its request to
that loop (``asyncio.run_coroutine_threadsafe``) and blocks for the answer. Only ``Attend`` and
``AttendStream`` are served, without the interceptor (no API key, status codes by hand).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from concurrent import futures

import grpc

from service.core.engine import Engine
from service.grpc import codec
from service.grpc.errors import error_status
from service.grpc.protogen import attention_stubs
from service.grpc.server import call_error
from service.settings import load_settings
from service.wire.tensors import ServerTiming

stubs = attention_stubs()
pb, pb_grpc = stubs.attention_pb2, stubs.attention_pb2_grpc


class SyncAttention(pb_grpc.AttentionServiceServicer):
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop):
        self.engine, self.loop = engine, loop

    def _attend(self, request, deadline, request_id=None, timing=None):
        timing = ServerTiming() if timing is None else timing
        req = codec.attention_request(request, deadline=deadline, request_id=request_id)
        timing.mark("decode")
        res = asyncio.run_coroutine_threadsafe(self.engine.attend(req), self.loop).result()
        timing.engine(res.stamps)
        out = codec.attend_response(res)
        timing.mark("encode")
        return out

    def Attend(self, request, context):
        timing = ServerTiming()
        try:
            response = self._attend(request, codec.deadline_of(context), timing=timing)
        except Exception as exc:
            err = error_status(exc)
            context.abort(err.status, err.message)
        context.set_trailing_metadata((("server-timing", timing.value()),))
        return response

    def AttendStream(self, request_iterator, context):
        deadline = codec.deadline_of(context)  # one call at a time: the experiment is about latency
        for i, request in enumerate(request_iterator):
            rid = request.request_id or str(i)
            try:
                yield self._attend(request, deadline, rid)
            except Exception as exc:
                yield pb.AttendResponse(request_id=rid, error=call_error(exc))


def main() -> None:
    argv = sys.argv[1:]
    threads = 8
    if "--threads" in argv:
        i = argv.index("--threads")
        threads = int(argv[i + 1])
        del argv[i:i + 2]
    settings = load_settings(argv)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    engine = Engine(settings)
    engine.prepare()
    asyncio.run_coroutine_threadsafe(engine.start(), loop).result()
    limit = min(settings.max_body_bytes, 2**31 - 1)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=[
        ("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)])
    pb_grpc.add_AttentionServiceServicer_to_server(SyncAttention(engine, loop), server)
    server.add_insecure_port(f"{settings.host}:{settings.grpc_port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
