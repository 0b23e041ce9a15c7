"""Python client of the hybrid-pd decode service over gRPC, sync and async.

    from hybridpd_client import Client, AsyncClient, GenerateError

    with Client("127.0.0.1:50052") as client:
        result = client.generate("Hello", max_tokens=16)       # a GenerateResult
        for chunk in client.stream("Hello", max_tokens=16):    # TokenChunks as they come
            print(chunk.text, end="")

    async with AsyncClient("127.0.0.1:50052") as client:
        result = await client.generate([1, 2, 3], max_tokens=4)
        stream = client.stream("Hello", max_tokens=16)
        async for chunk in stream: ...
        stream.result                                          # the GenerateResult, once ended

A failed call raises GenerateError carrying the gRPC status name, the message, the stable
reason and the request fields at fault.
"""

from hybridpd_client.aio import AsyncClient, AsyncGenerateStream
from hybridpd_client.errors import GenerateError
from hybridpd_client.sync import Client, GenerateStream
from hybridpd_client.types import GenerateResult, TokenChunk, TransferStats

__all__ = [
    "AsyncClient",
    "AsyncGenerateStream",
    "Client",
    "GenerateError",
    "GenerateResult",
    "GenerateStream",
    "TokenChunk",
    "TransferStats",
]
