"""One Register call to the kubelet, what its failure means in words an operator can act on, and
how a registered run ended (Outcome)."""

from __future__ import annotations

import enum
from pathlib import Path

import grpc

from hlplugin.api import deviceplugin_pb2 as pb
from hlplugin.api import deviceplugin_pb2_grpc as pb_grpc

API_VERSION = "v1beta1"


class RegistrationFailed(Exception):
    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


async def register_with(kubelet_path: Path, endpoint: str, resource_name: str,
                        timeout: float) -> None:
    """Register ``endpoint`` (a file name beside kubelet.sock) for ``resource_name``; raise
    RegistrationFailed with the gRPC status the kubelet's answer carried."""
    request = pb.RegisterRequest(version=API_VERSION, endpoint=endpoint,
                                 resource_name=resource_name, options=pb.DevicePluginOptions())
    async with grpc.aio.insecure_channel(f"unix://{kubelet_path}") as channel:
        try:
            await pb_grpc.RegistrationStub(channel).Register(
                request, timeout=timeout, wait_for_ready=False)
        except grpc.aio.AioRpcError as exc:
            raise RegistrationFailed(exc.code().name, exc.details() or "") from None


def explain(error: BaseException, timeout: float, kubelet_path: Path) -> str:
    """Why a registration failed, for the log and /readyz."""
    if not isinstance(error, RegistrationFailed):
        return f"{type(error).__name__}: {error}"
    if error.code == "DEADLINE_EXCEEDED":
        return (f"Register timed out after {timeout:g} s ({error.code}: the "
                f"kubelet at {kubelet_path} did not answer)")
    if error.code == "UNAVAILABLE":
        return f"the kubelet at {kubelet_path} is unreachable ({error})"
    return f"the kubelet refused with {error}"


class Outcome(enum.StrEnum):
    """How one registered instance's run ended (the steps' results; the values name the causes
    the metrics and logs use)."""

    REGISTERED = "registered"
    FAILED = "failed"
    LOST = "lost"  # our socket or kubelet.sock changed
    STREAM_ENDED = "stream_ended"
    KUBELET_GONE = "kubelet_gone"
