"""gRPC services of the router: pdserve.v1 Generator and Admin, grpc.health.v1, and
server reflection (so grpcurl and reflection clients work without the .proto)."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..engine.sampling_params import InvalidRequestError
from ..proto import pdserve_pb2 as pb
from ..proto import pdserve_pb2_grpc as pb_grpc
from .errors import RequestError

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 8 << 20   # a GenerateRequest larger than this is refused by gRPC itself


class GeneratorService(pb_grpc.GeneratorServicer):
    def __init__(self, router):
        self.router = router

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        # Metrics (pdserve/metrics.py): status is the finish_reason, or the error's gRPC
        # status code in lower case; a stream that ends otherwise was cancelled.
        timer = self.router.metrics.request()
        status, prompt_tokens = "cancelled", 0
        try:
            async for msg in self.router.generate(request, context.time_remaining()):
                timer.tokens(len(msg.token_ids))
                if msg.finish_reason:
                    status, prompt_tokens = msg.finish_reason, msg.usage.prompt_tokens
                yield msg
        except InvalidRequestError as e:
            status = grpc.StatusCode.INVALID_ARGUMENT.name.lower()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RequestError as e:
            status = e.code.name.lower()
            await context.abort(e.code, str(e))
        except asyncio.CancelledError:
            logger.debug("client cancelled %s", request.request_id or "<no id>")
            raise
        except Exception:
            status = "internal"
            raise
        finally:
            timer.finish(status, prompt_tokens)


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, router):
        self.router = router

    async def ClusterStatus(self, request, context):
        return await self.router.cluster_status()


def build_server(router, address: str) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server (not started) with every service; returns it and the bound port.

    Raises:
        RuntimeError: the address could not be bound.
    """
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),          # a second server on a busy port must fail, not share
    ])
    pb_grpc.add_GeneratorServicer_to_server(GeneratorService(router), server)
    pb_grpc.add_AdminServicer_to_server(AdminService(router), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (pb.DESCRIPTOR.services_by_name["Generator"].full_name,
             pb.DESCRIPTOR.services_by_name["Admin"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind gRPC server to {address}")
    for name in ("", names[0], names[1]):
        asyncio.get_running_loop().create_task(
            health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING))
    return server, port
