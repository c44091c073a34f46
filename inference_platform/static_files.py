"""The admin's static files, served by the ASGI app itself, without costing the API a thread hop.

WhiteNoise's middleware is synchronous only. Django runs a synchronous middleware inside an async
chain by moving the request to a thread and the rest of the chain back to the event loop: two
hand-overs between threads on every request, a chat completion included, for files that only the
admin pages ask for. This subclass speaks both: under ASGI it looks the path up in WhiteNoise's
table on the event loop (a dictionary read) and goes to a thread only to open a file it serves.
"""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.http import HttpRequest, HttpResponse
from whitenoise.middleware import WhiteNoiseMiddleware


class StaticFilesMiddleware(WhiteNoiseMiddleware):
    sync_capable = True
    async_capable = True

    def __init__(self, get_response, *args, **kwargs) -> None:
        super().__init__(get_response, *args, **kwargs)
        self._async = iscoroutinefunction(get_response)
        if self._async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest):
        if self._async:
            return self.__acall__(request)
        return super().__call__(request)

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        if self.autorefresh:  # development: a look at the disk, so off the event loop
            static_file = await sync_to_async(self.find_file, thread_sensitive=False)(request.path_info)
        else:
            static_file = self.files.get(request.path_info)
        if static_file is None:
            return await self.get_response(request)
        return await sync_to_async(self.serve, thread_sensitive=False)(static_file, request)
