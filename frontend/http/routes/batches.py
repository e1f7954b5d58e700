"""The batches face's routes: OpenAI's Files and Batch APIs and Anthropic's Message Batches,
all over the one batch runner; each handler gets the caller's owner and the shared records."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from frontend.batches import anthropic_batches
from frontend.batches import api as batches_api
from frontend.batches.models import AnthropicBatchCreate, BatchCreate
from frontend.http.routes.context import AppContext, guarded, json_response
from frontend.responses.stored import owner_of


def routes(app: AppContext) -> list[Route]:
    def owned(handler):
        """A batch wing handler, given the caller's owner and the shared records."""
        async def endpoint(request: Request) -> Response:
            answer = await handler(request, owner_of(request, app.keys), app.batches)
            return answer if isinstance(answer, Response) else json_response(answer)
        return guarded(endpoint)

    async def batch_create(request: Request, owner: str, b) -> Response:
        return await batches_api.create_batch(
            await app.decode(request, BatchCreate), owner, b)

    async def messages_batch_create(request: Request, owner: str, b) -> Response:
        return await anthropic_batches.create(
            request, await app.decode(request, AnthropicBatchCreate), owner, b)

    message_batch = "/v1/messages/batches/{batch_id}"
    return [
        # Anthropic's Message Batches, over the same batch runner as /v1/batches.
        Route("/v1/messages/batches", owned(messages_batch_create), methods=["POST"]),
        Route("/v1/messages/batches", owned(anthropic_batches.list_batches), methods=["GET"]),
        Route(f"{message_batch}/results", owned(anthropic_batches.results), methods=["GET"]),
        Route(f"{message_batch}/cancel", owned(anthropic_batches.cancel), methods=["POST"]),
        Route(message_batch, owned(anthropic_batches.retrieve), methods=["GET"]),
        Route(message_batch, owned(anthropic_batches.delete), methods=["DELETE"]),
        # OpenAI's Files and Batch APIs.
        Route("/v1/files", owned(batches_api.upload_file), methods=["POST"]),
        Route("/v1/files", owned(batches_api.list_files), methods=["GET"]),
        Route("/v1/files/{file_id}", owned(batches_api.get_file), methods=["GET"]),
        Route("/v1/files/{file_id}", owned(batches_api.delete_file), methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", owned(batches_api.file_content), methods=["GET"]),
        Route("/v1/batches", owned(batch_create), methods=["POST"]),
        Route("/v1/batches", owned(batches_api.list_batches), methods=["GET"]),
        Route("/v1/batches/{batch_id}", owned(batches_api.get_batch), methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", owned(batches_api.cancel_batch),
              methods=["POST"]),
    ]
