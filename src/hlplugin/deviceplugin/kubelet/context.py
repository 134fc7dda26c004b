"""The call context every handler of ours takes, whichever kubelet protocol it serves."""

from __future__ import annotations

from typing import Any

import grpc

Context = grpc.aio.ServicerContext[Any, Any]
