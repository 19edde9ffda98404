"""Every service on the gRPC port: ours, TEI's, health and reflection over all of them."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from embedserv.server.frontend import Frontend
from embedserv.server.grpc.inference import InferenceServicer, add_to_server
from embedserv.server.grpc.tei import add_tei_services


def add_services(
    frontend: Frontend, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer
) -> InferenceServicer:
    """Registers on `server` the Inference service, TEI's services and `health_servicer` (whose statuses the
    caller sets), and reflection that lists them all; returns the Inference servicer."""
    servicer = InferenceServicer(frontend)
    service = add_to_server(servicer, server)
    tei_services = add_tei_services(frontend, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            service,
            *tei_services,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    return servicer
